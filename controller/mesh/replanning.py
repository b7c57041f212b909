"""Re-planning: the planner driven by membership. A change (a node joins, is drained, leaves, dies,
comes back; the traffic changes) asks for a re-plan; a burst of changes makes one. A pipeline that
broke is replaced over the nodes no serving pipeline holds and only its requests move (they replay
their tokens on the pipelines that serve: none is lost, greedy output does not change); with
nothing broken, a better plan (by predicted tokens/s, or in classic mode by its step cost) is
installed only when it gains --replan-gain, and a plan that serves is never replaced for a better
one within HOLD_S of its install, of the last fault or of its moved requests catching up, nor while
they replay (in a storm, nodes that come back join the plan once it is over, rather than moving
every running request again between two faults and throwing away the replays under way)."""
from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc

from logicpipe.controller.mesh import mirrors, planning
from logicpipe.controller.mesh.membership import NOT_PROBED
from logicpipe.controller.mesh.pipeline import Pipeline, StageAssignment
from logicpipe.controller.mesh.state import Phase
from logicpipe.errors import FailedPrecondition, Fenced, InvalidArgument, MeshError
from logicpipe.planner import Link, Workload

if TYPE_CHECKING:
    from logicpipe.controller.app import ControllerApp

log = logging.getLogger(__name__)

DEBOUNCE_S = 0.3        # changes this close together make one re-plan (a burst: until it is quiet this long ...)
MAX_DEBOUNCE_S = 2.0    # ... or this long after its first change)
HOLD_S = 10.0           # a plan that still serves is replaced for a better one (a node back, a join) only once
                        # the last plan has served this long and no node has gone down for this long: in a
                        # storm of faults, running requests move once per fault that breaks their pipeline,
                        # not again for every node that comes back
MAX_HOLD_S = 60.0       # ... and waits for the requests still replaying on the plan in force at most this long
                        # after its install
RETRY_S = 1.0           # a re-plan that failed is tried again after this
CLOSE_WAIT_S = 2.0      # a re-plan waits this long for the moved sessions to close on the old stages
HISTORY = 32            # installed plans kept in `history` (the dashboard's re-plan list)


@dataclass(frozen=True)
class ReplanRecord:
    """One installed plan, as the dashboard lists it."""

    at: float           # when it began serving (time.time(), s)
    generation: int     # its plan generation
    why: str            # what asked for it
    took_s: float       # from the first change to serving, s
    replayed: int       # requests moved onto it
    pipelines: tuple    # per pipeline, its stages: ((node id, first layer, end layer exclusive), ...)


