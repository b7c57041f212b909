"""The controller's mesh: the model, the nodes (membership), the pipelines in force and the
requests on them. The app wires the parts and owns the mesh state (controller.state); re-planning
is the Replanner's (controller.replanning), the operator's commands are OperatorCommands'
(controller.commands)."""
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
from logicpipe.controller.mesh import planning
from logicpipe.controller.mesh.commands import OperatorCommands
from logicpipe.controller.jobs.handoff import HandoffPolicy
from logicpipe.controller.jobs.journal import Journal
from logicpipe.controller.mesh.membership import Members
from logicpipe.controller.mesh.pipeline import Pipeline
from logicpipe.controller.mesh.pipelines import PipelineSet
from logicpipe.controller.mesh.replanning import Replanner
from logicpipe.controller.jobs.scheduler import DEFAULT_SPECULATE, WAIT_FOR_NODES_S, RequestStats, Scheduler, SchedulerConfig
from logicpipe.controller.mesh.state import MeshState, Phase
from logicpipe.controller.jobs.text import load_tokenizer

log = logging.getLogger(__name__)



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
    standby_name: str = ""            # over TLS: the certificate name of the one standby Replicate serves
    peer_secret: bytes = b""          # in plaintext: the secret a standby sends to Replicate (--peer-secret-file)
    disaggregate: str = "auto"        # prefill on one pipeline, decode on another: auto (by measured rates) | off | on
    kv_mirror: bool = True            # replicas copy each other's KV blocks as they fill (mesh.mirrors)
    tp_groups: tuple = ()             # --tp-group: node ids of each stage over several nodes, rank 0 first
    tp_hosts: bool = False            # --tp-hosts auto: the planner pairs nodes of other hosts where it pays


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
    journal: str = ""           # the journal's health (Journal.state)
    journal_damage: str = ""    # what was found wrong with it at start ("" nothing)


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
    silent: str = ""           # a stage of it that does not answer now (pipeline.SILENT_S): its node id ("": none)


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
        self.state = MeshState()    # its one owner: set here only
        self.replanner = Replanner(self)        # the plan in force and the next one
        self.commands = OperatorCommands(self)  # drain, revoke, leave, register, plan previews
        # membership alone decides whether a node is alive; the pipelines report hints (_on_stage_lost)
        self.pipelines = PipelineSet(transport, self._on_event, self._on_stage_lost, why_down=self.why_down)
        self.pipelines.kv_mirror = options.kv_mirror
        self.pipelines.revoked = list(self.revocations)  # every Assign carries them
        self.chunks = planning.PrefillChunks(options.prefill_chunk)
        self.scheduler = Scheduler(
            self.pipelines, self.state,
            SchedulerConfig(self.config.max_position_embeddings, frozenset(self.config.eos_token_ids),
                            self.config.vocab_size, options.speculate, options.wait_for_nodes_s),
            prefill_chunk=self.prefill_chunk_for,
            on_trouble=lambda why: self.replanner.request_replan(f"a stage fault: {why}"),
            journal=self.journal, on_fenced=self.on_fenced, on_traffic=self._on_traffic,
            handoffs=HandoffPolicy(options.disaggregate))
        self.pipelines.on_silent = self.scheduler.evacuate  # a stalled replica's requests go on elsewhere
        self.pipelines.identity.standby_name = options.standby_name
        self.members = Members(self._probe, self.replanner.request_replan)
        self._browser: Browser | None = None

    def prefill_chunk_for(self, prompt_tokens: int, pipeline: Pipeline) -> int:
        """Prompt rows per step on `pipeline`'s stage 0 for a prompt of this many tokens
        (planning.PrefillChunks)."""
        return self.chunks.choose(prompt_tokens, pipeline.generation, pipeline.plan, self.replanner.profiles, self.spec)

    def stage_views(self, pipeline: Pipeline | None = None) -> list[StageView]:
        """The stages of every pipeline (or of `pipeline`), pipeline by pipeline."""
        return [StageView(h.node_id, h.address, h.start, h.end, h.device, h.parameter_count, p.index)
                for p in ([pipeline] if pipeline else self.pipelines.all) for h in p.stages]

    def pipeline_views(self) -> list[PipelineView]:
        serving = self.pipelines.serving()
        return [PipelineView(p.index, p.plan_id, p.generation, p.micro_batches, self.scheduler.load(p), p.tokens_per_s,
                             p in serving, (h.node_id or h.address) if (h := p.silent_stage()) is not None else "")
                for p in self.pipelines.all]

    def snapshot(self) -> ControllerSnapshot:
        sched, r = self.scheduler, self.replanner
        return ControllerSnapshot(
            model_dir=str(self.model_dir), phase=self.state.phase, reason=self.state.reason,
            plan_id=self.pipelines.plan_id, plan_generation=self.pipelines.generation, plan_json=r.plan_json,
            micro_batches=self.pipelines.micro_batches, speculate=sched.config.speculate, running=sched.running,
            queued=len(sched.waiting), stats=replace(sched.stats), stages=self.stage_views(),
            last_replan=r.last_replan, last_replan_s=r.last_replan_s, replans=r.replans,
            links={a: dict(b) for a, b in r.links.items()}, role=self.role,
            epoch=self.pipelines.epoch or self.journal.epoch, active=self.active_peer,
            journaled=len(self.journal.entries), pipelines=self.pipeline_views(), journal=self.journal.state(),
            journal_damage=self.journal.damage)

    # ---- membership ---------------------------------------------------------------------------
    def _on_event(self, ev) -> None:
        self.scheduler.on_event(ev)

    def _on_stage_lost(self, address: str, reason: str) -> None:
        """A pipeline's hint about one of its stages (no answer to its probes, its event stream
        ended, it serves another plan): membership takes the node as down (it alone brings it
        back, when its own probe is answered), and the broken pipeline is re-planned."""
        self.state.set(Phase.DEGRADED, f"stage {address} is down ({reason}); re-planning")
        self.members.mark_down(address, reason)
        self.replanner.request_replan(f"stage {address} lost: {reason}")

    def _on_traffic(self, why: str) -> None:
        """The requests at once moved to another power of two: a plan chosen by predicted tokens/s
        is checked against it (classic mode plans one pipeline whatever the traffic)."""
        if not planning.classic(self.options) and self.replanner.plan is not None:
            self.replanner.request_replan(why)

    def why_down(self, address: str) -> str:
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

    async def _probe(self, address: str, timeout: float):
        """Membership's probe (every PROBE_S, which renews our lease): a stage that another
        controller holds with a newer epoch means we were replaced (also found by the first probe
        after this process was stopped and resumed): step down at once."""
        st = await self.pipelines.probe(address, timeout=timeout)
        mine = self.pipelines.epoch
        if (self.role == "active" and mine and st.controller_epoch > mine
                and st.controller_id != self.pipelines.owner):
            self.on_fenced(f"node {st.node_id} follows controller {st.controller_id} of epoch {st.controller_epoch}, "
                           f"above ours ({mine})")
        return st

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

    async def readmit(self) -> int:
        """--readmit, an operator's act: a controller whose journal was lost (it would start at
        epoch 1 while the stages remember a higher one, and every stage would refuse it) takes
        the highest epoch the --nodes' Status shows, so that take_journal's next is the one
        the stages accept (stage_node.net.fence: the holder's + 1, once its lease expired)."""
        if not self.nodes:
            raise ValueError("it needs --nodes HOST:PORT,... (the stages whose epoch to read)")
        answers = await asyncio.gather(*(self.pipelines.probe(a, timeout=5.0) for a in self.nodes),
                                       return_exceptions=True)
        seen = [st for st in answers if not isinstance(st, BaseException)]
        if not seen:
            raise ValueError(f"none of --nodes ({', '.join(self.nodes)}) answered; start them first")
        top = max(st.controller_epoch for st in seen)
        if top > self.journal.epoch:
            log.warning("re-admitted by the operator (--readmit): the stages remember epoch %d, this journal %d; "
                        "taking %d", top, self.journal.epoch, top + 1)
            self.journal.set_epoch(top)
        return top

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
        self.replanner.start()

    async def wait_ready(self, timeout: float) -> bool:
        """Until a plan serves (or `timeout` s)."""
        deadline = time.monotonic() + timeout
        while not self.state.admitting and time.monotonic() < deadline:
            try:
                await asyncio.wait_for(self.replanner.plan_changed.wait(), max(0.01, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                break
        return self.state.admitting

    async def close(self) -> None:
        """Fail what is in flight and close every sequence we opened, then the pipeline."""
        self.replanner.close()
        if self._browser is not None:
            await self._browser.close()
        await self.members.close()
        await self.scheduler.shutdown()
        await self.pipelines.close()
        await self._release_stages()
        await self.journal.close()

    async def _release_stages(self) -> None:
        """Stopping as the active controller: end our lease on every stage now (StageNode.Release).
        When every member answered, the journal's directory says so: the next controller on it (epoch
        + 1) starts without waiting the lease out (controller.main); otherwise it waits, as after a
        crash (an Assign refused for a live lease would make it step down)."""
        if self.role != "active" or self.fenced or not self.pipelines.epoch:
            return
        addresses = list(self.members.by_address)
        answered, released = await self.pipelines.release(addresses) if addresses else (0, 0)
        log.info("released %d stage(s) as this controller stops (%d of %d members answered)", released, answered,
                 len(addresses))
        if answered == len(addresses):
            self.journal.mark_released(self.pipelines.epoch)
