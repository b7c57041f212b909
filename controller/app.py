"""The controller's mesh: the model, the nodes, the plan in force and the requests on it. The app
owns the mesh state (controller.state) and re-plans when membership changes (a node joins, is
drained, leaves, dies, comes back): running requests move to the new plan by replaying their
tokens, so none is lost and greedy output does not change."""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from logicpipe.common.discovery import Browser
from logicpipe.common.modeldir import ModelConfig, model_digest
from logicpipe.common.security.revocations import Revocations
from logicpipe.common.transport import Transport
from logicpipe.controller import planning
from logicpipe.controller.journal import Journal
from logicpipe.controller.membership import NOT_PROBED, Members
from logicpipe.controller.pipeline import Pipeline, StageAssignment
from logicpipe.controller.pipelines import PipelineSet
from logicpipe.controller.scheduler import DEFAULT_SPECULATE, WAIT_FOR_NODES_S, RequestStats, Scheduler, SchedulerConfig
from logicpipe.controller.state import MeshState, Phase
from logicpipe.controller.text import load_tokenizer
from logicpipe.errors import FailedPrecondition, Fenced, InvalidArgument, MeshError, NotFound, Unavailable
from logicpipe.planner import Link, Workload
from logicpipe.v1 import stage_pb2

log = logging.getLogger(__name__)

DEBOUNCE_S = 0.3        # changes this close together make one re-plan (a burst: until it is quiet this long ...)
MAX_DEBOUNCE_S = 2.0    # ... or this long after its first change)
HOLD_S = 10.0           # a plan that still serves is replaced for a better one (a node back, a join) only once
                        # the last plan has served this long: in a storm of faults, running requests move once
                        # per fault, not again for every node that comes back
RETRY_S = 1.0           # a re-plan that failed is tried again after this
CLOSE_WAIT_S = 2.0      # a re-plan waits this long for the moved sessions to close on the old stages
PUSH_TIMEOUT_S = 5.0    # a node that does not take the revocation list this fast gets it with its next Assign


@dataclass(frozen=True)
class ControllerOptions:
    """How the controller plans and serves (logicpipe-controller's flags)."""

    dtype: str = "float32"            # compute dtype on the stages (a stage without it computes in float32)
    plan_path: str | None = None      # plan artifact to reuse while it matches, and to write the plan to
    strategy: str = "dp"              # partition strategy: dp | uniform | memory | compute | mixed
    objective: str = "throughput"     # throughput | latency
    context: int = 2048               # tokens of context per sequence the plan reserves KV for
    micro_batches: int = 0            # micro-batches in flight (0: one per distinct compute device)
    address: str = ""                 # host:port the stages reach the controller at (weights, Leave)
    settle_s: float = 2.0             # the first plan waits this long after the first node for others, s
    replan_gain: float = 0.10         # a join re-plans only when the new plan's step cost is this much lower
    wait_for_nodes_s: float = WAIT_FOR_NODES_S  # a queued request waits this long while no plan fits, s
    mdns: bool = False                # browse mDNS for nodes (else only --nodes and Register)
    mesh: str = "default"             # ... of this mesh name
    speculate: int = DEFAULT_SPECULATE  # candidate tokens per step unless a request says
    prefill_chunk: int = 0            # prompt tokens per step (0: the cost model's choice)
    replicas: int = 0                 # pipelines at most (0: auto, the planner's choice; 1: one pipeline over
                                      # the nodes, planned by the bottleneck DP as before replicas)


@dataclass(frozen=True)
class StageView:
    """A stage of the plan in force, as Status and the first reply of a request show it."""

    node_id: str
    address: str
    start: int
    end: int  # exclusive
    device: str
    parameter_count: int
    pipeline: int = 0  # the pipeline (replica) it belongs to, 0-based in the plan's order


@dataclass(frozen=True)
class ControllerSnapshot:
    """The controller at one moment, for Status, `lpctl status` and /metrics."""

    model_dir: str
    phase: Phase
    reason: str                 # why it is not ready ("" when it is)
    plan_id: str
    plan_generation: int
    plan_json: str
    micro_batches: int          # the most any pipeline has
    speculate: int
    running: int
    queued: int
    stats: RequestStats
    stages: list[StageView] = field(default_factory=list)
    last_replan: str = ""
    last_replan_s: float = 0.0
    replans: int = 0
    links: dict = field(default_factory=dict)  # links[a][b]: planner.Link measured from node a to b
    role: str = "active"        # "active" | "standby"
    epoch: int = 0              # the fencing epoch it holds (active) or last saw (standby)
    active: str = ""            # a standby: the active controller it follows
    journaled: int = 0          # requests in the journal
    pipelines: list = field(default_factory=list)  # PipelineView per pipeline in force


