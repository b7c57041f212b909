"""Disaggregated prefill, the sending side's wire: a prefilled sequence's KV chunks streamed to a
stage of another pipeline (its ImportKv), stage to stage."""
from __future__ import annotations

import time
from typing import AsyncIterator

import grpc

from logicpipe.common.transport import Transport
from logicpipe.errors import Unavailable, from_code
from logicpipe.stage_node.net import wire
from logicpipe.tensor_codec import RawTensor
from logicpipe.v1 import stage_pb2, stage_pb2_grpc

SEND_TIMEOUT_S = 600.0  # one SendKv's whole stream (a 4k-token prompt of an 8B model is ~0.5 GiB of KV)


async def send_kv(transport: Transport, address: str, session_id: str, import_key: str,
                  chunks: AsyncIterator[tuple[int, int, RawTensor]]) -> tuple[int, float, bool]:
    """Stream (layer, start position, kv) chunks to the destination's session `session_id`:
    (bytes sent, seconds, whether the destination holds every position of every layer now)."""
    sent = 0
    t0 = time.perf_counter()

    async def messages():
        nonlocal sent
        async for layer, start, kv in chunks:
            sent += kv.nbytes
            yield wire.kv_chunk(session_id, import_key, layer, start, kv)

    async with transport.channel(address, "stage") as channel:
        try:
            reply = await stage_pb2_grpc.StageNodeStub(channel).ImportKv(messages(), timeout=SEND_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise Unavailable(f"stage {address} took no KV: {exc.details()}") from exc
            raise from_code(exc.code(), f"stage {address}: {exc.details()}") from exc
    return sent, time.perf_counter() - t0, reply.complete


def send_reply(sent: int, seconds: float) -> stage_pb2.SendKvReply:
    return stage_pb2.SendKvReply(bytes=sent, seconds=seconds)
