"""The planner's answer: an ordered pipeline of stages, what it costs, and what it was made from."""
from __future__ import annotations

from dataclasses import dataclass

from logicpipe.planner.types import NodeId, Objective, Reserve, Workload

FORMAT_VERSION = 1
"""Version of the plan artifact (JSON) layout; bump it when the layout or the cost model changes."""


@dataclass(frozen=True)
class Stage:
    """One pipeline stage: a node and the contiguous layer range [start, end) it holds."""

    node_id: NodeId     # the node running this stage
    device_kind: str    # the node's device kind ("cuda", "cpu", ...), for people reading the plan
    weight_format: str  # dtype the node loads its weights in (the checkpoint's, or fp32 upcast)
    start: int          # first layer, inclusive
    end: int            # one past the last layer (exclusive)
    compute_s: float    # s per step: its layers (+ embedding on the first stage, + LM head on the last)
    transfer_s: float   # s per step to send its output on (the last stage: the token back to stage 0)
    memory_bytes: int   # bytes it holds: weights + KV for the workload (+ embedding / LM head), no reserve
    devices: int = 1    # devices the node's stage spans (--tp N: its GPUs, as node:0 ... node:N-1)
    members: tuple[str, ...] = ()  # a stage over several nodes (--tp-group): their ids by rank, node_id first

    @property
    def device_ids(self) -> tuple[str, ...]:
        """The devices of the stage: its node id, node:gpu for each device of a multi-device stage, or the
        node ids of a stage over several nodes."""
        if self.members:
            return tuple(self.members)
        return (self.node_id,) if self.devices <= 1 else tuple(f"{self.node_id}:{i}" for i in range(self.devices))

    @property
    def num_layers(self) -> int:
        """Layers in this stage."""
        return self.end - self.start

    @property
    def total_s(self) -> float:
        """s per step this stage is busy: compute + transfer."""
        return self.compute_s + self.transfer_s


@dataclass(frozen=True)
class PlanMetadata:
    """What a plan was computed from, so a saved plan can be checked before it is reused."""

    format_version: int                          # FORMAT_VERSION of the planner that made it
    model_name: str                              # ModelSpec.name
    model_digest: str                            # sha256 (hex) of the canonical JSON of the ModelSpec
    profiles_digest: str                         # sha256 (hex) over all node digests, sorted by node id
    node_digests: tuple[tuple[NodeId, str], ...]  # (node id, sha256 of its profile) for every profile given, sorted
    num_layers: int                              # decoder layers of the model (the stages cover [0, num_layers))
    workload: Workload                           # the workload the costs and the KV reservation are for
    reserve: Reserve                             # the memory reserve every device keeps


@dataclass(frozen=True)
class Plan:
    """An ordered pipeline. `cost_s` is the bottleneck stage time (throughput objective) or the sum
    of stage times (latency objective), per step; `lower_bound_s` <= any plan's cost for the same
    inputs (equal to `cost_s` when `exact`). A mesh of several pipelines is a `MeshPlan` (`mesh.py`)."""

    stages: tuple[Stage, ...]  # in pipeline order; stage 0 embeds, the last samples
    objective: Objective       # what `cost_s` measures
    strategy: str              # "dp", "uniform", "memory", "compute", "mixed" or "custom"
    cost_s: float              # s per step: bottleneck (THROUGHPUT) or sum (LATENCY) of stage times
    lower_bound_s: float       # s per step: no plan over these devices costs less
    exact: bool                # True when the DP proved the plan optimal (lower_bound_s == cost_s)
    metadata: PlanMetadata     # what the plan was made from
    # Decode prediction of the step cost model (`cost.py`), set by `make_mesh_plan`; 0 = not predicted
    micro_batches: int = 0     # micro-batches in flight (1 <= m <= stages); 0: unknown (an older plan)
    rows: int = 0              # sequences of the workload's concurrency this pipeline serves
    tokens_per_s: float = 0.0  # predicted decode tokens/s of this pipeline at `rows` sequences

    @property
    def gap(self) -> float:
        """(cost - lower bound) / lower bound: 0.0 for an exact plan; an upper bound on how far a
        heuristic or fixed-strategy plan may be from the optimum."""
        if self.lower_bound_s <= 0:
            return 0.0
        return max(0.0, (self.cost_s - self.lower_bound_s) / self.lower_bound_s)

    @property
    def node_ids(self) -> tuple[NodeId, ...]:
        """The nodes taking part, in pipeline order (every node of a stage over several nodes)."""
        return tuple(n for s in self.stages for n in (s.members or (s.node_id,)))
