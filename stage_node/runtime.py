"""The stage runtime: the assignment in force and the parts that serve it, wired together.

Main loop (nano-vllm's shape): schedule -> run (on the runner thread) -> postprocess. Postprocess
commits the KV, then either queues the hidden states for the next stage, or (last stage) reports
the new tokens to their owner and feeds each one back to stage 0 (into its own scheduler when
this stage is also the first): the controller is not on the per-token path. Sending never blocks
the loop (links queue), and the loop never blocks the event loop (the runner computes).
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from dataclasses import dataclass
from enum import Enum

from logicpipe.limits import MAX_ID_CHARS
from logicpipe.errors import FailedPrecondition, InvalidArgument, MeshError, NotFound, Unavailable
from logicpipe.v1 import stage_pb2
from logicpipe.stage_node import wire
from logicpipe.stage_node.blocks import DEFAULT_BLOCK_SIZE, KVManager
from logicpipe.stage_node.drafter import Drafter, allocate
from logicpipe.common.modeldir import ModelConfig, ModelError, model_digest
from logicpipe.stage_node.events import EventHub
from logicpipe.stage_node.kv import KVPool, kv_bytes_per_token
from logicpipe.common.transport import Transport
from logicpipe.stage_node.links import PeerLink
from logicpipe.stage_node.runner import Runner, StepResult, execute
from logicpipe.stage_node.scheduler import Budget, Failure, Scheduler, Step
from logicpipe.stage_node.sequence import SeqSpec, SeqWork, Sequence
from logicpipe.stage_node.shard import Shard
from logicpipe.stage_node.step_graphs import StepGraphs

log = logging.getLogger(__name__)

COMPUTE_DTYPES = ("float32", "float16", "bfloat16")
WEIGHT_FORMATS = ("fp32", "fp16", "bf16", "int8", "nf4", "fp4")
LINK_CLOSE_S = 5.0     # closing an old link waits this long at most
IDLE_RECHECK_S = 1.0  # an idle step loop looks again this often (stale in-flight steps, gone owners)
MAX_PATH_CHARS = 4096


class NodeState(Enum):
    IDLE = "idle"          # no assignment
    LOADING = "loading"    # loading an assignment (a previous one, if any, still serves)
    READY = "ready"


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
    generation: int = 0     # plan generation: steps of another generation are refused (0: accept any)
    micro_batches: int = 0  # stage 0: sampled steps in flight at once (0: one per stage)
    controller_address: str = ""  # where to pull weights from and to say we leave ("" = unknown)
    weight_format: str = ""  # the plan's format of its layers (float, or the quantized one offered; "": any)
    wire_dtype: str = ""     # dtype of the hidden states it sends on ("": dtype)
    prev_node_id: str = ""   # over TLS: the stage that may stream steps here ("": any stage)
    last_node_id: str = ""   # stage 0 over TLS: the last stage, whose tokens stream here

    @property
    def first(self) -> bool:
        return self.start == 0

    @property
    def last(self) -> bool:
        return self.end == self.num_layers

    def check(self) -> None:
        if self.dtype not in COMPUTE_DTYPES:
            raise InvalidArgument(f"dtype {self.dtype[:40]!r} not supported; use one of {', '.join(COMPUTE_DTYPES)}")
        if self.weight_format not in ("", *WEIGHT_FORMATS):
            raise InvalidArgument(f"weight format {self.weight_format[:40]!r} not supported; use one of "
                                  f"{', '.join(WEIGHT_FORMATS)}")
        if self.wire_dtype not in ("", *COMPUTE_DTYPES):
            raise InvalidArgument(f"wire dtype {self.wire_dtype[:40]!r} not supported; use one of {', '.join(COMPUTE_DTYPES)}")
        if not self.model_dir or len(self.model_dir) > MAX_PATH_CHARS:
            raise InvalidArgument(f"model_dir must be a path of 1 to {MAX_PATH_CHARS} characters")
        if not (0 <= self.start < self.end <= self.num_layers):
            raise InvalidArgument(f"layer range [{self.start}, {self.end}) is not inside [0, {self.num_layers})")
        if not (0 <= self.stage_index < self.num_stages):
            raise InvalidArgument(f"stage index {self.stage_index} out of range for {self.num_stages} stages")
        if not self.last and not self.next_address:
            raise InvalidArgument(f"stage ending at layer {self.end} < {self.num_layers} needs a next_address")
        if self.last and not self.first and not self.first_address:
            raise InvalidArgument("the last stage needs first_address (where new tokens go)")


@dataclass(frozen=True)
class StageOptions:
    max_kv_bytes: int = 2 * 2**30        # KV pool of this stage, bytes
    block_size: int = DEFAULT_BLOCK_SIZE  # KV positions per block
    budget: Budget = Budget()            # per-step token rows and sequences
    session_ttl_s: float = 30.0          # a session outlives its gone owner (or its last step) this long
    draft_model: str = ""                # last stage: draft candidates with this model ("": prompt lookup)
    draft_layers: int = 0                # ... keeping only its first N decoder layers (0: all)
    quantize: str = "none"               # its layers' matrices in int8 / nf4 / fp4 (stage_node.quant)
    cuda_graphs: bool = True             # CUDA: small steps replayed as graphs (stage_node.step_graphs)
    dtype: str = "auto"                  # --dtype: "auto" (what the plan asks) or the one dtype it computes in
    model_root: str = ""                 # an assigned model directory must lie under this ("": anywhere)


@dataclass
class Engine:
    """What one assignment runs: its shard, KV pool and manager, scheduler, links."""

    assignment: Assignment
    shard: Shard
    pool: KVPool
    kv: KVManager
    scheduler: Scheduler
    next_link: PeerLink | None = None
    first_link: PeerLink | None = None
    shard_dir: str = ""  # where the weights were loaded from (the model dir, or the pull cache)


class StageRuntime:
    def __init__(self, node_id: str, device: str = "cpu", *, transport: Transport, options: StageOptions = StageOptions(),
                 runner: Runner | None = None, pull_root=None, local_model_dir: str | None = None):
        self.node_id = node_id
        self.transport = transport  # channels to the next stage, stage 0 and the controller (pulls)
        self.device = device
        self.options = options
        self.runner = runner or Runner()
        self.engine: Engine | None = None
        self.state = NodeState.IDLE
        self.events = EventHub()
        self.started = time.monotonic()
        self.steps = self.rows = self.seq_rows = self.max_step_seqs = 0
        self.compute_s = 0.0  # seconds spent in the runner on steps
        self.sessions_expired = 0
        self.weights_pulled_bytes = 0
        # last stage: sampled steps, the tokens they reported, candidates verified and accepted
        self.sampled_steps = self.sampled_tokens = self.candidates_verified = self.candidates_accepted = 0
        self.pull_root = pull_root  # where pulled tensors are cached (None: never pull)
        self.local_model_dir = local_model_dir  # --model-dir: our copy (None: the directory the controller names)
        self.stopping = False       # leaving (SIGTERM): the controller plans without it
        self.draft_model = None     # last stage with --draft-model: the loaded DraftModel
        self.drafter = "prompt lookup"  # what drafts candidates here (Status)
        self._wake = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()
        self._assign_lock = asyncio.Lock()
        self._step_lock = asyncio.Lock()  # held while a step computes (a re-assignment waits for it)

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        for coro, name in ((self._loop(), "stage-loop"), (self._janitor(), "stage-janitor")):
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
        if self.engine is not None:
            await self._drop_engine(self.engine, "the stage is stopping")
        self.runner.close()

    # ---- assignment ------------------------------------------------------------------------
    async def assign(self, a: Assignment) -> Engine:
        """Load `a` fully, then put it in place of the assignment in force (whose sessions end).
        A new plan that keeps this node's layers keeps its weights and KV pool: no load, and the
        prefix cache still holds what was computed (replays attach it instead of recomputing)."""
        a.check()
        self._check_formats(a)
        async with self._assign_lock:
            if self.engine is not None and self.engine.assignment == a:
                return self.engine
            model_dir = await self._model_dir_for(a)
            old = self.engine
            if old is not None and self._same_weights(old.assignment, a) and old.shard_dir == model_dir:
                async with self._step_lock:  # no step of the old engine is computing into the pool
                    self._end_sessions(old, "the stage was re-assigned")
                    self.engine = self._new_engine(a, old.shard, old.pool, old.kv, model_dir)
                await self._close_links(old)
                self._wake.set()
                log.info("re-assigned as stage %d/%d of plan generation %d, keeping layers [%d, %d)",
                         a.stage_index, a.num_stages, a.generation, a.start, a.end)
                return self.engine
            before = self.state
            self.state = NodeState.LOADING
            try:
                shard, pool = await self.runner.call(self._load, a, model_dir)
            except Exception as exc:  # noqa: BLE001 — whatever broke, the assignment in force stays
                self.state = before
                keeps = "it keeps its previous assignment" if self.engine else "it stays unassigned"
                raise FailedPrecondition(f"node {self.node_id} could not load layers [{a.start}, {a.end}) of "
                                         f"{a.model_dir[:200]}: {str(exc).splitlines()[0][:300]}; {keeps}") from exc
            async with self._step_lock:
                old, self.engine = self.engine, self._new_engine(a, shard, pool, None, model_dir)
                if old is not None:
                    self._end_sessions(old, "the stage was re-assigned")
            if old is not None:
                await self._close_links(old)
            self.state = NodeState.READY
            self._wake.set()
            if a.last:
                await self._load_draft_model(shard.config.vocab_size)
            log.info("assigned layers [%d, %d) of %s as stage %d/%d (%d parameters, %d KV blocks of %d)",
                     a.start, a.end, model_dir, a.stage_index, a.num_stages, shard.parameter_count,
                     pool.num_blocks, pool.block_size)
            return self.engine

    async def _load_draft_model(self, vocab_size: int) -> None:
        """Last stage with --draft-model: load it once. A draft model that cannot serve this model
        (unreadable, another vocabulary) is logged, and prompt lookup drafts instead."""
        from logicpipe.stage_node.draft_model import DraftModel, DraftModelError

        opts = self.options
        if not opts.draft_model or (self.draft_model is not None and self.draft_model.vocab_size == vocab_size):
            return
        try:
            dtype = self.engine.assignment.dtype if self.engine is not None else "float32"
            model = await self.runner.call(DraftModel, opts.draft_model, layers=opts.draft_layers, device=self.device,
                                           dtype=dtype)
            if model.vocab_size != vocab_size:
                raise DraftModelError(f"the draft model at {opts.draft_model} has a {model.vocab_size}-token "
                                      f"vocabulary, the model {vocab_size}: it needs the same tokenizer")
        except DraftModelError as exc:
            log.error("%s; drafting candidates by prompt lookup instead", exc)
            self.draft_model, self.drafter = None, f"prompt lookup ({exc})"
            return
        self.draft_model, self.drafter = model, model.describe()
        log.info("drafting candidates with the draft %s", self.drafter)

    @staticmethod
    def _same_weights(old: Assignment, new: Assignment) -> bool:
        return (old.model_dir, old.model_digest, old.start, old.end, old.num_layers, old.dtype) == \
            (new.model_dir, new.model_digest, new.start, new.end, new.num_layers, new.dtype)

    async def _model_dir_for(self, a: Assignment) -> str:
        """The directory to load `a` from: the assigned model directory when this node has it (and
        its digest matches), else the tensors pulled from the controller into the state directory."""
        local = self.local_model_dir or a.model_dir
        if not self.local_model_dir and not self._under_model_root(a.model_dir):
            if a.controller_address and a.model_digest and self.pull_root is not None:
                return await self._pull(a)  # never opened: the node takes the tensors from the controller
            raise InvalidArgument(f"node {self.node_id} loads models only from under its --model-root "
                                  f"{self.options.model_root}; {a.model_dir[:200]} is not")
        try:
            config = await asyncio.to_thread(ModelConfig.from_dir, local)
        except (ModelError, OSError) as exc:
            if a.controller_address and a.model_digest and self.pull_root is not None:
                return await self._pull(a)
            if isinstance(exc, ModelError):
                raise FailedPrecondition(f"node {self.node_id}: {exc}") from exc
            raise FailedPrecondition(f"node {self.node_id} cannot read the model directory "
                                     f"{local[:200]}: {exc.strerror or exc}") from exc
        if config.num_layers != a.num_layers:
            raise InvalidArgument(f"the model at {local} has {config.num_layers} layers, not {a.num_layers}")
        if a.model_digest:
            try:
                mine = await asyncio.to_thread(model_digest, local)
            except ModelError as exc:
                raise FailedPrecondition(f"node {self.node_id}: {exc}") from exc
            if mine != a.model_digest:
                if a.controller_address and self.pull_root is not None:
                    log.warning("the model at %s differs from the controller's (digest %s != %s): pulling its "
                                "layers instead", local, mine, a.model_digest)
                    return await self._pull(a)
                raise FailedPrecondition(
                    f"node {self.node_id}: the model at {local} differs from the controller's "
                    f"(digest {mine} != {a.model_digest}); copy the same model here")
        return local

    def _under_model_root(self, path: str) -> bool:
        """Whether `path` lies under --model-root (symlinks resolved; no root: anywhere)."""
        import os

        root = self.options.model_root
        if not root:
            return True
        real, base = os.path.realpath(path), os.path.realpath(root)
        return real == base or real.startswith(base.rstrip(os.sep) + os.sep)

    async def _pull(self, a: Assignment) -> str:
        """Pull the assignment's tensors (those not cached yet) from the controller."""
        from logicpipe.stage_node.weight_cache import pull_assignment

        before = self.state
        self.state = NodeState.LOADING
        try:
            result = await pull_assignment(self.transport, a.controller_address, a.model_digest, a.start, a.end, a.num_layers,
                                           self.pull_root)
        except MeshError:
            self.state = before
            raise
        except Exception as exc:  # noqa: BLE001
            self.state = before
            raise Unavailable(f"node {self.node_id} could not pull layers [{a.start}, {a.end}) from the "
                              f"controller at {a.controller_address}: {exc}") from exc
        self.state = before
        self.weights_pulled_bytes += result.pulled_bytes
        return str(result.path)

    def _check_formats(self, a: Assignment) -> None:
        """Refuse an assignment in a format or dtype this node does not offer (its --quantize,
        --dtype and device), saying what it runs."""
        from logicpipe.stage_node.profile import DTYPE_FORMAT

        q = self.options.quantize
        if a.weight_format and a.weight_format != (q if q != "none" else DTYPE_FORMAT[a.dtype]):
            runs = f"--quantize {q}" if q != "none" else f"{DTYPE_FORMAT[a.dtype]} for dtype {a.dtype}"
            raise InvalidArgument(f"node {self.node_id} runs its layers in {runs}; the plan asked for "
                                  f"{a.weight_format} (start the node with the format the mesh should use)")
        if self.options.dtype != "auto" and a.dtype != self.options.dtype:
            raise InvalidArgument(f"node {self.node_id} computes in {self.options.dtype} (--dtype); the plan asked "
                                  f"for {a.dtype}")

    def _load(self, a: Assignment, model_dir: str) -> tuple[Shard, KVPool]:
        """Runner thread: the shard's weights and an empty KV pool sized by --max-kv-mib."""
        import torch

        from logicpipe.stage_node.profile import DTYPE_FORMAT, float_formats

        if DTYPE_FORMAT[a.dtype] not in float_formats(self.device):
            raise ValueError(f"this {self.device} cannot compute in {a.dtype} (it has {', '.join(float_formats(self.device))})")
        dtype = getattr(torch, a.dtype)
        shard = Shard.load(model_dir, a.start, a.end, first=a.first, last=a.last, device=self.device, dtype=dtype,
                           quantize=self.options.quantize)
        bs = self.options.block_size
        block_bytes = bs * kv_bytes_per_token(shard.config, a.end - a.start, dtype)
        num_blocks = self.options.max_kv_bytes // block_bytes
        if num_blocks < 1:
            raise ValueError(f"a KV budget of {self.options.max_kv_bytes} bytes holds no block of {block_bytes}")
        pool = shard.new_pool(num_blocks, bs)
        if shard.device.type == "cuda" and self.options.cuda_graphs:
            shard.graphs = StepGraphs(shard, pool)
        return shard, pool

    def _new_engine(self, a: Assignment, shard: Shard, pool: KVPool, kv: KVManager | None, shard_dir: str) -> Engine:
        """An engine for `a`; `kv` (kept from the previous engine, its sequences closed first) keeps
        the prefix cache."""
        kv = kv or KVManager(pool.num_blocks, pool.block_size)
        scheduler = Scheduler(kv, first=a.first, last=a.last, node_id=self.node_id, budget=self.options.budget,
                              micro_batches=a.micro_batches or a.num_stages, is_orphaned=self._orphaned)
        eng = Engine(a, shard, pool, kv, scheduler, shard_dir=shard_dir)
        if not a.last:
            eng.next_link = PeerLink(a.next_address, self.transport, self._on_peer_reply, self._on_link_down,
                                     name=f"stage {a.stage_index + 1}")
        if a.last and not a.first:
            eng.first_link = PeerLink(a.first_address, self.transport, self._on_peer_reply, self._on_link_down, name="stage 0")
        return eng

    def _end_sessions(self, eng: Engine, why: str) -> None:
        """Close every sequence of `eng` (their owners are told)."""
        err = Unavailable(f"node {self.node_id}: {why}")
        for s in eng.scheduler.close_all():
            self.events.emit(s.spec.owner, [wire.error_event(s.id, err, self.node_id)])

    async def _close_links(self, eng: Engine) -> None:
        """Close `eng`'s links (bounded: a stalled peer must not hold up a re-assignment)."""
        for link in (eng.next_link, eng.first_link):
            if link is not None:
                try:
                    await asyncio.wait_for(link.close(), LINK_CLOSE_S)
                except asyncio.TimeoutError:
                    log.warning("closing the link to %s took over %.0f s; left behind", link.address, LINK_CLOSE_S)

    async def _drop_engine(self, eng: Engine, why: str) -> None:
        self._end_sessions(eng, why)
        await self._close_links(eng)

    def require_ready(self) -> Engine:
        if self.engine is None:
            raise FailedPrecondition(
                f"node {self.node_id} has no layer assignment yet ({self.state.value}); "
                "the controller assigns layers when it starts (logicpipe-controller --nodes ...)")
        return self.engine

    # ---- sessions --------------------------------------------------------------------------
    def open_session(self, req: stage_pb2.OpenSessionRequest) -> int:
        """Admit a sequence; returns the leading positions it already holds (prefix cache, parent)."""
        eng = self.require_ready()
        cfg = eng.shard.config
        spec: SeqSpec = wire.spec_from_proto(req, context=cfg.max_position_embeddings, vocab_size=cfg.vocab_size)
        _, cached = eng.scheduler.admit(spec)
        return cached

    def close_session(self, session_id: str) -> int:
        if self.engine is None:
            raise FailedPrecondition(f"node {self.node_id} has no layer assignment yet ({self.state.value}); "
                                     "it holds no sessions")
        sched = self.engine.scheduler
        if session_id not in sched.seqs:
            raise NotFound(f"session {session_id[:MAX_ID_CHARS]} is not open on node {self.node_id}")
        held = self.engine.kv.tables[session_id].length
        sched.close(session_id)
        self._wake.set()  # a micro-batch slot or blocks may have freed
        return held

    def _orphaned(self, s: Sequence) -> bool:
        return bool(s.spec.owner) and not self.events.listening(s.spec.owner)

    # ---- input -----------------------------------------------------------------------------
    def receive(self, batch: stage_pb2.StepBatch) -> list[tuple[str, MeshError]]:
        """A Stream message: feeds into stage 0, a computed step into a later stage. Raises
        InvalidArgument for a malformed message; returns the sequences rejected at once."""
        eng = self.require_ready()
        a, cfg = eng.assignment, eng.shard.config
        if a.first:
            works = wire.works_from_proto(batch, vocab_size=cfg.vocab_size)
        else:
            msg = wire.step_from_proto(batch, vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                                       stage_index=a.stage_index)
            works = list(msg.seqs)
        if batch.generation and a.generation and batch.generation != a.generation:
            err = FailedPrecondition(f"node {self.node_id} serves plan generation {a.generation}; a step of "
                                     f"generation {batch.generation} is stale")
            rejected = [(w.session_id, err) for w in works]
            self._report([Failure(w.session_id, eng.scheduler.owner_of(w.session_id), err) for w in works])
            return rejected
        rejected = []
        if a.first:
            for w in works:
                try:
                    eng.scheduler.feed(w)
                except MeshError as err:
                    rejected.append((w.session_id, err))
            self._report([Failure(sid, eng.scheduler.owner_of(sid), err) for sid, err in rejected])
        else:
            eng.scheduler.enqueue(msg)
        self._wake.set()
        return rejected

    # ---- the step loop ---------------------------------------------------------------------
    async def _loop(self) -> None:
        while True:
            eng = self.engine
            step = None
            if eng is not None:
                try:
                    step, failures = eng.scheduler.schedule()
                except Exception:  # noqa: BLE001 — a bookkeeping bug must not stop the node
                    log.exception("scheduling failed; its sequences are failed")
                    failures = self._fail_all_pending(eng)
                self._report(failures)
            if step is None:
                self._wake.clear()
                try:  # woken by new work; the timeout re-checks stale in-flight steps and gone owners
                    await asyncio.wait_for(self._wake.wait(), IDLE_RECHECK_S)
                except asyncio.TimeoutError:
                    pass
                continue
            t0 = time.perf_counter()
            async with self._step_lock:
                if eng is not self.engine:  # re-assigned since it was scheduled: drop the step
                    continue
                try:
                    result = await self.runner.call(execute, eng.shard, eng.pool, step, eng.assignment.wire_dtype)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # noqa: BLE001 — a bad step must not stop the node
                    log.exception("step failed")
                    result = StepResult(failed={p.seq.id: MeshError(f"node {self.node_id}: step failed: {exc}")
                                                for p in step.seqs})
            self.compute_s += time.perf_counter() - t0
            if eng is not self.engine:
                continue
            try:
                feeds = self._postprocess(eng, step, result)
                if feeds:
                    await self._send_feeds(eng, *feeds)
            except Exception:  # noqa: BLE001
                log.exception("postprocessing a step failed; its sequences are failed")
                self._report([Failure(p.seq.id, p.seq.spec.owner, MeshError(f"node {self.node_id}: internal error"),
                                      closed=True) for p in step.seqs if self._close_quietly(eng, p.seq.id)])

    def _close_quietly(self, eng: Engine, session_id: str) -> bool:
        if session_id in eng.scheduler.seqs:
            eng.scheduler.close(session_id)
            return True
        return False

    def _fail_all_pending(self, eng: Engine) -> list[Failure]:
        """After a scheduling error: close every sequence with pending work (their owners replay)."""
        out = []
        for s in [s for s in eng.scheduler.seqs.values() if s.pending]:
            eng.scheduler.close(s.id)
            out.append(Failure(s.id, s.spec.owner, MeshError(f"node {self.node_id}: internal error"), closed=True))
        eng.scheduler.inbox.clear()
        return out

    def _postprocess(self, eng: Engine, step: Step, result: StepResult):
        """Commit the step; pass its hidden states on, or (last stage) report its tokens and return
        the feeds for stage 0 with the draft-model jobs they wait for."""
        sched = eng.scheduler
        # a sequence that failed here is closed here: its KV and input state end with it, and its
        # owner (told below) closes it everywhere, or replays it
        self._report([Failure(sid, sched.owner_of(sid), err, closed=self._close_quietly(eng, sid))
                      for sid, err in result.failed.items()])
        done = sched.complete(step, set(result.failed))
        self.steps += 1
        self.rows += step.rows
        self.seq_rows += len(step.seqs)
        self.max_step_seqs = max(self.max_step_seqs, len(step.seqs))
        gen = eng.assignment.generation
        if not eng.assignment.last:
            if done:
                ids = [p.seq.id for p in done]
                hidden = result.hidden
                if ids != result.ok:  # some closed while they computed: their rows stay behind
                    computed, spans, row = set(result.ok), {}, 0
                    for q in step.seqs:
                        if q.seq.id in computed:
                            spans[q.seq.id] = (row, row + q.work.num_tokens)
                            row += q.work.num_tokens
                    hidden = wire.keep_rows(hidden, [spans[i] for i in ids])
                eng.next_link.send(wire.step_batch([p.work for p in done], gen, hidden))
            return None
        by_owner: dict[str, list[stage_pb2.Event]] = defaultdict(list)
        feeds: list[SeqWork] = []
        offers: list[tuple[int, Sequence, int, list[int] | None]] = []  # (feed index, seq, available, lookup's)
        for p in done:
            if not p.work.sample or p.seq.id not in result.tokens:
                continue
            index = p.seq.generated
            out = result.tokens[p.seq.id]
            tokens, reason = sched.finish(p, out)
            k = p.work.num_candidates
            self.sampled_steps += 1
            self.sampled_tokens += len(tokens)
            self.candidates_verified += k
            self.candidates_accepted += len(tokens) - 1 if k else 0  # as the owner counts: up to a stop
            by_owner[p.seq.spec.owner].append(wire.token_event(p.seq.id, tokens, index, reason, k))
            if not self._orphaned(p.seq):  # finished: stage 0 is told, so it stops waiting for it
                pos = p.work.stop - k + len(tokens) - 1
                if not reason and p.seq.spec.speculate:  # nothing cut: `tokens` is `out`
                    offers.append((len(feeds), p.seq, *self._offer(eng, p, out, pos)))
                feeds.append(SeqWork(p.seq.id, pos, (tokens[-1],), finished=bool(reason)))
        for owner, events in by_owner.items():  # queued before the feed is sent: token order holds
            self.events.emit(owner, events)
        # the sequences sampled together go back together and share stage 0's next step: their
        # candidates are handed out for that step as a whole
        jobs: list[tuple[int, str, list[int], int]] = []  # (feed index, session, context, k): the draft model's
        counts = allocate([s.draft.acceptance for _, s, _, _ in offers], [n for _, _, n, _ in offers])
        for (i, s, _, proposal), k in zip(offers, counts):
            if not k:
                continue
            if proposal is None:
                jobs.append((i, s.id, list(s.draft.context), k))
            else:
                w = feeds[i]
                feeds[i] = SeqWork(w.session_id, w.start_pos, (*w.token_ids, *proposal[:k]), num_candidates=k)
        return (feeds, jobs) if feeds else None

    async def _send_feeds(self, eng: Engine, feeds: list[SeqWork], jobs) -> None:
        """Last stage: the draft model's candidates first (if any), then the feeds to stage 0."""
        if jobs and self.draft_model is not None:
            model = self.draft_model
            try:
                drafts = await self.runner.call(lambda: [model.propose(sid, ctx, k) for _, sid, ctx, k in jobs])
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 — a drafting failure costs the candidates, never the tokens
                log.warning("the draft model failed (%s); these tokens go on without candidates", exc)
                drafts = [[] for _ in jobs]
            for (i, _, _, _), d in zip(jobs, drafts):
                w = feeds[i]
                feeds[i] = SeqWork(w.session_id, w.start_pos, (*w.token_ids, *d), num_candidates=len(d))
            if eng is not self.engine:
                return
        sched, gen = eng.scheduler, eng.assignment.generation
        if eng.first_link is None:  # one stage: first and last
            for w in feeds:
                try:
                    sched.feed(w)
                except MeshError as err:
                    self._report([Failure(w.session_id, sched.owner_of(w.session_id), err)])
        elif feeds:
            eng.first_link.send(wire.step_batch(feeds, gen))

    def _offer(self, eng: Engine, p, out: list[int], pos: int) -> tuple[int, list[int] | None]:
        """Last stage, a speculating sequence that goes on: record how its candidates fared, and
        offer candidates for the positions after `out` (the step's accepted candidates and its
        sampled token, whose last goes at `pos`) -> (how many it may send, prompt lookup's
        proposal; None: the draft model drafts them)."""
        s = p.seq
        k = p.work.num_candidates
        if s.draft is None:  # its context: what the KV holds before this step's candidates, then `out`
            s.draft = Drafter(eng.kv.tables[s.id].tokens[:p.work.stop - k], s.spec.speculate)
        s.draft.observe(k, len(out) - 1, out)
        limit = min(s.spec.max_new_tokens - s.generated - 1, s.spec.capacity - pos - 1)
        n = s.draft.budget(limit) if limit > 0 else 0
        if self.draft_model is not None:
            return n, None
        proposal = s.draft.lookup.propose(n)
        return len(proposal), proposal

    def _report(self, failures: list[Failure]) -> None:
        by_owner: dict[str, list[stage_pb2.Event]] = defaultdict(list)
        for f in failures:
            by_owner[f.owner].append(wire.error_event(f.session_id, f.error, self.node_id))
        for owner, events in by_owner.items():
            self.events.emit(owner, events)
        if failures:
            self._wake.set()

    def _on_peer_reply(self, reply: stage_pb2.StreamReply) -> None:
        log.debug("peer rejected session %s: %s", reply.session_id, reply.message)

    def _on_link_down(self, session_ids: list[str], reason: str) -> None:
        eng = self.engine
        if eng is None:
            return
        err = Unavailable(f"node {self.node_id}: {reason}")
        self._report([Failure(sid, eng.scheduler.owner_of(sid), err) for sid in session_ids])

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
            self.sessions_expired += len(expired)
            log.info("freed %d sessions whose owner was gone for %.0f s", len(expired), ttl)
            self._wake.set()
        return expired

    def orphaned_sessions(self) -> int:
        return 0 if self.engine is None else sum(1 for s in self.engine.scheduler.seqs.values() if self._orphaned(s))
