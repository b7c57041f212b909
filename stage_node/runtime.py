"""The stage runtime: one assignment, its shard, the sessions' KV, and the step loop.

Main loop (nano-vllm style): take every step waiting in the inbox -> one batched forward ->
postprocess (sample on the last stage, else forward the hidden rows to the next stage).
On the last stage a new token goes straight back to stage 0 (or into our own inbox when this
stage is also the first), and a TokenEvent goes to the controller: the controller is not on the
per-token path.
"""
from __future__ import annotations

import asyncio
import logging
import time
from itertools import accumulate
from dataclasses import dataclass

import torch

from logicpipe import tensor_codec
from logicpipe.errors import FailedPrecondition, InvalidArgument, MeshError, NotFound, ResourceExhausted, Unavailable
from logicpipe.v1 import stage_pb2
from stage_node.config import ModelConfig, ModelError, model_digest
from stage_node.kv import SeqSlice, SessionKV, kv_bytes_per_token
from stage_node.links import LinkDown, PeerLink
from stage_node.sampling import SamplingParams, make_generator, sample
from stage_node.shard import Shard

log = logging.getLogger(__name__)

COMPUTE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
MAX_STEP_ROWS = 16384  # token rows in one step message


@dataclass(frozen=True)
class Assignment:
    model_dir: str
    start: int          # first layer, inclusive
    end: int            # last layer, exclusive
    num_layers: int     # the model's layer count
    stage_index: int
    num_stages: int
    next_address: str   # "" on the last stage
    first_address: str  # "" on stage 0
    dtype: str = "float32"
    plan_id: str = ""
    model_digest: str = ""

    @property
    def first(self) -> bool:
        return self.start == 0

    @property
    def last(self) -> bool:
        return self.end == self.num_layers


@dataclass(frozen=True)
class SeqWork:
    """One sequence's slice of a step."""
    session_id: str
    start_pos: int
    num_tokens: int
    token_ids: tuple[int, ...] = ()  # stage 0 input only
    prefill_only: bool = False       # a prompt chunk before the last: no token sampled


@dataclass
class Work:
    seqs: list[SeqWork]
    hidden: torch.Tensor | None = None  # [sum(num_tokens), hidden]; None into stage 0


@dataclass
class Session:
    id: str
    kv: SessionKV
    sampling: SamplingParams
    generator: torch.Generator | None
    max_new_tokens: int
    stop_ids: frozenset[int]
    generated: int = 0
    finished: bool = False


def _error_event(session_id: str, err: MeshError, node_id: str) -> stage_pb2.Event:
    return stage_pb2.Event(
        session_id=session_id,
        error=stage_pb2.SessionError(code=err.code.value[0], message=str(err), node_id=node_id),
    )


