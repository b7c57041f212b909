"""Where an assignment's weights come from and how they load: the format checks, the model
directory (this node's copy, one under --model-root, or the tensors pulled from the controller,
`WeightSource`), and the shard, KV pool and draft model built on the runner thread."""
from __future__ import annotations

import asyncio
import logging
import os
import time
from pathlib import Path

import torch

from logicpipe.common.modeldir import ModelConfig, ModelError, model_digest
from logicpipe.common.transport import Transport
from logicpipe.errors import FailedPrecondition, InvalidArgument, MeshError, Unavailable
from logicpipe.formats import DTYPE_FORMAT
from logicpipe.stage_node.config import Assignment, StageOptions
from logicpipe.stage_node.engine.draft_model import DraftModel, DraftModelError
from logicpipe.stage_node.kernels.invariant import resolve as resolve_invariant
from logicpipe.stage_node.engine.kv import KVPool, kv_bytes_per_token
from logicpipe.stage_node.engine.kv_quant import quantized
from logicpipe.stage_node.profile import float_formats
from logicpipe.stage_node.model.shard import Shard
from logicpipe.stage_node.engine.step_graphs import StepGraphs
from logicpipe.stage_node.engine.window import held_blocks, split_budget
from logicpipe.stage_node.weights.weight_cache import pull_assignment

log = logging.getLogger(__name__)


def check_formats(a: Assignment, node_id: str, options: StageOptions) -> None:
    """Refuse an assignment in a format or dtype this node does not offer (its --quantize, --dtype
    and device), saying what it runs."""
    q = options.quantize
    if a.weight_format and a.weight_format != (q if q != "none" else DTYPE_FORMAT[a.dtype]):
        runs = f"--quantize {q}" if q != "none" else f"{DTYPE_FORMAT[a.dtype]} for dtype {a.dtype}"
        raise InvalidArgument(f"node {node_id} runs its layers in {runs}; the plan asked for "
                              f"{a.weight_format} (start the node with the format the mesh should use)")
    if options.dtype != "auto" and a.dtype != options.dtype:
        raise InvalidArgument(f"node {node_id} computes in {options.dtype} (--dtype); the plan asked for {a.dtype}")


def under_root(path: str, root: str) -> bool:
    """Whether `path` lies under `root` (symlinks resolved; no root: anywhere)."""
    if not root:
        return True
    real, base = os.path.realpath(path), os.path.realpath(root)
    return real == base or real.startswith(base.rstrip(os.sep) + os.sep)


class WeightSource:
    """Where this node loads an assignment's weights from: `local_model_dir` (--model-dir), else
    the directory the controller names when it lies under --model-root and holds the same model
    (its digest), else the tensors pulled from the controller into `pull_root` (None: never pull)."""

    def __init__(self, node_id: str, transport: Transport, *, model_root: str = "",
                 local_model_dir: str | None = None, pull_root: Path | None = None):
        self.node_id = node_id
        self.transport = transport  # the process's: channels to the controller
        self.model_root = model_root
        self.local_model_dir = local_model_dir
        self.pull_root = pull_root
        self.pulled_bytes = 0       # tensor bytes pulled so far
        self.pull_key = ""          # the stream key of the plan being assigned (PullWeights asks for it)

    def _can_pull(self, a: Assignment) -> bool:
        return bool(a.controller_address and a.model_digest and self.pull_root is not None)

    async def model_dir_for(self, a: Assignment) -> str:
        """The directory to load `a` from (pulling what it needs first, if it comes to that)."""
        local = self.local_model_dir or a.model_dir
        if not self.local_model_dir and not under_root(a.model_dir, self.model_root):
            if self._can_pull(a):
                return await self.pull(a)  # never opened: the node takes the tensors from the controller
            raise InvalidArgument(f"node {self.node_id} loads models only from under its --model-root "
                                  f"{self.model_root}; {a.model_dir[:200]} is not")
        try:
            config = await asyncio.to_thread(ModelConfig.from_dir, local)
        except (ModelError, OSError) as exc:
            if self._can_pull(a):
                return await self.pull(a)
            if isinstance(exc, ModelError):
                raise FailedPrecondition(f"node {self.node_id}: {exc}") from exc
            raise FailedPrecondition(f"node {self.node_id} cannot read the model directory "
                                     f"{local[:200]}: {exc.strerror or exc}") from exc
        if config.num_layers != a.num_layers:  # another model altogether
            if self._can_pull(a):
                log.warning("the model at %s has %d layers, the controller's %d: pulling its layers instead",
                            local, config.num_layers, a.num_layers)
                return await self.pull(a)
            raise FailedPrecondition(f"node {self.node_id}: the model at {local[:200]} has {config.num_layers} "
                                     f"layers, the controller's {a.num_layers}; copy the controller's model there"
                                     + (", or start the node without --model-dir to pull its layers"
                                        if self.local_model_dir else ""))
        if a.model_digest:
            try:
                mine = await asyncio.to_thread(model_digest, local)
            except ModelError as exc:
                raise FailedPrecondition(f"node {self.node_id}: {exc}") from exc
            if mine != a.model_digest:
                if a.controller_address and self.pull_root is not None:
                    log.warning("the model at %s differs from the controller's (digest %s != %s): pulling its "
                                "layers instead", local, mine, a.model_digest)
                    return await self.pull(a)
                raise FailedPrecondition(
                    f"node {self.node_id}: the model at {local} differs from the controller's "
                    f"(digest {mine} != {a.model_digest}); copy the same model here")
        return local

    async def pull(self, a: Assignment) -> str:
        """Pull the assignment's tensors (those not cached yet) from the controller."""
        try:
            result = await pull_assignment(self.transport, a.controller_address, a.model_digest, a.start, a.end,
                                           a.num_layers, self.pull_root, key=self.pull_key)
        except MeshError:
            raise
        except Exception as exc:  # noqa: BLE001 — said as the node's own error
            raise Unavailable(f"node {self.node_id} could not pull layers [{a.start}, {a.end}) from the "
                              f"controller at {a.controller_address}: {exc}") from exc
        self.pulled_bytes += result.pulled_bytes
        return str(result.path)


