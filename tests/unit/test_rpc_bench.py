"""bench.rpc_bench's pure parts: the --rate argument, and the tensor_split that gives llama.cpp's
RPC devices the mesh's layers (checked against llama.cpp's placement rule, modelled in
bench.llamacpp_rpc.layer_devices; the bench checks the real placement in llama.cpp's load log)."""
from __future__ import annotations

import pytest

from bench.llamacpp_rpc import layer_devices, tensor_split
from bench.rpc_bench import agreement, parse_rate


@pytest.mark.parametrize("text,bits", [("100mbit", 100_000_000), ("1gbit", 10**9), ("512kbit", 512_000),
                                       ("2.5mbit", 2_500_000), (" 100Mbit ", 100_000_000), ("800bit", 800)])
def test_parse_rate(text, bits):
    assert parse_rate(text) == bits


@pytest.mark.parametrize("text", ["100", "100mbps", "mbit", "0mbit", "-1mbit", "100 mbit", "fast"])
def test_parse_rate_refuses(text):
    with pytest.raises(ValueError, match="rate"):
        parse_rate(text)


@pytest.mark.parametrize("layers", [[10, 10, 10], [19, 10, 1], [1, 28, 1], [30], [15, 15], [1, 1, 1],
                                    [7, 7, 7, 7, 2], [1] * 16, [40, 39, 1]])
def test_tensor_split_places_the_layers_asked(layers):
    devices = layer_devices(tensor_split(layers), sum(layers))
    # decoder layers in order, device k holding layers[k]; the output layer on the last device
    assert devices[:-1] == [k for k, n in enumerate(layers) for _ in range(n)]
    assert devices[-1] == len(layers) - 1


def test_agreement():
    assert agreement([1, 2, 3, 4], [1, 2, 9, 4]) == {"common_prefix": 2, "equal_positions": 3, "of": 4}
    assert agreement([1, 2], [1, 2]) == {"common_prefix": 2, "equal_positions": 2, "of": 2}
