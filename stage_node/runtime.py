"""The stage node at run time: the assignment in force (an `Engine`, replaced whole by the next
one), the loop that runs its steps, sessions, leases, and the node's counters.

An assignment loads fully (stage_node.loading) before it replaces the one in force, whose
sessions then end; a new plan that keeps this node's layers keeps its weights and KV pool (no
load, and the prefix cache still holds what was computed: replays attach it instead of
recomputing). A session outlives its gone owner (or, without one, its last step) by the TTL.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace
from enum import Enum
from pathlib import Path
from typing import Callable

from logicpipe.common.transport import Transport
from logicpipe.errors import FailedPrecondition, InvalidArgument, MeshError, NotFound, PermissionDenied, Unavailable
from logicpipe.limits import MAX_ID_CHARS
from logicpipe.stage_node.weights import loading
from logicpipe.stage_node.engine import handoff, tp_group
from logicpipe.stage_node.engine.tp_member import Member, remote_for
from logicpipe.stage_node.engine.blocks import KVManager
from logicpipe.stage_node.engine.swap import SwapSpace
from logicpipe.stage_node.engine.window import managers
from logicpipe.stage_node.config import Assignment, StageOptions
from logicpipe.stage_node.engine.draft_model import DraftModel, DraftModelError
from logicpipe.stage_node.engine.engine import Engine
from logicpipe.stage_node.net.events import EventHub
from logicpipe.stage_node.net.fence import Caller, Fence
from logicpipe.stage_node.net.kv_disk import DiskKv
from logicpipe.stage_node.net.mirror import KvMirror
from logicpipe.stage_node.engine.kv import KVPool
from logicpipe.stage_node.engine.runner import Runner
from logicpipe.stage_node.engine.inbox import StepMsg
from logicpipe.stage_node.engine.sequence import SeqSpec, Sequence, SeqWork
from logicpipe.stage_node.model.shard import Shard
from logicpipe.stage_node.engine.stats import EngineView, StageSnapshot, StageStats

log = logging.getLogger(__name__)

IDLE_RECHECK_S = 1.0  # an idle step loop looks again this often (stale in-flight steps, gone owners)


class NodeState(Enum):
    IDLE = "idle"          # no assignment
    LOADING = "loading"    # loading an assignment (a previous one, if any, still serves)
    READY = "ready"
    MEMBER = "member"      # a member of another node's tensor-parallel stage (engine.tp_member): nothing else


class StageRuntime:
    def __init__(self, node_id: str, device: str = "cpu", *, transport: Transport,
                 options: StageOptions = StageOptions(), runner: Runner | None = None, pull_root: Path | None = None,
                 local_model_dir: str | None = None, fence_path: Path | None = None):
        self.node_id = node_id
        self.fence = Fence(node_id, fence_path, tls=transport.tls)  # who steers it, who is revoked
        self.device = device
        self.transport = transport  # the process's: channels to the next stage, stage 0, the controller
        self.options = options
        self.runner = runner or Runner()
        self.weights = loading.WeightSource(node_id, transport, model_root=options.model_root,
                                            local_model_dir=local_model_dir, pull_root=pull_root)
        self.engine: Engine | None = None
        self.state = NodeState.IDLE
        self.events = EventHub()
        self.stats = StageStats()
        self.started = time.monotonic()
        self.stopping = False       # leaving (SIGTERM): the controller plans without it
        self.draft_model: DraftModel | None = None  # last stage with --draft-model: the loaded model
        self.drafter = "prompt lookup"  # what drafts candidates here (Status)
        self._wake = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()
        self._assign_lock = asyncio.Lock()
        self._step_lock = asyncio.Lock()  # held while a step computes (a re-assignment waits for it)
        self.mirror = KvMirror(self)  # KV blocks copied to other pipelines' stages, and taken from theirs
        self.kv_disk = DiskKv(self, Path(options.kv_disk_dir) if options.kv_disk_dir else None,
                              options.kv_disk_bytes)  # the prefix cache kept on disk, read back at a restart
        self.member: Member | None = None  # a member of another node's stage (its follower process)
        self._member_tasks: set[asyncio.Task] = set()

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        jobs = [(self._loop(), "stage-loop"), (self._janitor(), "stage-janitor"), (self.mirror.run(), "kv-mirror")]
        if self.kv_disk.on:
            jobs.append((self.kv_disk.run(), "kv-disk"))
        for coro, name in jobs:
            task = asyncio.create_task(coro, name=name)
            self._tasks.add(task)

    def alive(self) -> bool:
        """The step loop and the janitor still run (systemd's watchdog stops hearing from a node
        whose loop died, and restarts it)."""
        return bool(self._tasks) and not any(t.done() for t in self._tasks)

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._leave_group()
        if self.engine is not None:
            self.engine.end_sessions("the stage is stopping")
            await self.engine.close_links()
        self.runner.close()

    # ---- assignment ------------------------------------------------------------------------
    async def assign(self, a: Assignment, stream_key: str = "", admit: Callable[[], None] | None = None) -> Engine | None:
        """Load `a` fully, then put it in place of the assignment in force (whose sessions end); a member's
        assignment of another node's stage over several nodes (tp_rank > 0) starts its follower (None).
        `stream_key`: the plan's (its stages' Stream calls carry it). `admit`: called once `a` is
        loaded and valid, just before it takes effect (the Assign's caller takes the fence there);
        if it raises, nothing changes: an invalid or refused assignment never holds the node."""
        a.check()
        loading.check_formats(a, self.node_id, self.options)
        remote = remote_for(a, self.node_id, self.device, own_group=bool(self.options.tp_max or self._own_group()))
        if remote is not None and a.tp_rank:
            await self._follow(a, remote, stream_key, admit)
            return None
        width = remote.world if remote is not None else tp_group.width_for(a.tp_width, self._own_group(),
                                                                            self.options.tp_max, self.node_id)
        async with self._assign_lock:
            self._leave_group()
            old = self.engine
            if old is not None and old.assignment == a and old.stream_key == stream_key:
                if admit is not None:
                    admit()
                return old
            before = self.state
            self.state = NodeState.LOADING
            try:
                self.weights.pull_key = stream_key
                model_dir = await self.weights.model_dir_for(a)
                self.stats.weights_pulled_bytes = self.weights.pulled_bytes
                if width != self._width() or remote != self._remote():
                    await self._reform(width, model_dir, remote)
                    old, before = None, NodeState.IDLE
                if old is not None and old.assignment.same_weights(a) and old.shard_dir == model_dir:
                    shard, pool, kv = old.shard, old.pool, old.kv  # keeps the prefix cache too
                else:
                    reuse = old.shard if old is not None and old.shard_dir == model_dir and \
                        (old.assignment.model_digest, old.assignment.num_layers) == (a.model_digest, a.num_layers) else None
                    shard, pool = await self.runner.call(loading.load_shard, a, model_dir, self.device, self.options,
                                                         reuse, self._logs_for(a, old if reuse is not None else None))
                    kv = None
            except MeshError:
                self.state = before
                raise
            except Exception as exc:  # noqa: BLE001 — whatever broke, the assignment in force stays
                self.state = before
                keeps = "it keeps its previous assignment" if self.engine is not None else "it stays unassigned"
                raise FailedPrecondition(f"node {self.node_id} could not load layers [{a.start}, {a.end}) of "
                                         f"{a.model_dir[:200]}: {str(exc).splitlines()[0][:300]}; {keeps}") from exc
            if admit is not None:
                try:
                    admit()
                except BaseException:
                    self.state = before
                    raise
            async with self._step_lock:  # no step of the old engine is computing into the pool
                if old is not None:
                    old.retired = True
                    old.end_sessions("the stage was re-assigned")
                if kv is None and old is not None and old.kv.span is not None and self._keeps_rows() and \
                        old.shard_dir == model_dir and old.pool.block_size == pool.block_size and \
                        (old.assignment.model_digest, old.assignment.num_layers) == (a.model_digest, a.num_layers) \
                        and not shard.arch.hybrid and shard.window is None:  # (hybrid: no prefix cache, nothing to
                    # keep, its pool's layers are not a range; windows: blocks given back, a second pool)
                    # the layers both ranges hold stay in the prefix cache (issue 34)
                    try:
                        kv, kept = old.kv.carried(pool.num_blocks, (a.start, a.end), a.last, self._logged(a, pool),
                                                  frozenset(pool.logs))
                        kv.partial = shard.can_tap
                        await self.runner.call(pool.take_over, old.pool, kept)
                        log.info("kept the KV of %d cached blocks over layers [%d, %d) for replays", len(kept),
                                 max(a.start, old.assignment.start), min(a.end, old.assignment.end))
                    except Exception:  # noqa: BLE001 — a cache not kept only costs replays their speed
                        log.exception("could not keep the KV of the previous range; starting with an empty pool")
                        kv = None
                self.engine = self._new_engine(a, shard, pool, kv, model_dir, stream_key)
                # a new pool takes what this node's disk holds of these layers before it serves (net.kv_disk)
                await self.kv_disk.restore(self.engine, fresh=kv is None)
            if old is not None:
                await old.close_links()
            self.state = NodeState.READY
            self._wake.set()
            if kv is not None:
                log.info("re-assigned as stage %d/%d of plan generation %d, keeping layers [%d, %d)",
                         a.stage_index, a.num_stages, a.generation, a.start, a.end)
                return self.engine
            if a.last:
                await self._load_draft_model(shard.config.vocab_size)
            log.info("assigned layers [%d, %d) of %s as stage %d/%d (%d parameters, %d KV blocks of %d)",
                     a.start, a.end, model_dir, a.stage_index, a.num_stages, shard.parameter_count,
                     pool.num_blocks, pool.block_size)
            return self.engine

    def _width(self) -> int:
        """Devices the stage spans now: its group's ranks, 1 without one."""
        return self.options.tp.world if self.options.tp is not None else 1

    def _remote(self) -> tp_group.Remote | None:
        """The group over several nodes this node is rank 0 of now (None: none)."""
        return self.options.tp.remote if self.options.tp is not None else None

    def _own_group(self):
        """The node's own group (--tp N, --tp-max), not one over several nodes."""
        return self.options.tp if self._remote() is None else None

    async def _follow(self, a: Assignment, remote: tp_group.Remote, stream_key: str,
                      admit: Callable[[], None] | None) -> None:
        """Become rank a.tp_rank of `remote` (engine.tp_member): the assignment in force (or a group of its
        own) ends, and the follower runs until the group is over; kept when it is that rank already."""
        async with self._assign_lock:
            self.weights.pull_key = stream_key  # (its own copy of the model, pulled as any stage's)
            model_dir = await self.weights.model_dir_for(a)
            if self.member is not None and self.member.same(a.tp_rank, remote, model_dir):
                if admit is not None:
                    admit()
                return
            if admit is not None:
                admit()
            self._leave_group()
            async with self._step_lock:
                old, self.engine = self.engine, None
                if old is not None:
                    old.retired = True
                    old.end_sessions(f"the node became a member of {remote.members[0]}'s tensor-parallel stage")
                if self.options.tp is not None:  # (rank 0 of another group before)
                    leader = await self.runner.call(tp_group.reform, self.options.tp, 1, self.device,
                                                    self.options.tp_threads)
                    self.options = replace(self.options, tp=leader)
            if old is not None:
                await old.close_links()
            member = self.member = Member(a.tp_rank, remote, model_dir, self.options.tp_threads)
            self.state = NodeState.MEMBER
            task = asyncio.create_task(self._member_ended(member), name="tp-member")
            self._member_tasks.add(task)
            task.add_done_callback(self._member_tasks.discard)

    async def _member_ended(self, member: Member) -> None:
        """Once the member's follower ends, the node is idle (to be assigned anew)."""
        await member.ended()
        if self.member is member:
            self.member = None
            self.state = NodeState.IDLE
            log.warning("the tensor-parallel stage of %s is over for this node (follower status %s): idle",
                        member.leader, member.proc.returncode)

    def _leave_group(self) -> None:
        """Stop being a member of another node's stage (before any other assignment)."""
        member, self.member = self.member, None
        if member is not None:
            member.stop()
            if self.state is NodeState.MEMBER:
                self.state = NodeState.IDLE

    async def _reform(self, width: int, model_dir: str, remote: tp_group.Remote | None = None) -> None:
        """A --tp-max node asked for another width (planner.width): the model's split checked first (a refusal
        leaves everything as it was), then the assignment in force ends (its shard is another split) and the
        follower group is formed again at `width` (stopped at 1: tp_group.reform)."""
        if width > 1:
            await self.runner.call(tp_group.check_model_split, model_dir, width)
            if self.device == "cuda" and tp_group.DESTROYED[0]:
                raise FailedPrecondition(f"tp_width {width}: node {self.node_id} cannot form a CUDA tensor-parallel "
                                         f"group again after ending one (it hung on 2 H200s); restart the node to "
                                         f"give it {width} GPUs again")
        log.info("tensor-parallel width %d -> %d: re-forming the stage's group", self._width(), width)
        old = self.engine
        async with self._step_lock:
            if old is not None:
                old.retired = True
                old.end_sessions("the stage's tensor-parallel width changes")
                self.engine = None
            try:
                leader = await self.runner.call(tp_group.reform, self.options.tp, width, self.device,
                                                self.options.tp_threads, remote)
            except BaseException:
                if self.options.tp is not None and self.options.tp.stopped:  # (ended, and none formed instead)
                    self.options = replace(self.options, tp=None)
                raise
            self.options = replace(self.options, tp=leader)
        if old is not None:
            await old.close_links()

    MAX_LOGS = 3  # boundaries whose rows a pool keeps at most (its end, and inner ones a re-plan grew over)

    def _keeps_rows(self) -> bool:
        return self.options.replay_rows and self.options.tp is None

    def _logs_for(self, a: Assignment, old: Engine | None) -> frozenset[int]:
        """Boundaries whose rows the pool for `a` keeps: its end (not on a last stage), and those
        inside its range that the pool it replaces kept (a range grown over a lost neighbour's
        layers keeps the rows of its former end: when the neighbour is back, the replay resumes
        there instead of computing the grown range again); the highest MAX_LOGS."""
        if not self._keeps_rows():
            return frozenset()
        want = set() if a.last else {a.end}
        if old is not None and old.kv.span is not None:
            want |= {b for b in old.pool.logs if a.start < b < a.end}
        return frozenset(sorted(want)[-self.MAX_LOGS:])

    def _logged(self, a: Assignment, pool: KVPool) -> frozenset[int]:
        """The boundaries every row computed on `a` leaves in `pool` (its inner ones and its end)."""
        return frozenset(b for b in pool.logs if a.start < b <= a.end)

    def _new_engine(self, a: Assignment, shard: Shard, pool: KVPool, kv: KVManager | None, shard_dir: str,
                    stream_key: str = "") -> Engine:
        """An engine for `a`; `kv` (kept from the previous engine, its sequences closed first) keeps
        the prefix cache."""
        if kv is None:  # (sliding-window layers that hold only their window: engine.window's managers)
            kv = managers(pool.num_blocks, pool.block_size, shard.window, pool.group.num_blocks if pool.group else 0)
            if self._keeps_rows() and shard.window is None:  # its blocks record the layers and rows they hold (issue 34)
                kv.span, kv.last, kv.logged = (a.start, a.end), a.last, self._logged(a, pool)
                kv.partial = shard.can_tap
        opts = self.options
        if pool.swap is None and opts.swap_bytes and opts.tp is None:  # (a pool kept keeps its swap space)
            pool.swap = SwapSpace(pool, opts.swap_bytes, opts.swap_dir, self.stats)
            log.info("swap space: %.1f MiB in %s for the KV of preempted sequences", opts.swap_bytes / 2**20,
                     pool.swap.where())
        return Engine(a, shard, pool, kv, node_id=self.node_id,
                      transport=self.transport, runner=self.runner, lock=self._step_lock, events=self.events,
                      stats=self.stats, budget=self.options.budget, orphaned=self._orphaned,
                      draft_model=lambda: self.draft_model, wake=self._wake.set, shard_dir=shard_dir,
                      stream_key=stream_key, min_step_s=opts.min_step_s, step_bar_s=opts.step_bar_s,
                      step_log=opts.step_log)

    async def _load_draft_model(self, vocab_size: int) -> None:
        """Last stage with --draft-model: load it once. A draft model that cannot serve this model
        (unreadable, another vocabulary) is logged, and prompt lookup drafts instead."""
        opts = self.options
        if not opts.draft_model or (self.draft_model is not None and self.draft_model.vocab_size == vocab_size):
            return
        dtype = self.engine.assignment.dtype if self.engine is not None else "float32"
        try:
            model = await self.runner.call(loading.load_draft_model, opts, self.device, dtype, vocab_size)
        except DraftModelError as exc:
            log.error("%s; drafting candidates by prompt lookup instead", exc)
            self.draft_model, self.drafter = None, f"prompt lookup ({exc})"
            return
        self.draft_model, self.drafter = model, model.describe()
        log.info("drafting candidates with the draft %s", self.drafter)

    def require_ready(self) -> Engine:
        if self.member is not None:
            raise FailedPrecondition(f"node {self.node_id} is a member of {self.member.leader}'s tensor-parallel stage: "
                                     f"it serves nothing else (send to {self.member.leader})")
        if self.engine is None:
            raise FailedPrecondition(
                f"node {self.node_id} has no layer assignment yet ({self.state.value}); "
                "the controller assigns layers when it starts (logicpipe-controller --nodes ...)")
        return self.engine

    # ---- sessions --------------------------------------------------------------------------
    def open_session(self, spec: SeqSpec) -> int:
        """Admit a sequence; returns the leading positions it already holds (prefix cache, parent)."""
        eng = self.require_ready()
        if spec.import_length:
            self._check_movable(eng, "take")
        _, cached = eng.scheduler.admit(spec)
        return cached

    # ---- disaggregated prefill (engine.handoff) ----------------------------------------------
    def _check_movable(self, eng: Engine, what: str) -> None:
        why = handoff.movable(eng.pool, states=eng.pool.states is not None, tensor_parallel=self.options.tp is not None)
        if why:
            raise FailedPrecondition(f"node {self.node_id} cannot {what} a sequence's KV from another pipeline: {why}")

    def export_kv(self, session_id: str, length: int, layers: tuple[int, int]):
        """The KV of positions [0, length) of `layers` (absolute, this stage's) of a session here,
        chunk by chunk: an async iterator of (layer, start position, RawTensor), each read on the
        runner thread between steps (the steps of other sequences go on meanwhile). The request
        is checked now (a MeshError), before the iterator is."""
        eng = self.require_ready()
        self._check_movable(eng, "send")
        a = eng.assignment
        if not a.start <= layers[0] < layers[1] <= a.end:
            raise InvalidArgument(f"layers [{layers[0]}, {layers[1]}) are not within node {self.node_id}'s "
                                  f"[{a.start}, {a.end})")
        seq = eng.scheduler.seqs.get(session_id)
        if seq is None:
            raise NotFound(f"session {session_id[:MAX_ID_CHARS]} is not open on node {self.node_id}")
        held = eng.kv.tables[session_id].length
        if not 1 <= length <= held:
            raise FailedPrecondition(f"session {session_id[:MAX_ID_CHARS]} holds {held} positions on node "
                                     f"{self.node_id}; {length} cannot be sent")
        return self._kv_chunks(eng, seq, length, layers)

    async def _kv_chunks(self, eng: Engine, seq: Sequence, length: int, layers: tuple[int, int]):
        a, session_id = eng.assignment, seq.id
        step = handoff.chunk_positions(eng.pool)
        for layer in range(*layers):
            for start in range(0, length, step):
                if eng.retired or eng.scheduler.seqs.get(session_id) is not seq:
                    raise Unavailable(f"session {session_id[:MAX_ID_CHARS]} closed on node {self.node_id} while "
                                      "its KV was sent")
                n = min(step, length - start)
                where = handoff.slots(eng.kv.tables[session_id].blocks, eng.kv.block_size, start, n)
                yield layer, start, await self.runner.call(handoff.read_rows, eng.pool, layer - a.start, where)

    async def import_kv(self, rows: handoff.KvRows) -> bool:
        """Write one chunk of a session's imported KV; True once every layer here holds all its
        positions (committed: its first step may come)."""
        eng = self.require_ready()
        seq = eng.scheduler.seqs.get(rows.session_id)
        if seq is None:
            raise NotFound(f"session {rows.session_id[:MAX_ID_CHARS]} is not open on node {self.node_id}")
        imp = seq.kv_import
        if imp is None:
            raise FailedPrecondition(f"session {rows.session_id[:MAX_ID_CHARS]} on node {self.node_id} takes no "
                                     "imported KV (not opened with kv_import_length, or all of it came)")
        a = eng.assignment
        imp.check(rows, (a.start, a.end), self.node_id)
        where = handoff.slots(eng.kv.tables[seq.id].blocks, eng.kv.block_size, rows.start_pos, rows.positions)
        async with self._step_lock:  # not into a pool a re-assignment is handing over
            if eng.retired or eng.scheduler.seqs.get(seq.id) is not seq:
                raise Unavailable(f"session {seq.id[:MAX_ID_CHARS]} closed on node {self.node_id} while its KV came")
            await self.runner.call(handoff.write_rows, eng.pool, rows.layer - a.start, where, rows.kv)
        imp.took(rows)
        if not imp.complete((a.start, a.end)) or seq.kv_import is not imp:
            return False
        seq.kv_import = None
        eng.kv.commit(seq.id, 0, seq.spec.prompt[: imp.length])
        seq.pending_pos = seq.rollback = imp.length
        seq.last_active = time.monotonic()
        return True

    def close_session(self, session_id: str, caller: Caller = Caller(), swap: bool = False) -> int:
        """Close a session; only its opener may (`caller`: who calls). `swap`: its owner replays it (it
        was preempted): its KV goes to the swap space, if any. Returns the positions it held."""
        if self.engine is None:
            raise FailedPrecondition(f"node {self.node_id} has no layer assignment yet ({self.state.value}); "
                                     "it holds no sessions")
        sched = self.engine.scheduler
        seq = sched.seqs.get(session_id)
        if seq is None:
            raise NotFound(f"session {session_id[:MAX_ID_CHARS]} is not open on node {self.node_id}")
        if caller != seq.spec.opener:
            raise PermissionDenied(f"session {session_id[:MAX_ID_CHARS]} belongs to the controller that opened it "
                                   f"({seq.spec.owner or 'no owner'}, {seq.spec.opener.describe()}); {caller.describe()} "
                                   "cannot close it")
        held = self.engine.kv.tables[session_id].length
        sched.close(session_id, swap=swap)
        self._wake.set()  # a micro-batch slot or blocks may have freed
        return held

    def receive(self, works: list[SeqWork] | StepMsg, generation: int) -> list[tuple[str, MeshError]]:
        """A Stream message (feeds into stage 0, a computed step into a later stage); returns the
        sequences rejected at once."""
        rejected = self.require_ready().receive(works, generation)
        self._wake.set()
        return rejected

    def _orphaned(self, s: Sequence) -> bool:
        return bool(s.spec.owner) and not self.events.listening(s.spec.owner)

    # ---- the step loop ---------------------------------------------------------------------
    async def _loop(self) -> None:
        while True:
            eng = self.engine
            if eng is not None and await eng.step():
                continue
            self._wake.clear()
            try:  # woken by new work; the timeout re-checks stale in-flight steps and gone owners
                await asyncio.wait_for(self._wake.wait(), IDLE_RECHECK_S)
            except asyncio.TimeoutError:
                pass

    # ---- leases ----------------------------------------------------------------------------
    async def _janitor(self) -> None:
        ttl = self.options.session_ttl_s
        while True:
            await asyncio.sleep(min(1.0, max(0.05, ttl / 4)))
            try:
                self.expire_sessions()
                if self.draft_model is not None and self.engine is not None:
                    self.draft_model.forget(set(self.engine.scheduler.seqs))
            except Exception:  # noqa: BLE001 — the janitor must outlive a bug (the watchdog watches it)
                log.exception("the session janitor failed a round")

    def expire_sessions(self, now: float | None = None) -> list[str]:
        """Free the sessions whose owner has been gone (or, with no owner, that have not been
        stepped) for the TTL. Returns their ids."""
        eng = self.engine
        if eng is None:
            return []
        now = time.monotonic() if now is None else now
        ttl = self.options.session_ttl_s
        expired = []
        for s in list(eng.scheduler.seqs.values()):
            owner = s.spec.owner
            if owner and self.events.listening(owner):
                continue
            since = max(s.last_active, self.events.left_at(owner) or 0.0) if owner else s.last_active
            if now - since > ttl:
                eng.scheduler.close(s.id)
                expired.append(s.id)
        if expired:
            self.stats.sessions_expired += len(expired)
            log.info("freed %d sessions whose owner was gone for %.0f s", len(expired), ttl)
            self._wake.set()
        return expired

    # ---- what it reports -------------------------------------------------------------------
    def snapshot(self) -> StageSnapshot:
        eng = self.engine
        view = None
        if eng is not None:
            a, shard, kv = eng.assignment, eng.shard, eng.kv
            view = EngineView(
                model_dir=a.model_dir, model_digest=a.model_digest, plan_id=a.plan_id, start=a.start, end=a.end,
                num_layers=a.num_layers, stage_index=a.stage_index, num_stages=a.num_stages,
                generation=a.generation, dtype=a.dtype, weight_format=shard.weight_format,
                weight_bytes=shard.weight_bytes, parameter_count=shard.parameter_count,
                tied_copy_count=shard.tied_copy_count, open_sessions=len(eng.scheduler.seqs),
                orphaned_sessions=sum(1 for s in eng.scheduler.seqs.values() if self._orphaned(s)),
                block_size=kv.block_size, kv_blocks_total=kv.num_blocks, kv_blocks_used=kv.used,
                kv_blocks_cached=len(kv.cached), kv_bytes=kv.used * eng.pool.block_bytes + (
                    kv.group.used * eng.pool.group.block_bytes if eng.pool.group is not None else 0),
                prefix_hit_tokens=kv.prefix_hit_tokens, preempted=eng.scheduler.preempted,
                micro_batches=eng.scheduler.micro_batches if a.first else 0,
                swap_bytes_total=eng.pool.swap.capacity if eng.pool.swap is not None else 0,
                swap_bytes_used=eng.pool.swap.used if eng.pool.swap is not None else 0)
        return StageSnapshot(node_id=self.node_id, state=self.state.value, device=str(self.device),
                             uptime_s=time.monotonic() - self.started, stats=replace(self.stats),
                             session_ttl_s=self.options.session_ttl_s, block_size=self.options.block_size,
                             stopping=self.stopping, drafter=self.drafter, engine=view,
                             step_bar_s=self.options.step_bar_s, tp_port=self.options.tp_port,
                             tp_leader=self.member.leader if self.member is not None else "")
