"""One assignment at work: its shard, KV pool and manager, scheduler and links, and its `step()`.

A step is nano-vllm's loop: schedule (stage_node.scheduler: which sequences, which rows, their KV
writes) -> run (stage_node.runner, on the runner thread: the batched forward, and sampling or
verification on the last stage) -> postprocess (commit the KV; pass the hidden states on, or, on
the last stage, report the new tokens to their owners and feed each sequence back to stage 0 with
its candidates: stage_node.last_stage). Sending never blocks (links queue), and a step never
blocks the event loop (the runner computes).
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import defaultdict
from typing import Callable

from logicpipe.common.transport import Transport
from logicpipe.errors import FailedPrecondition, MeshError, NotFound, Unavailable, from_code
from logicpipe.policy import STREAM_KEY_HEADER
from logicpipe.stage_node.engine import last_stage
from logicpipe.stage_node.engine.blocks import KVManager, OutOfBlocks
from logicpipe.stage_node.config import Assignment
from logicpipe.stage_node.engine.draft_model import DraftModel
from logicpipe.stage_node.engine.drafter import step_cost_for
from logicpipe.stage_node.net.events import ErrorEvent, Event, EventHub
from logicpipe.stage_node.model.grammar import GrammarBook
from logicpipe.stage_node.engine.kv import KVPool
from logicpipe.stage_node.net.links import PeerLink
from logicpipe.stage_node.engine.runner import Launched, Runner, StepResult, execute, launch, read_tokens
from logicpipe.stage_node.engine.inbox import StepMsg
from logicpipe.stage_node.engine.scheduler import Budget, Failure, PlannedSeq, Scheduler, Step
from logicpipe.stage_node.engine.sequence import SeqStatus, Sequence, SeqWork
from logicpipe.stage_node.engine.step_budget import StepClock, shape_of
from logicpipe.stage_node.model.shard import Shard
from logicpipe.stage_node.engine.stats import StageStats
from logicpipe.tensor_codec import RawTensor

log = logging.getLogger(__name__)

LINK_CLOSE_S = 5.0  # closing an old link waits this long at most


class Engine:
    OVERLAP_DEVICES = ("cuda",)  # where a one-stage pipeline overlaps its greedy steps (the tests add "cpu")

    """`lock` is the node's: held while a step computes, so that the node can hand the KV pool to
    the next engine only between steps; an engine replaced meanwhile (`retired`) drops its step."""

    def __init__(self, a: Assignment, shard: Shard, pool: KVPool, kv: KVManager, *, node_id: str,
                 transport: Transport, runner: Runner, lock: asyncio.Lock, events: EventHub, stats: StageStats,
                 budget: Budget, orphaned: Callable[[Sequence], bool],
                 draft_model: Callable[[], DraftModel | None], wake: Callable[[], None] = lambda: None,
                 shard_dir: str = "", stream_key: str = "", min_step_s: float = 0.0, step_bar_s: float = 0.0,
                 step_log: str = ""):
        self.assignment = a
        self.stream_key = stream_key      # the plan's: our Stream calls carry it, and calls to us must (see fence)
        self.shard, self.pool, self.kv = shard, pool, kv
        self.node_id = node_id
        self.runner, self.lock = runner, lock
        self.events, self.stats = events, stats
        self.orphaned = orphaned          # a sequence whose owner is gone (no feed, no micro-batch slot)
        self.draft_model = draft_model    # the last stage's draft model, if it has one loaded
        self.wake = wake                  # the node's step loop looks again (sequences were closed)
        self.shard_dir = shard_dir        # where the weights were loaded from (the model dir, or the pull cache)
        self.retired = False              # replaced by another engine: its steps are dropped
        self.min_step_s = min_step_s      # --min-step-ms: a step takes at least this long (a slower device emulated)
        self.step_log = open(step_log, "a", buffering=1) if step_log else None  # --step-log (line-buffered)
        self.step_cost = step_cost_for(shard.device.type, shard.weight_format)  # how many candidates pay
        hybrid = shard.arch.hybrid
        if hybrid:
            log.info("prefix cache off: %s keeps a recurrent state per sequence in its linear-attention layers, "
                     "which cached KV blocks do not carry", shard.config.family)
        self.scheduler = Scheduler(kv, first=a.first, last=a.last, node_id=node_id, budget=budget,
                                   micro_batches=a.micro_batches or a.num_stages, is_orphaned=orphaned,
                                   states=pool.states, prefix_cache=not hybrid, swap=pool.swap)
        self.scheduler.clock = self.clock = clock_of(shard, step_bar_s, pool)  # the step-time bar (engine.step_budget)
        if a.last:  # compiles a session's grammar when one first asks (its tokenizer read from shard_dir then)
            self.scheduler.grammars = GrammarBook(shard_dir, shard.config.vocab_size)
        # issue 32: a one-stage CUDA pipeline overlaps its greedy steps (see `_step_ahead`)
        # (not under --min-step-ms: its pacing is of the plain step, `_run`)
        self.overlap = a.first and a.last and shard.device.type in self.OVERLAP_DEVICES and not min_step_s
        self.ahead: Launched | None = None  # the launched step whose tokens are not read back yet
        self.next_link = self.first_link = None
        link = dict(metadata=((STREAM_KEY_HEADER, stream_key),) if stream_key else (), on_rejected=self._rejected)
        if not a.last:
            self.next_link = PeerLink(a.next_address, transport, self._link_down, name=f"stage {a.stage_index + 1}",
                                      **link)
        if a.last and not a.first:
            self.first_link = PeerLink(a.first_address, transport, self._link_down, name="stage 0", **link)

    # ---- the step ------------------------------------------------------------------------------
    async def step(self) -> bool:
        """One step: schedule -> run -> postprocess. False when there is nothing to do now."""
        if self.ahead is not None:
            return await self._step_ahead()
        step = self._schedule()
        if step is None:
            return False
        if self.overlap and all(map(overlappable, step.seqs)):
            await self._launch(step)
            return True
        result = await self._run(step)
        if result is None:  # the engine was replaced while the step waited: its results mean nothing
            return True
        try:
            feedback = self._postprocess(step, result)
            if feedback is not None:
                await self._feed_back(feedback)
        except Exception:  # noqa: BLE001 — fail the step's sequences, not the node
            log.exception("postprocessing a step failed; its sequences are failed")
            self.report([Failure(p.seq.id, p.seq.spec.owner, MeshError(f"node {self.node_id}: internal error"),
                                 closed=True) for p in step.seqs if self._close_quietly(p.seq.id)])
        return True

    # ---- overlapped greedy steps (issue 32) ----------------------------------------------------
    # A one-stage pipeline is its own first stage: the tokens a greedy step samples are the next
    # step's input. So its next step is launched before this one's tokens are read back: the
    # device keeps working while the host commits, reports and plans. A step of plain greedy rows
    # is launched (`runner.launch`) and held in `ahead`; the next `step()` commits it (its input
    # tokens are known by then), launches its successor (the same sequences, one row each, their
    # input the launched step's tokens on the device) when nothing else waits, then reads the
    # tokens back and reports them as `_postprocess` does. A sequence that finished (a stop token)
    # has its successor's row dropped: computed, never committed (its KV past the end is never
    # read, and goes with the sequence). Anything else (prompts or other sequences waiting,
    # candidates, sampled or penalized or constrained or logprob rows) runs the plain way.
    async def _launch(self, step: Step, source: tuple | None = None) -> None:
        t0 = time.perf_counter()
        async with self.lock:
            if self.retired:
                return
            try:
                self.ahead = await self.runner.call(launch, self.shard, self.pool, step, source)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 — a bad step must not stop the node
                log.exception("step failed")
                self.ahead = None
                result = StepResult(failed={p.seq.id: MeshError(f"node {self.node_id}: step failed: {exc}")
                                            for p in step.seqs})
                self._postprocess(step, result)
        self.stats.compute_s += time.perf_counter() - t0

    async def _step_ahead(self) -> bool:
        cur, self.ahead = self.ahead, None
        if self.retired:
            return True
        sched, st = self.scheduler, self.stats
        step = cur.step
        done = sched.complete(step, set())  # its input tokens are known: its KV is valid
        st.steps, st.rows, st.seq_rows = st.steps + 1, st.rows + step.rows, st.seq_rows + len(step.seqs)
        st.max_step_seqs = max(st.max_step_seqs, len(step.seqs))
        nxt = self._successor(cur, done)
        if nxt is not None:
            order = {sid: i for i, sid in enumerate(cur.sampled)}
            await self._launch(nxt, (cur.tokens, [order[p.seq.id] for p in nxt.seqs]))
        t0 = time.perf_counter()
        try:
            tokens = await self.runner.call(read_tokens, cur)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 — fail the step's sequences, not the node
            log.exception("reading a step's tokens failed; its sequences are failed")
            self.ahead = None
            self.report([Failure(p.seq.id, p.seq.spec.owner, MeshError(f"node {self.node_id}: step failed: {exc}"),
                                 closed=self._close_quietly(p.seq.id)) for p in step.seqs])
            return True
        st.compute_s += time.perf_counter() - t0
        try:
            out = last_stage.take_tokens(sched, self.kv, done, tokens, orphaned=self.orphaned, draft_model=False,
                                         cost=self.step_cost)
            st.sampled_steps += out.sampled
            st.sampled_tokens += out.tokens
            for owner, events in out.events.items():
                self.events.emit(owner, events)
            feeds = self._continue_ahead(out.feeds)
            if feeds:
                await self._feed_back(last_stage.Outcome(feeds=feeds))
        except Exception:  # noqa: BLE001 — fail the step's sequences, not the node
            log.exception("postprocessing a step failed; its sequences are failed")
            self.ahead = None
            self.report([Failure(p.seq.id, p.seq.spec.owner, MeshError(f"node {self.node_id}: internal error"),
                                 closed=True) for p in step.seqs if self._close_quietly(p.seq.id)])
        return True

    def _successor(self, cur: Launched, done: list[PlannedSeq]) -> Step | None:
        """The next step of `cur`'s sampled sequences (one row each, at the position after cur's
        rows, its token still on the device), or None when anything else waits to be scheduled."""
        sched = self.scheduler
        if self.retired or not cur.sampled or any(s.pending for s in sched.seqs.values()):
            return None
        sampled = set(cur.sampled)
        step = Step(cur.step.id, [])  # (no scheduler step id: not a step of its own for the in-flight count)
        now = time.monotonic()
        for p in done:
            s, w = p.seq, p.work
            if (p.seq.id not in sampled or s.status is not SeqStatus.RUNNING or self.orphaned(s)
                    or s.generated + 1 >= s.spec.max_new_tokens or w.stop + 1 > s.spec.capacity):
                continue  # it ends with cur's token (or nobody listens): the plain way
            nw = SeqWork(s.id, w.stop, (0,))  # its token: cur's, patched in when read back
            try:
                plan = self.kv.prepare_write(s.id, nw.start_pos, 1)
            except OutOfBlocks:
                continue  # the scheduler preempts for it, the plain way
            if plan.copies or (plan.window is not None and plan.window.copies):
                continue
            step.seqs.append(PlannedSeq(s, nw, plan, self.kv.read_span(s.id, nw.stop),
                                        window_blocks=self.kv.read_window(s.id, nw.stop)))
            s.pending_pos, s.in_flight_since = nw.stop, now  # as the scheduler does for a row it schedules
        return step if step.seqs else None

    def _continue_ahead(self, feeds: list[SeqWork]) -> list[SeqWork]:
        """The feeds of the step just read back: those of sequences whose successor row is already
        launched become that row's input token; the rest are returned (fed the plain way). The
        successor's rows without such a feed (finished, orphaned, failed) are dropped from it."""
        nxt = self.ahead
        if nxt is None:
            return feeds
        rows = {p.seq.id: i for i, p in enumerate(nxt.step.seqs)}
        keep: dict[int, PlannedSeq] = {}
        rest = []
        for w in feeds:
            i = rows.get(w.session_id)
            p = nxt.step.seqs[i] if i is not None else None
            if p is not None and not w.finished and not w.num_candidates and w.start_pos == p.work.start_pos:
                keep[i] = PlannedSeq(p.seq, SeqWork(p.work.session_id, p.work.start_pos, w.token_ids), p.plan,
                                     p.read_blocks, window_blocks=p.window_blocks)
            else:
                rest.append(w)
        for i, p in enumerate(nxt.step.seqs):
            if i not in keep:  # its input comes the plain way again, at the position its row had
                p.seq.pending_pos = p.work.start_pos
        nxt.step.seqs = [keep[i] for i in sorted(keep)]
        return rest

    def _schedule(self) -> Step | None:
        try:
            step, failures = self.scheduler.schedule()
        except Exception:  # noqa: BLE001 — a bookkeeping bug must not stop the node
            log.exception("scheduling failed; its sequences are failed")
            step, failures = None, self._fail_pending()
        self.report(failures)
        return step

    async def _run(self, step: Step) -> StepResult | None:
        t0 = time.perf_counter()
        async with self.lock:
            if self.retired:
                return None
            try:
                result = await self.runner.call(execute, self.shard, self.pool, step, self.assignment.wire_dtype)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 — a bad step must not stop the node
                log.exception("step failed")
                result = StepResult(failed={p.seq.id: MeshError(f"node {self.node_id}: step failed: {exc}")
                                            for p in step.seqs})
        if self.min_step_s:  # --min-step-ms: wait out the rest, as a slower device would compute it
            await asyncio.sleep(self.min_step_s - (time.perf_counter() - t0))
        self._timed(step, time.perf_counter() - t0)
        return None if self.retired else result

    def _timed(self, step: Step, seconds: float) -> None:
        """A computed step's time: the counters, and the cost model the step-time bar sizes chunks by."""
        st = self.stats
        st.compute_s += seconds
        st.max_step_s = max(st.max_step_s, seconds)
        if self.step_log is not None or self.clock.bar_s:
            positions, held = step.positions(self.clock.shape.window), step.held(self.clock)
            if self.step_log is not None:
                self.step_log.write(json.dumps({
                    "node": self.node_id, "t": round(time.time(), 3), "rows": step.rows, "positions": positions,
                    "held": held, "seqs": len(step.seqs), "decodes": step.decodes, "s": round(seconds, 5),
                    "model_s": round(self.clock.seconds(step.rows, positions, held), 5)}) + "\n")
            if self.clock.bar_s:  # (no bar: nothing sizes chunks by the model, which is not fitted then)
                self.clock.observe(step.rows, positions, held, seconds)
        if step.decodes:  # a decode row waited for this step: the bar's figure
            st.decode_steps += 1
            st.max_decode_step_s = max(st.max_decode_step_s, seconds)
            st.decode_steps_over_bar += bool(self.clock.bar_s) and seconds > self.clock.bar_s

    def _postprocess(self, step: Step, result: StepResult) -> last_stage.Outcome | None:
        """Commit the step; pass its hidden states on, or (last stage) report its tokens and return
        the feeds for stage 0. A sequence that failed here is closed here (its KV and input state
        end with it); its owner, told, closes it everywhere or replays it."""
        sched = self.scheduler
        self.report([Failure(sid, sched.owner_of(sid), err, closed=self._close_quietly(sid))
                     for sid, err in result.failed.items()])
        done = sched.complete(step, set(result.failed))
        for p in done:
            if p.plan.starts:  # a replay resumed over layers kept across a re-plan (issue 34)
                first = self.assignment.start
                pres = p.plan.pres or (first,) * len(p.plan.starts)
                skipped = [r - max(first, pre) for r, pre in zip(p.plan.starts, pres)]
                self.stats.replay_rows_resumed += sum(1 for x in skipped if x > 0)
                self.stats.replay_layers_skipped += sum(skipped)
        st = self.stats
        st.steps, st.rows, st.seq_rows = st.steps + 1, st.rows + step.rows, st.seq_rows + len(step.seqs)
        st.max_step_seqs = max(st.max_step_seqs, len(step.seqs))
        if not self.assignment.last:
            if done:
                self.next_link.send([p.work for p in done], self.assignment.generation, hidden_of(step, result, done))
            return None
        out = last_stage.take_tokens(sched, self.kv, done, result.tokens, orphaned=self.orphaned,
                                     draft_model=self.draft_model() is not None, logprobs=result.logprobs,
                                     prompt_logprobs=result.prompt_logprobs, cost=self.step_cost)
        st.sampled_steps += out.sampled
        st.sampled_tokens += out.tokens
        st.candidates_verified += out.verified
        st.candidates_accepted += out.accepted
        for owner, events in out.events.items():  # queued before the feed is sent: token order holds
            self.events.emit(owner, events)
        return out if out.feeds else None

    async def _feed_back(self, out: last_stage.Outcome) -> None:
        """Last stage: the draft model's candidates first (if any), then the feeds to stage 0."""
        feeds, model = out.feeds, self.draft_model()
        if out.jobs and model is not None:
            try:
                drafts = await self.runner.call(lambda: [model.propose(j.session_id, j.context, j.k) for j in out.jobs])
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 — a drafting failure costs the candidates, never the tokens
                log.warning("the draft model failed (%s); these tokens go on without candidates", exc)
                drafts = [[] for _ in out.jobs]
            feeds = last_stage.with_drafts(feeds, out.jobs, drafts)
            if self.retired:
                return
        if self.first_link is not None:
            self.first_link.send(feeds, self.assignment.generation)
            return
        for w in feeds:  # one stage: first and last
            try:
                self.scheduler.feed(w)
            except MeshError as err:
                self.report([Failure(w.session_id, self.scheduler.owner_of(w.session_id), err)])

    # ---- input ---------------------------------------------------------------------------------
    def receive(self, works: list[SeqWork] | StepMsg, generation: int) -> list[tuple[str, MeshError]]:
        """A Stream message: feeds into stage 0, a computed step into a later stage. Returns the
        sequences rejected at once (their owners are told too)."""
        a, sched = self.assignment, self.scheduler
        ws = list(works.seqs) if isinstance(works, StepMsg) else works
        if generation and a.generation and generation != a.generation:
            err = FailedPrecondition(f"node {self.node_id} serves plan generation {a.generation}; a step of "
                                     f"generation {generation} is stale")
            if not self.stats.stale_steps:
                log.warning("%s (the controller re-plans when it sees this node's generation)", err)
            self.stats.stale_steps += 1
            self.report([Failure(w.session_id, sched.owner_of(w.session_id), err) for w in ws])
            return [(w.session_id, err) for w in ws]
        if isinstance(works, StepMsg):
            sched.enqueue(works)  # a session not held here fails when the step is formed; the sender learns now
            return [(w.session_id, NotFound(f"session {w.session_id} is not open on node {self.node_id}"))
                    for w in ws if w.session_id not in sched.seqs]
        rejected = []
        for w in works:
            try:
                sched.feed(w)
            except MeshError as err:
                rejected.append((w.session_id, err))
        self.report([Failure(sid, sched.owner_of(sid), err) for sid, err in rejected])
        return rejected

    # ---- failures and the end ------------------------------------------------------------------
    def report(self, failures: list[Failure]) -> None:
        """Tell each failed sequence's owner."""
        by_owner: dict[str, list[Event]] = defaultdict(list)
        for f in failures:
            by_owner[f.owner].append(ErrorEvent(f.session_id, f.error, self.node_id))
        for owner, events in by_owner.items():
            self.events.emit(owner, events)
        if failures:
            self.wake()

    def _rejected(self, session_id: str, code: int, message: str) -> None:
        """A peer refused a session's step or feed: its owner (known here, maybe not there) is
        told, and replays it rather than wait for tokens that will not come."""
        s = self.scheduler.seqs.get(session_id)
        if s is not None and s.status is not SeqStatus.FINISHED:
            self.report([Failure(session_id, s.spec.owner, from_code(code, message))])

    def _link_down(self, session_ids: list[str], reason: str) -> None:
        err = Unavailable(f"node {self.node_id}: {reason}")
        self.report([Failure(sid, self.scheduler.owner_of(sid), err) for sid in session_ids])

    def _close_quietly(self, session_id: str) -> bool:
        if session_id in self.scheduler.seqs:
            self.scheduler.close(session_id)
            return True
        return False

    def _fail_pending(self) -> list[Failure]:
        """After a scheduling error: close every sequence with pending work (their owners replay)."""
        out = []
        for s in [s for s in self.scheduler.seqs.values() if s.pending]:
            self.scheduler.close(s.id)
            out.append(Failure(s.id, s.spec.owner, MeshError(f"node {self.node_id}: internal error"), closed=True))
        self.scheduler.inbox.clear()
        return out

    def end_sessions(self, why: str) -> None:
        """Close every sequence (their owners are told)."""
        err = Unavailable(f"node {self.node_id}: {why}")
        for s in self.scheduler.close_all():
            self.events.emit(s.spec.owner, [ErrorEvent(s.id, err, self.node_id)])

    async def close_links(self) -> None:
        """Close the links (bounded: a stalled peer must not hold up a re-assignment), and the step log."""
        if self.step_log is not None:
            self.step_log.close()
            self.step_log = None
        for link in (self.next_link, self.first_link):
            if link is not None:
                try:
                    await asyncio.wait_for(link.close(), LINK_CLOSE_S)
                except asyncio.TimeoutError:
                    log.warning("closing the link to %s took over %.0f s; left behind", link.address, LINK_CLOSE_S)


