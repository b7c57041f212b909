"""What a stage node is told: its own configuration (StageOptions, from its flags) and the
assignment the controller gives it (Assignment: a layer range of a model, its place in the
pipeline, its formats), checked before anything is loaded."""
from __future__ import annotations

from dataclasses import dataclass

from logicpipe.errors import InvalidArgument
from logicpipe.formats import FLOAT_DTYPES, WEIGHT_FORMATS
from logicpipe.limits import check_printable
from logicpipe.stage_node.engine.blocks import DEFAULT_BLOCK_SIZE
from logicpipe.stage_node.engine.scheduler import Budget

COMPUTE_DTYPES = FLOAT_DTYPES  # (logicpipe.formats: the one table)
MAX_PATH_CHARS = 4096
MAX_MICRO_BATCHES = 64  # sampled steps in flight on stage 0 (one per stage by default; no mesh is that deep)


@dataclass(frozen=True)
class StageOptions:
    max_kv_bytes: int = 2 * 2**30        # KV pool of this stage, bytes
    block_size: int = DEFAULT_BLOCK_SIZE  # KV positions per block
    budget: Budget = Budget()            # per-step token rows and sequences
    session_ttl_s: float = 30.0          # a session outlives its gone owner (or its last step) this long, s
    draft_model: str = ""                # last stage: draft candidates with this model ("": prompt lookup)
    draft_layers: int = 0                # ... keeping only its first N decoder layers (0: all)
    quantize: str = "none"               # its layers' matrices in int4 / int8 / nf4 / fp4 (stage_node.quant)
    cuda_graphs: bool = True             # CUDA: small steps replayed as graphs (stage_node.step_graphs)
    batch_invariant: str = "auto"        # CUDA: auto / on / off, batch-invariant kernels (stage_node.invariant)
    dtype: str = "auto"                  # --dtype: "auto" (what the plan asks) or the one dtype it computes in
    model_root: str = ""                 # an assigned model directory must lie under this ("": anywhere)
    tp: object = None                    # --tp N > 1: the stage's engine.tp_group.Leader (rank 0 of N); with
                                         # --tp-max, the one at the width in force (None at width 1)
    tp_max: int = 0                      # --tp-max N: the plan chooses the width of each assignment, 1..N (0: fixed)
    tp_threads: int = 0                  # --threads of each follower rank a CPU group starts (0: torch's choice)
    tp_port: int = 0                     # --tp-port: where a group over several nodes meets, this node its rank 0
    replay_rows: bool = True             # --replay-rows: log the rows it sends on (and inside a range a re-plan
                                         # grew), so a replay after a re-plan computes only the layers it lacks
    window_kv: bool = True               # --window-kv: sliding-window layers keep only their window's KV
                                         # (engine.window; every stage but a --tp one)
    kv_dtype: str = "auto"               # --kv-dtype: KV values in the compute dtype ("auto") or 8-bit, "int8" /
                                         # "fp8" with a float32 scale per (token, KV head) (engine.kv_quant)
    kv_context: int = 8192               # --kv-context: positions a sequence is expected to reach; a stage with
                                         # full and window layers splits its KV budget so both pools hold as
                                         # many sequences of this length (engine.window.split_budget)
    swap_bytes: int = 0                  # --swap-mib: where a preempted sequence's KV waits for its replay, bytes
                                         # (engine.swap; 0: none, the replay computes it again)
    swap_dir: str = ""                   # --swap-dir: ... in files there ("": host memory)
    kv_disk_bytes: int = 0               # --kv-disk-mib: the prefix cache kept on disk at most, bytes (net.kv_disk;
                                         # 0: off), in kv_disk_dir
    kv_disk_dir: str = ""                # ... the node's store directory (under --state-dir; "": off)
    min_step_s: float = 0.0              # --min-step-ms: a step takes at least this long (0: as long as it takes)
    step_bar_s: float = 0.1              # --max-step-ms: stage 0 sizes prompt chunks so that a step (its decode
                                         # rows and a chunk) stays under this, s, by engine.step_budget (0: off)
    step_log: str = ""                   # --step-log: a JSON line per computed step appended here ("": none)


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
    tp_width: int = 0        # devices the stage spans, chosen by the plan (0: the node's own: --tp N, or 1)
    tp_rank: int = 0         # a stage over several nodes (--tp-group): this node's rank (0: the stage's own)
    tp_world: int = 0        # ... the nodes it spans (0 or 1: this node alone)
    tp_init: str = ""        # ... where they meet: rank 0's tcp://HOST:PORT
    tp_members: tuple[str, ...] = ()  # ... their node ids by rank

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
        check_printable("model_dir", self.model_dir)  # a NUL is no path the OS takes (os.path raises)
        if not (0 <= self.start < self.end <= self.num_layers):
            raise InvalidArgument(f"layer range [{self.start}, {self.end}) is not inside [0, {self.num_layers})")
        if not (0 <= self.stage_index < self.num_stages):
            raise InvalidArgument(f"stage index {self.stage_index} out of range for {self.num_stages} stages")
        if self.num_stages > self.num_layers:
            raise InvalidArgument(f"{self.num_stages} stages for {self.num_layers} layers: each stage holds at least "
                                  "one layer")
        if self.micro_batches > MAX_MICRO_BATCHES:
            raise InvalidArgument(f"micro_batches {self.micro_batches} is over the cap of {MAX_MICRO_BATCHES} "
                                  "(0: one per stage); lower the controller's --micro-batches")
        if not self.last and not self.next_address:
            raise InvalidArgument(f"stage ending at layer {self.end} < {self.num_layers} needs a next_address")
        if self.last and not self.first and not self.first_address:
            raise InvalidArgument("the last stage needs first_address (where new tokens go)")
        if self.tp_world > 1:
            if len(self.tp_members) != self.tp_world or not self.tp_rank < self.tp_world:
                raise InvalidArgument(f"tp_rank {self.tp_rank}, tp_world {self.tp_world}: tp_members must name "
                                      f"{self.tp_world} nodes (got {len(self.tp_members)}) and the rank be below it")
            if not self.tp_init.startswith("tcp://"):
                raise InvalidArgument(f"tp_init {self.tp_init[:80]!r}: give rank 0's tcp://HOST:PORT")
            if self.tp_width not in (0, self.tp_world):
                raise InvalidArgument(f"tp_width {self.tp_width} with tp_world {self.tp_world}: a stage over several "
                                      "nodes spans one device of each")
        elif self.tp_rank or self.tp_members or self.tp_init:
            raise InvalidArgument("tp_rank, tp_members and tp_init belong to a stage over several nodes (tp_world >= 2)")

    def same_weights(self, other: "Assignment") -> bool:
        """Whether `other` needs exactly these weights (a re-assignment keeping them keeps the pool too)."""
        return (self.model_dir, self.model_digest, self.start, self.end, self.num_layers, self.dtype) == \
            (other.model_dir, other.model_digest, other.start, other.end, other.num_layers, other.dtype)
