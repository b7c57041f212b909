"""Request lifecycle: tokenize, open the sequence on every stage, feed the prompt to stage 0 (in
chunks), collect the tokens the last stage reports, close the sequence.

The controller keeps every request's prompt and tokens (so a later re-plan can replay them).
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator

from logicpipe.errors import InvalidArgument, Unavailable, from_code
from logicpipe.v1 import stage_pb2
from controller.pipeline import Pipeline

log = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 128
PREFILL_CHUNK = 512         # prompt tokens per step message
TOKEN_TIMEOUT_S = 120.0     # no token for this long fails the request


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
    tokens: list[int] = field(default_factory=list)
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    submitted: float = field(default_factory=time.monotonic)
    opened: float = 0.0
    first_token: float = 0.0
    finished: float = 0.0
    finish_reason: str = ""


class Scheduler:
    def __init__(self, pipeline: Pipeline, max_context: int, stop_ids: frozenset[int], vocab_size: int):
        self.pipeline = pipeline
        self.max_context = max_context  # the model's context, tokens
        self.stop_ids = stop_ids
        self.vocab_size = vocab_size
        self.active: dict[str, Request] = {}
        self.completed = 0
        self._closing: set[asyncio.Task] = set()

    # ---- events from the stages (called by the Pipeline) -----------------------------------
    def on_event(self, ev: stage_pb2.Event) -> None:
        req = self.active.get(ev.session_id)
        if req is None:
            return
        if ev.HasField("token"):
            req.queue.put_nowait(TokenUpdate(req.id, ev.token.token_id, ev.token.finished, ev.token.finish_reason))
        else:
            req.queue.put_nowait(from_code(ev.error.code, ev.error.message))

    def on_stage_lost(self, address: str, reason: str) -> None:
        for req in self.active.values():
            req.queue.put_nowait(Unavailable(f"stage {address} was lost mid-request ({reason})"))

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

    async def generate(self, prompt_ids: list[int], max_tokens: int, sampling: Sampling,
                       ignore_eos: bool = False) -> AsyncIterator[TokenUpdate]:
        """Yield each new token as the last stage reports it. Raises a MeshError on failure."""
        self.validate(prompt_ids, max_tokens, sampling)
        if not self.pipeline.stages:
            raise Unavailable("the mesh has no pipeline yet (no stage nodes assigned); see `lpctl status`")
        req = Request(uuid.uuid4().hex, list(prompt_ids), max_tokens, sampling)
        self.active[req.id] = req
        try:
            await self.pipeline.open_session(stage_pb2.OpenSessionRequest(
                session_id=req.id, capacity=len(prompt_ids) + max_tokens, sampling=sampling.to_proto(),
                max_new_tokens=max_tokens, stop_token_ids=[] if ignore_eos else sorted(self.stop_ids)))
            req.opened = time.monotonic()
            try:
                await self._feed_prompt(req)
                while True:
                    try:
                        item = await asyncio.wait_for(req.queue.get(), TOKEN_TIMEOUT_S)
                    except asyncio.TimeoutError:
                        raise Unavailable(f"no token from the pipeline in {TOKEN_TIMEOUT_S:.0f} s") from None
                    if isinstance(item, Exception):
                        raise item
                    req.tokens.append(item.token_id)
                    if len(req.tokens) == 1:
                        req.first_token = time.monotonic()
                    if item.finished:
                        req.finished, req.finish_reason = time.monotonic(), item.finish_reason
                        item.request = req
                    yield item
                    if item.finished:
                        self.completed += 1
                        return
            finally:
                task = asyncio.get_running_loop().create_task(self.pipeline.close_session(req.id))
                self._closing.add(task)  # keep a reference until done
                task.add_done_callback(self._closing.discard)
        finally:
            self.active.pop(req.id, None)

    async def _feed_prompt(self, req: Request) -> None:
        ids = req.prompt_ids
        for start in range(0, len(ids), PREFILL_CHUNK):
            chunk = ids[start: start + PREFILL_CHUNK]
            await self.pipeline.send_prompt(stage_pb2.StepBatch(seqs=[stage_pb2.SeqStep(
                session_id=req.id, start_pos=start, num_tokens=len(chunk), token_ids=chunk,
                prefill_only=start + len(chunk) < len(ids))]))