class Replanner:
    """The plan in force (`plan`, a planner.MeshPlan, and its JSON), what it was made from
    (`profiles`, `links`, `workload`), and the loop that makes the next one."""

    def __init__(self, app: ControllerApp):
        self.app = app
        o = app.options
        self.workload = Workload(context_tokens=min(o.context, app.config.max_position_embeddings))
        self.plan = None            # planner.MeshPlan in force: its pipelines, in the order of app.pipelines.all
        self.plan_json = ""
        self.profiles: list = []
        self.links: dict[str, dict[str, Link]] = {}  # links[a][b], measured once per pair of node ids
        self.last_replan, self.last_replan_s, self.replans = "", 0.0, 0
        self.history: deque[ReplanRecord] = deque(maxlen=HISTORY)  # the plans installed, oldest first
        self.plan_changed = asyncio.Event()  # set (and replaced) each time a plan is installed or given up
        self._reasons: list[str] = []
        self._since = 0.0
        self._trigger = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._plan_lock = asyncio.Lock()  # one re-plan at a time (the loop's, a drain's, a leave's)
        self._tasks: set[asyncio.Task] = set()
        self._installed_at = 0.0      # when the plan in force was installed (monotonic)
        self._repaired = False        # the plan chosen last was a repair (a stop-gap: the planner's own follows)
        self._now = False             # the re-plan in progress was asked for by an operator (drain, revoke, leave)
        self._recheck: asyncio.TimerHandle | None = None
        self._left_out = False        # the re-plan in progress left a node out (its install could not reach it)
        # pipelines being installed in the background while the ones in force serve on (a node back, a
        # join): each joins the set once ready; their nodes are no one else's meanwhile (issue 34)
        self._pending: dict[Pipeline, object] = {}  # -> its planner.Plan
        self._profile_of: dict[str, object] = {}    # node id -> its last planner profile (pending nodes' too)

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="replanner")

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        for task in self._tasks:
            task.cancel()

    def request_replan(self, why: str) -> None:
        """Something changed, or may have: plan again soon (a plan that still serves is kept)."""
        if not self._reasons:
            self._since = time.monotonic()
        self._reasons.append(why)
        self._trigger.set()

    def later(self, delay: float, why: str) -> None:
        """Plan again after `delay` s (once, however often asked meanwhile)."""
        if self._recheck is None or self._recheck.cancelled() or self._recheck.when() < asyncio.get_running_loop().time():
            self._recheck = asyncio.get_running_loop().call_later(max(0.1, delay), self.request_replan, why)

    async def _loop(self) -> None:
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
            self._left_out = False
            try:
                async with self._plan_lock:
                    await self.replan(why, since)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 — try again: requests are waiting for it
                # a node the install could not reach is left out now: the next try needs no wait
                retry = 0.0 if self._left_out else RETRY_S
                log.warning("re-plan (%s) failed: %s; trying again in %.1f s", why, exc, retry,
                            exc_info=not isinstance(exc, MeshError))
                if self._broken():  # no plan serves: requests wait for one, bounded
                    self.app.state.set(Phase.WAITING, f"re-plan failed: {exc}")
                else:  # the plan in force still serves
                    self.app.state.set(Phase.READY)
                await asyncio.sleep(retry)
                self.request_replan(why)

    async def _settle(self) -> None:
        """Before the first plan: until every known node has answered once, and (with mDNS, where
        nodes show up one by one) settle_s after the first trigger, so the first plan sees them all."""
        deadline = self._since + self.app.options.settle_s
        while time.monotonic() < deadline:
            unprobed = any(m.down == NOT_PROBED for m in self.app.members.by_address.values())
            if not unprobed and not self.app.options.mdns and self.app.members.by_address:
                return
            await asyncio.sleep(0.1)

    def broken_pipelines(self) -> list[Pipeline]:
        """The pipelines in force that cannot serve: a stage lost or down, or its node drained or leaving."""
        out = []
        for p in self.app.pipelines.all:
            for h in [*p.stages, *p.members]:  # (a member of a stage over several nodes: the stage with it)
                m = self.app.members.by_address.get(h.address)
                if h.lost or (m is not None and not m.usable):
                    out.append(p)
                    break
            else:
                if not p.stages:
                    out.append(p)
        return out

    def _broken(self) -> bool:
        """No pipeline serves: none installed, or every one broken."""
        return not self.app.pipelines.all or len(self.broken_pipelines()) == len(self.app.pipelines.all)

    async def replan(self, why: str, since: float | None = None) -> bool:
        """Plan over the usable nodes and install what changes. A pipeline that broke (a node
        lost, drained, leaving) is replaced over the nodes no serving pipeline holds, and only its
        requests move: the other pipelines go on untouched. With nothing broken (a join, a node
        back, the workload changed), a plan over all the nodes replaces the one in force when its
        predicted speed is better by replan_gain (the pipelines it keeps as they are go on
        untouched), else nodes no pipeline uses start pipelines of their own. Returns whether
        anything new was installed."""
        since = since or time.monotonic()
        if self.app.fenced:
            return False  # stepping down: another controller steers the mesh
        broken = self.broken_pipelines()
        kept = [p for p in self.app.pipelines.all if p not in broken]
        loading = self.pending_nodes()
        usable = [m for m in self.app.members.usable() if m.status is not None and m.node_id not in self.app.revocations
                  and m.node_id not in loading]
        if not usable:
            self.give_up(not kept, "no stage nodes yet" if not self.app.members.by_address else
                          "no usable stage node (" + "; ".join(f"{m.address}: {m.why_not()}"
                                                               for m in self.app.members.by_address.values()) + ")")
            return False
        ids = {m.node_id: m.address for m in usable}
        await self._measure_links(ids)
        usable = [m for m in usable if m.usable]  # a node whose links failed is out
        ids = {m.node_id: m.address for m in usable}
        profiles = [planning.device_profile(m.status, {b: l for b, l in self.links.get(m.node_id, {}).items() if b in ids},
                                            self.app.spec) for m in usable]
        try:
            self.profiles = self._grouped(profiles)
        except InvalidArgument as exc:
            self.give_up(not kept, str(exc))
            return False
        self._profile_of.update((p.node_id, p) for p in self.profiles)
        self.workload = self.app.scheduler.traffic.workload(self.app.options.context, self.app.config.max_position_embeddings)
        try:
            mesh = self._choose(kept, broken, why)
        except InvalidArgument as exc:
            self.give_up(not kept, f"no plan fits the {len(usable)} usable node(s): {exc}")
            if kept and broken:  # the others serve on; the broken ones go
                await self._install(planning.evaluate(self._plans(kept), self.profiles, self.app.spec, self.workload,
                                                      self.app.options), ids, why, since)
                return True
            return False
        if mesh is None:
            self.app.state.set(Phase.READY)  # a fault that healed before the re-plan may have paused admission
            return False
        await self._install(mesh, ids, why, since)
        return True

    def _grouped(self, profiles: list) -> list:
        """The profiles with each --tp-group whose nodes are all usable joined into one stage's, and with
        --tp-hosts auto the pairs the planner proposes (planning.grouped); InvalidArgument naming the flag for a group that cannot be one (a node the mesh
        never saw, a width that does not divide the model)."""
        o = self.app.options
        if not o.tp_groups and not o.tp_hosts:
            return profiles
        members = [m for m in self.app.members.by_address.values() if m.status is not None]
        known = {m.node_id or m.status.node_id for m in members}
        try:
            out, notes = planning.grouped(profiles, self.app.spec, o.tp_groups, auto=o.tp_hosts, known=known,
                                          context_tokens=self.workload.context_tokens,
                                          hosts={m.status.node_id: planning.host_of(m.status) for m in members})
        except ValueError as exc:
            raise InvalidArgument(str(exc)) from exc
        for note in notes:
            log.warning("%s", note)
        return out

    def pending_nodes(self) -> set[str]:
        """Node ids of the pipelines being installed in the background."""
        return {n for plan in self._pending.values() for n in plan.node_ids}

    @staticmethod
    def _plans(pipelines: list[Pipeline]) -> list:
        return [p.plan for p in pipelines if p.plan is not None]

    def _choose(self, kept: list[Pipeline], broken: list[Pipeline], why: str):
        """The planner.MeshPlan to install now, or None to keep the plan in force (see `replan`).
        InvalidArgument when no pipeline fits the nodes it may use."""
        o, spec, workload = self.app.options, self.app.spec, self.workload
        if self.plan is None:
            return planning.reuse_or_plan(o.plan_path, self.profiles, spec, workload, o)
        in_use = {n for p in kept for s in (p.plan.stages if p.plan else ()) for n in (s.members or (s.node_id,))}
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

        if broken and all(p.plan is not None for p in broken):
            # each broken pipeline over its survivors, the lost layers taken by a neighbour: the
            # survivors' kept KV serves the replays; a better plan follows once the mesh is quiet
            usable = {p.node_id for p in self.profiles}
            lost = {s.node_id for p in broken for s in p.plan.stages if s.node_id not in usable or any(
                h.node_id == s.node_id and h.lost for h in p.stages)}
            drained = {m.node_id for m in self.app.members.by_address.values() if not m.usable}
            held = {s.node_id for p in broken for s in p.plan.stages} - lost - drained
            idle = [p.node_id for p in self.profiles if p.node_id not in in_use and p.node_id not in held]
            repaired = []
            for p in broken:
                r = planning.repair(p.plan, lost | drained, self.profiles, spec, workload, o, idle)
                repaired.append(r)
                idle = [n for n in idle if r is None or n not in r.node_ids]
            if repaired and all(r is not None for r in repaired):
                log.info("%s: repairing %d pipeline(s) over their survivors (%s)", why, len(repaired),
                         "; ".join(" ".join(f"{s.node_id}[{s.start},{s.end})" for s in r.stages) for r in repaired))
                self._repaired = True
                return planning.evaluate(self._plans(kept) + repaired, self.profiles, spec, workload, o)
        repaired, self._repaired = self._repaired, False
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
        # a repair in force is a stop-gap (survivors kept their ranges, a neighbour took the lost one):
        # the planner's own plan replaces it, once the mesh is quiet, unless the repair is the better one
        # (a node back from a fault is so taken in again even where it adds no predicted speed)
        if planning.better(full, current, o) or (repaired and not planning.better(current, full, o)):
            sched = self.app.scheduler
            served = time.monotonic() - max(self._installed_at, self.app.members.last_fault(), sched.caught_up_at)
            replaying = sched.catching_up() if time.monotonic() - self._installed_at < MAX_HOLD_S else 0
            if sched.running and (served < HOLD_S or replaying) and not self._now:
                # better, but the plan in force serves and was installed (or a node fell, or its moved
                # requests caught up) just now, or requests it took over are still replaying: moving its
                # running requests again waits until the mesh has been quiet for a while
                wait = HOLD_S - served if served < HOLD_S else 1.0
                log.info("%s: a better plan (%s vs %s) waits %.1f s more (%s)", why, planning.describe(full),
                         planning.describe(current), wait,
                         f"{replaying} moved requests are still replaying" if replaying else
                         "the plan in force is new, or a fault was recent")
                self.later(wait, why)
                self._repaired = repaired  # (still in force, and the later decision needs to know)
            else:
                return full
        if grown:
            self._repaired = repaired  # the pipelines in force stay as they are
            return planning.evaluate(self._plans(kept) + grown, self.profiles, spec, workload, o)
        log.info("%s: keeping the plan in force (%s; a new one would be %s)", why, planning.describe(current),
                 planning.describe(full))
        return None

    def give_up(self, broken: bool, why: str) -> None:
        """No plan now: when no pipeline serves, requests wait (bounded) for nodes."""
        if not broken:
            log.info("keeping the plan in force: %s", why)
            self.app.state.set(Phase.READY)
            return
        log.warning("waiting for nodes: %s", why)
        self.app.state.set(Phase.WAITING, why)
        for p in self.app.pipelines.all:
            p.retired = True
        sessions = self.app.scheduler.detach_all()
        for p in self.app.pipelines.all:
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
        channels = {nid: self.app.transport.channel(addr, "stage") for nid, addr in ids.items()}
        try:
            stubs = {nid: self.app.pipelines.stub(ch) for nid, ch in channels.items()}
            in_plan = {h.node_id for h in self.app.pipelines.nodes}
            measured = await planning.measure_pairs(stubs, ids, pairs, epoch=self.app.pipelines.epoch,
                                                    owner=self.app.pipelines.owner)
            for (a, b), link in zip(pairs, measured):
                if not isinstance(link, BaseException):
                    self.links.setdefault(a, {})[b] = link
                    continue
                if a not in in_plan and getattr(link, "code", lambda: None)() == grpc.StatusCode.PERMISSION_DENIED:
                    # a node measures links only for the controller that holds it: a newcomer not
                    # assigned yet is planned with the default link, measured once it is assigned
                    log.info("link %s -> %s not measured yet (%s is not assigned): planning with the default", a, b, a)
                    continue
                if Fenced.seen_in(str(link)) and a in in_plan:  # a stage of our plan follows another controller
                    self.app.on_fenced(str(link))
                    raise link
                newcomer = next((x for x in (a, b) if x not in in_plan), None)
                if newcomer is None:
                    raise link
                self.app.members.mark_down(ids[newcomer], f"its link {a} -> {b} could not be measured: {link}")
        finally:
            for ch in channels.values():
                await ch.close()
        log.info("measured %d links in %.1f s", len(pairs), time.monotonic() - t0)

    async def _install(self, mesh, ids: dict[str, str], why: str, since: float) -> None:
        """Install `mesh` (a planner.MeshPlan): a pipeline in force that it keeps as it is (the
        same nodes and layers, serving) goes on untouched; the others are retired, their requests
        moved (replayed on the pipelines that serve, new ones included once they are up); the new
        pipelines are assigned and join the set as each is ready."""
        log.info("plan (%s) because %s:\n%s", planning.describe(mesh), why, planning.plan_table(mesh, self.app.spec))
        broken = self.broken_pipelines()
        current = {planning.pipeline_key(p.plan): p for p in self.app.pipelines.all
                   if p.plan is not None and p not in broken and not p.retired}
        keep: dict[int, Pipeline] = {}
        for i, plan in enumerate(mesh.pipelines):
            p = current.pop(planning.pipeline_key(plan), None)
            if p is not None:
                keep[i] = p
        dropped = [p for p in self.app.pipelines.all if p not in keep.values()]
        for p in dropped:
            p.retired = True  # no request opens there from now on
        sessions = self.app.scheduler.detach(dropped)
        if not keep:
            self.app.state.set(Phase.REPLANNING if self.plan is not None else Phase.PLANNING,
                           f"installing a new plan ({why})")
        for p in dropped:
            alive = [h for h in p.stages if not h.lost and not self.app.why_down(h.address)]
            if sessions and alive:  # free them on the old stages still there (else their TTL does)
                try:
                    await asyncio.wait_for(p.close_session_many(sessions, alive), CLOSE_WAIT_S)
                except asyncio.TimeoutError:
                    pass
            await p.close(wait_closes=False)
        self.app.pipelines.replace(list(keep.values()))  # the kept ones serve on while the new ones load
        for i, p in keep.items():
            p.plan = mesh.pipelines[i]
        fresh = {i: self.app.pipelines.new() for i in range(len(mesh.pipelines)) if i not in keep}

        async def install(i: int, p: Pipeline) -> None:
            plan = mesh.pipelines[i]
            p.plan = plan
            await p.install(str(self.app.model_dir), self.app.digest, self.app.num_layers,
                            [StageAssignment(ids[s.node_id], s.start, s.end, dtype, fmt, wire, s.node_id, s.devices,
                                             tuple((n, ids[n]) for n in s.members), self._tp_init(s, ids))
                             for s, (dtype, fmt, wire) in zip(plan.stages, planning.stage_formats(plan, self.profiles))],
                            self.app.options.dtype, self.app.options.micro_batches, controller_address=self.app.options.address,
                            generation=self.app.pipelines.next_generation(),
                            planned_micro_batches=0 if planning.classic(self.app.options) else plan.micro_batches)
            # ready: it takes requests at once (the set keeps the plan's order)
            self.app.pipelines.replace(sorted([*self.app.pipelines.all, p], key=lambda x: self._order(mesh, x)))
            self.app.scheduler.kick()

        if keep and fresh:
            # the pipelines kept serve on: the new ones load in the background and join as each is
            # ready, so a fault meanwhile (or another node back) is planned at once, not after a load;
            # a node that fails or stalls while loading holds up no one but its own pipeline
            for i, p in fresh.items():
                self._pending[p] = mesh.pipelines[i]
                task = asyncio.get_running_loop().create_task(self._install_later(install, i, p, why),
                                                              name="install-pipeline")
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
            failed, installed = [], list(self.app.pipelines.all)
        else:
            results = await asyncio.gather(*(install(i, p) for i, p in fresh.items()), return_exceptions=True)
            failed = [r for r in results if isinstance(r, BaseException)]
            installed = [p for p in self.app.pipelines.all]
        if failed:
            exc = failed[0]
            self._install_failed(failed)
            for i, p in fresh.items():
                if p not in installed:
                    await p.close(wait_closes=False)
            self.request_replan(f"the last install did not finish ({exc or type(exc).__name__})")
            if not installed:
                raise exc
        self.plan = self._evaluate_in_force() if failed else mesh
        self.plan_json = planning.to_json(self.plan)
        self._installed_at = time.monotonic()
        self.replans += 1
        self.last_replan, self.last_replan_s = why, time.monotonic() - since
        self.history.append(ReplanRecord(time.time(), self.app.pipelines.generation, why, self.last_replan_s,
                                         len(sessions), tuple(tuple((h.node_id, h.start, h.end) for h in p.stages)
                                                              for p in installed)))
        log.info("plan generation %d serves (%d pipelines: %s) %.1f s after: %s; %d requests replay",
                 self.app.pipelines.generation, len(installed), ", ".join(f"{len(p.stages)} stage{'s' if len(p.stages) != 1 else ''}" for p in installed),
                 self.last_replan_s, why, len(sessions))
        self.app.state.set(Phase.READY)
        self.plan_changed.set()
        self.plan_changed = asyncio.Event()
        self._measure_held(ids)

    def _tp_init(self, stage, ids: dict[str, str]) -> str:
        """Where the nodes of a stage over several nodes meet: its rank 0's host and --tp-port ("": one node)."""
        if not stage.members:
            return ""
        m = self.app.members.by_address.get(ids[stage.node_id])
        port = m.status.tp_port if m is not None and m.status is not None else 0
        if not port:
            raise FailedPrecondition(f"node {stage.node_id} reports no --tp-port: it cannot be rank 0 of a stage over "
                                     "several nodes (a LogicPipe stage of an older version?)")
        return f"tcp://{ids[stage.node_id].rpartition(':')[0]}:{port}"

    def _evaluate_in_force(self):
        """The planner.MeshPlan of the pipelines in force and those being installed."""
        plans = [p.plan for p in self.app.pipelines.all if p.plan is not None] + list(self._pending.values())
        nodes = {s.node_id for plan in plans for s in plan.stages}
        return planning.evaluate(plans, [self._profile_of[n] for n in nodes if n in self._profile_of], self.app.spec,
                                 self.workload, self.app.options)

    def _install_failed(self, failed: list[BaseException]) -> None:
        """Assignments that failed: a stage of a newer controller's steps this one down; a node that
        failed is left out until it answers again."""
        exc = failed[0]
        if isinstance(exc, MeshError) and Fenced.seen_in(str(exc)):
            self.app.on_fenced(str(exc))
            raise exc
        for err in failed:
            if isinstance(err, MeshError):
                for m in self.app.members.usable():
                    if m.address in str(err):
                        if isinstance(err, (InvalidArgument, FailedPrecondition)):  # not a passing fault
                            self.app.members.refuse(m.address, f"its assignment failed: {err}")
                        else:
                            self.app.members.mark_down(m.address, f"its assignment failed: {err}")
                        self._left_out = True

    async def _install_later(self, install, i: int, p: Pipeline, why: str) -> None:
        """`install(i, p)` in the background (see `_install`): `p` joins the set once ready; if it
        fails, the node is left out and the plan is made again."""
        t0 = time.monotonic()
        try:
            await install(i, p)
        except asyncio.CancelledError:
            self._pending.pop(p, None)
            await p.close(wait_closes=False)
            raise
        except Exception as exc:  # noqa: BLE001 — the pipelines in force serve on; plan again without it
            self._pending.pop(p, None)
            await p.close(wait_closes=False)
            log.warning("a new pipeline (%s) did not join: %s", why, exc)
            try:
                self._install_failed([exc])
            except MeshError:
                return  # a stage follows a newer controller: this one steps down
            if self.app.pipelines.all or self._pending:
                self.plan = self._evaluate_in_force()
                self.plan_json = planning.to_json(self.plan)
            self.request_replan(f"the last install did not finish ({exc or type(exc).__name__})")
            return
        self._pending.pop(p, None)
        self.plan = self._evaluate_in_force()
        self.plan_json = planning.to_json(self.plan)
        if self.app.state.waiting:  # (every pipeline in force broke meanwhile: this one serves now)
            self.app.state.set(Phase.READY)
        self.plan_changed.set()
        self.plan_changed = asyncio.Event()
        joined = time.monotonic() - t0
        # its share of the running requests (none lost: they replay there). With KV mirrors, those of the
        # pipelines that copy to it first, once their blocks are there (a replay then attaches its
        # history), then others' up to its share
        sources = [q for q in self.app.pipelines.serving() if p in self.app.pipelines.mirrors_of(q)]
        stages = " ".join(f"{h.node_id}[{h.start},{h.end})" for h in p.stages)  # (before the wait: a fault may close it)
        if sources:
            await asyncio.sleep(mirrors.SETTLE_S)
        moved = self.app.scheduler.rebalance(p, sources or None)
        log.info("pipeline %d (%s) joined the plan %.1f s after its install began (%s); %d running requests "
                 "move onto it", p.index, stages, joined, why, len(moved))

    def _measure_held(self, ids: dict[str, str]) -> None:
        """A newcomer measures links only for the controller that holds it, so its links were not
        measured before its first assignment: measure them now that this controller holds it (in the
        background, after the plan serves), for the next plan and /metrics."""
        held = {h.node_id for h in self.app.pipelines.nodes}  # (a group's members too: the link between them)
        todo = {n: a for n, a in ids.items() if n in held}
        if not any(b not in self.links.get(a, {}) for a in todo for b in todo if a != b):
            return

        async def measure() -> None:
            try:
                async with self._plan_lock:
                    await self._measure_links(todo)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 — the next re-plan measures them again
                log.info("measuring the new stages' links failed: %s", exc)

        task = asyncio.get_running_loop().create_task(measure(), name="measure-links")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    @staticmethod
    def _order(mesh, p: Pipeline) -> int:
        """`p`'s place in `mesh`'s pipelines."""
        key = planning.pipeline_key(p.plan)
        return next((i for i, plan in enumerate(mesh.pipelines) if planning.pipeline_key(plan) == key), len(mesh.pipelines))

    async def replan_now(self, why: str) -> None:
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
