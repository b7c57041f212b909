"""Request lifecycle: admission (a queue, then RESOURCE_EXHAUSTED), the sequence opened on every
stage, the input fed to stage 0, the tokens the last stage reports, the sequence closed.

The controller keeps every request's prompt and tokens, so a request whose sequence a stage gives
up (preempted to free KV blocks) is replayed: opened again with its prompt and the tokens it has
so far; its stages' swap space (closed with `swap`, they keep its KV for the replay) or the prefix
cache make that cheap, and each sampled token's draw depends only on (seed, sequence, position), so
the replay continues exactly where it was.

Every admitted request is also journaled (controller.journal): a controller that restarts, or a
standby that takes over, restores them (`restore`) and they go on from their tokens. A request's
tokens are read by its clients (`RequestHandle.updates(start)`): one at first, another that
resumes it later (after the controller came back, by its id); a request with no reader left ends
(its client went away), except one restored from the journal, which waits RETAIN_S for its client.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import math
import random
import time
import uuid
from collections import deque
from dataclasses import dataclass, replace
from typing import AsyncIterator, Callable

import grpc

from logicpipe.controller.jobs.handoff import PREFILLED, Handoff, HandoffPolicy, move_kv
from logicpipe.controller.jobs.job import OUTLINE_RECORD, Job, Request, RequestState, TokenUpdate
from logicpipe.controller.jobs.journal import Journal
from logicpipe.controller.jobs.rebalance import Movable, moves_onto
from logicpipe.controller.mesh.pipeline import Pipeline
from logicpipe.controller.mesh.pipelines import PipelineSet
from logicpipe.controller.mesh.state import MeshState
from logicpipe.errors import (
    AlreadyExists,
    FailedPrecondition,
    Fenced,
    InvalidArgument,
    MeshError,
    NotFound,
    ResourceExhausted,
    Unavailable,
    code_number,
    from_code,
)
from logicpipe.planner import Workload
from logicpipe.sampling import MAX_TOP_LOGPROBS, TokenLogprob
from logicpipe.v1 import stage_pb2

log = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 128
FEED_CHUNK = 8192           # input tokens per feed message (stage 0 chunks them into steps itself)
TOKEN_TIMEOUT_S = 120.0     # no token for this long fails a running request
PREFILL_ALLOWANCE_S = 0.02  # ... and before its first token, this much more per prompt token (a 32k-token
                            # prompt on a slow CPU mesh prefills for minutes; 50 tokens/s is the floor allowed)
QUEUE_TIMEOUT_S = 600.0     # a request waiting for KV blocks this long fails with RESOURCE_EXHAUSTED
MAX_QUEUED = 4096           # requests waiting at once; more are refused at once
MAX_PREEMPTIONS = 64        # a request preempted this often fails (the mesh is thrashing)
MAX_REPLAYS = 16            # a request whose sequence fails this often in a row, without a token between, fails
RETAIN_S = 300.0            # a request restored from the journal waits this long for its client to resume it
WAIT_FOR_NODES_S = 60.0     # no plan fits the nodes there are: a queued request waits this long for one
DEFAULT_SPECULATE = 4       # candidates per step unless the controller or the request says (rows 1..4 cost one step)
MAX_SPECULATE = 16          # candidates per step a request may ask for (each is a row on every stage)
ADMIT_RETRY_S = 0.5         # a refused admission is retried this often even if nothing finished
# stage 0 prefills a request replaying after a move or a fault (`catching_up`) before the other prompts, the
# one that has waited longest for a token first (OpenSessionRequest.prefill_rank: when it last had one, in
# ms); preemption still goes by arrival (priority). By arrival alone a storm's replays ran in the same order
# at every move, and the same one, always last, could be cut off before its token fault after fault (one
# request was the last to resume at eight faults in a row: 13.5 s)


def stalled_since(req: Request) -> float:
    """When `req` last had a token from the stages (its submission if none yet): time.monotonic()."""
    return req.times.heard or req.times.submitted


def prefill_rank(req: Request) -> int:
    """Stage 0's prefill order for `req`'s sequence (OpenSessionRequest.prefill_rank): a request catching
    up (replaying after a move or a fault) by when it last had a token (ms of time.monotonic(), at least
    1); any other 0 (none)."""
    return max(1, int(stalled_since(req) * 1000)) if req.catching_up else 0


@dataclass
class RequestStats:
    """Counters since the controller started (Status, lpctl status and /metrics read a copy)."""

    completed: int = 0
    failed: int = 0            # ended without finishing on an error (a stage fault past its replays, a timeout)
    cancelled: int = 0         # ended without finishing, with no error: its client left (Ctrl-C, a disconnect)
    prompt_tokens: int = 0     # tokens of every prompt admitted
    generated_tokens: int = 0  # tokens handed to clients
    replays: int = 0           # requests moved to another pipeline and replayed there
    replay_tokens: int = 0     # input positions of replays (prompt and tokens so far)
    replay_cached_tokens: int = 0  # ... of them held by the stages already (prefix caches, KV mirrors)
    evacuated: int = 0         # ... of them moved off a pipeline whose stage went silent (evacuate)
    preemptions: int = 0       # sequences given up by a stage for KV blocks, replayed later
    decode_steps: int = 0      # pipeline trips that reported tokens
    decode_tokens: int = 0     # ... the tokens they reported
    candidates: int = 0        # candidate tokens verified
    candidates_accepted: int = 0


class Traffic:
    """The workload plans are costed at, learned from the requests admitted: how many run at once
    (the most in the last WINDOW_S) and the context they hold (the mean prompt + new tokens of the
    last CONTEXTS requests), each rounded up to a power of two so that a re-plan sees a change only
    when the traffic really changed."""

    WINDOW_S = 120.0
    CONTEXTS = 256

    def __init__(self) -> None:
        self._peaks: deque[tuple[float, int]] = deque()  # (when, requests at once), the window's
        self._contexts: deque[int] = deque(maxlen=self.CONTEXTS)

    def observe(self, concurrency: int, context: int) -> None:
        now = time.monotonic()
        while self._peaks and (now - self._peaks[0][0] > self.WINDOW_S or self._peaks[0][1] <= concurrency):
            self._peaks.popleft()
        self._peaks.append((now, concurrency))
        self._contexts.append(context)

    @staticmethod
    def _pow2(x: float) -> int:
        return 1 << max(0, math.ceil(math.log2(max(1.0, x))))

    def concurrency(self) -> int:
        now = time.monotonic()
        return self._pow2(max((c for t, c in self._peaks if now - t <= self.WINDOW_S), default=1))

    def workload(self, context: int, max_context: int) -> Workload:
        """Requests at once and their context (at most `context`, the --context the plan reserves
        KV for; that when no request came yet)."""
        seen = sum(self._contexts) / len(self._contexts) if self._contexts else context
        return Workload(context_tokens=max(1, min(context, max_context, self._pow2(seen))), batch=self.concurrency())


@dataclass(frozen=True)
class SchedulerConfig:
    max_context: int                      # the model's context, tokens
    stop_ids: frozenset[int]              # the model's stop tokens
    vocab_size: int
    speculate: int = DEFAULT_SPECULATE    # candidates per step a request gets unless it says
    wait_for_nodes_s: float = WAIT_FOR_NODES_S  # a queued request waits this long while no plan fits


class RequestHandle:
    """A submitted request: iterate it for its tokens as the last stage reports them (a MeshError
    raised on failure); `stop` ends it as finished (a stop string found); `release` when done
    with it (its sequence closes, a kept one too). `async with` releases on the way out, also
    when the client goes away."""

    def __init__(self, scheduler: "Scheduler", request: Request):
        self._scheduler = scheduler
        self.request = request

    @property
    def id(self) -> str:
        return self.request.id

    @property
    def session_id(self) -> str:
        """The sequence open for it now ("" when none: queued, or closed)."""
        return self.request.session_id

    def updates(self, start: int = 0) -> AsyncIterator[TokenUpdate]:
        """Its tokens from index `start` on (a client resuming says how many it holds)."""
        return self._scheduler._updates(self.request, start)

    def __aiter__(self) -> AsyncIterator[TokenUpdate]:
        return self.updates()

    def stop(self, reason: str = "stop") -> None:
        self._scheduler._stop(self.request, reason)

    def release(self) -> None:
        self._scheduler._release(self.request)

    async def __aenter__(self) -> "RequestHandle":
        return self

    async def __aexit__(self, *exc) -> None:
        self.release()


class Scheduler:
    def __init__(self, pipelines: PipelineSet, state: MeshState, config: SchedulerConfig, *,
                 prefill_chunk: Callable[[int, Pipeline], int] = lambda prompt_tokens, pipeline: 0,
                 on_trouble: Callable[[str], None] = lambda why: None, journal: Journal | None = None,
                 on_fenced: Callable[[str], None] = lambda why: None,
                 on_traffic: Callable[[str], None] = lambda why: None, handoffs: HandoffPolicy | None = None):
        self.pipelines = pipelines      # the replicas in force; each request runs on one
        self.journal = journal if journal is not None else Journal(None, "")  # every admitted request, durably
        self.state = state              # admission runs while it is READY (its owner is the app)
        self.config = config
        self.prefill_chunk = prefill_chunk  # (prompt tokens, pipeline) -> rows per step there (0: budget)
        self.on_trouble = on_trouble        # a stage fault seen: check the plan
        self.on_fenced = on_fenced          # a stage follows a newer controller: this one must step down
        self.on_traffic = on_traffic        # the traffic's bucket changed (requests at once): the plan may not fit it
        self._traffic_bucket = 1
        self.active: dict[str, Request] = {}   # session id -> the request it serves
        self.opened: dict[str, Pipeline] = {}  # session id -> the pipeline it is open on (kept-open parents too)
        # disaggregated prefill (controller.jobs.handoff): which prompts are prefilled on another pipeline,
        # and the requests whose prefill-pipeline sequence (its id here) has not handed its KV over yet
        self.handoffs = handoffs if handoffs is not None else HandoffPolicy("off")
        self.prefilling: dict[str, Request] = {}
        self.requests: dict[str, Request] = {}  # request id -> every request not ended yet
        self.suspended = False      # the controller is stopping: requests stay journaled for the next one
        self._sweeper: asyncio.Task | None = None
        self.waiting: deque[Request] = deque()
        self.stats = RequestStats()
        self.traffic = Traffic()    # the workload the planner costs plans at
        self.observers: list[Callable[[Request], None]] = []  # called as each request ends (metrics)
        # called with each gap (s) between two consecutive tokens of a request as handed to its client (metrics)
        self.gap_observers: list[Callable[[float], None]] = []
        self._wake = asyncio.Event()
        self._admitter: asyncio.Task | None = None
        self._arrivals = itertools.count(1)
        self._hold_replays = False  # a preemption happened: replays wait until some request ends
        self.caught_up_at = 0.0  # when the last moved request had its first token after the move (monotonic)
        state.watch(self.kick)
        self.journal.on_lost.append(self._not_durable)

    @property
    def running(self) -> int:
        return len(self.active)

    def catching_up(self) -> int:
        """Requests moved by a fault or a re-plan that have not had a token since (their replay,
        queued or under way): a better plan waits for them rather than moving them again."""
        return sum(1 for r in (*self.active.values(), *self.waiting) if r.catching_up and not r.ended)

    # ---- events from the stages (called by the Pipeline) -----------------------------------
    def on_event(self, ev: stage_pb2.Event) -> None:
        if ev.session_id in self.prefilling:
            self._on_prefill_event(ev)
            return
        req = self.active.get(ev.session_id)
        if req is None:
            return  # a session we gave up (preempted, failed, cancelled): its late events mean nothing
        if ev.HasField("token"):
            t = ev.token
            if t.index != len(req.received):  # not the continuation of what we have: stale, ignore
                log.warning("request %s: token index %d, expected %d", req.id, t.index, len(req.received))
                return
            self.journal.tokens(req.id, len(req.received), t.token_ids)
            req.received.extend(t.token_ids)
            if req.top_logprobs is not None:  # (not journaled: a restored request has none for its earlier tokens)
                got = [TokenLogprob.from_proto(lp) for lp in t.logprobs]
                req.logprobs.extend(got + [None] * (len(t.token_ids) - len(got)))
            if req.prompt_logprobs is not None and req.prompt_lps is None:  # (the first event of a session asked)
                req.prompt_lps = [TokenLogprob.from_proto(lp) for lp in t.prompt_logprobs]
            req.failures = 0  # it moves again
            req.times.heard = time.monotonic()
            if t.index == 0:  # its first token: how fast it prefilled
                self._first_token(req)
            if req.catching_up:
                req.catching_up, req.joined_onto, self.caught_up_at = False, False, time.monotonic()
            req.done = t.finished
            req.stage_reason = t.finish_reason
            accepted = len(t.token_ids) - 1 if t.candidates else 0
            req.decode_steps += 1
            req.candidates += t.candidates
            req.accepted += accepted
            st = self.stats
            st.decode_steps += 1
            st.decode_tokens += len(t.token_ids)
            st.candidates += t.candidates
            st.candidates_accepted += accepted
            if req.done and not req.readers and not req.keep_open:  # nobody reads it yet: free its KV now
                del self.active[req.session_id]
                self._close_soon(req.session_id)
                req.session_id = ""
            req.notify()
            return
        if req.done:
            return  # it has every token: a stage's late complaint about its session changes nothing
        err = from_code(ev.error.code, ev.error.message)
        if ev.error.code == code_number(grpc.StatusCode.RESOURCE_EXHAUSTED):
            self._requeue(req, err, preempted=True)
        elif ev.error.code == code_number(grpc.StatusCode.INVALID_ARGUMENT):  # the request itself is wrong
            self._fail(req, err)
        else:
            # a stage or link fault (UNAVAILABLE), a stage that lost the sequence (restarted: NOT_FOUND,
            # unassigned: FAILED_PRECONDITION), an internal error: replay it (its own failures in a row
            # are capped, so a request that breaks every stage still ends)
            self._requeue(req, err)
            self.on_trouble(str(err))

    # ---- re-planning (called by the app) -----------------------------------------------------
    def detach_all(self) -> list[str]:
        """`detach` of every pipeline."""
        return self.detach(None)

    def detach(self, pipelines: list[Pipeline] | None) -> list[str]:
        """Every request running on `pipelines` (None: on any) back to the front of the queue,
        the one that has waited longest for a token first (as prefill_rank), to be replayed from its
        prompt and the tokens it has on the pipeline the
        router picks then. The requests of the other pipelines go on untouched. Returns the
        sessions they had (for the caller to close where they are still open)."""
        moving = None if pipelines is None else set(map(id, pipelines))
        for p in (self.pipelines.all if pipelines is None else pipelines):
            p.detaches += 1  # an open in flight there now belongs to the plan that is going away
        running = sorted(((sid, r) for sid, r in self.active.items()
                          if moving is None or id(self.opened.get(sid)) in moving
                          or id(self._prefill_pipeline(r)) in moving),  # its prompt is prefilled there
                         key=lambda kv: stalled_since(kv[1]), reverse=True)
        was: dict[str, Pipeline | None] = {}
        for sid, req in running:
            self._drop_prefill(req)
            del self.active[sid]
            p = was[sid] = self.opened.pop(sid, None)
            if p is not None and moving is not None and id(p) not in moving:
                p.close_session_soon(sid)  # (its pipeline stays: nobody else closes it there)
        for sid in [sid for sid, p in self.opened.items() if moving is None or id(p) in moving]:
            del self.opened[sid]  # finished parents kept open for forks: gone with their pipeline
        for sid, req in running:
            req.session_id = ""
            if req.done:  # finished; its client reads what is queued
                continue
            # replayed where its KV blocks were copied (mesh.mirrors), if that pipeline still serves then
            # (of two, the less loaded, counting the moves before this one: spread over them)
            req.target = self.pipelines.mirror_of(was[sid], self.aimed_load)
            self._back_in_queue(req, Unavailable("its pipeline was replaced"), moved=True)
        self._hold_replays = False
        return [session for session, _ in running]

    def rebalance(self, target: Pipeline, sources: list[Pipeline] | None = None) -> list[str]:
        """`target` just joined while other pipelines serve: move its share of the running requests
        onto it (controller.jobs.rebalance: of the most loaded pipelines, those still waiting for their
        replay, the longest wait first, then the cheapest replays; every
        request of a pipeline whose stage is silent first, `evacuate`), each
        replayed there from its prompt and tokens as after a fault (the same tokens). A request
        still catching up from an earlier move may move too: its replay starts over there, but a
        pipeline that took every request of the last fault would otherwise replay them all while
        the newcomer idles; not one whose replay under way is on a pipeline that took it as it
        joined (no request restarts at every join). A request that is finished, or a fork's parent
        or child, or prefilled elsewhere, stays. `sources` given (KV mirrors: the pipelines that copy
        their KV blocks to `target`), their requests move first (their replays attach the histories
        copied), then, while `target` holds less than its share, the others' (their replays
        recompute: a join took nothing before when the requests sat on a pipeline that copies
        elsewhere). Returns the sessions moved (closed on their old pipelines)."""
        serving = self.pipelines.serving()
        prefillers = self.handoffs.prefill_only(serving)  # (they decode nobody's requests)
        serving = [p for p in serving if id(p) not in prefillers]
        if target not in serving or len(serving) < 2:
            return []
        for p in serving:  # a stalled replica's requests first: they wait for nothing now
            if p is not target and p.silent_stage() is not None:
                self.evacuate(p)
        running = [Movable(sid, id(p), len(r.inputs), stalled_since(r) if r.catching_up else None)
                   for sid, r in self.active.items() if (p := self.opened.get(sid)) is not None and p in serving]
        movable = {sid for sid, r in self.active.items()
                   if not (r.done or (r.catching_up and r.joined_onto) or r.keep_open or r.parent or r.handoff is not None
                           or sid in self.prefilling)}
        ids = [id(p) for p in serving]
        picked: list[str] = []
        if sources is not None:  # the mirrored first
            copied = {id(q) for q in sources}
            picked = moves_onto(id(target), running, ids, {sid for sid in movable
                                                           if id(self.opened.get(sid)) in copied})
            taken = set(picked)
            running = [Movable(m.key, id(target), m.replay_tokens, m.waiting_since) if m.key in taken else m
                       for m in running]
            movable -= taken
        picked += moves_onto(id(target), running, ids, movable)
        for sid in picked:
            req = self.active.pop(sid)
            self._close_soon(sid)
            req.session_id, req.target = "", target
            self._back_in_queue(req, Unavailable(f"moved onto pipeline {target.index}, which joined"), moved=True)
            req.joined_onto = True
        if picked:
            log.info("%d running requests move onto pipeline %d, which joined", len(picked), target.index)
        return picked

    def evacuate(self, pipeline: Pipeline) -> list[str]:
        """A stage of `pipeline` is silent (SIGSTOPped, swapping: pipeline.SILENT_S): its running
        requests move onto the serving pipelines that are not, spread over them (each of its KV
        mirrors takes up to its even share, the dearest replays first, which attach their history
        there; the router places the others), replayed there from their prompt and tokens as after a fault (the
        same tokens), rather than waiting for it; requests still catching up from an earlier move
        too (they make no progress there either). A fork's parent or child and a request whose
        prefill elsewhere is still under way stay. Nothing moves while no other pipeline answers: they wait for it, as before.
        Returns the sessions moved (closed there once it answers again)."""
        prefillers = self.handoffs.prefill_only(self.pipelines.serving())
        others = [p for p in self.pipelines.serving()
                  if p is not pipeline and id(p) not in prefillers and p.silent_stage() is None]
        stage = pipeline.silent_stage()
        if not others or stage is None:
            return []
        moving = [sid for sid, r in self.active.items()
                  if self.opened.get(sid) is pipeline
                  and not (r.done or r.keep_open or r.parent or self._prefill_pipeline(r) is not None
                           or sid in self.prefilling)]  # (a handoff still under way stays; one done moves)
        if not moving:
            return []
        silent = time.monotonic() - max(stage.answered, pipeline.heard)
        why = Unavailable(f"stage {stage.node_id or stage.address} of pipeline {pipeline.index} is silent "
                          f"({silent:.1f} s)")
        log.info("%d running requests move off pipeline %d: %s", len(moving), pipeline.index, why)
        # spread, so that the next fault catches fewer of them: each mirror takes up to its even share of
        # what the others will run (the dearest replays, the least loaded mirror first: their KV is
        # there), the router places the rest
        share = -(-(len(moving) + sum(self.aimed_load(p) for p in others)) // len(others))
        room = {q: share - self.aimed_load(q) for q in self.pipelines.mirrors_of(pipeline) if q in others}
        # (each goes to the queue's front: the dearest, last, open first, the mirrors' before the router's)
        moving.sort(key=lambda sid: len(self.active[sid].inputs))
        targets: dict[str, Pipeline | None] = {}
        for sid in reversed(moving):
            q = max(room, key=room.__getitem__, default=None)  # (ties: the next in the ring)
            targets[sid] = None if q is None or room[q] <= 0 else q
            if targets[sid] is not None:
                room[q] -= 1
        for sid in moving:
            req = self.active.pop(sid)
            self._close_soon(sid)  # (a stage that does not answer gets it again once it does)
            req.session_id = ""
            req.target = targets[sid]
            self._back_in_queue(req, why, moved=True)
        self.stats.evacuated += len(moving)
        return moving

    def load(self, pipeline: Pipeline) -> int:
        """Requests running on `pipeline` now."""
        return sum(1 for p in self.opened.values() if p is pipeline)

    def aimed_load(self, pipeline: Pipeline) -> int:
        """Requests running on `pipeline` now, and those queued to replay there (moved, not open yet)."""
        return self.load(pipeline) + sum(1 for r in self.waiting if r.target is pipeline)

    def _close_soon(self, session_id: str, *, swap: bool = False) -> None:
        """Close a session on the pipeline it is open on (in the background); `swap`: it is replayed
        later, its stages keep its KV in their swap space for that."""
        pipeline = self.opened.pop(session_id, None)
        if pipeline is not None:
            pipeline.close_session_soon(session_id, swap=swap)

    # ---- requests ---------------------------------------------------------------------------
    def validate(self, job: Job) -> None:
        prompt_ids, max_tokens, cfg = job.prompt_ids, job.max_tokens, self.config
        if not prompt_ids:
            raise InvalidArgument("the prompt is empty")
        bad = [t for t in prompt_ids if not 0 <= t < cfg.vocab_size]
        if bad:
            raise InvalidArgument(f"prompt token id {bad[0]} is outside the vocabulary [0, {cfg.vocab_size})")
        if max_tokens < 1:
            raise InvalidArgument("max_tokens must be at least 1")
        if len(prompt_ids) + max_tokens > cfg.max_context:
            raise InvalidArgument(
                f"{len(prompt_ids)} prompt tokens + {max_tokens} new tokens exceed the model's "
                f"{cfg.max_context}-token context; shorten the prompt or lower --max-tokens")
        try:
            job.sampling.validate()
        except ValueError as exc:
            raise InvalidArgument(str(exc)) from exc
        if job.speculate is not None and not 0 <= job.speculate <= MAX_SPECULATE:
            raise InvalidArgument(f"speculate must be 0 (off) to {MAX_SPECULATE} candidates per step, "
                                  f"not {job.speculate}")
        if not 0 <= job.prefill_chunk <= cfg.max_context:  # a chunk is of one prompt, which fits the context
            raise InvalidArgument(f"prefill_chunk must be 0 (the controller's choice) to {cfg.max_context} prompt "
                                  f"tokens per step (the model's context), not {job.prefill_chunk}")
        bad = next((t for t, _ in job.sampling.logit_bias if not 0 <= t < cfg.vocab_size), None)
        if bad is not None:
            raise InvalidArgument(f"logit_bias: token id {bad} is outside the vocabulary [0, {cfg.vocab_size})")
        for name, top in (("top_logprobs", job.top_logprobs), ("prompt_logprobs", job.prompt_logprobs)):
            if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
                raise InvalidArgument(f"{name} must be 0 to {MAX_TOP_LOGPROBS}, not {top}")
        largest = self.pipelines.largest_request()
        if largest and len(prompt_ids) + max_tokens > largest:
            raise ResourceExhausted(
                f"{len(prompt_ids)} prompt tokens + {max_tokens} new tokens need more KV than a stage holds in all "
                f"({largest} positions); lower --max-tokens, or give the stages more --max-kv-mib")

    def submit(self, job: Job) -> RequestHandle:
        """Queue `job` (checked first: a MeshError says why it cannot run); its handle yields its
        tokens as they come."""
        self.validate(job)
        self.journal.check_durable()  # the journal cannot hold it: refused, never served as if it were durable
        if len(self.waiting) >= MAX_QUEUED:
            raise ResourceExhausted(f"{len(self.waiting)} requests are already waiting for the mesh; retry later")
        if job.request_id in self.requests:
            raise AlreadyExists(f"request {job.request_id} exists; resume it instead of submitting it again")
        sampling = job.sampling
        if not sampling.greedy and sampling.seed is None:  # a seed of our own: replays draw the same
            sampling = sampling.with_seed(random.getrandbits(63))
        job = replace(job, request_id=job.request_id or uuid.uuid4().hex, sampling=sampling,
                      stop_ids=(frozenset() if job.ignore_eos else self.config.stop_ids) | job.stop_ids,
                      speculate=self.config.speculate if job.speculate is None else job.speculate)
        req = Request(job.request_id, job, priority=next(self._arrivals))
        self.stats.prompt_tokens += len(req.prompt_ids)
        self.requests[req.id] = req
        self.traffic.observe(len(self.requests), req.capacity)
        if (bucket := self.traffic.concurrency()) != self._traffic_bucket:
            self._traffic_bucket = bucket
            self.on_traffic(f"the traffic changed: up to {bucket} requests at once")
        if job.parent is None and not job.keep_open:  # forks (outline points) live and die with their run
            self.journal.admit(req.id, job.to_json(), req.priority)
        self.waiting.append(req)
        self.kick()
        return RequestHandle(self, req)

    def find(self, request_id: str) -> Request | None:
        return self.requests.get(request_id)

    def attach(self, request_id: str) -> RequestHandle:
        """A handle on a request not ended yet (a client resuming it)."""
        req = self.requests.get(request_id)
        if req is None or req.ended:
            raise NotFound(f"no request {request_id!r} here: it ended (its tokens were all delivered, or it "
                           "failed) or was never admitted; submit it again")
        return RequestHandle(self, req)

    def restore(self, entries) -> int:
        """Requests from the journal (journal.Entry), oldest first, to run again from their tokens;
        each waits RETAIN_S for its client to resume it. Returns how many it restored."""
        now = time.monotonic()
        top = restored = 0
        for e in sorted(entries, key=lambda e: e.priority):
            if e.id in self.requests or OUTLINE_RECORD in e.job:  # an outline runs again when its client resumes it
                continue
            restored += 1
            job = replace(Job.from_json(e.job), request_id=e.id)
            req = Request(e.id, job, received=list(e.tokens), priority=e.priority, restored=True, detached_since=now,
                          logprobs=[None] * len(e.tokens))
            top = max(top, e.priority)
            self.requests[req.id] = req
            self.waiting.append(req)
        self._arrivals = itertools.count(max(top + 1, next(self._arrivals)))
        if self.requests:
            self.kick()
            self._ensure_sweeper()
        return restored

    async def _updates(self, req: Request, start: int = 0) -> AsyncIterator[TokenUpdate]:
        """`req`'s tokens from index `start` on, as they come; when its last reader leaves, the
        request is over for the mesh (its sequence closed unless kept open for forks)."""
        req.readers += 1
        req.detached_since = 0.0
        i = max(0, start)
        try:
            while True:
                while i < len(req.received):
                    token = req.received[i]
                    i += 1
                    last = req.done and i == len(req.received)
                    if i > req.delivered:
                        now = time.monotonic()  # a gap only after the token before it (not after a resume's skip)
                        gap = now - req.times.last_token if req.delivered == i - 1 and req.times.last_token else None
                        req.delivered = i
                        self.stats.generated_tokens += 1
                        req.times.last_token = now
                        if i == 1:
                            req.times.first_token = req.times.last_token
                        if gap is not None:
                            for observe in self.gap_observers:
                                observe(gap)
                    if last and req.state is not RequestState.FINISHED:
                        req.state, req.times.finished, req.finish_reason = (RequestState.FINISHED, time.monotonic(),
                                                                      req.stage_reason)
                        self.stats.completed += 1  # counted before the client takes it: it may close us right after
                    lp = req.logprobs[i - 1] if i <= len(req.logprobs) else None
                    yield TokenUpdate(token, last, req.stage_reason if last else "", lp)
                    if last:
                        return
                if req.done and i >= len(req.received) and req.received:
                    return  # a resume that already holds every token
                if req.error is not None:
                    raise req.error
                if req.state is RequestState.FINISHED:  # stopped by a client
                    return
                await self._wait_change(req)
        except MeshError:
            req.reader_failed = True
            raise
        finally:
            req.readers -= 1
            # the last reader gone: its client left (or got everything); unless the controller is
            # stopping, when it stays journaled for the next one to resume
            if not req.readers and not self.suspended:
                self._end(req)

    def _stop(self, req: Request, reason: str) -> None:
        """The client ends `req` as finished (a stop string it found): a completed request, not a
        failed one."""
        if req.state is not RequestState.FINISHED:
            req.state, req.times.finished, req.finish_reason = RequestState.FINISHED, time.monotonic(), reason
            self.stats.completed += 1
        req.notify()

    async def _wait_change(self, req: Request) -> None:
        """Until `req` changes (a MeshError raised when it is stuck). A request waiting in the
        queue is held up by the queue (which fails it after QUEUE_TIMEOUT_S); a running one fails
        when no token came for TOKEN_TIMEOUT_S."""
        changed = req.changed()
        while True:
            try:
                await asyncio.wait_for(changed.wait(), 1.0)
                return
            except asyncio.TimeoutError:
                now = time.monotonic()
                since = max(req.times.last_token, req.times.opened_now)
                limit = TOKEN_TIMEOUT_S + (0.0 if req.times.last_token else PREFILL_ALLOWANCE_S * len(req.prompt_ids))
                if req.state is RequestState.RUNNING and now - since > limit:
                    raise Unavailable(f"no token from the pipeline in {limit:.0f} s") from None
                wait_s = self.config.wait_for_nodes_s
                if (req.state is RequestState.QUEUED and self.state.waiting  # across failed installs in between
                        and now - max(req.times.queued_since, self.state.unready_since) > wait_s):
                    raise ResourceExhausted(f"waited {wait_s:.0f} s for the mesh: {self.state.reason}") from None
                if req.state is RequestState.QUEUED and now - req.times.queued_since > QUEUE_TIMEOUT_S + TOKEN_TIMEOUT_S:
                    raise ResourceExhausted(f"waited {now - req.times.queued_since:.0f} s for the mesh; retry later") from None
                if req.state is RequestState.QUEUED and req not in self.waiting and req.error is None:
                    raise Unavailable("the request left the admission queue without being opened") from None
                if req.error is not None or req.received and len(req.received) > req.delivered:
                    return
                continue

    def _not_durable(self, ids: list[str], err: MeshError) -> None:
        """The journal could not commit these requests' admission: they fail (their clients are
        told why) rather than run as if a controller's death could not lose them."""
        for rid in ids:
            req = self.requests.get(rid)
            if req is not None and not req.ended:
                self._fail(req, err)
                if not req.readers:
                    self._end(req)

    def _fail(self, req: Request, err: MeshError) -> None:
        """`req` fails with `err` (its readers get the tokens they have not read, then the error)."""
        if req.error is None:
            req.error = err
        req.notify()

    def _end(self, req: Request) -> None:
        """The request is over for the mesh (finished, failed, or its client left): out of the
        queue; its sequence closed, unless it finished and is kept open for forks."""
        if req.ended:
            return
        req.ended = True
        if req.state is not RequestState.FINISHED:
            req.state = RequestState.FAILED
            if req.error is None and not req.reader_failed:
                self.stats.cancelled += 1  # nothing went wrong: its client stopped reading (went away)
            else:
                self.stats.failed += 1
        self.stats.replays += req.replays
        if self.requests.get(req.id) is req:
            del self.requests[req.id]
        if not self.suspended:  # stopping: it stays journaled for the controller that follows
            self.journal.drop(req.id)
        self._hold_replays = False
        if req in self.waiting:
            self.waiting.remove(req)
        self._drop_prefill(req)
        self._observe_decode(req)
        if req.session_id and self.active.get(req.session_id) is req:
            del self.active[req.session_id]
            if not (req.keep_open and req.state is RequestState.FINISHED):
                self._close_soon(req.session_id)
                req.session_id = ""
        self.kick()
        for observe in self.observers:
            observe(req)

    def _release(self, req: Request) -> None:
        """The client is done with `req`: it ends (if it has not), and a sequence kept open for
        forks closes (unless a re-plan already did)."""
        self._end(req)
        if req.session_id and req.session_id not in self.active:
            self._close_soon(req.session_id)
        req.session_id = ""

    def _requeue(self, req: Request, err: MeshError, *, preempted: bool = False) -> None:
        """A stage ended the request's sequence: a fault (replay it, on this pipeline once it is
        healthy again or on the next one) or, `preempted`, to free KV blocks (replay it when there
        is room, once another request has ended, else it would thrash)."""
        was = self.opened.get(req.session_id)
        del self.active[req.session_id]
        self._close_soon(req.session_id, swap=preempted)  # (a preempted one's KV waits for its replay there)
        req.session_id = ""
        if not preempted:  # replayed where its KV blocks were copied (mesh.mirrors), if that one serves
            req.target = self.pipelines.mirror_of(was, self.aimed_load)  # (a fault's others went before it)
        if req.handoff is not None:  # a fault before its first token: replayed without a handoff
            self._drop_prefill(req)
            req.handoff, req.no_handoff = None, True
            self.handoffs.fallbacks += 1
        if preempted:
            self.stats.preemptions += 1
            self._hold_replays = True
        self._back_in_queue(req, err, preempted=preempted)

    def _back_in_queue(self, req: Request, err: MeshError, *, preempted: bool = False, moved: bool = False) -> None:
        """`req` to the front of the queue (the oldest work goes first), to be replayed from its
        prompt and the tokens it has. `moved`: a new plan replaces the one it ran on (not its
        failure: the mesh changed). It fails instead once preempted too often, or once its own
        sequence failed MAX_REPLAYS times in a row with no token between (a request that breaks
        whatever runs it)."""
        if preempted:
            req.preemptions += 1
            if req.preemptions > MAX_PREEMPTIONS:
                self._fail(req, ResourceExhausted(f"preempted {req.preemptions} times for lack of KV blocks "
                                                  f"(last: {err}); the mesh is overloaded, retry later"))
                return
        else:
            req.replays += 1
            req.catching_up, req.joined_onto = True, False  # (a join sets it after, moving one itself)
            if not moved:
                req.failures += 1
                if req.failures > MAX_REPLAYS:
                    self._fail(req, Unavailable(f"its sequence failed {req.failures - 1} times in a row with no new "
                                                f"token; giving up (last: {err})"))
                    return
        log.info("request %s %s (%s); replaying it with its %d tokens", req.id,
                 "preempted" if preempted else "interrupted", err, len(req.received))
        req.state, req.times.queued_since = RequestState.QUEUED, time.monotonic()
        self.waiting.appendleft(req)
        req.notify()
        self.kick()

    # ---- admission --------------------------------------------------------------------------
    def kick(self) -> None:
        self._wake.set()
        if self._admitter is None or self._admitter.done():
            self._admitter = asyncio.get_running_loop().create_task(self._admit_loop(), name="admission")

    async def _admit_loop(self) -> None:
        """Open the waiting requests in order; one that finds no room waits (and the ones behind
        it) until a request ends, or fails after QUEUE_TIMEOUT_S."""
        while self.waiting:
            self._wake.clear()
            req = self.waiting[0]
            if not self.pipelines.serving() or not (self.state.admitting or self.state.replanning):
                try:  # the app resumes us; the timeout re-checks a stage that came back
                    await asyncio.wait_for(self._wake.wait(), ADMIT_RETRY_S)
                except asyncio.TimeoutError:
                    pass
                continue
            if req.preemptions and self._hold_replays and self.active:
                await self._wake.wait()
                continue
            largest = self.pipelines.largest_request()
            if largest and req.capacity > largest:  # no pipeline's smallest pool can ever hold it
                self.waiting.remove(req)
                self._fail(req, ResourceExhausted(
                    f"{len(req.prompt_ids)} prompt tokens + {req.max_tokens} new tokens need more KV than a stage "
                    f"of the plan in force holds in all ({largest} positions); lower the tokens, or give the "
                    "stages more --max-kv-mib"))
                continue
            try:
                await self._open_somewhere(req)
            except ResourceExhausted as err:
                if time.monotonic() - req.times.queued_since > QUEUE_TIMEOUT_S:
                    if req in self.waiting:
                        self.waiting.remove(req)
                    self._fail(req, ResourceExhausted(
                        f"waited {QUEUE_TIMEOUT_S:.0f} s for KV blocks on the stages ({err}); retry later"))
                    continue
                try:
                    await asyncio.wait_for(self._wake.wait(), ADMIT_RETRY_S)
                except asyncio.TimeoutError:
                    pass
                continue
            except (Unavailable, FailedPrecondition) as err:
                # not the request's fault: a stage fault, or a stage's state (restarted and not yet
                # assigned, loading, stopping, on another plan) that a re-plan sets right; the
                # request waits for the pipeline to heal. A stage that follows a newer controller:
                # this one steps down, and the request resumes at the new one.
                if Fenced.seen_in(str(err)):
                    self.on_fenced(str(err))
                else:
                    self.on_trouble(str(err))
                await asyncio.sleep(ADMIT_RETRY_S)
                continue
            except MeshError as err:
                if req in self.waiting:
                    self.waiting.remove(req)
                self._fail(req, err)
                continue
            except Exception as exc:  # noqa: BLE001 — the queue must keep moving
                log.exception("opening request %s failed", req.id)
                if req in self.waiting:
                    self.waiting.remove(req)
                self._fail(req, Unavailable(f"the controller could not open the request: {exc}"))
                continue

    def _parent_pipeline(self, req: Request) -> Pipeline | None:
        """The pipeline a fork's parent sequence is open on (a fork shares its KV there), or None
        when it has no parent open (it then opens without one)."""
        if req.parent is None or req.received:
            return None
        pipeline = self.opened.get(req.parent[0])
        if pipeline is None or pipeline not in self.pipelines.serving():
            log.info("request %s: parent session gone; opening without it", req.id)
            req.parent = None
            return None
        return pipeline

    async def _open_somewhere(self, req: Request) -> None:
        """Open `req` on the pipeline the router picks (a fork: on its parent's); one whose stages
        are short of KV blocks now is passed over for the next, and RESOURCE_EXHAUSTED is raised
        only when every pipeline that can hold it refused."""
        tried: set[int] = set()
        parent = self._parent_pipeline(req)
        serving = self.pipelines.serving()
        prefillers = self.handoffs.prefill_only(serving)  # they prefill for the others and decode nobody's
        while True:
            inputs = req.inputs
            target, req.target = req.target, None  # (a rebalance's move: there once, if it still serves)
            if target is not None and (target not in serving or id(target) in tried
                                       or target.silent_stage() is not None):
                target = None
            pipeline = parent or target or self.pipelines.route(inputs, req.capacity, self.load,
                                                                frozenset(tried) | prefillers,
                                                                affinity=not req.received)
            if pipeline is None:
                raise Unavailable("no pipeline serves now")
            prefill = None
            if parent is None and not req.received and not req.no_handoff and req.prompt_logprobs is None:
                prefill = self.handoffs.prefill_for(len(inputs), pipeline, serving)
            try:
                if prefill is None or not await self._open_handoff(req, pipeline, prefill):
                    await self._open(req, pipeline)
                return
            except ResourceExhausted:
                tried.add(id(pipeline))
                if parent is not None or not self.pipelines.route(inputs, req.capacity, self.load,
                                                                  frozenset(tried) | prefillers):
                    raise

    async def _open(self, req: Request, pipeline: Pipeline) -> None:
        """Open the request's sequence on every stage of `pipeline` and feed its input (prompt +
        tokens so far)."""
        session = uuid.uuid4().hex
        inputs = req.inputs
        generation, detaches = pipeline.generation, pipeline.detaches
        open_request = self._open_request(req, session, inputs, pipeline)
        try:
            cached = await pipeline.open_session(open_request)
        except NotFound:
            if not open_request.parent_session_id:
                raise
            # the parent is gone (a re-plan replays sequences, not finished parents): no fork; the
            # prefix cache still attaches what it holds of the shared tokens
            log.info("request %s: parent session gone; opening without it", req.id)
            req.parent = None
            open_request.ClearField("parent_session_id")
            open_request.parent_length = 0
            cached = await pipeline.open_session(open_request)
        if req not in self.waiting or pipeline.generation != generation or pipeline.detaches != detaches:
            # its client left while it opened, or a new plan is coming: it opens again on that one
            pipeline.close_session_soon(session)
            return
        self._running(req, session, pipeline)
        start = min(cached, len(inputs) - 1)  # at least the last input is computed: it samples the next token
        req.prefill_tokens = len(inputs) - start
        if req.received:  # a replay (tokens so far among its inputs)
            self.stats.replay_tokens += len(inputs)
            self.stats.replay_cached_tokens += start
            log.info("request %s replays on pipeline %d: %d of its %d positions attached (prefix cache, KV mirror), "
                     "%d computed", req.id, pipeline.index, start, len(inputs), len(inputs) - start)
        await self._feed(req, pipeline, session, inputs, start, len(inputs), detaches)

    def _running(self, req: Request, session: str, pipeline: Pipeline) -> None:
        """`req` opened as `session` on `pipeline`: out of the queue, running."""
        self.waiting.remove(req)  # not popleft: a preempted request may have gone in front meanwhile
        self.opened[session] = req.pipeline = pipeline
        self.pipelines.remember(req.inputs, pipeline)
        req.session_id, req.state = session, RequestState.RUNNING
        req.times.opened_now = time.monotonic()
        req.times.opened = req.times.opened or req.times.opened_now
        self.active[session] = req

    async def _feed(self, req: Request, pipeline: Pipeline, session: str, inputs: list[int], start: int, stop: int,
                    detaches: int, *, prefill_only: bool = False) -> None:
        """Feed inputs[start:stop] of `session` to `pipeline`'s stage 0 (the last piece samples,
        unless `prefill_only`); a pipeline that takes no input puts `req` back in the queue. Only
        while `session` is still the request's there (`_feeding`): one moved meanwhile (a join, a
        silent pipeline) stops being fed, and a failure then leaves its new session alone."""
        try:
            for a in range(start, stop, FEED_CHUNK):
                if not self._feeding(req, session, pipeline):
                    return  # moved (or ended) meanwhile: its new session is fed where it went
                chunk = inputs[a: min(stop, a + FEED_CHUNK)]
                await pipeline.send_feed(stage_pb2.StepBatch(seqs=[stage_pb2.SeqStep(
                    session_id=session, start_pos=a, num_tokens=len(chunk), token_ids=chunk,
                    prefill_only=prefill_only or a + FEED_CHUNK < stop)]))  # more of the input follows
        except Unavailable as err:
            if not self._feeding(req, session, pipeline):
                return  # moved meanwhile (its new session is not this one's to fail)
            if self.active.get(req.session_id) is req:
                self._requeue(req, err)
            if pipeline.detaches == detaches:
                raise
            # else detached meanwhile by a re-plan: it waits for the new plan

    def _feeding(self, req: Request, session: str, pipeline: Pipeline) -> bool:
        """`session` is still `req`'s on `pipeline`: its running session there, or its prefill
        session of a handoff."""
        return self.opened.get(session) is pipeline or self.prefilling.get(session) is req

    def _open_request(self, req: Request, session: str, inputs: list[int], pipeline: Pipeline) -> stage_pb2.OpenSessionRequest:
        """What the stages of `pipeline` are told of `req`'s sequence `session` (its input `inputs`)."""
        open_request = stage_pb2.OpenSessionRequest(
            session_id=session, capacity=req.capacity, sampling=req.sampling.to_proto(),
            max_new_tokens=req.max_tokens, stop_token_ids=sorted(req.stop_ids), prompt_token_ids=inputs,
            generated=len(req.received), priority=req.priority, prefill_rank=prefill_rank(req), speculate=req.speculate,
            sequence=req.job.sequence,
            grammar=req.job.grammar)  # structured output: the last stage constrains to it
        if req.top_logprobs is not None:
            open_request.top_logprobs = req.top_logprobs
        if req.prompt_logprobs is not None and req.prompt_lps is None:  # (a replay after the first token: has them)
            open_request.prompt_logprobs = req.prompt_logprobs
        forked = req.parent[1] if req.parent is not None and not req.received else 0  # positions it shares
        chunk = req.job.prefill_chunk
        if not chunk:
            try:  # for the plan in force (a replay may run on another)
                chunk = self.prefill_chunk(len(inputs) - forked, pipeline)
            except Exception:  # noqa: BLE001 — without a chunk the stages' budget cuts the prompt
                log.exception("choosing the prefill chunk of request %s failed; using the stages' budget", req.id)
                chunk = 0
        req.prefill_chunk = open_request.prefill_chunk = chunk
        if req.parent is not None and not req.received:
            open_request.parent_session_id, open_request.parent_length = req.parent
        return open_request

    # ---- disaggregated prefill (controller.jobs.handoff) --------------------------------------
    async def _open_handoff(self, req: Request, decode: Pipeline, prefill: Pipeline) -> bool:
        """Open `req` on `decode` to take the KV of all its input but the last token, and on
        `prefill` to compute that KV; feed the prefill pipeline. False (nothing open) when the
        prefill pipeline cannot take it now: it opens the plain way on `decode`."""
        inputs = req.inputs
        h = Handoff(prefill, uuid.uuid4().hex, len(inputs) - 1)
        session = uuid.uuid4().hex
        marks = [(p, p.generation, p.detaches) for p in (decode, prefill)]
        open_d = self._open_request(req, session, inputs, decode)
        open_d.kv_import_length, open_d.kv_import_key = h.length, h.key
        open_p = stage_pb2.OpenSessionRequest(
            session_id=h.session, capacity=h.length, prompt_token_ids=inputs[: h.length], prefill_only=True,
            max_new_tokens=1, priority=req.priority, prefill_rank=prefill_rank(req),
            prefill_chunk=req.job.prefill_chunk or self._chunk(h.length, prefill))
        got_d, got_p = await asyncio.gather(decode.open_session(open_d), prefill.open_session(open_p),
                                            return_exceptions=True)
        if isinstance(got_d, BaseException) or isinstance(got_p, BaseException):
            if not isinstance(got_d, BaseException):
                decode.close_session_soon(session)
            if not isinstance(got_p, BaseException):
                prefill.close_session_soon(h.session)
            if isinstance(got_d, BaseException):
                raise got_d  # as a plain opening's would be
            log.info("request %s: the prefill pipeline cannot take it (%s); prefilling where it decodes", req.id, got_p)
            return False
        if req not in self.waiting or any(p.generation != g or p.detaches != d for p, g, d in marks):
            decode.close_session_soon(session)  # its client left, or a new plan is coming: it opens again
            prefill.close_session_soon(h.session)
            return True
        self._running(req, session, decode)
        self.opened[h.session] = prefill
        self.prefilling[h.session], req.handoff = req, h
        start = min(got_p, h.length - 1)
        h.computed, h.opened = h.length - start, time.monotonic()
        self.handoffs.handoffs += 1
        await self._feed(req, prefill, h.session, inputs, start, h.length, marks[1][2], prefill_only=True)
        return True

    def _chunk(self, prompt_tokens: int, pipeline: Pipeline) -> int:
        try:
            return self.prefill_chunk(prompt_tokens, pipeline)
        except Exception:  # noqa: BLE001 — without a chunk the stages' budget cuts the prompt
            log.exception("choosing a prefill chunk failed; using the stages' budget")
            return 0

    def _on_prefill_event(self, ev: stage_pb2.Event) -> None:
        """An event of a prefill pipeline's sequence: its KV is held (hand it over), or it failed."""
        req = self.prefilling[ev.session_id]
        h = req.handoff
        if ev.HasField("token"):
            if ev.token.finish_reason == PREFILLED and not h.prefilled:
                h.prefilled = time.monotonic()
                self.handoffs.observe_prefill(h.prefill, h.computed, h.prefilled - h.opened)
                h.task = asyncio.get_running_loop().create_task(self._hand_over(req, h), name=f"handoff-{req.id}")
            return
        self._handoff_failed(req, from_code(ev.error.code, ev.error.message))

    async def _hand_over(self, req: Request, h: Handoff) -> None:
        """Move the KV to the decode pipeline's stages, then feed it the last input token."""
        session, decode = req.session_id, req.pipeline
        try:
            h.bytes = await move_kv(h, decode, session)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 — any failure falls back to a replay
            err = exc if isinstance(exc, MeshError) else Unavailable(f"handing its KV over failed: {exc}")
            if self.prefilling.get(h.session) is req:
                self._handoff_failed(req, err)
            return
        if self.prefilling.get(h.session) is not req or self.active.get(session) is not req:
            return  # it ended, or was moved, meanwhile
        h.transferred = time.monotonic()
        self.handoffs.observe_transfer(h.prefill, h.length, h.transferred - h.prefilled)
        self._drop_prefill(req)
        inputs = req.inputs
        await self._feed(req, decode, session, inputs, h.length, len(inputs), decode.detaches)

    def _handoff_failed(self, req: Request, err: MeshError) -> None:
        """Its prefill or its KV's move failed: back in the queue, replayed without a handoff."""
        if req.session_id and self.active.get(req.session_id) is req and not req.done:
            log.info("request %s: disaggregated prefill failed (%s); replaying it", req.id, err)
            self._requeue(req, Unavailable(f"its disaggregated prefill failed: {err}"))
        else:
            self._drop_prefill(req)

    def _prefill_pipeline(self, req: Request) -> Pipeline | None:
        """The pipeline prefilling `req` for a handoff now (None: none)."""
        h = req.handoff
        return h.prefill if h is not None and self.prefilling.get(h.session) is req else None

    def _drop_prefill(self, req: Request) -> bool:
        """Its handoff's prefill sequence closed and forgotten (its move cancelled); whether it had one."""
        h = req.handoff
        if h is None or self.prefilling.get(h.session) is not req:
            return False
        del self.prefilling[h.session]
        self._close_soon(h.session)
        if h.task is not None and not h.task.done() and h.task is not asyncio.current_task():
            h.task.cancel()
        if not h.transferred:
            req.handoff = None  # (its timings are a plain request's)
        return True

    def _first_token(self, req: Request) -> None:
        """`req`'s first token came: the prefill rate of its pipeline, or its handoff's first step."""
        now = time.monotonic()
        h = req.handoff
        if h is not None and h.transferred:
            h.first_step = now
        elif req.pipeline is not None and req.prefill_tokens:
            self.handoffs.observe_prefill(req.pipeline, req.prefill_tokens, now - req.times.opened_now)

    def _observe_decode(self, req: Request) -> None:
        t = req.times
        if req.pipeline is not None and len(req.tokens) > 1 and t.finished > t.first_token > 0:
            self.handoffs.observe_decode(req.pipeline, len(req.tokens) - 1, t.finished - t.first_token)

    def _ensure_sweeper(self) -> None:
        if self._sweeper is None or self._sweeper.done():
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep(), name="restored-requests")

    async def _sweep(self) -> None:
        """Restored requests that no client resumed within RETAIN_S end (finished or not)."""
        while any(r.restored for r in self.requests.values()):
            await asyncio.sleep(1.0)
            now = time.monotonic()
            for req in [r for r in self.requests.values() if r.restored and not r.readers and r.detached_since]:
                if now - req.detached_since > RETAIN_S:
                    log.info("request %s: no client resumed it in %.0f s; dropping it", req.id, RETAIN_S)
                    self._fail(req, Unavailable("no client resumed it in time"))
                    self._end(req)

    async def suspend(self) -> None:
        """The controller is stopping: from now on no request leaves the journal as its client's
        stream is cut, and each client is told to resume it at the controller that follows."""
        self.suspended = True
        for req in [*self.active.values(), *self.waiting]:
            self._fail(req, Unavailable(f"the controller is stopping; resume request {req.id} at the controller "
                                        "that follows (it keeps its journal) or at the standby"))
        await asyncio.sleep(0.1)  # the readers pass it on before the server cancels their calls

    async def shutdown(self) -> None:
        """Close every sequence we hold (the controller is stopping); the requests stay journaled,
        and their clients are told to resume them at the controller that follows."""
        if not self.suspended:
            await self.suspend()
        if self._sweeper is not None:
            self._sweeper.cancel()
        sessions = list(self.opened.items())
        self.active.clear()
        self.opened.clear()
        self.waiting.clear()
        if self._admitter is not None:
            self._admitter.cancel()
        await asyncio.gather(*(p.close_session(s) for s, p in sessions), return_exceptions=True)
