"""The HTTP API in-process, with no mesh behind it: the real front door (caps, tokenizing with the
default model's tokenizer, the chat template, stop strings) over a fake scheduler whose every
request "generates" a fixed answer at once, or holds it until the test opens a gate (to keep
requests open while a test counts them). Served by the API's own runner on 127.0.0.1, stopped
when the `async with` ends, also on failure.

    async with http_api(model_dir, requests_per_client=2) as (client, fake):
        status, headers, body = await client.post("/v1/completions", json={...})
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import aiohttp
from aiohttp import web

from logicpipe.common.modeldir import ModelConfig, model_digest
from logicpipe.controller.api.http_api import HttpApi
from logicpipe.controller.jobs.door import FrontDoor
from logicpipe.controller.jobs.job import Job, TokenUpdate
from logicpipe.controller.jobs.journal import Journal
from logicpipe.controller.jobs.scheduler import Scheduler, SchedulerConfig
from logicpipe.controller.mesh.state import Phase
from logicpipe.errors import AlreadyExists, NotFound
from logicpipe.sampling import TokenLogprob

ANSWER = "Paris is the capital of France."
CONTEXT = 2048


@dataclass
class FakeRequest:
    id: str
    prompt_ids: list[int]
    max_tokens: int
    sampling: object
    job: Job | None = None
    session_id: str = ""
    top_logprobs: int | None = None
    prompt_logprobs: int | None = None
    prompt_lps: list | None = None  # made-up prompt logprobs: -1 - i / 10 for prompt token i + 1
    received: tuple = ()  # what a scheduler Request has of these (a resume's bound): none yet, not done
    done: bool = False
    # what door.request_timings reads of a scheduler Request: no tokens, every moment 0
    tokens: tuple = ()
    times: SimpleNamespace = field(default_factory=lambda: SimpleNamespace(submitted=0.0, opened=0.0, first_token=0.0,
                                                                           finished=0.0))
    decode_steps: int = 0
    candidates: int = 0
    accepted: int = 0
    speculate: int = 0
    prefill_chunk: int = 0
    handoff: object = None  # not prefilled on another pipeline


def fake_logprob(token: int, i: int, top: int | None) -> TokenLogprob | None:
    """Token i's made-up logprob (-(i + 1) / 10, the most likely) and its top ones: itself, then
    tokens 0, 1, ... (None: not asked)."""
    if top is None:
        return None
    lp = -(i + 1) / 10
    others = [(t, lp - 1 - j) for j, t in enumerate(t for t in range(top + 1) if t != token)]
    return TokenLogprob(lp, tuple([(token, lp), *others][:top]))


class FakeHandle:
    def __init__(self, fake: "FakeScheduler", req: FakeRequest):
        self.fake, self.request = fake, req

    @property
    def id(self) -> str:
        return self.request.id

    @property
    def session_id(self) -> str:
        return self.request.session_id

    async def updates(self, start: int = 0):
        tokens = self.fake.answer[: self.request.max_tokens]
        req = self.request
        if req.prompt_logprobs is not None:
            req.prompt_lps = [TokenLogprob(-1 - i / 10) for i in range(len(req.prompt_ids) - 1)]
        for i, t in enumerate(tokens):
            if i == 1:  # one token out, then (if held) wait: a stream has begun, the request is open
                await self.fake.gate.wait()
            if i >= start:
                yield TokenUpdate(t, i == len(tokens) - 1, "length", fake_logprob(t, i, self.request.top_logprobs))

    def __aiter__(self):
        return self.updates()

    def stop(self, reason: str = "stop") -> None:
        pass

    def release(self) -> None:
        self.fake.requests.pop(self.request.id, None)


class FakeScheduler:
    """What the front door and the outline runner use of controller.scheduler.Scheduler; a job is
    checked by the real Scheduler.validate."""

    def __init__(self, answer: list[int], vocab_size: int):
        self.answer = answer
        self.config = SchedulerConfig(max_context=CONTEXT, stop_ids=frozenset(), vocab_size=vocab_size)
        self.pipelines = SimpleNamespace(largest_request=lambda: 0)
        self.observers: list = []      # what controller.metrics.Metrics hooks into
        self.gap_observers: list = []
        self.requests: dict[str, FakeHandle] = {}
        self.gate = asyncio.Event()  # held requests wait for this after their first token
        self.gate.set()
        self.journal = Journal(None, "")  # the front door journals outline requests itself

    validate = Scheduler.validate

    def find(self, request_id: str) -> FakeHandle | None:
        return self.requests.get(request_id)

    def submit(self, job: Job) -> FakeHandle:
        self.validate(job)
        if job.request_id in self.requests:
            raise AlreadyExists(f"request {job.request_id} exists; resume it instead of submitting it again")
        req = FakeRequest(job.request_id or uuid.uuid4().hex, list(job.prompt_ids), job.max_tokens, job.sampling,
                          job, session_id=uuid.uuid4().hex, top_logprobs=job.top_logprobs,
                          prompt_logprobs=job.prompt_logprobs)
        handle = self.requests[req.id] = FakeHandle(self, req)
        return handle

    def attach(self, request_id: str) -> FakeHandle:
        if request_id not in self.requests:
            raise NotFound(f"no request {request_id!r} here")
        return self.requests[request_id]


_TOKENIZERS: dict[Path, object] = {}


def tokenizer(model_dir: Path):
    """The model's tokenizer, loaded once per process (about a second)."""
    if model_dir not in _TOKENIZERS:
        from transformers import AutoTokenizer

        _TOKENIZERS[model_dir] = AutoTokenizer.from_pretrained(model_dir)
    return _TOKENIZERS[model_dir]


class Client:
    """aiohttp's ClientSession on the API's base URL: `await client.post(path, ...)` gives
    (status, headers, body: parsed JSON, or the text of a stream)."""

    def __init__(self, session: aiohttp.ClientSession, base: str, port: int):
        self.session, self.base, self.port = session, base, port

    async def request(self, method: str, path: str, **kw) -> tuple[int, dict, object]:
        async with self.session.request(method, self.base + path, **kw) as r:
            text = await r.text(errors="replace")
            body = json.loads(text) if r.content_type == "application/json" else text
            return r.status, dict(r.headers), body

    async def post(self, path: str, **kw):
        return await self.request("POST", path, **kw)

    async def get(self, path: str, **kw):
        return await self.request("GET", path, **kw)


@contextlib.asynccontextmanager
async def http_api(model_dir: Path, *, requests_per_client: int = 64, keys=None):
    """(Client, FakeScheduler) over HttpApi served by its own runner on 127.0.0.1 (`keys`: its
    http_auth.ApiKeys, None: none)."""
    tok = tokenizer(model_dir)
    fake = FakeScheduler(tok(ANSWER, add_special_tokens=False)["input_ids"], len(tok))
    app = SimpleNamespace(model_dir=model_dir, scheduler=fake, journal=fake.journal,
                          state=SimpleNamespace(admitting=True, phase=Phase.READY, reason=""),
                          config=ModelConfig.from_dir(model_dir), digest=model_digest(model_dir))  # (for /api/show)
    door = FrontDoor(fake, tok, model_dir=model_dir, requests_per_client=requests_per_client)
    runner = HttpApi(app, door, keys=keys).runner()
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        async with aiohttp.ClientSession() as session:
            yield Client(session, f"http://127.0.0.1:{port}", port), fake
    finally:
        fake.gate.set()
        await runner.cleanup()
