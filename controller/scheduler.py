"""Request lifecycle: admission (a queue, then RESOURCE_EXHAUSTED), the sequence opened on every
stage, the input fed to stage 0, the tokens the last stage reports, the sequence closed.

The controller keeps every request's prompt and tokens, so a request whose sequence a stage gives
up (preempted to free KV blocks) is replayed: opened again with its prompt and the tokens it has
so far; the prefix cache makes that cheap, and each sampled token's draw depends only on (seed,
sequence, position), so the replay continues exactly where it was.
"""
from __future__ import annotations

import asyncio
import logging
import random
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from enum import Enum
from typing import AsyncIterator

import grpc

from logicpipe.errors import InvalidArgument, MeshError, ResourceExhausted, Unavailable, from_code
from logicpipe.v1 import stage_pb2
from controller.pipeline import Pipeline

log = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 128
FEED_CHUNK = 8192           # input tokens per feed message (stage 0 chunks them into steps itself)
TOKEN_TIMEOUT_S = 120.0     # no token for this long fails a running request
QUEUE_TIMEOUT_S = 600.0     # a request waiting for KV blocks this long fails with RESOURCE_EXHAUSTED
MAX_QUEUED = 4096           # requests waiting at once; more are refused at once
MAX_PREEMPTIONS = 16        # a request preempted this often fails (the mesh is thrashing)
ADMIT_RETRY_S = 0.5         # a refused admission is retried this often even if nothing finished


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0            # 0 = off
    top_p: float = 1.0        # 1 = off
    seed: int | None = None

    def to_proto(self) -> stage_pb2.SamplingParams:
        p = stage_pb2.SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p)
        if self.seed is not None:
            p.seed = self.seed
        return p


class RequestState(Enum):
    QUEUED = "queued"      # waiting for KV blocks (new, or preempted and to be replayed)
    RUNNING = "running"    # its sequence is open on every stage
    FINISHED = "finished"
    FAILED = "failed"


@dataclass
class TokenUpdate:
    request_id: str
    token_id: int
    finished: bool
    finish_reason: str
    request: "Request | None" = None  # set on the finished update, for its timings


@dataclass
class Request:
    id: str
    prompt_ids: list[int]
    max_tokens: int
    sampling: Sampling
    stop_ids: frozenset[int]
    tokens: list[int] = field(default_factory=list)
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)  # TokenUpdate | MeshError, to the client
    state: RequestState = RequestState.QUEUED
    session_id: str = ""      # the sequence open for it now (a new one per admission)
    preemptions: int = 0
    submitted: float = field(default_factory=time.monotonic)
    queued_since: float = field(default_factory=time.monotonic)
    opened: float = 0.0
    first_token: float = 0.0
    finished: float = 0.0
    finish_reason: str = ""

    @property
    def capacity(self) -> int:
        return len(self.prompt_ids) + self.max_tokens