class StageRuntime:
    def __init__(self, node_id: str, device: str = "cpu", *, max_kv_bytes: int = 2 * 2**30):
        self.node_id = node_id
        self.device = torch.device(device)
        self.max_kv_bytes = max_kv_bytes  # KV reserved by all open sessions together, bytes
        self.assignment: Assignment | None = None
        self.shard: Shard | None = None
        self.state = "idle"
        self.sessions: dict[str, Session] = {}
        self.steps = 0
        self.tokens = 0
        self.started = time.monotonic()
        self._inbox: asyncio.Queue[Work] = asyncio.Queue()
        self._deferred: list[Work] = []
        self._subscribers: set[asyncio.Queue] = set()
        self._next: PeerLink | None = None
        self._first: PeerLink | None = None
        self._loop_task: asyncio.Task | None = None
        self._assign_lock = asyncio.Lock()

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        self._loop_task = asyncio.create_task(self._run(), name="stage-loop")

    async def stop(self) -> None:
        if self._loop_task:
            self._loop_task.cancel()
        await self._drop_links()

    async def _drop_links(self) -> None:
        for link in (self._next, self._first):
            if link is not None:
                await link.close()
        self._next = self._first = None

    # ---- assignment ------------------------------------------------------------------------
    async def assign(self, a: Assignment) -> Shard:
        if a.dtype not in COMPUTE_DTYPES:
            raise InvalidArgument(f"dtype {a.dtype!r} not supported; use one of {', '.join(COMPUTE_DTYPES)}")
        if not (0 <= a.start < a.end <= a.num_layers):
            raise InvalidArgument(f"layer range [{a.start}, {a.end}) is not inside [0, {a.num_layers})")
        if not (0 <= a.stage_index < a.num_stages):
            raise InvalidArgument(f"stage index {a.stage_index} out of range for {a.num_stages} stages")
        if not a.last and not a.next_address:
            raise InvalidArgument(f"stage ending at layer {a.end} < {a.num_layers} needs a next_address")
        if a.last and not a.first and not a.first_address:
            raise InvalidArgument("the last stage needs first_address (where new tokens go)")
        async with self._assign_lock:
            if self.assignment == a and self.shard is not None:
                return self.shard
            try:
                config = ModelConfig.from_dir(a.model_dir)
            except ModelError as exc:
                raise FailedPrecondition(f"node {self.node_id}: {exc}") from exc
            if config.num_layers != a.num_layers:
                raise InvalidArgument(f"the model at {a.model_dir} has {config.num_layers} layers, not {a.num_layers}")
            if a.model_digest and a.model_digest != model_digest(a.model_dir):
                raise FailedPrecondition(
                    f"node {self.node_id}: the model at {a.model_dir} differs from the controller's "
                    f"(digest {model_digest(a.model_dir)} != {a.model_digest}); copy the same model here")
            self._drop_sessions("the stage was re-assigned")
            await self._drop_links()
            self.state, self.assignment, self.shard = "loading", None, None
            try:
                shard = await asyncio.to_thread(
                    Shard.load, a.model_dir, a.start, a.end, first=a.first, last=a.last,
                    device=self.device, dtype=COMPUTE_DTYPES[a.dtype])
            except (ModelError, ValueError, OSError) as exc:
                self.state = "idle"
                raise FailedPrecondition(f"node {self.node_id} could not load layers [{a.start}, {a.end}): {exc}") from exc
            self.shard, self.assignment, self.state = shard, a, "ready"
            if not a.last:
                self._next = PeerLink(a.next_address, self._on_peer_reply, name=f"stage {a.stage_index + 1}")
            if a.last and not a.first:
                self._first = PeerLink(a.first_address, self._on_peer_reply, name="stage 0")
            log.info("assigned layers [%d, %d) of %s as stage %d/%d (%d parameters)",
                     a.start, a.end, a.model_dir, a.stage_index, a.num_stages, shard.parameter_count)
            return shard

    def require_ready(self) -> Shard:
        if self.shard is None or self.assignment is None:
            raise FailedPrecondition(
                f"node {self.node_id} has no layer assignment yet ({self.state}); "
                "the controller assigns layers when it starts (logicpipe-controller --nodes ...)")
        if self.state == "draining":
            raise Unavailable(f"node {self.node_id} is draining and takes no new work")
        return self.shard

    # ---- sessions --------------------------------------------------------------------------
    def kv_bytes(self) -> int:
        return sum(s.kv.nbytes for s in self.sessions.values())

    def open_session(self, session_id: str, capacity: int, sampling: SamplingParams,
                     max_new_tokens: int, stop_ids: frozenset[int]) -> Session:
        shard = self.require_ready()
        if not session_id:
            raise InvalidArgument("session_id is empty")
        if session_id in self.sessions:
            raise FailedPrecondition(f"session {session_id} is already open on node {self.node_id}")
        limit = shard.config.max_position_embeddings
        if not (1 <= capacity <= limit):
            raise InvalidArgument(f"capacity {capacity} tokens is outside [1, {limit}] (the model's context)")
        try:
            sampling.validate()
        except ValueError as exc:
            raise InvalidArgument(str(exc)) from exc
        need = capacity * kv_bytes_per_token(shard.config, shard.end - shard.start, shard.dtype)
        if self.kv_bytes() + need > self.max_kv_bytes:
            raise ResourceExhausted(
                f"node {self.node_id}: {need / 2**20:.1f} MiB of KV for {capacity} tokens does not fit "
                f"({self.kv_bytes() / 2**20:.1f} of {self.max_kv_bytes / 2**20:.0f} MiB in use); retry later")
        session = Session(session_id, shard.new_cache(capacity), sampling, make_generator(sampling),
                          max_new_tokens, stop_ids)
        self.sessions[session_id] = session
        return session

    def close_session(self, session_id: str) -> int:
        if self.shard is None:  # not require_ready(): a draining node still closes sessions
            raise FailedPrecondition(f"node {self.node_id} has no layer assignment yet ({self.state}); "
                                     "it holds no sessions")
        session = self.sessions.pop(session_id, None)
        if session is None:
            raise NotFound(f"session {session_id} is not open on node {self.node_id}")
        return session.kv.length

    def _drop_sessions(self, why: str) -> None:
        if self.sessions:
            self._emit([_error_event(sid, Unavailable(f"node {self.node_id}: {why}"), self.node_id)
                        for sid in self.sessions])
        self.sessions.clear()
        self._deferred.clear()
        while not self._inbox.empty():
            self._inbox.get_nowait()

    # ---- events ----------------------------------------------------------------------------
    def subscribe(self) -> asyncio.Queue:
        q: asyncio.Queue = asyncio.Queue()
        self._subscribers.add(q)
        return q

    def unsubscribe(self, q: asyncio.Queue) -> None:
        self._subscribers.discard(q)

    def _emit(self, events: list[stage_pb2.Event]) -> None:
        if events:
            for q in self._subscribers:
                q.put_nowait(events)

    def _fail(self, session_ids, err: MeshError) -> None:
        self._emit([_error_event(sid, err, self.node_id) for sid in session_ids])

    def _on_peer_reply(self, reply: stage_pb2.StreamReply) -> None:
        log.warning("peer rejected session %s: %s", reply.session_id, reply.message)

    # ---- the step loop ---------------------------------------------------------------------
    def submit(self, work: Work) -> list[tuple[str, MeshError]]:
        """Queue a step; returns the sequences rejected at once (unknown session)."""
        self.require_ready()
        rejected = [(s.session_id, NotFound(f"session {s.session_id} is not open on node {self.node_id}"))
                    for s in work.seqs if s.session_id not in self.sessions]
        if rejected:
            self._fail([sid for sid, _ in rejected], rejected[0][1])
            work = _without(work, {sid for sid, _ in rejected})
        if work.seqs:
            self._inbox.put_nowait(work)
        return rejected

    async def _run(self) -> None:
        while True:
            if not self._deferred:
                self._deferred.append(await self._inbox.get())
            while not self._inbox.empty():
                self._deferred.append(self._inbox.get_nowait())
            batch, self._deferred = _take_batch(self._deferred)
            try:
                await self._step(batch)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 — a bad step must not stop the node
                log.exception("step failed")
                self._fail({s.session_id for s in batch.seqs}, MeshError(f"node {self.node_id}: step failed: {exc}"))

    async def _step(self, work: Work) -> None:
        shard = self.shard
        if shard is None:
            return
        work = self._check_positions(work)
        if not work.seqs:
            return
        seqs = [self.sessions[s.session_id] for s in work.seqs]
        with torch.inference_mode():
            if shard.first:
                ids = torch.tensor([t for s in work.seqs for t in s.token_ids], dtype=torch.long, device=self.device)
                hidden = shard.embed(ids)  # hidden: [rows, hidden]
            else:
                hidden = work.hidden.to(self.device, shard.dtype)
            out = shard.forward(hidden, [SeqSlice(sess.kv, s.start_pos, s.num_tokens)
                                         for sess, s in zip(seqs, work.seqs)])
            self.steps += 1
            self.tokens += out.shape[0]
            if shard.last:
                pick = [i for i, s in enumerate(work.seqs) if not s.prefill_only]
                ends = list(accumulate(s.num_tokens for s in work.seqs))
                logits = shard.logits(out[[ends[i] - 1 for i in pick]])  # logits: [sampled seqs, vocab]
                tokens = sample(logits, [seqs[i].sampling for i in pick], [seqs[i].generator for i in pick])
            else:
                hidden_msg = tensor_codec.encode(out)
        if not shard.last:
            msg = stage_pb2.StepBatch(
                seqs=[stage_pb2.SeqStep(session_id=s.session_id, start_pos=s.start_pos, num_tokens=s.num_tokens,
                                        prefill_only=s.prefill_only) for s in work.seqs],
                hidden=hidden_msg)
            await self._send(self._next, msg, work)
        elif pick:
            await self._postprocess([work.seqs[i] for i in pick], [seqs[i] for i in pick], tokens)

    def _check_positions(self, work: Work) -> Work:
        bad = {}
        for s in work.seqs:
            sess = self.sessions.get(s.session_id)
            if sess is None:
                bad[s.session_id] = NotFound(f"session {s.session_id} was closed on node {self.node_id}")
            elif sess.finished:
                bad[s.session_id] = FailedPrecondition(f"session {s.session_id} has finished; open a new one")
            elif s.start_pos != sess.kv.length:
                bad[s.session_id] = FailedPrecondition(
                    f"session {s.session_id} step at position {s.start_pos} but node {self.node_id} holds "
                    f"{sess.kv.length} tokens")
            elif s.start_pos + s.num_tokens > sess.kv.capacity:
                bad[s.session_id] = ResourceExhausted(
                    f"session {s.session_id} would grow past its {sess.kv.capacity}-token capacity")
        for sid, err in bad.items():
            self._fail([sid], err)
        return _without(work, set(bad)) if bad else work

    async def _postprocess(self, done: list[SeqWork], seqs: list[Session], tokens: list[int]) -> None:
        events, feed = [], []
        for s, sess, tok in zip(done, seqs, tokens):
            sess.generated += 1
            pos = s.start_pos + s.num_tokens  # position the new token will take
            reason = ""
            if tok in sess.stop_ids:
                reason = "stop"
            elif sess.generated >= sess.max_new_tokens or pos >= sess.kv.capacity:
                reason = "length"
            sess.finished = bool(reason)
            events.append(stage_pb2.Event(session_id=s.session_id, token=stage_pb2.TokenEvent(
                token_id=tok, index=sess.generated - 1, finished=sess.finished, finish_reason=reason)))
            if not reason:
                feed.append(SeqWork(s.session_id, pos, 1, (tok,)))
        self._emit(events)  # only queued here: sent while the token below is in flight
        if feed and self._first is None:  # one stage: first and last
            self._inbox.put_nowait(Work(feed))
        elif feed:
            msg = stage_pb2.StepBatch(seqs=[stage_pb2.SeqStep(session_id=f.session_id, start_pos=f.start_pos,
                                                              num_tokens=1, token_ids=f.token_ids) for f in feed])
            await self._send(self._first, msg, Work(feed))

    async def _send(self, link: PeerLink | None, msg: stage_pb2.StepBatch, work: Work) -> None:
        if link is None:
            return
        try:
            await link.send(msg)
        except LinkDown as exc:
            log.warning("%s", exc)
            self._fail([s.session_id for s in work.seqs], Unavailable(f"node {self.node_id}: {exc}"))


def _without(work: Work, drop: set[str]) -> Work:
    """The work less the sequences of `drop`, hidden rows included."""
    keep, rows, offset = [], [], 0
    for s in work.seqs:
        if s.session_id not in drop:
            keep.append(s)
            if work.hidden is not None:
                rows.append(work.hidden[offset: offset + s.num_tokens])
        offset += s.num_tokens
    hidden = torch.cat(rows) if work.hidden is not None and rows else None
    return Work(keep, hidden)


def _take_batch(pending: list[Work]) -> tuple[Work, list[Work]]:
    """Merge waiting work into one step, each session at most once (a second slice of the same
    session waits for the next step, after the first has written its KV)."""
    if len(pending) == 1:  # the common case: nothing to merge, no copy of the hidden rows
        return pending[0], []
    seqs, rows, seen, rest = [], [], set(), []
    for w in pending:
        if any(s.session_id in seen for s in w.seqs):
            rest.append(w)
            continue
        seen.update(s.session_id for s in w.seqs)
        seqs.extend(w.seqs)
        if w.hidden is not None:
            rows.append(w.hidden)
    return Work(seqs, torch.cat(rows) if rows else None), rest
