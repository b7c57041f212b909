"""The pipelines in force: replicas over disjoint nodes, each a `Pipeline`, and what they share
(the controller's identity towards the stages). The scheduler routes each request to one of them
(`route`): the least loaded by its predicted speed, or the one whose stages hold the request's
prefix in their cache when it is not much busier."""
from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from typing import Callable

import grpc

from logicpipe.common.transport import Transport
from logicpipe.controller.mesh import mirrors as kv_mirrors
from logicpipe.controller.mesh.pipeline import (
    RPC_TIMEOUT_S,
    ControllerIdentity,
    HoldsIdentity,
    Pipeline,
    StageHandle,
    probe_node,
)
from logicpipe.v1 import stage_pb2

log = logging.getLogger(__name__)

RELEASE_TIMEOUT_S = 1.0   # a stage's Release at stop (a stopping controller does not wait longer)
AFFINITY_BLOCK = 16        # prefix lengths are taken in whole KV blocks of the stages (their default block size)
AFFINITY_LENGTHS = (1024, 256, 64, 16)  # prefix lengths (tokens) remembered per request, longest matched first
AFFINITY_ENTRIES = 4096    # prefixes remembered at most (least recently used forgotten first)
AFFINITY_SLACK = 2         # a prefix's pipeline is taken while its load is within this many requests (per
AFFINITY_SLACK_SHARE = 0.25  # predicted-speed share), or this share, whichever is more, of the least loaded one's


def prefix_keys(tokens: list[int]) -> list[int]:
    """Hashes of the request's leading tokens at each of AFFINITY_LENGTHS it reaches (longest
    first); the last token is left out (it is always computed: it samples the next one)."""
    usable = len(tokens) - 1
    return [hash((n, tuple(tokens[:n]))) for n in AFFINITY_LENGTHS if n <= usable]


