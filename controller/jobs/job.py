"""One request, one record: the frozen `Job` (what was asked: prompt tokens, sampling, where it
stops, what its adapter keeps of it) and the `Request` that runs it (the job, its progress, its
timeline). Every adapter (gRPC, HTTP) builds the same Job; the journal stores it through
`Job.to_json` / `Job.from_json`; the stages receive a projection of it (the scheduler's
OpenSessionRequest)."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

from logicpipe.errors import MeshError
from logicpipe.sampling import SamplingParams, TokenLogprob

if TYPE_CHECKING:
    from logicpipe.controller.jobs.handoff import Handoff
    from logicpipe.controller.mesh.pipeline import Pipeline


class RequestState(Enum):
    QUEUED = "queued"      # waiting for KV blocks (new, or preempted and to be replayed)
    RUNNING = "running"    # its sequence is open on every stage
    FINISHED = "finished"
    FAILED = "failed"


@dataclass(frozen=True)
class TokenUpdate:
    token_id: int
    finished: bool
    finish_reason: str
    logprob: TokenLogprob | None = None  # a request that asked for logprobs (None: not kept, e.g. before a restore)


OUTLINE_RECORD = "outline"  # the key of an outline request's journal record (controller.jobs.outline), not a Job's


def sampling_to_json(s: SamplingParams) -> dict:
    return {"temperature": s.temperature, "top_k": s.top_k, "top_p": s.top_p, "seed": s.seed,
            "presence_penalty": s.presence_penalty, "frequency_penalty": s.frequency_penalty,
            "logit_bias": [list(b) for b in s.logit_bias]}


def sampling_from_json(s) -> SamplingParams:
    """As sampling_to_json wrote it; also as a list (older journals)."""
    if isinstance(s, list):  # [temperature, top_k, top_p, seed, presence, frequency, bias] (older journals)
        t, k, p, seed, *penalties = s
        presence, frequency, bias = penalties or (0.0, 0.0, [])
        s = {"temperature": t, "top_k": k, "top_p": p, "seed": seed, "presence_penalty": presence,
             "frequency_penalty": frequency, "logit_bias": bias}
    return SamplingParams(float(s["temperature"]), int(s["top_k"]), float(s["top_p"]), s.get("seed"),
                          float(s.get("presence_penalty", 0.0)), float(s.get("frequency_penalty", 0.0)),
                          tuple((int(i), float(b)) for i, b in s.get("logit_bias", ())))


@dataclass(frozen=True)
class Job:
    """What one sequence asks of the mesh. Once admitted, its defaults are resolved (the seed of a
    sampled request, the stop tokens with the model's, the candidates per step), so a replay or
    a restored request runs exactly as the first did."""

    prompt_ids: tuple[int, ...]
    max_tokens: int                        # new tokens at most
    sampling: SamplingParams = SamplingParams()
    ignore_eos: bool = False               # the model's stop tokens do not end it
    stop_ids: frozenset[int] = frozenset()  # stop tokens (as asked: besides the model's; admitted: all of them)
    speculate: int | None = None           # candidates per step at most (None: the controller's --speculate)
    prefill_chunk: int = 0                 # prompt tokens per step (0: the controller's choice)
    parent: tuple[str, int] | None = None  # (session, positions): share its KV (the prompt starts with its tokens)
    keep_open: bool = False                # the sequence stays open after it finishes, until released (forks)
    request_id: str = ""                   # the client's id for it ("" : one is made); resumed by this id
    top_logprobs: int | None = None        # each token's logprob and this many most likely ones (None: none)
    prompt_logprobs: int | None = None     # ... each prompt token's too (from the second), this many most likely
    sequence: int = 0                      # its index among its request's choices: mixed into its draws
    # what its adapter keeps of the request (journaled: a client that resumes it gets it as it asked)
    stop: tuple[str, ...] = ()             # stop strings (the front door cuts the text at the first)
    api: str = ""                          # the door it came by ("" gRPC, "chat", "completions", ...)
    client: str = ""                       # who submitted it: only they may resume it
    grammar: str = ""                      # structured output: the grammar the last stage constrains it to
    prompt_only: bool = False              # it asked for the prompt's logprobs only (max_tokens 0 at its door)

    def to_json(self) -> dict:
        """The journal's record of it: named fields, plain JSON types."""
        return {"prompt": list(self.prompt_ids), "max_tokens": self.max_tokens,
                "sampling": sampling_to_json(self.sampling),
                "ignore_eos": self.ignore_eos, "stop_ids": sorted(self.stop_ids), "speculate": self.speculate,
                "chunk": self.prefill_chunk, "request_id": self.request_id, "top_logprobs": self.top_logprobs,
                "prompt_logprobs": self.prompt_logprobs, "sequence": self.sequence, "stop": list(self.stop),
                "api": self.api, "client": self.client, "grammar": self.grammar, "prompt_only": self.prompt_only}

    @classmethod
    def from_json(cls, doc: dict) -> "Job":
        """A job as `to_json` wrote it; also as journals before it kept named fields did (the
        sampling as a list, the adapter's fields in a "meta" object)."""
        sampling = sampling_from_json(doc["sampling"])
        meta = doc.get("meta") or {}
        kept = {**meta, **{k: doc[k] for k in ("stop", "api", "client", "grammar", "prompt_only") if k in doc}}
        speculate = doc.get("speculate")
        return cls(tuple(int(t) for t in doc["prompt"]), int(doc["max_tokens"]), sampling,
                   ignore_eos=bool(doc.get("ignore_eos", False)), stop_ids=frozenset(int(t) for t in doc["stop_ids"]),
                   speculate=None if speculate is None else int(speculate), prefill_chunk=int(doc.get("chunk", 0)),
                   request_id=str(doc.get("request_id", "")), top_logprobs=doc.get("top_logprobs"),
                   prompt_logprobs=doc.get("prompt_logprobs"), sequence=int(doc.get("sequence", 0)),
                   stop=tuple(kept.get("stop", ())), api=str(kept.get("api", "")), client=str(kept.get("client", "")),
                   grammar=str(kept.get("grammar", "")), prompt_only=bool(kept.get("prompt_only", False)))


@dataclass
class Timeline:
    """When a request got where it is (time.monotonic() seconds; 0: not yet)."""

    submitted: float = field(default_factory=time.monotonic)
    queued_since: float = field(default_factory=time.monotonic)  # in the queue since (new, or moved back)
    opened: float = 0.0       # first opened on the stages
    opened_now: float = 0.0   # its current session opened (after a preemption or a move: the replay)
    first_token: float = 0.0
    last_token: float = 0.0
    heard: float = 0.0        # its last token came from the stages (the controller's own clock: no reader needed)
    finished: float = 0.0


@dataclass
class Request:
    """A job admitted: the frozen job, its progress on the mesh, its timeline."""

    id: str
    job: Job
    received: list[int] = field(default_factory=list)   # reported by the last stage (a replay's input)
    logprobs: list = field(default_factory=list)  # TokenLogprob | None per token of `received` (None: not kept)
    prompt_lps: list | None = None  # its prompt tokens' TokenLogprobs, once the last stage reported them
    delivered: int = 0        # tokens handed to a client (the most any of its readers got)
    error: MeshError | None = None  # why it failed (its readers raise it after the tokens they have not read)
    stage_reason: str = ""    # the finish reason the last stage reported with its last token
    readers: int = 0          # clients reading its tokens now
    restored: bool = False    # restored from the journal (no client yet: kept RETAIN_S for one to resume it)
    detached_since: float = 0.0  # a restored request with no reader: since when
    state: RequestState = RequestState.QUEUED
    session_id: str = ""      # the sequence open for it now (a new one per admission)
    pipeline: Pipeline | None = None  # the pipeline (replica) its sequence is open on now, or was last
    priority: int = 0         # arrival order: the stages preempt younger requests first
    preemptions: int = 0
    replays: int = 0          # moved to another pipeline (fault, re-plan) and replayed there
    catching_up: bool = False  # moved (a fault, a re-plan) and not had a token since: its replay is under way
    joined_onto: bool = False  # its replay under way is on a pipeline that took it as it joined (rebalance)
    target: Pipeline | None = None  # moved by a rebalance onto this pipeline: it opens there next (if it serves)
    failures: int = 0         # its sequence failed (a stage fault) with no token since the last failure
    done: bool = False        # its last token was reported (the client may not have read it yet)
    prefill_chunk: int = 0    # prompt rows per step its latest opening used (0: the stage's budget)
    decode_steps: int = 0     # pipeline trips that reported tokens
    candidates: int = 0       # candidates verified in them
    accepted: int = 0         # ... and accepted
    parent: tuple[str, int] | None = None  # (session, positions) to fork from while that session is there
    ended: bool = False       # over for the mesh (counted, out of the queue and of `active`)
    reader_failed: bool = False  # a reader was given a MeshError (no token in time, ...): failed, not cancelled
    finish_reason: str = ""
    times: Timeline = field(default_factory=Timeline)
    prefill_tokens: int = 0   # prompt tokens its latest opening computed (the rest the prefix cache held)
    handoff: Handoff | None = None  # disaggregated prefill: its prompt prefilled on another pipeline
    no_handoff: bool = False  # a handoff of it failed: it is prefilled where it decodes

    _changed: asyncio.Event | None = None

    def __post_init__(self) -> None:
        if self.parent is None and not self.received:
            self.parent = self.job.parent

    # what was asked, read through the job
    @property
    def prompt_ids(self) -> tuple[int, ...]:
        return self.job.prompt_ids

    @property
    def max_tokens(self) -> int:
        return self.job.max_tokens

    @property
    def sampling(self) -> SamplingParams:
        return self.job.sampling

    @property
    def stop_ids(self) -> frozenset[int]:
        return self.job.stop_ids

    @property
    def speculate(self) -> int:
        """Candidates per step at most (resolved when admitted; 0: none)."""
        return self.job.speculate or 0

    @property
    def top_logprobs(self) -> int | None:
        return self.job.top_logprobs

    @property
    def prompt_logprobs(self) -> int | None:
        return self.job.prompt_logprobs

    @property
    def keep_open(self) -> bool:
        return self.job.keep_open

    @property
    def capacity(self) -> int:
        return len(self.prompt_ids) + self.max_tokens

    @property
    def inputs(self) -> list[int]:
        """What a (re)opening feeds the stages: the prompt and the tokens so far."""
        return [*self.job.prompt_ids, *self.received]

    @property
    def tokens(self) -> list[int]:
        """The tokens handed to its client(s)."""
        return self.received[: self.delivered]

    def changed(self) -> asyncio.Event:
        """Set at the next change (a token, the end, an error, a state change)."""
        if self._changed is None:
            self._changed = asyncio.Event()
        return self._changed

    def notify(self) -> None:
        ev, self._changed = self._changed, None
        if ev is not None:
            ev.set()
