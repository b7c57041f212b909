"""PullWeights in-process: a Controller servicer whose PullWeights is `stream_weights` over the
default model (SmolLM2-135M-Instruct, float32, tied embeddings) on an ephemeral loopback port, and
`pull_shard` into a temporary cache: the pulled shard equals the one loaded from the model
directory, a second pull fetches only what is new, bad requests get their status, and a corrupted
stream leaves nothing in the cache."""
from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Callable

import grpc
import pytest
import torch

from logicpipe.common.modeldir import ModelConfig, model_digest, safetensors_files, safetensors_header
from logicpipe.common.transport import PLAINTEXT
from logicpipe.controller.mesh.weights_server import MAX_TENSORS_PER_REQUEST, stream_weights
from logicpipe.errors import FailedPrecondition, NotFound, Unavailable
from logicpipe.stage_node.weights import weight_cache
from logicpipe.stage_node.model.shard import Shard
from logicpipe.stage_node.weights.weight_cache import PullResult, needed_tensors, pull_assignment, pull_shard
from logicpipe.stage_node.model.weights import EMBED, FINAL_NORM, LM_HEAD, layer_tensor_names
from logicpipe.v1 import controller_pb2, controller_pb2_grpc

from .conftest import RPC_TIMEOUT_S, expect_status, run

SMOL_LAYERS = 30
Tamper = Callable[[controller_pb2.WeightChunk], controller_pb2.WeightChunk]


class WeightsServicer(controller_pb2_grpc.ControllerServicer):
    """The Controller's PullWeights only; `tamper` may change each chunk on its way out."""

    def __init__(self, model_dir: Path, digest: str, tamper: Tamper | None = None):
        self.model_dir, self.digest, self.tamper = model_dir, digest, tamper

    async def PullWeights(self, request, context):
        async for chunk in stream_weights(self.model_dir, self.digest, request, peer=context.peer()):
            yield self.tamper(chunk) if self.tamper else chunk


@contextlib.asynccontextmanager
async def weights_server(model_dir: Path, digest: str, tamper: Tamper | None = None):
    """host:port of a server with the interceptors of the real ones (MeshError -> status)."""
    server = PLAINTEXT.server()
    controller_pb2_grpc.add_ControllerServicer_to_server(WeightsServicer(model_dir, digest, tamper), server)
    port = server.add_insecure_port("127.0.0.1:0")
    assert port, "could not bind an ephemeral loopback port"
    try:
        await server.start()
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(None)


@pytest.fixture(scope="module")
def digest(model_dir) -> str:
    return model_digest(model_dir)


@pytest.fixture(scope="module")
def config(model_dir) -> ModelConfig:
    return ModelConfig.from_dir(model_dir)


def tensor_bytes(model_dir: Path, names: list[str]) -> int:
    header = {n: m for f in safetensors_files(model_dir) for n, m in safetensors_header(f).items()}
    return sum(header[n]["data_offsets"][1] - header[n]["data_offsets"][0] for n in names)


def part_files(cache_dir: Path) -> list[Path]:
    return sorted(cache_dir.glob("part-*.safetensors"))


def test_pull_first_stage_then_only_new_layers(model_dir, digest, config, tmp_path, caplog, monkeypatch):
    # progress by fraction at once: a quiet machine pulls these 243 MiB in half a second, under the
    # gap that spaces progress lines out, and the test must not depend on the machine's speed
    monkeypatch.setattr(weight_cache, "PROGRESS_MIN_GAP_S", 0.0)
    cache_root = tmp_path / "cache"
    (cache_root / digest).mkdir(parents=True)
    leftover = cache_root / digest / ".part-0badc0de.safetensors.tmp"  # what a crash mid-pull leaves
    leftover.write_bytes(b"half a file")
    first10 = needed_tensors(config, 0, 10, first=True, last=False)
    assert EMBED in first10 and FINAL_NORM not in first10

    async def scenario() -> tuple[PullResult, PullResult]:
        async with weights_server(model_dir, digest) as address:
            a = await pull_shard(PLAINTEXT, address, digest, True, first10, cache_root)
            b = await pull_shard(PLAINTEXT, address, digest, True, needed_tensors(config, 0, 15, first=True, last=False),
                                 cache_root)
            return a, b

    with caplog.at_level(logging.INFO):
        a, b = run(scenario())
    cache_dir = cache_root / digest
    assert a.path == b.path == cache_dir
    assert not leftover.exists()
    assert (cache_dir / "config.json").read_bytes() == (model_dir / "config.json").read_bytes()
    assert (cache_dir / "generation_config.json").is_file()
    for name in ("tokenizer.json", "tokenizer_config.json"):  # a last stage's structured output needs them
        assert (cache_dir / name).read_bytes() == (model_dir / name).read_bytes()
    assert (a.tensors, a.cached, a.pulled_bytes) == (len(first10), 0, tensor_bytes(model_dir, first10))
    new = [n for i in range(10, 15) for n in layer_tensor_names(config, i)]
    assert (b.tensors, b.cached, b.pulled_bytes) == (len(new), len(first10), tensor_bytes(model_dir, new))
    assert len(part_files(cache_dir)) == 2 and not list(cache_dir.glob(".*.tmp"))
    assert any("pulling weights:" in r.getMessage() for r in caplog.records)  # progress
    assert any(r.name == "logicpipe.controller.mesh.weights_server" and "sent" in r.getMessage() for r in caplog.records)

    pulled = Shard.load(cache_dir, 0, 15, first=True, last=False)
    local = Shard.load(model_dir, 0, 15, first=True, last=False)
    assert torch.equal(pulled.embed_tokens, local.embed_tokens)
    for i in (0, 9, 10, 14):
        for field in ("qkv", "o", "gate_up", "down", "input_norm", "post_norm"):
            assert torch.equal(getattr(pulled.layers[i], field), getattr(local.layers[i], field)), (i, field)


