"""Measure the link from this node to another: latency from small Echo round trips, bandwidth from
one large payload sent and a tiny reply."""
from __future__ import annotations

import statistics
import time

from logicpipe.common.transport import Transport
from logicpipe.v1 import stage_pb2, stage_pb2_grpc

PROBE_TIMEOUT_S = 10.0


async def measure_link(transport: Transport, address: str, probes: int, payload_bytes: int) -> tuple[float, float]:
    """(one-way latency in s, bandwidth in bytes/s) to the StageNode at `address`."""
    async with transport.channel(address, "stage") as channel:
        stub = stage_pb2_grpc.StageNodeStub(channel)
        await stub.Echo(stage_pb2.EchoRequest(), timeout=PROBE_TIMEOUT_S)  # connect, warm up
        rtts = []
        for _ in range(max(1, probes)):
            t0 = time.perf_counter()
            await stub.Echo(stage_pb2.EchoRequest(), timeout=PROBE_TIMEOUT_S)
            rtts.append(time.perf_counter() - t0)
        rtt = statistics.median(rtts)
        payload = bytes(payload_bytes)
        t0 = time.perf_counter()
        await stub.Echo(stage_pb2.EchoRequest(payload=payload), timeout=PROBE_TIMEOUT_S)
        elapsed = max(time.perf_counter() - t0 - rtt, 1e-6)
    return rtt / 2, payload_bytes / elapsed