class PipelineSet(HoldsIdentity):
    """The controller's pipelines (replicas), in the order of the plan in force."""

    def __init__(self, transport: Transport, on_event: Callable[[stage_pb2.Event], None],
                 on_stage_lost: Callable[[str, str], None], why_down: Callable[[str], str] = lambda a: "",
                 owner: str = ""):
        self.transport = transport
        # on_stage_lost: a stage's hint (no answer, lost); why_down: membership's word on a node's address
        self._callbacks = (on_event, on_stage_lost, why_down)
        self.identity = ControllerIdentity(**({"owner": owner} if owner else {}))
        self.all: list[Pipeline] = []
        self._generation = 0
        self._affinity: OrderedDict[int, Pipeline] = OrderedDict()
        self.routed_by_prefix = 0  # requests sent to the pipeline that held their prefix
        self.kv_mirror = True      # each pipeline's stages copy their KV blocks to others' (mesh.mirrors)
        self.mirrors: dict[int, list[Pipeline]] = {}  # id(pipeline) -> the pipelines that hold its KV mirror
        self._mirror_task: asyncio.Task | None = None
        # a pipeline with a silent stage (pipeline.SILENT_S), each probe round while it is: its owner
        # moves its requests elsewhere (the scheduler's evacuate)
        self.on_silent: Callable[[Pipeline], None] = lambda pipeline: None

    async def probe(self, address: str, timeout: float = RPC_TIMEOUT_S) -> stage_pb2.StatusReply:
        """Status of a node, or Unavailable naming it (with our key: membership's probe every
        PROBE_S renews our lease on the stages we hold, stage_node.net.fence)."""
        return await probe_node(self.transport, address, timeout, self.identity.metadata)

    def next_generation(self) -> int:
        """A plan generation above every one before (across restarts too: it starts from the clock)."""
        self._generation = max(self._generation + 1, int(time.time() * 1000), *(p.generation + 1 for p in self.all))
        return self._generation

    # ---- the set ----------------------------------------------------------------------------
    def new(self) -> Pipeline:
        """A pipeline not installed yet, sharing our identity (the caller installs and adds it)."""
        on_event, on_lost, why_down = self._callbacks
        p = Pipeline(self.transport, on_event, on_lost, why_down=why_down, identity=self.identity)
        p.on_silent = lambda pipeline: self.on_silent(pipeline)
        return p

    def replace(self, pipelines: list[Pipeline]) -> None:
        """The pipelines in force from now on, numbered in this order."""
        self.all = list(pipelines)
        for i, p in enumerate(self.all):
            p.index = i
        alive = set(map(id, self.all))
        for key in [k for k, p in self._affinity.items() if id(p) not in alive]:
            del self._affinity[key]
        self._pair_mirrors()

    # ---- KV mirrors (mesh.mirrors) ------------------------------------------------------------
    def _pair_mirrors(self) -> None:
        """Pair the pipelines in force for KV mirrors and tell their stages (in the background)."""
        installed = [p for p in self.all if p.stages and not p.retired]
        self.mirrors = kv_mirrors.pair(installed) if self.kv_mirror else {}
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        if self._mirror_task is not None and not self._mirror_task.done():
            self._mirror_task.cancel()
        if installed:
            self._mirror_task = loop.create_task(self._tell_mirrors(installed, dict(self.mirrors)), name="kv-mirrors")

    async def _tell_mirrors(self, installed: list[Pipeline], mirrors: dict[int, list[Pipeline]]) -> None:
        try:
            copying = await kv_mirrors.tell(installed, mirrors, self.identity.mirror_key)
        except Exception as exc:  # noqa: BLE001 — (a background task: nobody awaits it) no mirrors, said once
            log.warning("telling the stages their KV mirrors failed: %r", exc)
            return
        if mirrors:
            log.info("KV mirrors: %s (%d stages copy)", ", ".join(
                f"{p.index}->{'+'.join(str(m.index) for m in mirrors[id(p)])}" for p in installed if id(p) in mirrors),
                copying)

    def mirrors_of(self, pipeline: Pipeline | None) -> list[Pipeline]:
        """The pipelines whose stages hold `pipeline`'s KV mirror, the next in the ring first."""
        return [] if pipeline is None else list(self.mirrors.get(id(pipeline), ()))

    def mirror_of(self, pipeline: Pipeline | None, load: Callable[[Pipeline], int] | None = None) -> Pipeline | None:
        """Where a request moved off `pipeline` replays to attach its history: of the pipelines that hold
        its KV mirror, one that serves with no silent stage, the least loaded by `load` (ring order
        breaking ties; no `load`: the first in the ring). None: none."""
        serving = set(map(id, self.serving()))
        usable = [q for q in self.mirrors_of(pipeline) if id(q) in serving and q.silent_stage() is None]
        if not usable:
            return None
        return usable[0] if load is None else min(usable, key=load)

    @property
    def stages(self) -> list[StageHandle]:
        """Every stage of every pipeline, pipeline by pipeline."""
        return [h for p in self.all for h in p.stages]

    @property
    def nodes(self) -> list[StageHandle]:
        """Every node of every pipeline: its stages and the members of its stages over several nodes."""
        return [h for p in self.all for h in (*p.stages, *p.members)]

    @property
    def generation(self) -> int:
        """The newest pipeline's plan generation (0: none installed)."""
        return max((p.generation for p in self.all), default=0)

    @property
    def plan_id(self) -> str:
        return ",".join(p.plan_id for p in self.all if p.plan_id)

    @property
    def micro_batches(self) -> int:
        return max((p.micro_batches for p in self.all), default=1)

    @property
    def down(self) -> list[tuple[str, str]]:
        return [d for p in self.all for d in p.down]

    def serving(self) -> list[Pipeline]:
        """The pipelines that take requests now: installed, no stage down."""
        return [p for p in self.all if p.stages and not p.down and not p.retired]

    def largest_request(self) -> int:
        """KV positions of the largest request any serving pipeline can hold (0: unknown)."""
        return max((p.largest_request() for p in self.serving()), default=0)

    # ---- routing ----------------------------------------------------------------------------
    def route(self, prompt: list[int], capacity: int, load: Callable[[Pipeline], int],
              exclude: frozenset[int] = frozenset(), *, affinity: bool = True) -> Pipeline | None:
        """The pipeline for a request of `capacity` positions whose input starts with `prompt`:
        among the serving ones that can hold it (and not in `exclude`, by id), the least loaded
        relative to its predicted speed (`load`: requests on it now), unless the pipeline that
        last took the same prefix is within AFFINITY_SLACK (or AFFINITY_SLACK_SHARE) of that: its
        stages' prefix caches hold the prefix (`affinity` False: the least loaded, whatever it holds;
        a replay's tokens outweigh its shared prompt prefix). A pipeline with a silent stage
        (pipeline.SILENT_S) only when every other is. None when none can take it."""
        fits = [p for p in self.serving() if id(p) not in exclude
                and (not p.largest_request() or capacity <= p.largest_request())]
        fits = [p for p in fits if p.silent_stage() is None] or fits
        if not fits:
            return None
        speeds = [p.tokens_per_s for p in fits]
        mean = sum(speeds) / len(speeds) if all(speeds) else 0.0

        def pressure(p: Pipeline) -> float:  # requests per unit of (relative) speed, this one included
            share = p.tokens_per_s / mean if mean else 1.0
            return (load(p) + 1) / share

        best = min(fits, key=lambda p: (pressure(p), p.index))
        for key in prefix_keys(prompt) if affinity else ():
            held = self._affinity.get(key)
            if held is not None and held in fits:
                if pressure(held) <= pressure(best) + max(AFFINITY_SLACK, AFFINITY_SLACK_SHARE * pressure(best)):
                    if held is not best:
                        self.routed_by_prefix += 1
                    return held
                break
        return best

    def remember(self, prompt: list[int], pipeline: Pipeline) -> None:
        """`pipeline` holds `prompt`'s prefixes in its caches now."""
        for key in prefix_keys(prompt):
            self._affinity[key] = pipeline
            self._affinity.move_to_end(key)
        while len(self._affinity) > AFFINITY_ENTRIES:
            self._affinity.popitem(last=False)

    async def release(self, addresses: list[str]) -> tuple[int, int]:
        """Stopping: end our lease on the stages at `addresses` now (StageNode.Release), all at once.
        Returns (how many answered, how many we held and released); one that does not answer in
        RELEASE_TIMEOUT_S keeps our lease until it runs out."""
        req = stage_pb2.ReleaseRequest(controller_epoch=self.epoch, controller_id=self.owner)

        async def one(address: str) -> bool | None:
            try:
                async with self.transport.channel(address, "stage") as ch:
                    return (await self.stub(ch).Release(req, timeout=RELEASE_TIMEOUT_S)).released
            except grpc.aio.AioRpcError as exc:
                log.info("stage %s not released (%s): its lease runs out instead", address, exc.code().name)
                return None

        got = await asyncio.gather(*(one(a) for a in addresses))
        return sum(x is not None for x in got), sum(bool(x) for x in got)

    async def close(self) -> None:
        if self._mirror_task is not None:
            self._mirror_task.cancel()
        for p in self.all:
            await p.close()
