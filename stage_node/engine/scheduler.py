"""The stage scheduler: admission by free KV blocks, per-step budgets, micro-batches, preemption.

Stage 0 forms steps from its sequences' pending input (prompts fed by the controller, tokens fed
back by the last stage): decode rows first, in as many micro-batches as there are devices (at most
that many sampled steps in flight, each of about active / micro_batches sequences), then prefill
chunks of waiting prompts fill the step's token budget. Later stages run the steps they receive,
merging whatever is queued up to the same budget. Every stage plans a step's KV writes before the
runner computes it; a sequence that cannot get blocks preempts the youngest sequences (their owner
replays them later) and, if that is not enough, is preempted itself. A preempted sequence's KV goes
to the stage's swap space where it has one (engine.swap), and its replay's admission copies it back.

Pure bookkeeping (no torch): the runner computes what `schedule` returns; `complete` commits it.
"""
from __future__ import annotations

import itertools
import logging
import math
import random
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field, replace
from typing import Callable

from logicpipe.errors import FailedPrecondition, MeshError, NotFound, ResourceExhausted
from logicpipe.stage_node.engine.handoff import KvImport
from logicpipe.stage_node.engine.inbox import StepMsg, decode_first
from logicpipe.stage_node.engine.blocks import BadWrite, KVManager, OutOfBlocks, WritePlan
from logicpipe.stage_node.model.sampling import draw
from logicpipe.stage_node.engine.sequence import SeqSpec, SeqStatus, Sequence, SeqWork
from logicpipe.stage_node.engine.states import RecurrentStates
from logicpipe.stage_node.engine.step_budget import StepClock, attended
from logicpipe.stage_node.engine.swap import SwapSpace
from logicpipe.tensor_codec import RawTensor

log = logging.getLogger(__name__)

RECENTLY_CLOSED = 4096    # closed sessions whose owner is remembered (late steps' errors reach it)
STALE_IN_FLIGHT_S = 30.0  # a sampled step whose token has not come back in this long stops holding a micro-batch slot
PREFILL_SHARE = 64        # token rows of a step decode rows leave to waiting prompts


class _NoRoom(Exception):
    """No free blocks for a step's rows without preempting another sequence."""


@dataclass(frozen=True)
class Budget:
    max_tokens: int = 512  # token rows in one step
    max_seqs: int = 64     # sequences in one step


@dataclass(frozen=True)
class PlannedSeq:
    seq: Sequence
    work: SeqWork
    plan: WritePlan                 # copies, then the slots its rows write
    read_blocks: tuple[int, ...]    # the blocks of positions [0, work.stop)
    part: int = 0                   # later stages: which received message holds its rows,
    row: int = 0                    # and where they start in it
    draws: tuple[float, ...] | None = None  # last stage, sampled (not greedy): the random draw of each
                                            # position it samples (the token's, then one per candidate)
    window_blocks: tuple[int, ...] | None = None  # the blocks its sliding-window layers read (engine.window;
                                                  # None: read_blocks)


@dataclass
class Step:
    id: int
    seqs: list[PlannedSeq]
    parts: list[RawTensor] = field(default_factory=list)  # later stages: the received hidden states

    @property
    def rows(self) -> int:
        return sum(p.work.num_tokens for p in self.seqs)

    def positions(self, window: int = 0) -> int:
        """Key positions its rows attend over in all (engine.step_budget)."""
        return sum(attended(p.work.start_pos, p.work.num_tokens, window) for p in self.seqs)

    def held(self, clock) -> int:
        """Positions its sequences gather once it is computed, in all (`StepClock.held`)."""
        return sum(clock.held(p.work.start_pos, p.work.num_tokens) for p in self.seqs)

    @property
    def decodes(self) -> bool:
        """It holds a decode row (a sequence past its prompt)."""
        return any(p.work.start_pos >= len(p.seq.spec.prompt) for p in self.seqs)


@dataclass(frozen=True)
class Failure:
    """A sequence that failed on this stage (it is closed here when `closed`)."""

    session_id: str
    owner: str          # whose Events stream hears of it ("" for a session this stage does not know)
    error: MeshError
    closed: bool = False