def test_last_stage_with_tied_embeddings_pulls_embed_and_final_norm(model_dir, digest, config, tmp_path):
    assert config.tie_word_embeddings
    names = needed_tensors(config, SMOL_LAYERS - 1, SMOL_LAYERS, first=False, last=True)
    assert EMBED in names and FINAL_NORM in names and LM_HEAD not in names

    async def scenario() -> PullResult:
        async with weights_server(model_dir, digest) as address:
            # the stage's path: config first (fresh cache), then the tensors the config says
            return await pull_assignment(PLAINTEXT, address, digest, SMOL_LAYERS - 1, SMOL_LAYERS, SMOL_LAYERS, tmp_path)

    result = run(scenario())
    assert result.tensors == len(names) and result.pulled_bytes == tensor_bytes(model_dir, names)
    pulled = Shard.load(result.path, SMOL_LAYERS - 1, SMOL_LAYERS, first=False, last=True)
    local = Shard.load(model_dir, SMOL_LAYERS - 1, SMOL_LAYERS, first=False, last=True)
    assert torch.equal(pulled.lm_head, local.lm_head) and torch.equal(pulled.final_norm, local.final_norm)
    assert torch.equal(pulled.layers[0].down, local.layers[0].down)


def test_bad_requests_get_their_status(model_dir, digest, config, tmp_path):
    layer0 = layer_tensor_names(config, 0)

    async def scenario():
        async with weights_server(model_dir, digest) as address:
            with pytest.raises(FailedPrecondition) as info:
                await pull_shard(PLAINTEXT, address, "0123456789abcdef", False, layer0, tmp_path)
            assert digest in str(info.value) and "0123456789abcdef" in str(info.value)
            with pytest.raises(NotFound) as info:
                await pull_shard(PLAINTEXT, address, digest, False, layer0 + ["model.layers.99.mlp.up_proj.weight"], tmp_path)
            assert "model.layers.99.mlp.up_proj.weight" in str(info.value)
            async with PLAINTEXT.channel(address, "controller") as channel:
                stub = controller_pb2_grpc.ControllerStub(channel)

                async def pull(**fields):
                    request = controller_pb2.PullWeightsRequest(model_digest=digest, **fields)
                    return [c async for c in stub.PullWeights(request, timeout=RPC_TIMEOUT_S)]

                await expect_status(pull(files=["model.safetensors"]), grpc.StatusCode.INVALID_ARGUMENT,
                                    "model.safetensors", "config.json")
                await expect_status(pull(files=["../config.json"]), grpc.StatusCode.INVALID_ARGUMENT)
                await expect_status(pull(tensors=[f"t{i}" for i in range(MAX_TENSORS_PER_REQUEST + 1)]),
                                    grpc.StatusCode.INVALID_ARGUMENT, str(MAX_TENSORS_PER_REQUEST))
                await expect_status(pull(tensors=["nope"]), grpc.StatusCode.NOT_FOUND, "nope")

    run(scenario())
    assert not list((tmp_path / digest).glob("*.safetensors"))


def flip_a_byte(chunk: controller_pb2.WeightChunk) -> controller_pb2.WeightChunk:
    if not chunk.is_file and chunk.name.endswith("mlp.down_proj.weight") and chunk.offset > 0:
        data = bytearray(chunk.data)
        data[len(data) // 2] ^= 0x01
        chunk.data = bytes(data)
    return chunk


def end_mid_tensor(chunk: controller_pb2.WeightChunk) -> controller_pb2.WeightChunk:
    if chunk.name.endswith("mlp.down_proj.weight") and chunk.offset > 0:
        raise Unavailable("the controller went away mid-stream")  # the call ends UNAVAILABLE
    return chunk


@pytest.mark.parametrize("tamper", [flip_a_byte, end_mid_tensor])
def test_broken_stream_leaves_no_file(model_dir, digest, config, tmp_path, tamper):
    layer0 = layer_tensor_names(config, 0)

    async def scenario():
        async with weights_server(model_dir, digest, tamper) as address:
            await pull_shard(PLAINTEXT, address, digest, True, layer0, tmp_path)

    with pytest.raises(Unavailable) as info:
        run(scenario())
    assert ("sha256" if tamper is flip_a_byte else "mid-stream") in str(info.value)
    cache_dir = tmp_path / digest
    assert not list(cache_dir.glob("*.safetensors")) and not list(cache_dir.glob(".*.tmp"))
    assert not (cache_dir / "config.json").exists()