def overlappable(p: PlannedSeq) -> bool:
    """A row of a step that may be launched ahead: no candidates; a sampled sequence plain greedy
    (no penalties, grammar, logprobs or speculation); no prompt logprobs."""
    s, w = p.seq.spec, p.work
    if w.num_candidates or s.prompt_logprobs is not None:
        return False
    return not w.sample or (s.sampling.greedy and not s.sampling.penalized and not s.grammar
                            and s.top_logprobs is None and not s.speculate)


def hidden_of(step: Step, result: StepResult, done: list[PlannedSeq]) -> RawTensor:
    """The hidden states of the `done` sequences (some may have closed while the step computed:
    their rows stay behind). result.hidden holds the rows of result.ok, in step order."""
    ids = [p.seq.id for p in done]
    if ids == result.ok:
        return result.hidden
    computed, spans, row = set(result.ok), {}, 0
    for q in step.seqs:
        if q.seq.id in computed:
            spans[q.seq.id] = (row, row + q.work.num_tokens)
            row += q.work.num_tokens
    return result.hidden.take_rows([spans[i] for i in ids])


def clock_of(shard: Shard, bar_s: float, pool=None) -> StepClock:
    """The step cost model of a shard's layers (engine.step_budget) over `pool`, under a bar of `bar_s` (0: none)."""
    c, layers = shard.config, shard.end - shard.start
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    per_layer = c.hidden_size * (2 * q + 2 * kv) + 3 * c.hidden_size * c.intermediate_size
    kv_bytes = layers * c.kv_parts * kv * shard.dtype.itemsize
    return StepClock(shape_of(params=layers * per_layer, attention_layers=layers, num_heads=c.num_heads,
                              kv_bytes=kv_bytes, head_dim=c.head_dim,
                              in_place_rows=0 if pool is None else shard.in_place_rows(pool)),
                      shard.device.type, bar_s=bar_s)