class Scheduler:
    def __init__(self, kv: KVManager, *, first: bool, last: bool, node_id: str, budget: Budget = Budget(),
                 micro_batches: int = 1, is_orphaned: Callable[[Sequence], bool] = lambda s: False,
                 states: RecurrentStates | None = None, prefix_cache: bool = True, swap: SwapSpace | None = None):
        self.kv = kv
        self.swap = swap  # where a preempted sequence's KV waits for its replay (None: it is computed again)
        self.states = states  # linear-attention layers here: their per-sequence states (engine.states)
        self.prefix_cache = prefix_cache  # attach cached prompt blocks (off for a model with recurrent state)
        self.first, self.last = first, last
        self.node_id = node_id
        self.budget = budget
        self.micro_batches = max(1, micro_batches)  # stage 0: sampled steps in flight at once
        self.is_orphaned = is_orphaned
        self.grammars = None  # last stage: a GrammarBook (stage_node.grammar) for structured-output sessions
        self.seqs: dict[str, Sequence] = {}
        self.inbox: deque[StepMsg] = deque()  # later stages: received steps, in order
        self._order = itertools.count()
        self._recently_closed: OrderedDict[str, str] = OrderedDict()  # session id -> owner
        self._step_ids = itertools.count(1)
        self.preempted = 0  # sequences given up to free blocks, since start
        self.clock: StepClock | None = None  # the step-time bar's cost model (engine.step_budget; None: rows only)

    # ---- admission --------------------------------------------------------------------------
    def admit(self, spec: SeqSpec) -> tuple[Sequence, int]:
        """Open a sequence: attach what the prefix cache (or its parent) holds, take the blocks of
        the rest of its prompt now. Returns it and how many leading positions it already holds."""
        if spec.session_id in self.seqs:
            raise FailedPrecondition(f"session {spec.session_id} is already open on node {self.node_id}")
        kv = self.kv
        if not kv.fits(spec.capacity):
            raise ResourceExhausted(
                f"node {self.node_id}: a sequence of {spec.capacity} positions needs {kv.blocks_for(spec.capacity)} "
                f"KV blocks and this node has {kv.num_blocks} in all; raise its --max-kv-mib or shorten the request")
        constraint = None
        if self.last and spec.grammar:  # before any blocks are taken: a bad grammar refuses the session
            if self.grammars is None:
                raise FailedPrecondition(f"node {self.node_id} cannot constrain sampling to a grammar")
            replayed = spec.prompt[len(spec.prompt) - spec.generated:] if spec.generated else ()
            constraint = self.grammars.constraint(spec.grammar, replayed)
        parent = None
        if spec.parent:
            parent = self.seqs.get(spec.parent)
            if parent is None:
                raise NotFound(f"parent session {spec.parent} is not open on node {self.node_id}")
            if spec.parent_length > kv.tables[spec.parent].length:
                raise FailedPrecondition(f"parent session {spec.parent} holds {kv.tables[spec.parent].length} "
                                         f"positions, fewer than the {spec.parent_length} asked for")
        if parent is not None:
            table = kv.fork(spec.parent, spec.session_id, spec.parent_length, spec.capacity)
            held = kv.held(spec.session_id)  # (less where a sliding window gave back what it needs: engine.window)
            if held < spec.parent_length:
                log.info("session %s forks %d positions of %s, whose sliding window is given back there: it holds %d",
                         spec.session_id, spec.parent_length, spec.parent, held)
            if self.states is not None:  # it holds the positions up to the parent's last state within them
                kept = self.states.fork(spec.parent, spec.session_id, spec.parent_length)
                if kept < held:
                    log.info("session %s forks %d positions of %s, whose recurrent state is kept at %s: it holds %d",
                             spec.session_id, spec.parent_length, spec.parent, self.states.positions(spec.parent), kept)
                held = min(held, kept)
            if held < spec.parent_length:
                kv.truncate(spec.session_id, held)
        else:
            table = kv.open(spec.session_id, spec.capacity)
            if self.states is not None:
                self.states.open(spec.session_id)
            if self.prefix_cache and not spec.import_length and not (  # (an import's blocks are its own; the
                    self.last and spec.prompt_logprobs is not None):  # prompt_logprobs need every prompt row's logits)
                kv.attach_prefix(spec.session_id, spec.prompt)
        try:
            watermark = sum(1 for s in self.seqs.values() if s.status is not SeqStatus.FINISHED)
            need = max(0, kv.blocks_for(len(spec.prompt)) - len(table.blocks))
            missing = kv.shortfall(spec.session_id, len(spec.prompt), watermark)  # (a window's bounded)
            if missing:
                raise ResourceExhausted(
                    f"node {self.node_id}: {need} KV blocks for the prompt of session {spec.session_id} plus "
                    f"{watermark} kept for the running sequences' growth, but {kv.available} are free: "
                    f"{missing} missing ({missing * kv.block_size} positions); retry when a request ends")
            if self.swap is not None and parent is None and not (self.last and spec.prompt_logprobs is not None):
                self.swap.swap_in(spec.session_id, spec.prompt, kv, self.states)  # a replay: its KV comes back
            kv.reserve(spec.session_id, len(spec.prompt))
        except (MeshError, OutOfBlocks) as exc:
            kv.close(spec.session_id)
            if self.states is not None:
                self.states.drop(spec.session_id)
            if isinstance(exc, OutOfBlocks):
                raise ResourceExhausted(f"node {self.node_id}: {exc}; retry when a request ends") from exc
            raise
        seed = spec.sampling.seed if spec.sampling.seed is not None else random.getrandbits(63)
        seq = Sequence(spec, next(self._order), seed, generated=spec.generated, grammar=constraint)
        if spec.import_length:  # its KV comes by ImportKv (engine.handoff) before its first step
            seq.kv_import = KvImport(spec.import_length, spec.import_key)
        seq.pending_pos = table.length
        seq.rollback = table.length  # the first step may start anywhere up to what is attached
        self.seqs[spec.session_id] = seq
        return seq, table.length

    def close(self, session_id: str, swap: bool = False) -> Sequence:
        """`swap`: its owner replays it (it was preempted): its KV goes to the swap space, if there is one."""
        seq = self.seqs.pop(session_id)
        if self.swap is not None:
            self.swap.lost.discard(session_id)
            if swap:
                self.swap.swap_out(session_id, self.kv, self.states)
        self.kv.close(session_id)
        if self.states is not None:
            self.states.drop(session_id)
        self._recently_closed[session_id] = seq.spec.owner
        while len(self._recently_closed) > RECENTLY_CLOSED:
            self._recently_closed.popitem(last=False)
        return seq

    def close_all(self) -> list[Sequence]:
        return [self.close(sid) for sid in list(self.seqs)]

    # ---- input ------------------------------------------------------------------------------
    def feed(self, w: SeqWork) -> Sequence:
        """Stage 0: input tokens for a sequence (its prompt, or tokens fed back by the last stage).
        Raises a MeshError for this sequence alone."""
        if w.finished:  # the last stage ended it: no step of it is out any more, none will come
            s = self.seqs.get(w.session_id)
            if s is None:
                raise NotFound(f"session {w.session_id} is not open on node {self.node_id}")
            s.in_flight, s.pending, s.status = None, [], SeqStatus.FINISHED
            return s
        s = self._open_seq(w.session_id)
        if w.stop > s.spec.capacity:
            raise ResourceExhausted(f"session {s.id} would grow past its {s.spec.capacity}-token capacity")
        if s.pending:
            if w.start_pos != s.next_pos or s.pending_candidates:
                raise FailedPrecondition(f"session {s.id}: input at position {w.start_pos} but node {self.node_id} "
                                         f"expects position {s.next_pos}")
            s.pending.extend(w.token_ids)
        else:
            low = s.next_pos - s.rollback
            if not low <= w.start_pos <= s.next_pos:
                raise FailedPrecondition(f"session {s.id}: input at position {w.start_pos} but node {self.node_id} "
                                         f"holds {s.next_pos} positions (it may roll back to {low})")
            s.pending, s.pending_pos = list(w.token_ids), w.start_pos
            s.rollback = 0
        s.pending_candidates = w.num_candidates
        s.more_input = not w.sample  # a feed marked prefill_only: more of this input follows
        s.in_flight = None
        s.status = SeqStatus.RUNNING
        s.last_active = time.monotonic()
        return s

    def enqueue(self, msg: StepMsg) -> None:
        """Later stages: a computed step from the previous stage, to run in order."""
        self.inbox.append(msg)

    def _open_seq(self, session_id: str) -> Sequence:
        s = self.seqs.get(session_id)
        if s is None:
            raise NotFound(f"session {session_id} is not open on node {self.node_id}")
        if s.status is SeqStatus.FINISHED:
            raise FailedPrecondition(f"session {session_id} has finished; open a new one")
        return s

    # ---- forming steps ----------------------------------------------------------------------
    def schedule(self) -> tuple[Step | None, list[Failure]]:
        """The next step to compute (None: nothing to do now) and the sequences that failed."""
        return self._schedule_first() if self.first else self._schedule_later()

    def micro_batches_now(self) -> tuple[int, int]:
        """(micro-batches in flight at most, sequences in each): M micro-batches, or more when the
        running sequences do not fit M steps of the sequence budget (every one must keep moving)."""
        live = sum(1 for s in self.seqs.values() if s.status is SeqStatus.RUNNING and not self.is_orphaned(s))
        m = max(self.micro_batches, math.ceil(live / self.budget.max_seqs))
        return m, max(1, math.ceil(live / m))

    def steps_in_flight(self) -> int:
        now = time.monotonic()
        return len({s.in_flight for s in self.seqs.values()
                    if s.in_flight is not None and now - s.in_flight_since < STALE_IN_FLIGHT_S
                    and not self.is_orphaned(s)})

    def _schedule_first(self) -> tuple[Step | None, list[Failure]]:
        b = self.budget
        ready = [s for s in self.seqs.values() if s.pending and not self.is_orphaned(s)]
        chosen: list[tuple[Sequence, int]] = []
        rows = positions = held = 0  # token rows, the key positions they attend over, those their sequences hold
        window = self.clock.shape.window if self.clock is not None else 0
        in_flight_cap, group = self.micro_batches_now()
        prompts = sorted((s for s in ready if s.is_prefill_ready()), key=lambda s: s.prefill_order)
        # decode rows first, those that waited longest first; with prompts waiting, they keep a seat
        # and a share of the token budget, so that decoding can never starve a prefill
        max_seqs = b.max_seqs - (1 if prompts else 0)
        max_rows = b.max_tokens - (min(PREFILL_SHARE, b.max_tokens // 2) if prompts else 0)
        if self.steps_in_flight() < in_flight_cap:
            decode = sorted((s for s in ready if s.is_decode_ready()), key=lambda s: (s.last_step, s.age))
            for s in decode[:group]:
                over = rows + len(s.pending) - max_rows
                if over > 0 and s.pending_candidates:  # candidates are a bet: they give way to the budget
                    drop = min(over, s.pending_candidates)
                    del s.pending[-drop:]
                    s.pending_candidates -= drop
                if len(chosen) >= max_seqs or rows + len(s.pending) > max_rows:
                    break
                chosen.append((s, len(s.pending)))
                rows += len(s.pending)
                positions += attended(s.pending_pos, len(s.pending), window)
                held += self.clock.held(s.pending_pos, len(s.pending)) if self.clock is not None else 0
        # the bar holds while some sequence decodes (here or further down the pipeline: its next step waits
        # for this one); a prompt alone flows in whole chunks, its first token no later than it need be
        decoding = self.clock is not None and bool(self.clock.bar_s) and bool(prompts) and any(
            s.next_pos > len(s.spec.prompt) for s in self.seqs.values())
        for s in prompts:
            room = b.max_tokens - rows
            if room <= 0 or len(chosen) >= b.max_seqs:
                break
            n = min(room, len(s.pending), s.spec.prefill_chunk or len(s.pending))  # a long prompt flows in chunks
            if decoding:  # the step-time bar: a chunk shrinks as the context it attends over grows
                n = self.clock.chunk(rows, positions, held, s.pending_pos, n)
            if n < len(s.pending) and s.pending_candidates:  # the last chunk keeps the row before them
                n = min(n, len(s.pending) - s.pending_candidates - 1)
            if n < 1:
                continue
            chosen.append((s, n))
            rows += n
            positions += attended(s.pending_pos, n, window)
            held += self.clock.held(s.pending_pos, n) if self.clock is not None else 0
            if s.spec.prefill_rank:  # a replay after a move is the only prompt of its step: its first token comes
                break  # when its own rows are done, not a batch's, and a fault mid-batch loses no finished replay
        if not chosen:
            return None, []
        step = Step(next(self._step_ids), [])
        failures: list[Failure] = []
        planned: set[str] = set()
        for s, n in sorted(chosen, key=lambda c: c[0].age):  # the oldest get their blocks first
            if s.id not in self.seqs:  # preempted for an older sequence of this step
                continue
            whole = n == len(s.pending)
            sample = whole and not s.more_input  # the last of its input so far, and nothing more to come
            w = SeqWork(s.id, s.pending_pos, tuple(s.pending[:n]), sample=sample,
                        num_candidates=s.pending_candidates if whole else 0)
            try:
                try:
                    step.seqs.append(self._plan(s, w, planned, failures, spare_others=bool(w.num_candidates)))
                except _NoRoom:  # candidates never evict a sequence: without them, it may
                    w = SeqWork(s.id, w.start_pos, w.token_ids[:-w.num_candidates], sample=w.sample)
                    step.seqs.append(self._plan(s, w, planned, failures))
            except MeshError as err:
                failures.append(Failure(s.id, s.spec.owner, err, closed=s.id not in self.seqs))
                continue
            planned.add(s.id)
            del s.pending[:n]  # dropped candidates with them
            s.pending_pos += w.num_tokens
            s.last_step = step.id
            if whole:
                s.pending_candidates = 0
            if sample:
                s.in_flight, s.in_flight_since = step.id, time.monotonic()
        return (step if step.seqs else None), failures

    def _schedule_later(self) -> tuple[Step | None, list[Failure]]:
        b = self.budget
        step = Step(next(self._step_ids), [])
        failures: list[Failure] = []
        seen: set[str] = set()
        rows = nseqs = positions = held = 0
        clock = self.clock if self.clock is not None and self.clock.bar_s else None  # (no bar: rows alone)
        if clock is not None:
            decode_first(self.inbox)
        while self.inbox:
            msg = self.inbox[0]
            more = sum(attended(w.start_pos, w.num_tokens, clock.shape.window) for w in msg.seqs) if clock else 0
            holds = sum(clock.held(w.start_pos, w.num_tokens) for w in msg.seqs) if clock else 0
            if nseqs and (rows + msg.rows > b.max_tokens or nseqs + len(msg.seqs) > b.max_seqs
                          or any(w.session_id in seen for w in msg.seqs)
                          or (clock is not None and not clock.fits(rows + msg.rows, positions + more, held + holds))):
                break  # it waits for the next step (a sequence's next slice needs this one's KV first)
            positions, held = positions + more, held + holds
            self.inbox.popleft()
            part = len(step.parts)
            step.parts.append(msg.hidden)
            rows_at = msg.rows_at()
            age = {w.session_id: self.seqs[w.session_id].age if w.session_id in self.seqs else (0, 0)
                   for w in msg.seqs}
            for w in sorted(msg.seqs, key=lambda w: age[w.session_id]):  # the oldest get their blocks first
                try:
                    s = self._check_step(w)
                    step.seqs.append(self._plan(s, w, seen, failures, part=part, row=rows_at[w.session_id]))
                    seen.add(w.session_id)
                except MeshError as err:
                    known = self.seqs.get(w.session_id)
                    failures.append(Failure(w.session_id, known.spec.owner if known else self.owner_of(w.session_id),
                                            err, closed=known is None))
            rows += msg.rows
            nseqs += len(msg.seqs)
        return (step if step.seqs else None), failures

    def _check_step(self, w: SeqWork) -> Sequence:
        s = self._open_seq(w.session_id)
        length = self.kv.tables[s.id].length
        low = length - s.rollback
        if not low <= w.start_pos <= length:
            raise FailedPrecondition(f"session {s.id} step at position {w.start_pos} but node {self.node_id} holds "
                                     f"{length} positions (it may roll back to {low})")
        if w.stop > s.spec.capacity:
            raise ResourceExhausted(f"session {s.id} would grow past its {s.spec.capacity}-token capacity")
        return s

    def _plan(self, s: Sequence, w: SeqWork, planned: set[str], failures: list[Failure], *,
              part: int = 0, row: int = 0, spare_others: bool = False) -> PlannedSeq:
        """Blocks for w's rows. If the pool is short, sequences younger than `s` (and not already
        planned into this step) are preempted, youngest first; if that is not enough, `s` is.
        `spare_others`: raise _NoRoom instead of preempting anyone."""
        if self.states is not None and not self.states.holds(s.id, w.start_pos):
            raise FailedPrecondition(f"session {s.id} on node {self.node_id}: its linear-attention layers hold no "
                                     f"state at position {w.start_pos} (they hold {self.states.positions(s.id)}); "
                                     "replay it from its prompt")
        while True:
            try:
                plan = self.kv.prepare_write(s.id, w.start_pos, w.num_tokens, w.token_ids)
                break
            except BadWrite as exc:
                raise FailedPrecondition(f"session {s.id} on node {self.node_id}: {exc}") from exc
            except OutOfBlocks as exc:
                if spare_others:
                    raise _NoRoom() from exc
                victims = sorted((v for v in self.seqs.values() if v.id not in planned and v.age > s.age),
                                 key=lambda v: v.age, reverse=True)
                if not victims:
                    self._preempt(s)
                    raise ResourceExhausted(f"node {self.node_id} preempted session {s.id}: {exc}") from exc
                self._preempt(victims[0])
                failures.append(Failure(victims[0].id, victims[0].spec.owner, ResourceExhausted(
                    f"node {self.node_id} preempted session {victims[0].id} to free KV blocks for older ones"),
                    closed=True))
        if plan.starts and self.last and w.sample:  # rows whose logits are read are computed whatever they kept
            k, s0 = w.num_candidates + 1, self.kv.span[0]
            plan = replace(plan, starts=plan.starts[:-k] + (s0,) * k,
                           pres=plan.pres[:-k] + (s0,) * k if plan.pres else ())
        u = None
        if self.last and w.sample and not s.spec.sampling.greedy:
            first = w.stop - w.num_candidates  # the position the sampled token takes
            u = tuple(draw(s.seed, s.spec.index, first + i) for i in range(w.num_candidates + 1))
        return PlannedSeq(s, w, plan, self.kv.read_span(s.id, w.stop), part, row, u, self.kv.read_window(s.id, w.stop))

    def _preempt(self, s: Sequence) -> None:
        log.info("preempting session %s (%d positions) to free KV blocks%s", s.id, self.kv.tables[s.id].length,
                 "" if self.swap is not None else "; its replay computes them again (no --swap-mib)")
        self.close(s.id, swap=True)
        self.preempted += 1

    def owner_of(self, session_id: str) -> str:
        """The owner of an open or recently closed session ("" if unknown)."""
        s = self.seqs.get(session_id)
        return s.spec.owner if s else self._recently_closed.get(session_id, "")

    # ---- results ----------------------------------------------------------------------------
    def complete(self, step: Step, failed: set[str]) -> list[PlannedSeq]:
        """Commit the rows the runner computed (all but `failed`); returns those still open."""
        done = []
        now = time.monotonic()
        for p in step.seqs:
            if p.work.session_id in failed or self.seqs.get(p.work.session_id) is not p.seq:
                continue  # failed, or closed while it computed
            self.kv.commit(p.seq.id, p.work.start_pos, p.work.token_ids)
            self.kv.upgrade(p.plan.upgraded)
            p.seq.rollback = p.work.num_candidates
            p.seq.status = SeqStatus.RUNNING
            p.seq.last_active = now
            done.append(p)
        return done

    def finish(self, p: PlannedSeq, tokens: list[int]) -> tuple[list[int], str]:
        """Last stage: the new tokens to report (cut at a stop token or the length limit) and the
        finish reason ("" while it goes on)."""
        s = p.seq
        out, reason = [], ""
        counts = s.generated_counts() if s.spec.sampling.penalized else None
        for t in tokens:
            out.append(t)
            s.generated += 1
            if counts is not None:
                counts[t] += 1
            pos = p.work.stop - p.work.num_candidates + len(out) - 1  # position this token would take
            if t in s.spec.stop_ids or (s.grammar is not None and s.grammar.terminated
                                        and s.generated >= s.grammar.accepted):  # the grammar ended here
                reason = "stop"
            elif s.generated >= s.spec.max_new_tokens or pos >= s.spec.capacity:
                reason = "length"
            if reason:
                s.status = SeqStatus.FINISHED
                break
        return out, reason
