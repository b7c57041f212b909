"""A stage node's counters, and the one snapshot of the node that Status reports (the controller's
`lpctl status`/`nodes` and /metrics read it from there)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StageStats:
    """Counters since the node started (over every assignment it has had)."""

    steps: int = 0                 # steps computed
    rows: int = 0                  # token rows in them
    seq_rows: int = 0              # sequences in them (summed over steps)
    max_step_seqs: int = 0         # most sequences in one step
    compute_s: float = 0.0         # seconds spent in the runner on steps
    max_step_s: float = 0.0        # the longest step, s
    decode_steps: int = 0          # steps that held a decode row (a sequence past its prompt)
    max_decode_step_s: float = 0.0  # the longest of them, s: what a decoding request waited at most here
    decode_steps_over_bar: int = 0  # ... those over the step-time bar (--max-step-ms)
    sessions_expired: int = 0      # sessions freed because their owner was gone
    weights_pulled_bytes: int = 0  # tensor bytes pulled from the controller
    stale_steps: int = 0           # steps and feeds refused for carrying another plan generation
    replay_rows_resumed: int = 0   # replayed rows computed from a layer kept over a re-plan, or not at all
    replay_layers_skipped: int = 0  # ... the layers (summed over those rows) not computed again
    # swapping (engine.swap): sequences whose KV went to the swap space, its blocks and bytes; those
    # whose replay took it back, its blocks, bytes and positions (not computed again); and the
    # sequences the swap space had no room for (their replay computes them again)
    swapped_out_seqs: int = 0
    swapped_out_blocks: int = 0
    swapped_out_bytes: int = 0
    swapped_in_seqs: int = 0
    swapped_in_blocks: int = 0
    swapped_in_bytes: int = 0
    swapped_in_tokens: int = 0
    swap_full: int = 0
    # last stage: sampled steps, the tokens they reported, candidates verified and accepted
    sampled_steps: int = 0
    sampled_tokens: int = 0
    candidates_verified: int = 0
    candidates_accepted: int = 0
    # KV mirrors (net.mirror): full blocks sent to other pipelines' stages, taken from theirs, failed calls
    mirrored_out_blocks: int = 0
    mirrored_in_blocks: int = 0
    mirror_errors: int = 0
    # the prefix cache kept on disk (net.kv_disk): blocks written, blocks read back at a restart, failed reads/writes
    kv_disk_written_blocks: int = 0
    kv_disk_restored_blocks: int = 0
    kv_disk_errors: int = 0


@dataclass(frozen=True)
class EngineView:
    """The assignment in force and what it holds."""

    model_dir: str
    model_digest: str
    plan_id: str
    start: int
    end: int
    num_layers: int
    stage_index: int
    num_stages: int
    generation: int
    dtype: str
    weight_format: str
    weight_bytes: int
    parameter_count: int
    tied_copy_count: int
    open_sessions: int
    orphaned_sessions: int         # open, their owner gone (freed after the TTL)
    block_size: int
    kv_blocks_total: int
    kv_blocks_used: int
    kv_blocks_cached: int
    kv_bytes: int
    prefix_hit_tokens: int
    preempted: int
    micro_batches: int             # stage 0: micro-batches in flight at most (0 elsewhere)
    swap_bytes_total: int = 0      # its swap space (engine.swap; 0: none)
    swap_bytes_used: int = 0       # ... held by swapped-out sequences now


@dataclass(frozen=True)
class StageSnapshot:
    node_id: str
    state: str                     # idle | loading | ready | member
    device: str
    uptime_s: float
    stats: StageStats
    session_ttl_s: float
    block_size: int                # --block-size (the engine's, once assigned)
    stopping: bool
    drafter: str                   # what drafts candidates on the last stage
    step_bar_s: float = 0.0        # --max-step-ms, s (0: no bar)
    tp_port: int = 0               # --tp-port: where a group over several nodes meets with this node as its rank 0
    tp_leader: str = ""            # state "member": the node whose stage it computes a share of
    engine: EngineView | None = field(default=None)
