"""What a fault and bad-input probe found, as regressions: garbage bytes on any RPC, unbounded
link probes, large Echo calls and Events subscribers, each refused with its status and a one-line
message while the node keeps serving."""
from __future__ import annotations

import asyncio
import socket

import grpc
import pytest

from logicpipe.v1 import stage_pb2

from .conftest import (
    RPC_TIMEOUT_S,
    Events,
    expect_status,
    run,
    serve_valid_request,
    single_stage,
)

IA = grpc.StatusCode.INVALID_ARGUMENT
GARBAGE = b"\xff\xfe\x00\x12garbage that is no protobuf\x9a"

STAGE_METHODS = {  # method: streaming request?, streaming reply?
    "Assign": (False, False), "OpenSession": (False, False), "CloseSession": (False, False),
    "Stream": (True, True), "Events": (False, True), "Status": (False, False), "Echo": (False, False),
    "MeasureLink": (False, False),
}
CONTROLLER_METHODS = {"Submit": (False, True), "Status": (False, False), "Plan": (False, False)}


async def call_with_garbage(channel: grpc.aio.Channel, path: str, streaming_in: bool, streaming_out: bool):
    raw = dict(request_serializer=None, response_deserializer=None)
    if streaming_in:
        call = channel.stream_stream(path, **raw)(timeout=RPC_TIMEOUT_S)
        await call.write(GARBAGE)
        return await call.read()
    if streaming_out:
        call = channel.unary_stream(path, **raw)(GARBAGE, timeout=RPC_TIMEOUT_S)
        return await call.read()
    return await channel.unary_unary(path, **raw)(GARBAGE, timeout=RPC_TIMEOUT_S)


@pytest.mark.parametrize("method", list(STAGE_METHODS))
def test_garbage_bytes_on_a_stage_rpc_are_invalid_argument(method, tiny_model):
    async def main():
        async with single_stage(tiny_model.path, "garbage") as node:
            err = await expect_status(call_with_garbage(node.channel, f"/logicpipe.v1.StageNode/{method}",
                                                        *STAGE_METHODS[method]), IA, "does not parse")
            assert "\n" not in err.details()
            await serve_valid_request(node, expect=tiny_model.greedy)
    run(main())


def test_garbage_bytes_on_controller_rpcs_are_invalid_argument(model_dir):
    from .conftest import controller

    async def main():
        async with controller(model_dir, [], start=False) as ctl:
            for method, kinds in CONTROLLER_METHODS.items():
                await expect_status(call_with_garbage(ctl.channel, f"/logicpipe.v1.Controller/{method}", *kinds),
                                    IA, "does not parse")
    run(main())


def test_measure_link_is_bounded_and_says_what_failed_in_one_line(tiny_model):
    async def main():
        with socket.socket() as plain:  # a TCP listener that speaks no gRPC
            plain.bind(("127.0.0.1", 0))
            plain.listen()
            target = f"127.0.0.1:{plain.getsockname()[1]}"
            async with single_stage(tiny_model.path, "prober") as node:
                err = await expect_status(node.stub.MeasureLink(stage_pb2.MeasureLinkRequest(target_address=target),
                                                                timeout=60),
                                          grpc.StatusCode.UNAVAILABLE, target, "not a reachable stage node")
                assert "\n" not in err.details() and len(err.details()) < 400
                await expect_status(node.stub.MeasureLink(stage_pb2.MeasureLinkRequest(
                    target_address=node.address, probes=100_000), timeout=RPC_TIMEOUT_S), IA, "probes", "cap")
                ok = await node.stub.MeasureLink(stage_pb2.MeasureLinkRequest(target_address=node.address, probes=3,
                                                                              payload_bytes=1024), timeout=RPC_TIMEOUT_S)
                assert ok.latency_s > 0 and ok.bandwidth > 0
    run(main())


def test_large_echo_calls_are_limited_and_small_ones_always_answered(tiny_model, monkeypatch):
    import logicpipe.stage_node.service as service

    async def main():
        async with single_stage(tiny_model.path, "echo") as node:
            big = stage_pb2.EchoRequest(reply_bytes=2 * 2**20)
            assert len((await node.stub.Echo(big, timeout=RPC_TIMEOUT_S)).payload) == 2 * 2**20
            monkeypatch.setattr(service, "LARGE_ECHOES", 0)  # as if the large-echo slots were all taken
            await expect_status(node.stub.Echo(big, timeout=RPC_TIMEOUT_S), grpc.StatusCode.RESOURCE_EXHAUSTED,
                                "large Echo", "retry")
            await expect_status(node.stub.Echo(stage_pb2.EchoRequest(payload=bytes(2 * 2**20)), timeout=RPC_TIMEOUT_S),
                                grpc.StatusCode.RESOURCE_EXHAUSTED, "large Echo")
            small = await node.stub.Echo(stage_pb2.EchoRequest(reply_bytes=100), timeout=RPC_TIMEOUT_S)
            assert len(small.payload) == 100
            monkeypatch.setattr(service, "LARGE_ECHOES", 2)
            # many at once: each either answered or refused, none lost, the node then serves
            calls = await asyncio.gather(*(node.stub.Echo(big, timeout=RPC_TIMEOUT_S) for _ in range(12)),
                                         return_exceptions=True)
            for c in calls:
                assert not isinstance(c, Exception) or c.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, c
            await serve_valid_request(node, expect=tiny_model.greedy)
    run(main())


def test_events_subscribers_are_capped(tiny_model, monkeypatch):
    import logicpipe.stage_node.service as service

    monkeypatch.setattr(service, "MAX_SUBSCRIBERS", 3)

    async def main():
        async with single_stage(tiny_model.path, "popular") as node:
            subs = [Events(node, owner=f"o{i}") for i in range(3)]
            for s in subs:
                await s.__aenter__()
            try:
                await expect_status(node.stub.Events(stage_pb2.EventsRequest(owner="late"),
                                                     timeout=RPC_TIMEOUT_S).read(),
                                    grpc.StatusCode.RESOURCE_EXHAUSTED, "3 Events subscribers")
            finally:
                for s in subs:
                    await s.__aexit__()
            await asyncio.sleep(0.2)
            async with Events(node, owner="late"):
                pass
            await serve_valid_request(node, expect=tiny_model.greedy)
    run(main())