class Scheduler:
    def __init__(self, pipeline: Pipeline, max_context: int, stop_ids: frozenset[int], vocab_size: int):
        self.pipeline = pipeline
        self.max_context = max_context  # the model's context, tokens
        self.stop_ids = stop_ids
        self.vocab_size = vocab_size
        self.active: dict[str, Request] = {}   # session id -> the request it serves
        self.waiting: deque[Request] = deque()
        self.completed = 0
        self.preemptions = 0
        self._wake = asyncio.Event()
        self._admitter: asyncio.Task | None = None

    @property
    def running(self) -> int:
        return len(self.active)

    # ---- events from the stages (called by the Pipeline) -----------------------------------
    def on_event(self, ev: stage_pb2.Event) -> None:
        req = self.active.get(ev.session_id)
        if req is None:
            return  # a session we gave up (preempted, failed, cancelled): its late events mean nothing
        if ev.HasField("token"):
            t = ev.token
            n = len(t.token_ids)
            for i, tok in enumerate(t.token_ids):
                last = i == n - 1
                req.queue.put_nowait(TokenUpdate(req.id, tok, t.finished and last, t.finish_reason if last else ""))
            return
        err = from_code(ev.error.code, ev.error.message)
        if ev.error.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]:
            self._preempted(req, err)
        else:
            req.queue.put_nowait(err)

    def on_stage_lost(self, address: str, reason: str) -> None:
        err = Unavailable(f"stage {address} was lost mid-request ({reason})")
        for req in [*self.active.values(), *self.waiting]:
            req.queue.put_nowait(err)

    # ---- requests ---------------------------------------------------------------------------
    def validate(self, prompt_ids: list[int], max_tokens: int, sampling: Sampling) -> None:
        if not prompt_ids:
            raise InvalidArgument("the prompt is empty")
        bad = [t for t in prompt_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidArgument(f"prompt token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        if max_tokens < 1:
            raise InvalidArgument("max_tokens must be at least 1")
        if len(prompt_ids) + max_tokens > self.max_context:
            raise InvalidArgument(
                f"{len(prompt_ids)} prompt tokens + {max_tokens} new tokens exceed the model's "
                f"{self.max_context}-token context; shorten the prompt or lower --max-tokens")
        if sampling.temperature < 0:
            raise InvalidArgument(f"temperature {sampling.temperature} is negative; use 0 for greedy or a value > 0")
        if sampling.top_k < 0:
            raise InvalidArgument(f"top_k {sampling.top_k} is negative; use 0 to turn it off")
        if not 0 < sampling.top_p <= 1:
            raise InvalidArgument(f"top_p {sampling.top_p} is outside (0, 1]; use 1 to turn it off")
        largest = self.pipeline.largest_request()
        if largest and len(prompt_ids) + max_tokens > largest:
            raise ResourceExhausted(
                f"{len(prompt_ids)} prompt tokens + {max_tokens} new tokens need more KV than a stage holds in all "
                f"({largest} positions); lower --max-tokens, or give the stages more --max-kv-mib")

    async def generate(self, prompt_ids: list[int], max_tokens: int, sampling: Sampling,
                       ignore_eos: bool = False) -> AsyncIterator[TokenUpdate]:
        """Yield each new token as the last stage reports it. Raises a MeshError on failure."""
        self.validate(prompt_ids, max_tokens, sampling)
        if not self.pipeline.stages:
            raise Unavailable("the mesh has no pipeline yet (no stage nodes assigned); see `lpctl status`")
        if len(self.waiting) >= MAX_QUEUED:
            raise ResourceExhausted(f"{len(self.waiting)} requests are already waiting for the mesh; retry later")
        if not sampling.temperature == 0 and sampling.seed is None:  # a seed of our own: replays draw the same
            sampling = Sampling(sampling.temperature, sampling.top_k, sampling.top_p, random.getrandbits(63))
        req = Request(uuid.uuid4().hex, list(prompt_ids), max_tokens, sampling,
                      frozenset() if ignore_eos else self.stop_ids)
        self.waiting.append(req)
        self._kick()
        try:
            while True:
                timeout = QUEUE_TIMEOUT_S + 5 if req.state is RequestState.QUEUED else TOKEN_TIMEOUT_S
                try:
                    item = await asyncio.wait_for(req.queue.get(), timeout)
                except asyncio.TimeoutError:
                    raise Unavailable(f"no token from the pipeline in {timeout:.0f} s") from None
                if isinstance(item, Exception):
                    raise item
                req.tokens.append(item.token_id)
                if len(req.tokens) == 1:
                    req.first_token = time.monotonic()
                if item.finished:
                    req.state, req.finished, req.finish_reason = RequestState.FINISHED, time.monotonic(), item.finish_reason
                    item.request = req
                yield item
                if item.finished:
                    self.completed += 1
                    return
        finally:
            if req.state is not RequestState.FINISHED:
                req.state = RequestState.FAILED
            self._release(req)

    def _release(self, req: Request) -> None:
        """The request is over (or its client left): out of the queue, its sequence closed."""
        if req in self.waiting:
            self.waiting.remove(req)
        if req.session_id and self.active.get(req.session_id) is req:
            del self.active[req.session_id]
            self.pipeline.close_session_soon(req.session_id)
        self._kick()

    def _preempted(self, req: Request, err: MeshError) -> None:
        """A stage gave the request's sequence up to free KV blocks: replay it when there is room."""
        del self.active[req.session_id]
        self.pipeline.close_session_soon(req.session_id)
        req.session_id = ""
        req.preemptions += 1
        self.preemptions += 1
        if req.preemptions > MAX_PREEMPTIONS:
            req.queue.put_nowait(ResourceExhausted(f"preempted {req.preemptions} times for lack of KV blocks "
                                                   f"(last: {err}); the mesh is overloaded, retry later"))
            return
        log.info("request %s preempted (%s); replaying it with its %d tokens", req.id, err, len(req.tokens))
        req.state, req.queued_since = RequestState.QUEUED, time.monotonic()
        self.waiting.appendleft(req)  # the oldest work goes first
        self._kick()

    # ---- admission --------------------------------------------------------------------------
    def _kick(self) -> None:
        self._wake.set()
        if self._admitter is None or self._admitter.done():
            self._admitter = asyncio.get_running_loop().create_task(self._admit_loop(), name="admission")

    async def _admit_loop(self) -> None:
        """Open the waiting requests in order; one that finds no room waits (and the ones behind
        it) until a request ends, or fails after QUEUE_TIMEOUT_S."""
        while self.waiting:
            self._wake.clear()
            req = self.waiting[0]
            try:
                await self._open(req)
            except ResourceExhausted as err:
                if time.monotonic() - req.queued_since > QUEUE_TIMEOUT_S:
                    self.waiting.popleft()
                    req.queue.put_nowait(ResourceExhausted(
                        f"waited {QUEUE_TIMEOUT_S:.0f} s for KV blocks on the stages ({err}); retry later"))
                    continue
                try:
                    await asyncio.wait_for(self._wake.wait(), ADMIT_RETRY_S)
                except asyncio.TimeoutError:
                    pass
                continue
            except MeshError as err:
                if self.waiting and self.waiting[0] is req:
                    self.waiting.popleft()
                req.queue.put_nowait(err)
                continue

    async def _open(self, req: Request) -> None:
        """Open the request's sequence on every stage and feed its input (prompt + tokens so far)."""
        session = uuid.uuid4().hex
        inputs = req.prompt_ids + req.tokens
        cached = await self.pipeline.open_session(stage_pb2.OpenSessionRequest(
            session_id=session, capacity=req.capacity, sampling=req.sampling.to_proto(),
            max_new_tokens=req.max_tokens, stop_token_ids=sorted(req.stop_ids), prompt_token_ids=inputs,
            generated=len(req.tokens)))
        if not self.waiting or self.waiting[0] is not req:  # its client left while it opened
            self.pipeline.close_session_soon(session)
            return
        self.waiting.popleft()
        req.session_id, req.state = session, RequestState.RUNNING
        req.opened = req.opened or time.monotonic()
        self.active[session] = req
        start = min(cached, len(inputs) - 1)  # at least the last input is computed: it samples the next token
        for a in range(start, len(inputs), FEED_CHUNK):
            chunk = inputs[a: a + FEED_CHUNK]
            await self.pipeline.send_feed(stage_pb2.StepBatch(seqs=[stage_pb2.SeqStep(
                session_id=session, start_pos=a, num_tokens=len(chunk), token_ids=chunk)]))

    async def shutdown(self) -> None:
        """Fail every request and close every sequence we hold (the controller is stopping)."""
        err = Unavailable("the controller is shutting down")
        for req in [*self.active.values(), *self.waiting]:
            req.queue.put_nowait(err)
        sessions = list(self.active)
        self.active.clear()
        self.waiting.clear()
        if self._admitter is not None:
            self._admitter.cancel()
        await asyncio.gather(*(self.pipeline.close_session(s) for s in sessions), return_exceptions=True)
