"""KV mirrors, the controller's half (issue 34; the stages' half is stage_node.net.mirror).

With several pipelines (replicas), each pipeline's stages copy the full KV blocks of their running
sequences to the matching stages of the next FANOUT pipelines of the same kind (a ring over the
pipelines whose stages hold the same layers on the same kind of device with the same dtypes, weight
format, KV format and block size: their KV has the same bits); with FANOUT + 1 replicas or fewer,
every replica holds every other's. A request that a fault moves off its pipeline is routed to a
pipeline that holds its mirror and still serves (`mirror_of`: of several, the less loaded of those
that serve, so that a second fault, on the first mirror, still finds a copy), where its replay
attaches its history's blocks from the prefix cache and computes only the positions past the last
block copied. Pairs are made again, and every stage told (SetMirror), each time the set of
pipelines changes; a stage that is down meanwhile only fails its copies (counted on it). A pipeline
that joins takes its share of the running requests (controller.jobs.rebalance) from the pipelines
that copy to it first, SETTLE_S after it joined, so that their replays there attach their
histories, then from the others while it holds less than its share.
"""
from __future__ import annotations

import asyncio
import logging

import grpc

from logicpipe.controller.mesh.pipeline import RPC_TIMEOUT_S, Pipeline
from logicpipe.v1 import stage_pb2

log = logging.getLogger(__name__)

FANOUT = 2  # pipelines each pipeline copies its KV blocks to, at most (stage_node.net.mirror takes up to 4 targets):
           # in a storm the first mirror is often down by the time a request moves, the second is not
SETTLE_S = 1.5  # a pipeline that joins takes running requests from those that copy to it this long after (their
                # blocks copied meanwhile: stage_node.net.mirror sends up to 64 MiB a target each 0.5 s)


def numerics(p: Pipeline) -> tuple | None:
    """What makes two pipelines' KV the same bits, stage by stage (None: not known yet)."""
    out = []
    for h in p.stages:
        st = getattr(h, "status", None)  # (None: not probed yet)
        if not isinstance(st, stage_pb2.StatusReply) or not st.model_digest:
            return None
        prof = st.profile
        out.append((h.start, h.end, st.model_digest, st.device.split(":")[0], prof.device_name, prof.kv_format,
                    st.dtype, st.weight_format, st.block_size, max(prof.devices, 1)))
    return tuple(out) or None


def pair(pipelines: list[Pipeline], fanout: int = FANOUT) -> dict[int, list[Pipeline]]:
    """id(pipeline) -> the pipelines its stages copy their KV blocks to: the next `fanout` of the same
    numerics, in ring order (the next one first)."""
    groups: dict[tuple, list[Pipeline]] = {}
    for p in pipelines:
        key = numerics(p)
        if key is not None:
            groups.setdefault(key, []).append(p)
    out = {}
    for ps in groups.values():
        n = min(fanout, len(ps) - 1)
        if n < 1:  # a lone pipeline copies nowhere
            continue
        for i, p in enumerate(ps):
            out[id(p)] = [ps[(i + k) % len(ps)] for k in range(1, n + 1)]
    return out


async def tell(pipelines: list[Pipeline], mirrors: dict[int, list[Pipeline]], key: str) -> int:
    """SetMirror on every stage of `pipelines`: its targets (the same stage of each of its mirror
    pipelines, or none) and the key. Returns the stages that copy now; a refusal is logged, not raised."""
    calls, stages = [], []
    for p in pipelines:
        for s, h in enumerate(p.stages):
            targets = [m.stages[s].address for m in mirrors.get(id(p), ()) if s < len(m.stages)]
            stages.append((h, targets))
            calls.append(h.stub.SetMirror(stage_pb2.SetMirrorRequest(
                targets=targets, key=key, generation=p.generation, controller_epoch=p.epoch,
                controller_id=p.owner), timeout=RPC_TIMEOUT_S))
    results = await asyncio.gather(*calls, return_exceptions=True)
    copying = 0
    for (h, targets), r in zip(stages, results):
        if isinstance(r, grpc.aio.AioRpcError):
            log.info("stage %s (%s) mirrors no KV: %s %s", h.node_id or h.address, h.address, r.code().name,
                     (r.details() or "")[:200])
        elif isinstance(r, BaseException):
            log.info("stage %s mirrors no KV: %s", h.address, r)
        elif targets:
            copying += 1
    return copying