def _tied(src: Shard) -> bool:
    """Whether `src`'s LM head is the (tied) input embedding matrix."""
    return src.tied_copy_count > 0 or (src.first and src.last and src.lm_head is src.embed_tokens)


def reusable(old: Shard | None, a: Assignment, options: StageOptions) -> bool:
    """Whether `old` (the shard in force, from the same model directory) holds some of the layers
    `a` needs in the same dtype: they are taken over rather than read again (`shard_for`)."""
    return (old is not None and options.quantize == "none" and old.dtype == getattr(torch, a.dtype)
            and old.start < a.end and a.start < old.end and old.graphs is None)


def shard_for(a: Assignment, model_dir: str, device: str, options: StageOptions, old: Shard | None = None) -> Shard:
    """Runner thread: the weights of `a`. With `old` reusable (a re-plan moved this stage's range
    over layers it holds), its layers in `a`'s range, its embeddings and LM head where `a` needs
    them too, are taken over as they are, and only the rest is read from the checkpoint (a range
    that shrank reads nothing)."""
    dtype = getattr(torch, a.dtype)
    if not reusable(old, a, options):
        return Shard.load(model_dir, a.start, a.end, first=a.first, last=a.last, device=device, dtype=dtype,
                          quantize=options.quantize)
    t0 = time.perf_counter()
    low = Shard.load(model_dir, a.start, old.start, first=a.first, last=False, device=device, dtype=dtype) \
        if a.start < old.start else None
    high = Shard.load(model_dir, old.end, a.end, first=False, last=a.last, device=device, dtype=dtype) \
        if a.end > old.end else None
    kept = old.layers[max(a.start, old.start) - old.start:min(a.end, old.end) - old.start]
    layers = (low.layers if low else []) + kept + (high.layers if high else [])
    embed = (low.embed_tokens if low else old.embed_tokens) if a.first else None
    head_src = (high if high else old) if a.last else None
    shard = Shard(old.config, a.start, a.end, first=a.first, last=a.last, layers=layers, embed_tokens=embed,
                  final_norm=head_src.final_norm if head_src else None, lm_head=head_src.lm_head if head_src else None,
                  lm_head_tied=_tied(head_src) if head_src else False, ropes=old.ropes, device=old.device, dtype=dtype)
    shard.weight_format = old.weight_format
    log.info("layers [%d, %d): kept %d layers of [%d, %d) loaded before, read %d in %.2f s", a.start, a.end,
             len(kept), old.start, old.end, len(layers) - len(kept), time.perf_counter() - t0)
    return shard