@dataclass(frozen=True)
class PipelineView:
    """A pipeline (replica) of the plan in force, as Status, `lpctl status` and /metrics show it."""

    index: int
    plan_id: str
    generation: int
    micro_batches: int
    running: int               # requests on it now
    predicted_tokens_per_s: float  # the planner's decode tokens/s for it at the workload (0: not predicted)
    serving: bool              # it takes requests (no stage down)


class ControllerApp:
    def __init__(self, model_dir: str | Path, nodes: list[str], *, transport: Transport,
                 revocations: Revocations | None = None, options: ControllerOptions = ControllerOptions(),
                 journal: Journal | None = None):
        self.model_dir = Path(model_dir).resolve()
        self.nodes = list(nodes)    # --nodes: always members
        self.options = options
        self.transport = transport  # the process's: channels to the stages
        self.revocations = revocations if revocations is not None else Revocations()  # never planned with
        self.config = ModelConfig.from_dir(self.model_dir)
        self.digest = model_digest(self.model_dir)
        self.tokenizer = load_tokenizer(self.model_dir)
        # every admitted request, durably (None: in memory only); opened (locked, read) by the caller
        self.journal = journal if journal is not None else Journal(None, self.digest)
        self.role = "active"   # "standby": it follows another controller's journal (controller.standby)
        self.active_peer = ""  # a standby: the active controller's address
        self.fenced = ""       # why a stage refused us for a newer controller ("" : not refused)
        self.on_step_down: list = []  # callbacks run once when fenced (main: stop the process)
        self.num_layers = self.config.num_layers
        self.spec = planning.model_spec(self.config, self.model_dir.name, self.digest, options.dtype)
        self.workload = Workload(context_tokens=min(options.context, self.config.max_position_embeddings))
        self.plan = None            # planner.MeshPlan in force: its pipelines, in the order of self.pipelines.all
        self.plan_json = ""
        self.profiles: list = []
        self.links: dict[str, dict[str, Link]] = {}  # links[a][b], measured once per pair of node ids
        self.state = MeshState()    # its one owner: set here only
        # membership alone decides whether a node is alive; the pipelines report hints (_on_stage_lost)
        self.pipelines = PipelineSet(transport, self._on_event, self._on_stage_lost, why_down=self._why_down)
        self.pipelines.revoked = list(self.revocations)  # every Assign carries them
        self.chunks = planning.PrefillChunks(options.prefill_chunk)
        self.scheduler = Scheduler(
            self.pipelines, self.state,
            SchedulerConfig(self.config.max_position_embeddings, frozenset(self.config.eos_token_ids),
                            self.config.vocab_size, options.speculate, options.wait_for_nodes_s),
            prefill_chunk=self.prefill_chunk_for, on_trouble=lambda why: self.request_replan(f"a stage fault: {why}"),
            journal=self.journal, on_fenced=self.on_fenced)
        self.members = Members(self.pipelines.probe, self.request_replan)
        self.last_replan, self.last_replan_s, self.replans = "", 0.0, 0
        self.plan_changed = asyncio.Event()  # set (and replaced) each time a plan is installed or given up
        self._reasons: list[str] = []
        self._since = 0.0
        self._trigger = asyncio.Event()
        self._replanner: asyncio.Task | None = None
        self._plan_lock = asyncio.Lock()  # one re-plan at a time (the loop's, a drain's, a leave's)
        self._tasks: set[asyncio.Task] = set()
        self._browser: Browser | None = None
        self._installed_at = 0.0      # when the plan in force was installed (monotonic)
        self._now = False             # the re-plan in progress was asked for by an operator (drain, revoke, leave)
        self._recheck: asyncio.TimerHandle | None = None

    def prefill_chunk_for(self, prompt_tokens: int, pipeline: Pipeline) -> int:
        """Prompt rows per step on `pipeline`'s stage 0 for a prompt of this many tokens
        (planning.PrefillChunks)."""
        return self.chunks.choose(prompt_tokens, pipeline.generation, pipeline.plan, self.profiles, self.spec)

    def stage_views(self, pipeline: Pipeline | None = None) -> list[StageView]:
        """The stages of every pipeline (or of `pipeline`), pipeline by pipeline."""
        return [StageView(h.node_id, h.address, h.start, h.end, h.device, h.parameter_count, p.index)
                for p in ([pipeline] if pipeline else self.pipelines.all) for h in p.stages]

    def pipeline_views(self) -> list[PipelineView]:
        serving = self.pipelines.serving()
        return [PipelineView(p.index, p.plan_id, p.generation, p.micro_batches, self.scheduler.load(p), p.tokens_per_s,
                             p in serving) for p in self.pipelines.all]

    def snapshot(self) -> ControllerSnapshot:
        sched = self.scheduler
        return ControllerSnapshot(
            model_dir=str(self.model_dir), phase=self.state.phase, reason=self.state.reason,
            plan_id=self.pipelines.plan_id, plan_generation=self.pipelines.generation, plan_json=self.plan_json,
            micro_batches=self.pipelines.micro_batches, speculate=sched.config.speculate, running=sched.running,
            queued=len(sched.waiting), stats=replace(sched.stats), stages=self.stage_views(),
            last_replan=self.last_replan, last_replan_s=self.last_replan_s, replans=self.replans,
            links={a: dict(b) for a, b in self.links.items()}, role=self.role,
            epoch=self.pipelines.epoch or self.journal.epoch, active=self.active_peer,
            journaled=len(self.journal.entries), pipelines=self.pipeline_views())

    # ---- membership ---------------------------------------------------------------------------
    def request_replan(self, why: str) -> None:
        """Something changed, or may have: plan again soon (a plan that still serves is kept)."""
        if not self._reasons:
            self._since = time.monotonic()
        self._reasons.append(why)
        self._trigger.set()

    def _later(self, delay: float, why: str) -> None:
        """Plan again after `delay` s (once, however often asked meanwhile)."""
        if self._recheck is None or self._recheck.cancelled() or self._recheck.when() < asyncio.get_running_loop().time():
            self._recheck = asyncio.get_running_loop().call_later(max(0.1, delay), self.request_replan, why)

    def _on_event(self, ev) -> None:
        self.scheduler.on_event(ev)

    def _on_stage_lost(self, address: str, reason: str) -> None:
        """A pipeline's hint about one of its stages (no answer to its probes, its event stream
        ended, it serves another plan): membership takes the node as down (it alone brings it
        back, when its own probe is answered), and the broken pipeline is re-planned."""
        self.state.set(Phase.DEGRADED, f"stage {address} is down ({reason}); re-planning")
        self.members.mark_down(address, reason)
        self.request_replan(f"stage {address} lost: {reason}")

    def _why_down(self, address: str) -> str:
        """Membership's word on the node at `address`: why it cannot serve ("" when it can)."""
        m = self.members.by_address.get(address)
        return m.why_not() if m is not None else ""

    def not_serving(self) -> str:
        """Why this controller takes no requests now ("" when it does)."""
        if self.fenced:
            return f"this controller was replaced by a newer one ({self.fenced}); use the other controller"
        if self.role == "standby":
            return ("standby: this controller is the standby; the active controller is "
                    + (self.active_peer or "not known yet (a takeover may be under way)"))
        return ""

    def on_fenced(self, why: str) -> None:
        """A stage follows a newer controller (a standby took over): step down. Requests are not
        failed here; the process stops (controller.main exits with EXIT_FENCED and its service
        manager starts it again, as the standby of the new active)."""
        if self.fenced:
            return
        self.fenced = why
        log.error("another controller took over the mesh (%s); stepping down", why)
        self.state.set(Phase.WAITING, f"replaced by a newer controller: {why}")
        for cb in self.on_step_down:
            cb()

    def take_journal(self) -> int:
        """Become the active controller over the journal, in one step of the loop (a client that
        resumes never finds this controller active without its requests): a fencing epoch above
        the last one, on disk before any stage sees it, and every journaled request restored to
        run again from its tokens. Returns how many."""
        epoch = self.journal.epoch + 1
        self.journal.set_epoch(epoch)
        self.journal.flush()
        self.pipelines.epoch = epoch
        restored = self.scheduler.restore(list(self.journal.entries.values()))
        self.role, self.active_peer = "active", ""
        if restored:
            log.info("resuming %d journaled requests (fencing epoch %d)", restored, epoch)
        return restored

    async def start(self, mdns_interface: str | None = None, *, nodes: dict[str, str] | None = None) -> None:
        """Take the mesh as the active controller: a fencing epoch above any before it (the stages
        refuse older controllers from then on), the journal's requests restored to run again from
        their tokens; then know the --nodes (and `nodes`: a plan's, from the controller taken over
        from), browse mDNS, and plan as nodes come (the first plan waits settle_s after the first
        node for the others)."""
        if self.role != "active" or not self.pipelines.epoch:
            self.take_journal()
        self.journal.start()
        for a in (nodes or {}).values():
            self.members.add(a, "static")
        for a in self.nodes:
            self.members.add(a, "static")
        self.members.start()
        if self.options.mdns:
            self._browser = Browser(lambda ad: self.members.add(ad.address, "mdns"),
                                    lambda node_id: self.members.gone(node_id, "its mDNS record was withdrawn"),
                                    interface=mdns_interface, mesh=self.options.mesh)
            await self._browser.start()
        self._replanner = asyncio.create_task(self._replan_loop(), name="replanner")

    async def wait_ready(self, timeout: float) -> bool:
        """Until a plan serves (or `timeout` s)."""
        deadline = time.monotonic() + timeout
        while not self.state.admitting and time.monotonic() < deadline:
            try:
                await asyncio.wait_for(self.plan_changed.wait(), max(0.01, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                break
        return self.state.admitting

    # ---- planning -----------------------------------------------------------------------------
    async def _replan_loop(self) -> None:
        while True:
            await self._trigger.wait()
            first = time.monotonic()
            while True:  # a burst of changes (deaths, restarts, joins) makes one re-plan
                self._trigger.clear()
                await asyncio.sleep(DEBOUNCE_S)
                if not self._trigger.is_set() or time.monotonic() - first >= MAX_DEBOUNCE_S:
                    break
            if self.plan is None:
                await self._settle()
            self._trigger.clear()
            reasons, since, self._reasons = self._reasons, self._since, []
            why = "; ".join(dict.fromkeys(reasons)) or "a check"
            try:
                async with self._plan_lock:
                    await self.replan(why, since)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 — try again: requests are waiting for it
                log.warning("re-plan (%s) failed: %s; trying again in %.0f s", why, exc, RETRY_S,
                            exc_info=not isinstance(exc, MeshError))
                if self._broken():  # no plan serves: requests wait for one, bounded
                    self.state.set(Phase.WAITING, f"re-plan failed: {exc}")
                else:  # the plan in force still serves
                    self.state.set(Phase.READY)
                await asyncio.sleep(RETRY_S)
                self.request_replan(why)

    async def _settle(self) -> None:
        """Before the first plan: until every known node has answered once, and (with mDNS, where
        nodes show up one by one) settle_s after the first trigger, so the first plan sees them all."""
        deadline = self._since + self.options.settle_s
        while time.monotonic() < deadline:
            unprobed = any(m.down == NOT_PROBED for m in self.members.by_address.values())
            if not unprobed and not self.options.mdns and self.members.by_address:
                return
            await asyncio.sleep(0.1)

    def _broken_pipelines(self) -> list[Pipeline]:
        """The pipelines in force that cannot serve: a stage lost or down, or its node drained or leaving."""
        out = []
        for p in self.pipelines.all:
            for h in p.stages:
                m = self.members.by_address.get(h.address)
                if h.lost or (m is not None and not m.usable):
                    out.append(p)
                    break
            else:
                if not p.stages:
                    out.append(p)
        return out

    def _broken(self) -> bool:
        """No pipeline serves: none installed, or every one broken."""
        return not self.pipelines.all or len(self._broken_pipelines()) == len(self.pipelines.all)

    async def replan(self, why: str, since: float | None = None) -> bool:
        """Plan over the usable nodes and install what changes. A pipeline that broke (a node
        lost, drained, leaving) is replaced over the nodes no serving pipeline holds, and only its
        requests move: the other pipelines go on untouched. With nothing broken (a join, a node
        back, the workload changed), a plan over all the nodes replaces the one in force when its
        predicted speed is better by replan_gain (the pipelines it keeps as they are go on
        untouched), else nodes no pipeline uses start pipelines of their own. Returns whether
        anything new was installed."""
        since = since or time.monotonic()
        if self.fenced:
            return False  # stepping down: another controller steers the mesh
        broken = self._broken_pipelines()
        kept = [p for p in self.pipelines.all if p not in broken]
        usable = [m for m in self.members.usable() if m.status is not None and m.node_id not in self.revocations]
        if not usable:
            self._give_up(not kept, "no stage nodes yet" if not self.members.by_address else
                          "no usable stage node (" + "; ".join(f"{m.address}: {m.why_not()}"
                                                               for m in self.members.by_address.values()) + ")")
            return False
        ids = {m.node_id: m.address for m in usable}
        await self._measure_links(ids)
        usable = [m for m in usable if m.usable]  # a node whose links failed is out
        ids = {m.node_id: m.address for m in usable}
        self.profiles = [planning.device_profile(m.status, {b: l for b, l in self.links.get(m.node_id, {}).items() if b in ids},
                                                 self.spec) for m in usable]
        self.workload = self.scheduler.traffic.workload(self.options.context, self.config.max_position_embeddings)
        try:
            mesh = self._choose(kept, broken, why)
        except InvalidArgument as exc:
            self._give_up(not kept, f"no plan fits the {len(usable)} usable node(s): {exc}")
            if kept and broken:  # the others serve on; the broken ones go
                await self._install(planning.evaluate(self._plans(kept), self.profiles, self.spec, self.workload,
                                                      self.options), ids, why, since)
                return True
            return False
        if mesh is None:
            self.state.set(Phase.READY)  # a fault that healed before the re-plan may have paused admission
            return False
        await self._install(mesh, ids, why, since)
        return True

    @staticmethod
    def _plans(pipelines: list[Pipeline]) -> list:
        return [p.plan for p in pipelines if p.plan is not None]

    def _choose(self, kept: list[Pipeline], broken: list[Pipeline], why: str):
        """The planner.MeshPlan to install now, or None to keep the plan in force (see `replan`).
        InvalidArgument when no pipeline fits the nodes it may use."""
        o, spec, workload = self.options, self.spec, self.workload
        if self.plan is None:
            return planning.reuse_or_plan(o.plan_path, self.profiles, spec, workload, o)
        in_use = {s.node_id for p in kept for s in (p.plan.stages if p.plan else ())}
        free = [p for p in self.profiles if p.node_id not in in_use]
        left = o.replicas - len(kept) if o.replicas else 0

        def extra() -> list:
            if not free or (o.replicas and left <= 0):
                return []
            try:
                return list(planning.mesh_for(free, spec, workload, o, replicas=left).pipelines)
            except InvalidArgument:
                if kept:
                    return []  # the free nodes make no pipeline: the kept ones serve on
                raise

        if broken or not kept:
            return planning.evaluate(self._plans(kept) + extra(), self.profiles, spec, workload, o)
        full = planning.mesh_for(self.profiles, spec, workload, o)
        current = planning.evaluate(self._plans(kept), self.profiles, spec, workload, o)
        if planning.same_pipelines(full, current):
            log.info("%s: keeping the plan in force (%s)", why, planning.describe(current))
            return None
        if planning.extends(full, current):
            return full  # only pipelines added: nothing in force moves
        grown = extra()
        if planning.better(full, current, o):
            served = time.monotonic() - self._installed_at
            if self.scheduler.running and served < HOLD_S and not self._now:
                # better, but the plan in force serves and was installed just now: moving its running
                # requests again waits until the mesh has been quiet for a while
                log.info("%s: a better plan (%s vs %s) waits %.1f s more (the plan in force is new)",
                         why, planning.describe(full), planning.describe(current), HOLD_S - served)
                self._later(HOLD_S - served, why)
            else:
                return full
        if grown:
            return planning.evaluate(self._plans(kept) + grown, self.profiles, spec, workload, o)
        log.info("%s: keeping the plan in force (%s; a new one would be %s)", why, planning.describe(current),
                 planning.describe(full))
        return None

    def _give_up(self, broken: bool, why: str) -> None:
        """No plan now: when no pipeline serves, requests wait (bounded) for nodes."""
        if not broken:
            log.info("keeping the plan in force: %s", why)
            self.state.set(Phase.READY)
            return
        log.warning("waiting for nodes: %s", why)
        self.state.set(Phase.WAITING, why)
        for p in self.pipelines.all:
            p.retired = True
        sessions = self.scheduler.detach_all()
        for p in self.pipelines.all:
            for session in sessions:
                p.close_session_soon(session)
        self.plan_changed.set()
        self.plan_changed = asyncio.Event()

    async def _measure_links(self, ids: dict[str, str]) -> None:
        """Measure the ordered pairs of `ids` not measured yet (a join measures its own links only)."""
        pairs = [(a, b) for a in ids for b in ids if a != b and b not in self.links.get(a, {})]
        if not pairs:
            return
        t0 = time.monotonic()
        channels = {nid: self.transport.channel(addr, "stage") for nid, addr in ids.items()}
        try:
            stubs = {nid: self.pipelines.stub(ch) for nid, ch in channels.items()}
            in_plan = {h.node_id for h in self.pipelines.stages}
            measured = await planning.measure_pairs(stubs, ids, pairs, epoch=self.pipelines.epoch,
                                                    owner=self.pipelines.owner)
            for (a, b), link in zip(pairs, measured):
                if not isinstance(link, BaseException):
                    self.links.setdefault(a, {})[b] = link
                    continue
                if Fenced.seen_in(str(link)) and a in in_plan:  # a stage of our plan follows another controller
                    self.on_fenced(str(link))
                    raise link
                newcomer = next((x for x in (a, b) if x not in in_plan), None)
                if newcomer is None:
                    raise link
                self.members.mark_down(ids[newcomer], f"its link {a} -> {b} could not be measured: {link}")
        finally:
            for ch in channels.values():
                await ch.close()
        log.info("measured %d links in %.1f s", len(pairs), time.monotonic() - t0)

    async def _install(self, mesh, ids: dict[str, str], why: str, since: float) -> None:
        """Install `mesh` (a planner.MeshPlan): a pipeline in force that it keeps as it is (the
        same nodes and layers, serving) goes on untouched; the others are retired, their requests
        moved (replayed on the pipelines that serve, new ones included once they are up); the new
        pipelines are assigned and join the set as each is ready."""
        log.info("plan (%s) because %s:\n%s", planning.describe(mesh), why, planning.plan_table(mesh, self.spec))
        broken = self._broken_pipelines()
        current = {planning.pipeline_key(p.plan): p for p in self.pipelines.all
                   if p.plan is not None and p not in broken and not p.retired}
        keep: dict[int, Pipeline] = {}
        for i, plan in enumerate(mesh.pipelines):
            p = current.pop(planning.pipeline_key(plan), None)
            if p is not None:
                keep[i] = p
        dropped = [p for p in self.pipelines.all if p not in keep.values()]
        for p in dropped:
            p.retired = True  # no request opens there from now on
        sessions = self.scheduler.detach(dropped)
        if not keep:
            self.state.set(Phase.REPLANNING if self.plan is not None else Phase.PLANNING,
                           f"installing a new plan ({why})")
        for p in dropped:
            alive = [h for h in p.stages if not h.lost and not self._why_down(h.address)]
            if sessions and alive:  # free them on the old stages still there (else their TTL does)
                try:
                    await asyncio.wait_for(p.close_session_many(sessions, alive), CLOSE_WAIT_S)
                except asyncio.TimeoutError:
                    pass
            await p.close(wait_closes=False)
        self.pipelines.replace(list(keep.values()))  # the kept ones serve on while the new ones load
        for i, p in keep.items():
            p.plan = mesh.pipelines[i]
        fresh = {i: self.pipelines.new() for i in range(len(mesh.pipelines)) if i not in keep}

        async def install(i: int, p: Pipeline) -> None:
            plan = mesh.pipelines[i]
            p.plan = plan
            await p.install(str(self.model_dir), self.digest, self.num_layers,
                            [StageAssignment(ids[s.node_id], s.start, s.end, dtype, fmt, wire, s.node_id)
                             for s, (dtype, fmt, wire) in zip(plan.stages, planning.stage_formats(plan, self.profiles))],
                            self.options.dtype, self.options.micro_batches, controller_address=self.options.address,
                            generation=self.pipelines.next_generation(),
                            planned_micro_batches=0 if planning.classic(self.options) else plan.micro_batches)
            # ready: it takes requests at once (the set keeps the plan's order)
            self.pipelines.replace(sorted([*self.pipelines.all, p], key=lambda x: self._order(mesh, x)))
            self.scheduler.kick()

        results = await asyncio.gather(*(install(i, p) for i, p in fresh.items()), return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        installed = [p for p in self.pipelines.all]
        if failed:
            exc = failed[0]
            if isinstance(exc, MeshError) and Fenced.seen_in(str(exc)):
                self.on_fenced(str(exc))
                raise exc
            for err in failed:
                if isinstance(err, MeshError):
                    for m in self.members.usable():  # the node that failed is left out until it answers again
                        if m.address in str(err):
                            if isinstance(err, (InvalidArgument, FailedPrecondition)):  # not a passing fault
                                self.members.refuse(m.address, f"its assignment failed: {err}")
                            else:
                                self.members.mark_down(m.address, f"its assignment failed: {err}")
            for i, p in fresh.items():
                if p not in installed:
                    await p.close(wait_closes=False)
            self.request_replan(f"the last install did not finish ({exc or type(exc).__name__})")
            if not installed:
                raise exc
        self.plan = planning.evaluate([p.plan for p in installed], self.profiles, self.spec, self.workload, self.options) \
            if failed else mesh
        self.plan_json = planning.to_json(self.plan)
        self._installed_at = time.monotonic()
        self.replans += 1
        self.last_replan, self.last_replan_s = why, time.monotonic() - since
        log.info("plan generation %d serves (%d pipelines: %s) %.1f s after: %s; %d requests replay",
                 self.pipelines.generation, len(installed), ", ".join(str(len(p.stages)) + " stages" for p in installed),
                 self.last_replan_s, why, len(sessions))
        self.state.set(Phase.READY)
        self.plan_changed.set()
        self.plan_changed = asyncio.Event()

    @staticmethod
    def _order(mesh, p: Pipeline) -> int:
        """`p`'s place in `mesh`'s pipelines."""
        key = planning.pipeline_key(p.plan)
        return next((i for i, plan in enumerate(mesh.pipelines) if planning.pipeline_key(plan) == key), len(mesh.pipelines))

    # ---- requests from lpctl ---------------------------------------------------------------------
    async def revoke(self, node_id: str) -> str:
        """Drop a revoked node at once: a new plan without it serves (or none, if none fits: its
        requests then wait), and it is never planned with again."""
        self.revocations.add(node_id)
        self.pipelines.revoked = list(self.revocations)
        told = await self._push_revoked()
        m = self.members.find(node_id)
        if m is None or not any(h.node_id == node_id for h in self.pipelines.stages):
            return f"{node_id} revoked (it was not in the plan); {told}"
        m.drained = True
        await self._replan_now(f"node {node_id} revoked")
        return f"node {node_id} revoked; plan generation {self.pipelines.generation} serves without it; {told}"

    async def _push_revoked(self) -> str:
        """Tell every answering member the revocation list now (the plan's stages get it with each
        Assign too): a revoked controller or stage certificate is refused by the stages
        themselves, not only here. Returns what happened, in words."""
        members = [m for m in self.members.by_address.values() if not m.down and m.node_id not in self.revocations]
        request = stage_pb2.RevokedRequest(names=self.pipelines.revoked, controller_epoch=self.pipelines.epoch,
                                           controller_id=self.pipelines.owner)

        async def push(address: str):
            async with self.transport.channel(address, "stage") as ch:
                return await self.pipelines.stub(ch).Revoked(request, timeout=PUSH_TIMEOUT_S)

        results = await asyncio.gather(*(push(m.address) for m in members), return_exceptions=True)
        failed = [(m, r) for m, r in zip(members, results) if isinstance(r, BaseException)]
        for m, r in failed:
            log.warning("node %s (%s) did not take the revocation list now (it gets it with its next assignment): %s",
                        m.node_id or "?", m.address, getattr(r, "details", lambda: r)())
        return f"{len(members) - len(failed)} of {len(members)} nodes refuse it now"

    async def drain(self, node: str, undrain: bool = False) -> str:
        """Take a node out of planning (its requests move) or let it back in. Answers once the
        plan that follows serves."""
        m = self.members.find(node)
        if m is None:
            raise NotFound(f"no node {node!r} is known; see `lpctl status`")
        if m.drained == (not undrain):
            return f"node {m.node_id or m.address} is already {'drained' if m.drained else 'in planning'}"
        m.drained = not undrain
        why = f"node {m.node_id or m.address} {'undrained' if undrain else 'drained'}"
        unfit = "" if undrain else self._why_no_plan_without(m)
        if unfit:
            m.drained = False
            raise FailedPrecondition(f"no plan fits without node {m.node_id}: {unfit}")
        await self._replan_now(why)
        return why + f"; plan generation {self.pipelines.generation} serves"

    def _why_no_plan_without(self, m) -> str:
        """Why no plan fits the usable nodes (`m` already left out of them); "" when one does."""
        usable = [x for x in self.members.usable() if x.status is not None]
        if not usable:
            return "no other usable node"
        try:
            planning.mesh_for([planning.device_profile(x.status, self.links.get(x.node_id, {}), self.spec) for x in usable],
                              self.spec, self.workload, self.options)
        except (InvalidArgument, Unavailable) as exc:
            return str(exc)
        return ""

    async def leave(self, node_id: str, timeout: float) -> tuple[bool, str]:
        """A node stops: re-plan without it; answers once its requests have moved (or timeout)."""
        m = self.members.find(node_id)
        if m is None:
            return False, f"node {node_id} is not known here"
        m.leaving = True
        if not any(h.address == m.address for h in self.pipelines.stages):
            return True, "it serves no stage of the plan in force"
        try:
            await asyncio.wait_for(self._replan_now(f"node {node_id} is stopping"), timeout)
        except asyncio.TimeoutError:
            return False, f"no new plan within {timeout:.0f} s"
        moved = not any(h.address == m.address for h in self.pipelines.stages)
        return moved, ("its requests moved to plan generation %d" % self.pipelines.generation) if moved else \
            self.state.reason

    async def _replan_now(self, why: str) -> None:
        """Re-plan now and return once the outcome serves (a new plan, or the one kept). The
        re-plan runs on whether or not our caller (an RPC) is cancelled or times out."""
        async def locked() -> None:
            async with self._plan_lock:
                self._now = True
                try:
                    await self.replan(why)
                finally:
                    self._now = False

        task = asyncio.get_running_loop().create_task(locked())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        await asyncio.shield(task)

    def name_taken(self, name: str) -> str:
        """Why a certificate name is in use in this mesh ("" when it is not): a join must not get it."""
        if self.transport.bundle is not None and name == self.transport.bundle.name:
            return "it is this controller's name"
        m = next((m for m in self.members.by_address.values() if m.node_id == name), None)
        if m is not None:
            return f"the node at {m.address} goes by it"
        if any(h.node_id == name for h in self.pipelines.stages):
            return "a stage of the plan goes by it"
        return ""

    async def register(self, address: str, node_id: str) -> tuple[bool, str]:
        other = self.members.owner_of_id(node_id, besides=address)
        if other is not None:
            msg = (f"node id {node_id!r} is already taken by the node at {other.address}; "
                   "give each node a distinct --node-id (or its own --state-dir)")
            log.error("refusing the node at %s: %s", address, msg)
            return False, msg
        self.members.add(address, "registered")
        return True, ""

    async def plan_preview(self, strategy: str, objective: str, boundaries: list[int]) -> tuple[str, str]:
        """The plan in force (strategy "") or the plan another strategy/objective would make now."""
        if not strategy:
            if self.plan is None:
                raise Unavailable(f"no plan is in force yet ({self.state.reason})")
            return self.plan_json, planning.plan_table(self.plan, self.spec)
        if not self.profiles:
            raise Unavailable("the controller has not profiled any node yet")
        options = replace(self.options, strategy=strategy, objective=objective or self.options.objective)
        mesh = planning.mesh_for(self.profiles, self.spec, self.workload, options, boundaries=boundaries)
        return planning.to_json(mesh), planning.plan_table(mesh, self.spec)

    async def close(self) -> None:
        """Fail what is in flight and close every sequence we opened, then the pipeline."""
        if self._replanner is not None:
            self._replanner.cancel()
        for task in self._tasks:
            task.cancel()
        if self._browser is not None:
            await self._browser.close()
        await self.members.close()
        await self.scheduler.shutdown()
        await self.pipelines.close()
        await self.journal.close()
