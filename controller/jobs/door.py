"""The one front door for requests. Whichever API a request comes by (gRPC `Submit`, the HTTP API),
its adapter turns it into a `Prompt` and `RequestOptions` and opens a `Completion` here; this
module applies every rule a request meets on the way in and out, so they are the same at every
door: requests per client, the caps and checks of controller.jobs.rules (prompt and conversation
size, stop strings, request ids, a grammar that admits some value), tokenizing (off the event
loop), the chat template, detokenizing, and outline-DAG requests.

    async with door.open(prompt, options, client) as completion:   # a MeshError says why not
        async for piece in completion:                             # its tokens and text as they come
            ...
    completion.finish_reason, completion.tokens, completion.timings()  # afterwards

    async with door.resume(request_id, have, client) as completion:  # the same, from token `have` on
        ...

A plain request is journaled (controller.journal) with what resuming it needs: its stop strings
and which API it came by; a client whose stream broke (the controller restarted, a standby took
over) resumes it by its id and gets what it would have got, from the tokens it already holds on.
An outline request is journaled as what runs it again (outline.outline_record); a client that
resumes it after its controller died, or its stream broke, gets it run again from its start
(exact: greedy, or seeded here), the tokens it holds of each point skipped (`have_points`).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncIterator

from logicpipe.controller.jobs.outline import OutlineRun
from logicpipe.controller.jobs.outline_door import OutlineRequests, held_points
from logicpipe.controller.jobs.job import OUTLINE_RECORD, Job, Request
from logicpipe.controller.jobs.scheduler import RequestHandle, Scheduler
from logicpipe.controller.jobs.rules import (
    MAX_CHOICES,
    ROLE_ALIASES,
    Prompt,
    RequestOptions,
    checked,
)
from logicpipe.controller.jobs.text import StopScan, TextStream, encode_chat, encode_prompt
from logicpipe.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from logicpipe.limits import check_request_id
from logicpipe.sampling import SamplingParams

DEFAULT_REQUESTS_PER_CLIENT = 64  # requests one client may have open at once (--max-requests-per-client)

def resumable_tokens(req) -> int:
    """The most tokens a client of `req` (a scheduler Request) can hold: all it finished with, else
    its max_tokens (none when it asked for the prompt's logprobs only)."""
    if req.job.prompt_only:
        return 0
    return len(req.received) if req.done else req.job.max_tokens


def host_client(host: str) -> str:
    """The client a call without a certificate counts as: its host (IPv6 in brackets), whichever
    door it came by."""
    return f"host [{host}]" if ":" in host and not host.startswith("[") else f"host {host}"


@dataclass(frozen=True)
class Piece:
    """What a completion adds as it runs: a token and the text it releases."""

    token_ids: tuple[int, ...]
    text: str                 # new text, safe to show (a stop string never leaks)
    point: int = 0            # outline requests: whose token (0: the outline itself)
    finished: bool = False    # the last piece of a plain request
    finish_reason: str = ""   # on the last piece: "stop" (a stop token or string) or "length"
    logprobs: tuple = ()      # a request that asked: a TokenLogprob (or None: not kept) per token_ids


@dataclass(frozen=True)
class Timings:
    queue_s: float
    first_token_s: float
    total_s: float
    decode_tokens_per_s: float
    decode_steps: int
    candidates: int
    accepted: int
    speculate: int
    prefill_chunk: int
    # disaggregated prefill (controller.jobs.handoff): first_token_s after queue_s is these three
    disaggregated: bool = False
    prefill_s: float = 0.0      # the prefill pipeline's sequence opened to its KV held
    transfer_s: float = 0.0     # its KV moved to the decode pipeline's stages
    first_step_s: float = 0.0   # the decode pipeline's first step (the first new token)


def request_timings(req: Request) -> Timings:
    n = len(req.tokens)
    t = req.times
    decode = t.finished - t.first_token
    return Timings(queue_s=t.opened - t.submitted, first_token_s=t.first_token - t.submitted,
                   total_s=t.finished - t.submitted,
                   decode_tokens_per_s=(n - 1) / decode if decode > 0 and n > 1 else 0.0,
                   decode_steps=req.decode_steps, candidates=req.candidates, accepted=req.accepted,
                   speculate=req.speculate, prefill_chunk=req.prefill_chunk, **handoff_timings(req))


def handoff_timings(req: Request) -> dict:
    """A disaggregated request's TTFT as prefill / transfer / first decode step (none otherwise)."""
    h = req.handoff
    if h is None or not h.first_step:
        return {}
    return {"disaggregated": True, "prefill_s": h.prefilled - h.opened, "transfer_s": h.transferred - h.prefilled,
            "first_step_s": h.first_step - h.transferred}


@dataclass
class Completion:
    """One request through the front door: iterate it for its pieces; afterwards it holds the
    outcome (what the adapters report: text, tokens, finish reason, timings, an outline's points)."""

    id: str
    prompt_tokens: int
    tokens: list[int] = field(default_factory=list)   # every token received
    text: str = ""                                    # the answer (cut at a stop string)
    finish_reason: str = ""                           # "stop" | "length" once finished
    stop_string: str = ""                             # ... the stop string that ended it ("": none did)
    points: list = field(default_factory=list)        # outline requests: controller.outline.Point, in order
    warnings: list[str] = field(default_factory=list)  # ... the outline parser's repairs
    submitted: float = field(default_factory=time.monotonic)
    handle: RequestHandle | None = None               # a plain request's, once submitted
    api: str = ""                                     # the door it was submitted by (a resume answers in its form)
    top_logprobs: int | None = None                   # it asked for logprobs with this many most likely tokens
    logprobs: list = field(default_factory=list)      # ... a TokenLogprob (None: not kept) per token received
    prompt_ids: tuple[int, ...] = ()                  # its prompt's tokens
    prompt_logprobs: list | None = None               # asked: a TokenLogprob per prompt token from the second
    shares_prompt: bool = False                       # a choice after the first of n: its prompt is counted once
    outline: bool = False                             # an outline request (its points follow its pieces)
    _pieces: AsyncIterator[Piece] | None = None

    def __aiter__(self) -> AsyncIterator[Piece]:
        return self._pieces

    def timings(self) -> Timings | None:
        """A plain request's timings, once it has finished."""
        return request_timings(self.handle.request) if self.handle is not None and self.finish_reason else None


class FrontDoor:
    """Requests in, completions out, over the scheduler (see the module's docstring)."""

    def __init__(self, scheduler: Scheduler, tokenizer, *, model_dir: Path,
                 requests_per_client: int = DEFAULT_REQUESTS_PER_CLIENT, serving=lambda: ""):
        self.scheduler = scheduler
        self.serving = serving              # "" while this controller serves requests, else why not (a standby)
        self.tokenizer = tokenizer          # None: a model without one takes token ids only
        self.model_dir = model_dir
        self.requests_per_client = requests_per_client
        self._open: dict[str, int] = {}     # client -> its completions open now
        self.outlines = OutlineRequests(scheduler, tokenizer)  # journaled, resumed by running them again

    @contextlib.asynccontextmanager
    async def open(self, prompt: Prompt, options: RequestOptions, client: str, *,
                   admitted: bool = False) -> AsyncIterator[Completion]:
        """A completion of `prompt` for `client` (a certificate name, an API key or a host), refused
        with a MeshError before any work when it breaks a rule; it ends (its sequences closed) when
        the block is left, also when the client went away. `admitted`: the caller holds the
        client's place already (`admit`)."""
        async with self._held(client, admitted):
            await checked(prompt, options)
            completion = await (self._outline(prompt, options, client) if options.outline is not None
                                else self._plain(prompt, options, client))
            try:
                yield completion
            finally:
                await completion._pieces.aclose()
                if completion.handle is not None:
                    completion.handle.release()

    @contextlib.asynccontextmanager
    async def open_n(self, prompt: Prompt, options: RequestOptions, client: str, n: int, *,
                     admitted: bool = False) -> AsyncIterator[list[Completion]]:
        """`n` completions of one prompt (OpenAI's `n`), the prompt computed once: a sequence of its
        own computes it (sampling one token, unused) and stays open while each choice forks its KV,
        so a choice computes only its prompt's last row again (to sample its first token). Choice
        i's draws mix in i: a seeded request gives n different answers (choice 0 the answer of
        n = 1), greedy n equal ones. Not journaled (forks live and die with their request)."""
        if not 1 <= n <= MAX_CHOICES:
            raise InvalidArgument(f"n must be 1 to {MAX_CHOICES} choices, not {n}")
        async with self._held(client, admitted):
            await checked(prompt, options)
            if options.outline is not None or options.prompt_logprobs is not None or not options.max_tokens:
                raise InvalidArgument("n > 1 is for plain requests: not with an outline or the prompt's logprobs")
            o = options
            ids = await self.token_ids(prompt)
            parent = self.scheduler.submit(Job(tuple(ids), 1, SamplingParams(), keep_open=True, speculate=0,
                                               prefill_chunk=o.prefill_chunk, client=client))
            completions: list[Completion] = []
            try:
                async for _ in parent.updates():  # the prompt is in the stages' KV
                    pass
                for i in range(n):
                    handle = self.scheduler.submit(Job(
                        tuple(ids), o.max_tokens, o.sampling, o.ignore_eos, speculate=o.speculate,
                        prefill_chunk=o.prefill_chunk, parent=(parent.session_id, len(ids)), top_logprobs=o.top_logprobs,
                        sequence=i, stop=tuple(o.stop), api=o.api, client=client, grammar=o.json_schema or ""))
                    c = Completion(handle.id, len(ids), handle=handle, api=o.api, top_logprobs=o.top_logprobs,
                                   prompt_ids=tuple(ids), shares_prompt=i > 0)
                    c._pieces = self._plain_pieces(c, handle, o)
                    completions.append(c)
                yield completions
            finally:
                for c in completions:
                    await c._pieces.aclose()
                    c.handle.release()
                parent.release()

    @contextlib.asynccontextmanager
    async def resume(self, request_id: str, have: int, client: str, *, have_points: tuple[int, ...] = (),
                     admitted: bool = False, have_name: str = "have_tokens") -> AsyncIterator[Completion]:
        """Request `request_id` again, from its token `have` on (the client holds the ones before;
        of an outline request, have_points[i] of point i, 0 the outline): its pieces are those the
        first stream would have carried from there. Only the client that submitted it may (any
        other is told it does not exist). `have` past what the request can ever have is refused at
        once (INVALID_ARGUMENT naming `have_name`); up to that, a resume waits for the tokens still
        to come."""
        async with self._held(client, admitted):
            check_request_id("request_id", request_id)
            doc = self.outlines.record(request_id, client)
            if doc is not None:
                c = self._outline_completion(request_id, doc, held_points(have, have_points))
                try:
                    yield c
                finally:
                    await c._pieces.aclose()
                return
            handle = self.scheduler.attach(request_id)
            req = handle.request
            job = req.job
            if job.client and job.client != client:  # (not released: that would end it for its client)
                raise NotFound(f"no request {request_id!r} here: it ended (its tokens were all delivered, or it "
                               "failed) or was never admitted; submit it again")
            most = resumable_tokens(req)
            if have > most:
                why = (f"it finished with {most}" if req.done else
                       f"its max_tokens is {most}" if not job.prompt_only else "it asked for the prompt's logprobs only")
                raise InvalidArgument(f"{have_name} {have} is more tokens than request {request_id!r} can ever have "
                                      f"({why}): give the number of its tokens you hold, 0 to {most}")
            o = RequestOptions(0 if job.prompt_only else job.max_tokens, job.sampling, stop=job.stop,
                               prompt_logprobs=job.prompt_logprobs)
            c = Completion(handle.id, len(req.prompt_ids), handle=handle, api=job.api,
                           top_logprobs=req.top_logprobs, prompt_ids=tuple(req.prompt_ids))
            c._pieces = self._plain_pieces(c, handle, o, skip=have, skip_name=have_name)
            try:
                yield c
            finally:
                await c._pieces.aclose()
                handle.release()

    def _held(self, client: str, admitted: bool):
        return contextlib.nullcontext() if admitted else self.admit(client)

    @contextlib.asynccontextmanager
    async def admit(self, client: str):
        """One more request of `client` open while inside (refused past its cap, or while this
        controller serves none). An adapter that has work to do before `open` (HTTP reads and
        parses a body of up to 8 MiB) takes the place first, so that work counts too."""
        why_not = self.serving()
        if why_not:
            raise FailedPrecondition(why_not)
        n = self._open.get(client, 0)
        if n >= self.requests_per_client:
            raise ResourceExhausted(f"{client} has {n} requests running, the cap per client "
                                    f"(--max-requests-per-client); wait for one to finish")
        self._open[client] = n + 1
        try:
            yield
        finally:
            self._open[client] -= 1
            if not self._open[client]:
                del self._open[client]

    # ---- plain requests ------------------------------------------------------------------------
    async def _plain(self, prompt: Prompt, o: RequestOptions, client: str) -> Completion:
        ids = await self.token_ids(prompt)
        handle = self.scheduler.submit(Job(tuple(ids), max(1, o.max_tokens), o.sampling, o.ignore_eos,
                                           speculate=o.speculate, prefill_chunk=o.prefill_chunk,
                                           request_id=o.request_id, top_logprobs=o.top_logprobs,
                                           prompt_logprobs=o.prompt_logprobs, stop=tuple(o.stop), api=o.api,
                                           client=client, grammar=o.json_schema or "", prompt_only=not o.max_tokens))
        c = Completion(handle.id, len(ids), handle=handle, api=o.api, top_logprobs=o.top_logprobs,
                       prompt_ids=tuple(ids))
        c._pieces = self._plain_pieces(c, handle, o)
        return c

    async def _plain_pieces(self, c: Completion, handle: RequestHandle, o: RequestOptions,
                            skip: int = 0, skip_name: str = "") -> AsyncIterator[Piece]:
        """Its pieces; `skip`: the first tokens are the client's already (their text is worked out,
        so what follows comes out as it would have, but not sent; a request that finishes with
        fewer is InvalidArgument naming `skip_name`: the client cannot hold them)."""
        text, stops = TextStream(self.tokenizer), StopScan(o.stop)
        async with contextlib.aclosing(handle.updates()) as updates:
            async for u in updates:
                if o.prompt_logprobs is not None and c.prompt_logprobs is None:  # they come with the first token
                    c.prompt_logprobs = list(getattr(handle.request, "prompt_lps", None) or [])
                if not o.max_tokens:  # the prompt only: its one computed token is not the client's
                    c.finish_reason = "length"
                    yield Piece((), "", finished=True, finish_reason="length")
                    return
                c.tokens.append(u.token_id)
                if c.top_logprobs is not None:
                    c.logprobs.append(u.logprob)
                released = stops.push(text.push([u.token_id], u.finished), final=u.finished)
                c.text += released
                if stops.stopped:
                    handle.stop("stop")
                    c.finish_reason, c.stop_string = "stop", stops.matched
                elif u.finished:
                    c.finish_reason = "stop" if u.finish_reason == "stop" else "length"
                if c.finish_reason and skip > len(c.tokens):
                    raise InvalidArgument(f"{skip_name} {skip} is more tokens than request {c.id!r} has: it finished "
                                          f"with {len(c.tokens)}; give the number of its tokens you hold")
                if len(c.tokens) > skip or c.finish_reason:
                    new = len(c.tokens) > skip
                    yield Piece((u.token_id,) if new else (), released if new else "", finished=bool(c.finish_reason),
                                finish_reason=c.finish_reason,
                                logprobs=(u.logprob,) if new and c.top_logprobs is not None else ())
                if c.finish_reason:
                    return

    async def token_ids(self, prompt: Prompt) -> list[int]:
        """The prompt's token ids: tokenizing takes ~0.5 s per MiB, so it runs off the event loop."""
        if prompt.token_ids:
            return list(prompt.token_ids)
        if prompt.messages:
            if self.tokenizer is None or not self.tokenizer.chat_template:
                raise InvalidArgument(f"the model at {self.model_dir} has no chat template: send a raw prompt")
            turns = [(ROLE_ALIASES.get(r, r), c) for r, c in prompt.messages]
            return await asyncio.to_thread(encode_chat, self.tokenizer, turns,
                                           json.loads(prompt.tools) if prompt.tools else None)
        if self.tokenizer is None:
            raise InvalidArgument(f"the model at {self.model_dir} has no tokenizer: submit prompt_token_ids")
        return await asyncio.to_thread(self.encode_prompt, prompt.text, prompt.raw)

    def encode_prompt(self, text: str, raw: bool) -> list[int]:
        return encode_prompt(self.tokenizer, text, raw)

    # ---- outline requests ----------------------------------------------------------------------
    async def _outline(self, prompt: Prompt, o: RequestOptions, client: str) -> Completion:
        """The question is the prompt's text, or the last user message of a conversation. Journaled
        before it runs (outline_door: refused when the journal cannot hold it)."""
        if self.tokenizer is None:
            raise InvalidArgument(f"the model at {self.model_dir} has no tokenizer: outline requests need one")
        users = [c for r, c in prompt.messages if r == "user"]
        question = users[-1] if prompt.messages and users else prompt.text
        if not question.strip():
            raise InvalidArgument("an outline request needs a prompt (the question)")
        raw = prompt.raw and not prompt.messages
        prompt_tokens = len(await asyncio.to_thread(self.encode_prompt, question, raw))
        rid, doc = self.outlines.admit(question, o.request_id, outline_text=o.outline.outline_text,
                                       max_points=o.outline.max_points, point_tokens=o.max_tokens,
                                       sampling=o.sampling, sequential=o.outline.sequential, speculate=o.speculate,
                                       client=client, prompt_tokens=prompt_tokens)
        return self._outline_completion(rid, doc, {})

    def _outline_completion(self, rid: str, doc: dict, held: dict[int, int]) -> Completion:
        c = Completion(rid, int(doc[OUTLINE_RECORD]["prompt_tokens"]), outline=True)
        run = self.outlines.run(doc)
        c._pieces = self._outline_pieces(c, run, self.outlines.events(rid, run, held))
        return c

    async def _outline_pieces(self, c: Completion, run: OutlineRun, events) -> AsyncIterator[Piece]:
        """Its pieces, but those its client holds (a resumed request)."""
        streams: dict[int, TextStream] = {}
        async with contextlib.aclosing(events) as events:
            async for pid, token, finished, held in events:
                c.tokens.append(token)
                text = streams.setdefault(pid, TextStream(self.tokenizer)).push([token], finished)
                if not held:
                    yield Piece((token,), text, point=pid)
        c.points, c.warnings, c.finish_reason = run.points, run.warnings, "stop"
        c.text = "\n\n".join(f"{p.id}. {p.title}\n{p.text.strip()}" for p in run.points)