def load_shard(a: Assignment, model_dir: str, device: str, options: StageOptions,
               old: Shard | None = None, logs: frozenset[int] = frozenset()) -> tuple[Shard, KVPool]:
    """Runner thread: the shard's weights (those of `old`, the shard in force, kept where they
    overlap: `shard_for`) and an empty KV pool sized by --max-kv-mib (with CUDA graphs for small
    steps on a GPU). `logs`: the layer boundaries whose rows the pool keeps (its end, and inside
    the range where every row runs the torch forward: `Shard.can_tap`), counted in its budget."""
    if DTYPE_FORMAT[a.dtype] not in float_formats(device):
        raise ValueError(f"this {device} cannot compute in {a.dtype} (it has {', '.join(float_formats(device))})")
    dtype = getattr(torch, a.dtype)
    tp = options.tp
    invariant = resolve_invariant(options.batch_invariant, device)
    if tp is not None:  # every rank loads its part (stage_node.engine.tp_group); nothing is taken over
        shard = tp.load(model_dir, a.start, a.end, first=a.first, last=a.last, dtype=dtype, quantize=options.quantize,
                        invariant=invariant)
    else:
        shard = shard_for(a, model_dir, device, options, old)
    shard.batch_invariant = invariant
    check_kv_dtype(options.kv_dtype, invariant, tp is not None)
    shard.kv_dtype, shard._native = options.kv_dtype, None  # (before anything asks for its native layers)
    # linear-attention layers (their per-sequence state comes with each step) run eagerly: no CUDA graphs yet
    graphs = shard.device.type == "cuda" and options.cuda_graphs and not shard.linear_layers
    if tp is not None:
        logs = frozenset()
    elif graphs or not shard.can_tap:  # rows that skip the torch forward cannot leave their inner boundaries
        logs = frozenset(b for b in logs if b == a.end)
    bs = options.block_size
    if tp is None and options.window_kv and shard.hold_windows():
        logs = frozenset()  # (its sequences' blocks are not kept across re-plans: engine.window)
        log.info("sliding-window layers of [%d, %d) keep only their last %d positions of KV%s", a.start, a.end,
                 shard.window, f" (in a pool of their own, split for {options.kv_context}-position sequences)"
                 if shard.window_layers else "")
    num_blocks, group_blocks = pool_blocks(shard.config, len(shard.kv_layers), len(shard.window_layers), shard.window,
                                           dtype, options.max_kv_bytes, bs, options.kv_context, len(logs),
                                           options.kv_dtype)
    pool = tp.new_pool(shard, num_blocks, bs, graphs) if tp is not None else shard.new_pool(num_blocks, bs,
                                                                                          group_blocks)
    pool.span = (a.start, a.end)
    pool.add_logs(sorted(logs), shard.config.hidden_size)
    if graphs:  # warms at start-up: every kernel variant and graph bucket (a tensor-parallel stage's on
        shard.graphs = StepGraphs(shard, pool)  # every rank together: tp_group.Leader.capture)
    elif shard.device.type == "cuda":
        shard.warm_up(pool)  # no graphs: still compile every Triton kernel variant before the first step
    return shard, pool


def pool_blocks(config: ModelConfig, kv_layers: int, window_layers: int, window: int | None, dtype: torch.dtype,
                budget: int, block_size: int, kv_context: int, logs: int = 0, kv_dtype: str = "auto") -> tuple[int, int]:
    """Blocks of a stage's KV pool for `kv_layers` layers (and `logs` boundaries of rows) and of its
    window layers' pool (`window_layers` layers apart: 0 where none), within `budget` bytes: split so
    both hold as many sequences of `kv_context` positions (engine.window.split_budget). `kv_dtype`:
    the values' format (8-bit: a byte an element and a scale a head's vector; the logged rows stay in `dtype`)."""
    bs = block_size
    # (linear-attention layers keep no KV; a stage of only those sizes its blocks as one layer's)
    block_bytes = bs * (kv_bytes_per_token(config, max(1, kv_layers), dtype, kv_dtype)
                        + logs * config.hidden_size * dtype.itemsize)
    group_blocks = 0
    if window_layers:  # full and window layers: the budget split between their pools (engine.window)
        window_bytes = bs * kv_bytes_per_token(config, window_layers, dtype, kv_dtype)
        budget, rest = split_budget(budget, block_bytes // bs, window_bytes // bs, held_blocks(window, bs) * bs,
                                    kv_context)
        group_blocks = rest // window_bytes
        if group_blocks < 1:
            raise ValueError(f"a KV budget of {budget + rest} bytes holds no block of the window layers")
    num_blocks = budget // block_bytes
    if num_blocks < 1:
        raise ValueError(f"a KV budget of {budget} bytes holds no block of {block_bytes}")
    return num_blocks, group_blocks


def check_kv_dtype(kv_dtype: str, invariant: bool, tensor_parallel: bool) -> None:
    """ValueError, naming --kv-dtype, where a stage's kernels cannot read 8-bit KV: the batch-invariant
    and fused Triton kernels of a CUDA stage (its attention reads float KV by slot; `--batch-invariant
    off` runs the torch forward, CUDA graphs included, which dequantizes) and tensor-parallel ranks
    (their pools are mirrored without scales)."""
    if not quantized(kv_dtype):
        return
    if invariant:
        raise ValueError(f"--kv-dtype {kv_dtype}: the batch-invariant CUDA kernels read float KV only; start the "
                         "stage with --batch-invariant off (its torch attention dequantizes 8-bit KV)")
    if tensor_parallel:
        raise ValueError(f"--kv-dtype {kv_dtype}: tensor-parallel stages (--tp) keep float KV only")


def load_draft_model(options: StageOptions, device: str, dtype: str, vocab_size: int) -> DraftModel:
    """Runner thread: --draft-model for a model of `vocab_size` tokens; DraftModelError when it
    cannot serve (unreadable, another vocabulary)."""
    model = DraftModel(options.draft_model, layers=options.draft_layers, device=device, dtype=dtype)
    if model.vocab_size != vocab_size:
        raise DraftModelError(f"the draft model at {options.draft_model} has a {model.vocab_size}-token "
                              f"vocabulary, the model {vocab_size}: it needs the same tokenizer")
    return model
