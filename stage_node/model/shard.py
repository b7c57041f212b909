"""A stage's slice of a model: the weights of decoder layers [start, end) and their forward.

One forward serves every family (common.families): it reads the checkpoint's `Arch` where the
families differ (biases, q/k norms, norm style, activation, embedding scale, soft-capping,
sliding-window layers and their RoPE, a mixture of experts: stage_node.moe; the gated delta-net layers of
Qwen3.5 / Qwen3-Next, whose per-sequence state comes with the step: stage_node.model.deltanet).

The forward runs on packed rows: the new tokens of several sequences, one after the other, go
through every projection and MLP together, and only attention is done per sequence, against that
sequence's keys and values in the paged KV pool. The arithmetic follows transformers' models
operation for operation (RMSNorm in float32, HF's RoPE tables, SDPA with GQA, HF's eager attention
where scores are soft-capped or joined by sinks), so logits agree to float32 rounding and greedy tokens match; and a
row's result never depends on what else is in its batch (see `stage_node.ops`; on CUDA with
`batch_invariant`, products and attention by the kernels of `stage_node.invariant`).
"""
from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from logicpipe.common.modeldir import ModelConfig, checkpoint_index
from logicpipe.stage_node.kernels import cpu_native, fused
from logicpipe.stage_node.kernels import invariant
from logicpipe.stage_node.engine.kv import KVPool, StepKV, seq_slice
from logicpipe.stage_node.engine.kv_quant import dequantize, index_select, rotate, signs_on, unrotate
from logicpipe.stage_node.engine.states import RecurrentStates
from logicpipe.stage_node.model import deltanet, native_layers
from logicpipe.stage_node.model import tp as tp_split
from logicpipe.stage_node.model.tp import TensorParallel
from logicpipe.stage_node.model.mla import mla_attention
from logicpipe.stage_node.model.moe import experts_forward
from logicpipe.stage_node.model.ops import (
    DECODE_ROWS,
    INVARIANT_ROWS,
    Rows,
    rowwise,
    glu,
    attention,
    causal_mask,
    head_norm,
    linear,
    rms_norm,
    softcap,
)
from logicpipe.stage_node.kernels.gpu_quant import TritonMatrix
from logicpipe.stage_node.kernels.quant import HEAD_FORMAT, check_format, tensor_bytes
from logicpipe.stage_node.kernels.quant import quantize as quantize_matrix
from logicpipe.stage_node.model.rope import RopeTables, apply_rope, rope_parameters
from logicpipe.stage_node.model.weights import (
    EMBED,
    FINAL_NORM,
    LM_HEAD,
    LayerWeights,
    build_layer,
    read_tensors,
    shard_tensor_names,
)

log = logging.getLogger(__name__)

__all__ = ["Shard"]



class Shard:
    """Weights and forward of the contiguous decoder-layer range [start, end)."""

    def __init__(self, config: ModelConfig, start: int, end: int, *, first: bool, last: bool,
                 layers: list[LayerWeights], embed_tokens: torch.Tensor | None,
                 final_norm: torch.Tensor | None, lm_head: torch.Tensor | None, lm_head_tied: bool,
                 ropes: dict[str, RopeTables], device: torch.device, dtype: torch.dtype,
                 tp: TensorParallel | None = None):
        # tp: this process's rank of a tensor-parallel stage (model.tp): `config` is then its share
        # (heads, MLP), the layers its parts, the LM head its rows of the vocabulary
        self.tp = tp
        self.config = config
        self.arch = config.arch
        self.start, self.end = start, end  # decoder layers [start, end) of the whole model
        self.first, self.last = first, last  # first: holds embed_tokens; last: final norm + LM head
        self.device, self.dtype = device, dtype
        self.weight_format = str(dtype).removeprefix("torch.")  # or the quantized format of its layers
        self.layers = layers
        self.embed_tokens = embed_tokens  # [vocab, hidden] (first only); the LM head itself when tied
        self.final_norm = final_norm  # [hidden] (last only)
        self.lm_head = lm_head  # [vocab, hidden] (last only)
        self.ropes = ropes  # layer kind ("full", "sliding") -> its RoPE tables (one object when they agree)
        self.rope = ropes["full"]
        self.graphs = None  # a CUDA stage's StepGraphs (stage_node.step_graphs), set with its KV pool
        # CUDA: products and attention by the batch-invariant kernels (stage_node.invariant; set by the
        # stage's --batch-invariant); a CPU shard is batch-invariant by its row kinds and ignores it
        self.batch_invariant = False
        # CUDA with batch_invariant: plain Llama-style layers run stage_node.fused's kernels (the
        # benches turn it off to compare); see `fused_layers`
        self.use_fused = True
        # a CPU shard of natively quantized plain layers runs them in one call (native_layers; benches
        # and tests turn it off to compare)
        self.use_native = True
        # local layers of gated delta-net linear attention: their state is kept per sequence (engine.states),
        # and no KV: the pool holds the other layers' only, local layer kv_layers[j] at its index j
        self.linear_layers = tuple(i for i, w in enumerate(layers) if w.linear is not None)
        self.kv_layers = tuple(i for i, w in enumerate(layers) if w.linear is None)
        self._kv = {i: j for j, i in enumerate(self.kv_layers)}  # local layer -> its index in the pool (or group)
        # sliding-window layers that keep only their window's KV (`hold_windows`, engine.window): the window
        # (positions; None: every layer keeps its whole context), and those layers when the pool's group
        # holds them apart from full-attention layers (() when every KV layer of the stage slides)
        self.window: int | None = None
        self.window_layers: tuple[int, ...] = ()
        # its KV pools' values: "auto" (the compute dtype) or 8-bit, "int8" / "fp8" with a scale per (token, head)
        # (engine.kv_quant; set by the loader from --kv-dtype before the pool is made: `new_pool`)
        self.kv_dtype = "auto"
        owned = sum(w.numel() for w in layers)
        owned += embed_tokens.numel() if first else 0
        owned += (final_norm.numel() + (0 if lm_head_tied else lm_head.numel())) if last else 0
        self.parameter_count = owned  # parameters this stage owns (count)
        # parameters held as a copy of a tied weight owned by the first stage (count)
        self.tied_copy_count = lm_head.numel() if last and lm_head_tied and not first else 0
        c, a = config, config.arch
        self._q_size = c.num_heads * c.head_dim
        self._kv_size = c.num_kv_heads * c.head_dim
        self._scale = a.attn_scale or c.head_dim ** -0.5
        self._gemma = a.norm == "gemma"
        self._glu = glu(a.activation, limit=a.swiglu_limit, alpha=a.swiglu_alpha)  # [rows, 2 * inter] -> [rows, inter]
        self._embed_scale = torch.tensor(a.embed_scale, dtype=dtype, device=device) if a.embed_scale != 1.0 else None
        # each layer's q and k norm weights as one [heads + kv_heads, head_dim]: one norm call per layer
        self._ropes = [a.ropes(start + i) for i in range(len(layers))]  # per local layer: RoPE applied
        self._qk_norms = {i: torch.cat([w.q_norm.expand(c.num_heads, -1), w.k_norm.expand(c.num_kv_heads, -1)])
                          for i, w in enumerate(layers) if w.q_norm is not None}

    @property
    def fused_layers(self) -> bool:
        """Whether the layers run with stage_node.fused's kernels (norm + residual, RoPE + KV write,
        SwiGLU in one launch each): a CUDA stage with batch-invariant kernels, and layers of plain
        Llama style in floats or in int4 / int8 by the Triton kernels (stage_node.kernels.gpu_quant; no
        biases, per-head or extra norms, experts, Gemma norms, partial or skipped RoPE; SwiGLU)."""
        if not (self.use_fused and self.batch_invariant and self.device.type == "cuda"):
            return False
        if self._plain is None:
            a = self.arch
            self._plain = (a.norm == "llama" and a.activation == "silu" and not a.sandwich and self.dtype in
                           (torch.float32, torch.bfloat16, torch.float16) and all(
                               isinstance(m, torch.Tensor) and m.dtype == self.dtype or isinstance(m, TritonMatrix)
                               for w in self.layers for m in (w.qkv, w.o, w.gate_up, w.down)) and all(
                               w.qkv_bias is None and w.o_bias is None and w.gate_up_bias is None and
                               w.down_bias is None and w.q_norm is None and w.attn_out_norm is None and
                               w.mlp_out_norm is None and w.experts is None and w.mla is None for w in self.layers) and
                           a.rotary == 1.0 and all(self._ropes))  # RoPE over every layer's whole heads
        return self._plain

    _plain: bool | None = None

    @property
    def native(self):
        """The layers as one native call a step (stage_node.model.native_layers), or None where they
        cannot run so (or `use_native` is off)."""
        if not self.use_native:
            return None
        if self._native is None:
            why = native_layers.eligible(self)
            self._native = native_layers.NativeLayers(self) if why is None else False
            log.info("layers [%d, %d): %s", self.start, self.end,
                     "native CPU layers (one call a step)" if why is None else f"torch forward ({why})")
        return self._native or None

    _native = None
    # rank 0 of a tensor-parallel stage: its engine.tp_group.Leader, which mirrors forward and logits to
    # the other ranks before they run here
    mirror = None

    def layers_fused(self, x: torch.Tensor, positions: torch.Tensor, write_slots: torch.Tensor, kv: torch.Tensor,
                     tables: dict, attend, window: tuple | None = None) -> torch.Tensor:
        """Every layer over x [T, hidden] by stage_node.fused's kernels: positions, write_slots [T]
        int64 (device); kv: the pool's [layers, 2, kv_heads, slots, head_dim]; tables: layer kind ->
        (cos, sin_signed) [positions, head_dim]; attend(i, q) -> [T, heads * hd] attends over the
        pool (new keys already written; attend(i, q, True) -> (that, its rows rounded for o's one-row
        int4 kernel): invariant.attention's `rounded`); window: (write_slots, kv) of the window layers' own pool
        (`window_layers`; None: every layer's KV is in `kv`). The same arithmetic in the eager forward
        and a CUDA graph."""
        c = self.config
        eps = c.rms_norm_eps
        n = len(self.layers)
        group = set(self.window_layers) if window is not None else ()
        T = x.shape[0]
        # the one-row int4 products' inputs rounded by the kernel that writes them (fused.add_norm,
        # attention's merge, fused.silu_mul), not by a pre-pass of their own (gpu_quant.round_rows): the
        # same integers
        x, h, pre = self._add_norm(None, x, self.layers[0].input_norm, eps, 1, self._rounds(self.layers[0].qkv, T))
        # o's and down's parts added by their one-row int4 kernel where it runs: add_norm reads one part (not
        # on a rank of a tensor-parallel stage, whose parts its all-reduce adds)
        added = self.tp is None
        for i, w in enumerate(self.layers):
            cos, sin = tables[self.kind(i)]
            ws, pool, j = (*window, self._kv[i]) if i in group else (write_slots, kv, self._kv.get(i, i))
            # the products whose parts over K their consumer adds (rope_kv, add_norm) split where a
            # second kernel would have made that slower (invariant.summed_parts)
            qkv = invariant.mm_parts(h, w.qkv, summed=True, rounded=pre)  # [parts, T, q + 2 kv]
            q = fused.rope_kv(qkv, cos, sin, positions, ws, pool[j, 0], pool[j, 1], c.num_heads,
                              c.num_kv_heads, c.head_dim, h.dtype)
            # (o's input rounded by attention's merge, where its heads hold whole groups of 32)
            o_in, o_pre = attend(i, q, True) if self._rounds(w.o, T) and c.head_dim % 32 == 0 else (attend(i, q), None)
            x, h, pre = self._add_norm(invariant.mm_parts(o_in, w.o, summed=True, rounded=o_pre, added=added), x,
                                       w.post_norm, eps, 0, self._rounds(w.gate_up, T))
            gu = invariant.mm_parts(h, w.gate_up, rounded=pre)  # (mm's parts: silu_mul adds them as mm would)
            mlp, pre = (fused.silu_mul(gu, True, h.dtype) if self._rounds(w.down, T)
                        else (fused.silu_mul(gu, dtype=h.dtype), None))
            x, h, pre = self._add_norm(invariant.mm_parts(mlp, w.down, summed=True, rounded=pre, added=added), x,
                                       self.layers[i + 1].input_norm if i + 1 < n else None, eps, 1,
                                       i + 1 < n and self._rounds(self.layers[i + 1].qkv, T))
        return x

    def _rounds(self, m, rows: int) -> bool:
        """Whether the kernel writing m's input rounds it for m's one-row int4 kernel (gpu_quant's
        takes_rounded): not on a rank of a tensor-parallel stage, whose add_norm is its own kernel."""
        return self.tp is None and getattr(m, "takes_rounded", None) is not None and m.takes_rounded(rows)

    def _add_norm(self, ws: torch.Tensor | None, x: torch.Tensor, weight, eps: float, slot: int,
                  rounded: bool = False) -> tuple:
        """The fused layers' o or down product (its parts over K, [parts, T, N]; None: nothing) added
        to the residual x, then the next norm: fused.add_norm; on a rank of a tensor-parallel stage the
        product summed over the ranks first (TensorParallel.reduce_add_norm, one kernel on CUDA; `slot`:
        0 for o, 1 for down; a fixed order, whatever the step). -> (x, the norm, its rows rounded for
        the next product's one-row int4 kernel where `rounded`, else None)."""
        if rounded:
            return fused.add_norm(ws, x, weight, eps, rounded=True)
        if self.tp is None or ws is None:
            return (*fused.add_norm(ws, x, weight, eps), None)
        return (*self.tp.reduce_add_norm(ws, x, weight, eps, slot), None)

    @torch.inference_mode()
    def warm_up(self, pool: KVPool) -> float:
        """Run every kernel variant a step can reach once, so that none is compiled during a step: a
        CUDA stage with batch-invariant kernels compiles a Triton kernel the first time each product
        tile (by row count: invariant.mm_config), output dtype and attention variant occurs, about a
        second each (seen as 1 to 4 s eager steps under concurrency). Eager forwards (and the LM head)
        of 1, DECODE_ROWS + 1, 65 and 129 rows: one sequence each, its rows writing only `pool`'s scratch
        slot and reading zeroed or scratch positions. -> seconds taken"""
        if not (self.batch_invariant and self.device.type == "cuda"):
            return 0.0
        t0 = time.perf_counter()
        bs = pool.block_size
        top = min(129, pool.num_blocks * bs, pool.group.num_blocks * bs if pool.group is not None else 129)
        for m in sorted({1, min(invariant.DECODE_ROWS + 1, top), min(65, top), top}):
            nb = -(-m // bs)
            reads = [StepKV(p, torch.full((m,), p.scratch_slot, dtype=torch.long, device=self.device),
                            (seq_slice(0, m, list(range(nb)), bs, self.device, 0),))
                     for p in ((pool,) if pool.group is None else (pool, pool.group))]  # (the window layers' own)
            kv = dataclasses.replace(reads[0], window=reads[1] if len(reads) > 1 else None)
            gen = torch.Generator(device=self.device).manual_seed(0)
            x = torch.randn(m, self.config.hidden_size, generator=gen, device=self.device).to(self.dtype)
            out = self.forward(x, kv)
            if self.last:
                self.logits(out)
        torch.cuda.synchronize(self.device)
        took = time.perf_counter() - t0
        log.info("warmed the kernels of layers [%d, %d) in %.1f s", self.start, self.end, took)
        return took

    def kind(self, i: int) -> str:
        """Local layer i's attention: "full" or "sliding"."""
        return "sliding" if self.arch.sliding(self.start + i) else "full"

    @property
    def decode_rows(self) -> Rows:
        """The rows of a step of decode rows only (a CUDA graph's step; the LM head's rows)."""
        return INVARIANT_ROWS if self.batch_invariant else DECODE_ROWS

    def norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, weight, self.config.rms_norm_eps, self._gemma)

    @classmethod
    def load(cls, model_dir, start: int, end: int, *, first: bool, last: bool,
             device="cpu", dtype=torch.float32, quantize: str = "none", tp: TensorParallel | None = None) -> "Shard":
        """Load layers [start, end) (+ embeddings if first, + final norm and LM head if last);
        `quantize`: the layers' matrices in int4 / int8 / nf4 / fp4, each quantized as it is built
        (with int4 / int8 the LM head in int8 too, quant.HEAD_FORMAT); `tp`: this rank's part of
        a tensor-parallel stage (model.tp), each layer split as it is read."""
        t0 = time.perf_counter()
        model_dir = Path(model_dir)
        config = ModelConfig.from_dir(model_dir)
        check_range(config, start, end)
        device = torch.device(device)
        index = checkpoint_index(model_dir)
        tied = config.tie_word_embeddings or LM_HEAD not in index
        if tied and not config.tie_word_embeddings and last:
            log.warning("%s has no %s: using the input embeddings as LM head", model_dir, LM_HEAD)
        names = shard_tensor_names(config, start, end, first=first, last=last, tied=tied)
        t = read_tensors(model_dir, names, index)
        if quantize != "none":
            check_format(quantize, device.type)
            if config.arch.hybrid:
                raise ValueError(f"--quantize {quantize}: quantized linear-attention layers ({config.family}) are "
                                 "not supported yet; run this stage unquantized")
        whole = config
        if tp is not None:
            config = tp_split.local_config(config, tp.world)
        layers = [quantize_layer(tp_split.part_of(build_layer(t, i, whole, device=device, dtype=dtype), whole, tp), quantize)
                  for i in range(start, end)]
        embed = t.pop(EMBED).to(device=device, dtype=dtype) if EMBED in t else None  # [vocab, hidden]
        norm = t.pop(FINAL_NORM).to(device=device, dtype=dtype) if last else None
        head = None
        if last:  # tied: the embeddings serve as the head (one tensor on a stage that is both)
            head = embed if tied else t.pop(LM_HEAD).to(device=device, dtype=dtype)  # [vocab, hidden]
            if tp is not None:  # this rank's rows of the vocabulary
                a, b = tp.span(whole.vocab_size)
                head = head[a:b].contiguous()
            if quantize in HEAD_FORMAT:  # int4 / int8 stages: the head in int8 (a copy beside a tied embedding)
                head = quantize_matrix(head, HEAD_FORMAT[quantize])
        del t
        ropes = {"full": RopeTables(*rope_parameters(model_dir, "full"), dtype=dtype, device=device)}
        if "sliding" in config.arch.layer_types:
            sliding = rope_parameters(model_dir, "sliding")
            same = torch.equal(sliding[0], ropes["full"].inv_freq.cpu()) and sliding[1] == ropes["full"].scaling
            ropes["sliding"] = ropes["full"] if same else RopeTables(*sliding, dtype=dtype, device=device)
        if tp is not None:  # every rank loads at the same point: the one-shot all-reduce's buffer is exchanged here
            tp.enable_one_shot(config.hidden_size, dtype, device)
        shard = cls(config, start, end, first=first, last=last, layers=layers,
                    embed_tokens=embed if first else None, final_norm=norm, lm_head=head,
                    lm_head_tied=tied, ropes=ropes, device=device, dtype=dtype, tp=tp)
        shard.weight_format = quantize if quantize != "none" else str(dtype).removeprefix("torch.")
        log.info("loaded layers [%d, %d) of %s%s%s: %.1fM params (+%.1fM tied copy), %s %s, weights %s in %.1f MiB, "
                 "%.2f s", start, end, model_dir.name, " +embed" if first else "", " +head" if last else "",
                 shard.parameter_count / 1e6, shard.tied_copy_count / 1e6, device, dtype, shard.weight_format,
                 shard.weight_bytes / 2**20, time.perf_counter() - t0)
        return shard

    @property
    def num_layers(self) -> int:
        return self.end - self.start

    @property
    def weight_bytes(self) -> int:
        """Bytes of the weights this stage holds (quantized matrices at their packed size; a tied
        LM head that is the embedding matrix counted once)."""
        total = sum(tensor_bytes(x) for w in self.layers for x in vars(w).values())
        held = {id(x): x for x in (self.embed_tokens, self.final_norm, self.lm_head) if x is not None}
        return total + sum(tensor_bytes(x) for x in held.values())

    def hold_windows(self) -> bool:
        """Let this shard's sliding-window layers keep only their window's KV (engine.window): the
        torch forward, the native CPU layers, the batch-invariant and fused CUDA kernels and the step
        graphs all read a window from its first position (`SeqSlice.lo`). With full layers too, the
        window layers move to a pool of their own (`window_layers`). Call it before its pool and
        graphs are made. -> whether it does (a shard without sliding layers, or of latent attention: no)."""
        if self.window is not None:
            return True
        a = self.arch
        sliding = tuple(i for i in self.kv_layers if self.kind(i) == "sliding")
        if not sliding or not a.sliding_window or a.mla or self.tp is not None or self.mirror is not None:
            return False
        if self.graphs is not None:
            raise RuntimeError("hold_windows: the shard's step graphs were made over a pool without windows")
        self.window = a.sliding_window
        if len(sliding) < len(self.kv_layers):
            self.window_layers = sliding
            self.kv_layers = tuple(i for i in self.kv_layers if i not in sliding)
            self._kv = {i: j for j, i in enumerate(self.kv_layers)} | {i: j for j, i in enumerate(sliding)}
        return True

    def new_pool(self, num_blocks: int, block_size: int, group_blocks: int = 0) -> KVPool:
        """A KV pool for this shard's layers (those that keep KV): `num_blocks` blocks of `block_size`
        positions; with `window_layers`, theirs apart in `pool.group`, of `group_blocks` blocks."""
        c = self.config
        mla = self.arch.mla
        pool = KVPool(len(self.kv_layers), c.num_kv_heads, c.head_dim, num_blocks, block_size, dtype=self.dtype,
                      device=self.device, parts=c.kv_parts, value_dim=mla.kv_lora_rank if mla else None,
                      kv_dtype=self.kv_dtype)
        if self.window_layers:
            pool.group = KVPool(len(self.window_layers), c.num_kv_heads, c.head_dim, group_blocks, block_size,
                                dtype=self.dtype, device=self.device, parts=c.kv_parts, kv_dtype=self.kv_dtype)
        if self.linear_layers:  # their recurrent states, per sequence, beside the KV of the other layers
            pool.states = RecurrentStates()
        return pool

    @torch.inference_mode()
    def embed(self, token_ids: torch.Tensor, checked: bool = False) -> torch.Tensor:
        """token_ids: [T] int64 -> hidden states [T, hidden] (first stage only). `checked`: the ids
        are known to lie in the vocabulary (the last stage's own tokens, on the device: no check,
        which would wait for the device)."""
        if not self.first:
            raise RuntimeError(f"shard [{self.start}, {self.end}) is not a first stage: it has no embeddings")
        if not checked and token_ids.numel() and (int(token_ids.min()) < 0 or int(token_ids.max()) >= self.config.vocab_size):
            raise ValueError(f"token ids must lie in [0, {self.config.vocab_size})")  # checked where they are (CPU)
        x = F.embedding(token_ids.to(device=self.device, dtype=torch.long), self.embed_tokens)
        return x if self._embed_scale is None else x * self._embed_scale

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [B, hidden] -> logits [B, vocab] float32 (last stage only)."""
        if not self.last:
            raise RuntimeError(f"shard [{self.start}, {self.end}) is not a last stage: it has no LM head")
        hidden = hidden.to(device=self.device, dtype=self.dtype)
        if self.mirror is not None:  # a tensor-parallel stage's rank 0: the other ranks gather with it
            with self.mirror.lost_on_error():  # (a send that fails: a member is gone)
                self.mirror.logits(hidden)
                return self._logits(hidden)
        return self._logits(hidden)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self._own_logits(hidden)
        if self.tp is not None:  # each rank's rows of the vocabulary, side by side
            logits = self.tp.all_gather_last(logits.contiguous())
        return logits

    def _own_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The logits of this shard's rows of the vocabulary (a tensor-parallel rank's share) [B, rows] float32."""
        if self.fused_layers:  # the final norm by the fused layers' kernel (one launch)
            logits = invariant.mm(fused.add_norm(None, hidden, self.final_norm, self.config.rms_norm_eps)[1],
                                  self.lm_head)
        else:
            logits = linear(self.norm(hidden, self.final_norm), self.lm_head, None, self.decode_rows)
        return softcap(logits, self.arch.final_softcap).float()

    @torch.inference_mode()
    def greedy(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [B, hidden] -> each row's greedy token [B] int64 on the device: the argmax of
        `logits(hidden)` (the first of equal maxima; a NaN counts as the largest, as torch.argmax has
        it). A tensor-parallel stage gathers each rank's (largest logit, its index) instead of the
        logits: the first rank holding the overall largest has the overall first index of it."""
        if not self.last:
            raise RuntimeError(f"shard [{self.start}, {self.end}) is not a last stage: it has no LM head")
        hidden = hidden.to(device=self.device, dtype=self.dtype)
        if self.tp is None:
            return self._logits(hidden).argmax(-1)
        if self.mirror is not None:  # rank 0: the other ranks take their share with it
            with self.mirror.lost_on_error():
                self.mirror.greedy(hidden)
                return self._greedy(hidden)
        return self._greedy(hidden)

    def _greedy(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self._own_logits(hidden)  # [B, V / world]
        at = logits.argmax(-1, keepdim=True)
        # (value, index in the whole vocabulary) in float64, exact for both: one gather of 16 bytes a row and rank
        mine = torch.cat([logits.gather(-1, at).double(), (at + self.tp.span(self.config.vocab_size)[0]).double()], -1)
        every = self.tp.all_gather_rows(mine)  # [world, B, 2], in rank order
        best = every[..., 0].argmax(0, keepdim=True)  # [1, B]: the first rank of the largest
        return every[..., 1].gather(0, best)[0].long()

    @torch.inference_mode()
    def forward(self, hidden: torch.Tensor, kv: StepKV, first: int = 0, stop: int | None = None) -> torch.Tensor:
        """hidden: [T, hidden], rows of kv.seqs[0], kv.seqs[1], ... packed in order -> [T, hidden].

        Writes each new row's keys/values into its slot of the pool (kv.write_slots) and attends,
        per sequence, over its positions [0, start_pos + num_tokens). `first`: the local layer the
        rows enter (their earlier layers' KV is in the pool already: a replay resumed over kept
        layers, issue 34; the torch forward only, see `can_tap`); `stop`: the local layer they
        leave before (None: the last; the rows returned are then those entering it). The rows entering each boundary
        the pool logs inside the range are written to it (`KVPool.logs`).
        """
        hidden = hidden.to(device=self.device, dtype=self.dtype)
        check_step(hidden, kv, len(self.kv_layers))
        if (first or stop is not None) and not self.can_tap:
            raise ValueError(f"layers [{self.start}, {self.end}) run whole (native or fused layers): "
                             f"they cannot start at layer {self.start + first}")
        if self.mirror is not None:  # a tensor-parallel stage's rank 0: the other ranks run it too
            with self.mirror.lost_on_error():  # (a send that fails: a member is gone)
                self.mirror.forward(hidden, kv)
                return self._forward(hidden, kv)
        return self._forward(hidden, kv, first, stop)

    @property
    def can_tap(self) -> bool:
        """Every row this shard computes runs the layer-by-layer torch forward (no native or fused
        layers, no CUDA graphs, no tensor parallelism): it can log the rows entering a boundary
        inside its range and start rows at any of its layers."""
        return (self.tp is None and self.mirror is None and self.graphs is None and not self.fused_layers
                and not (self.device.type == "cpu" and self.native is not None))

    def _forward(self, hidden: torch.Tensor, kv: StepKV, first: int = 0, stop: int | None = None) -> torch.Tensor:
        seqs = kv.seqs
        if self.device.type == "cpu" and self.native is not None:
            return self.native.forward(hidden, kv)
        # what each attention kind reads: the sliding-window layers their window (`hold_windows`: from the
        # pool's group where the stage has full layers too), the others every position
        reading = {kind: kv.window if kind == "sliding" and kv.window is not None else kv for kind in self.ropes}
        read_kvs = {id(r): r for r in reading.values()}  # (one StepKV for every kind unless windows are held)
        reads = None
        if self.batch_invariant:
            by_kv = {key: self._invariant_reads(r) for key, r in read_kvs.items()}
            reads = {kind: by_kv[id(r)] for kind, r in reading.items()}
        if self.fused_layers:
            positions = reads["full"][1]
            top = max(s.stop for s in seqs)
            for rope in self.ropes.values():
                rope.lookup(0, top)  # grows its tables to the step's positions
            ropes = {kind: (rope.cos, rope.sin_signed) for kind, rope in self.ropes.items()}

            def attend_fused(i, q, rounded=False):
                kind = self.kind(i)
                pool, (table, _, tiles, tiles_at) = reading[kind].pool, reads[kind]
                return invariant.attention(q, pool.k[self._kv[i]], pool.v[self._kv[i]], table, positions, tiles,
                                           scale=self._scale, cap=self.arch.attn_softcap, tiles_at=tiles_at,
                                           window=self.arch.sliding_window if kind == "sliding" else None,
                                           rounded=rounded)

            window = None if kv.window is None else (kv.window.write_slots, kv.window.pool.kv)
            return self.layers_fused(hidden, positions, kv.write_slots, kv.pool.kv, ropes, attend_fused, window)
        if len(seqs) == 1:
            s = seqs[0]
            tables = {kind: rope.lookup(s.start_pos, s.stop) for kind, rope in self.ropes.items()}  # [T, head_dim]
        else:
            positions = torch.cat([torch.arange(s.start_pos, s.stop) for s in seqs]).to(self.device)
            tables = {kind: rope.gather(positions) for kind, rope in self.ropes.items()}  # [T, head_dim]
        window = self.arch.sliding_window
        masks = {kind: [causal_mask(s.start_pos, s.num_tokens, self.device, window if kind == "sliding" else None, s.lo)
                        for s in reading[kind].seqs] for kind in self.ropes}
        rows = Rows.split([p >= s.decode_from for s in seqs for p in range(s.start_pos, s.stop)], self.device,
                          invariant=self.batch_invariant)
        # a CPU stage's float32 or int8 KV: attention reads the pool in place (cpu_quant.c's lp_attend), every
        # row of a layer in one call (a layer with sinks: torch's path)
        direct = None
        if reads is None and self._reads_native(kv.pool):
            by_kv = {key: self._native_reads(r) for key, r in read_kvs.items()}
            direct = {kind: by_kv[id(r)] for kind, r in reading.items()}
        spans = None  # torch's path: views of the pool where a sequence's slots are consecutive, once a step
        if reads is None and (direct is None or any(w.sinks is not None for w in self.layers)):
            by_kv = {key: self._spans(r) for key, r in read_kvs.items()}
            spans = {kind: by_kv[id(r)] for kind, r in reading.items()}

        c = self.config
        logs = kv.pool.logs
        for i, w in enumerate(self.layers):
            if i < first:
                continue
            if stop is not None and i >= stop:
                break
            if i and self.start + i in logs:  # the rows entering layer i, for a later replay (issue 34)
                logs[self.start + i].index_copy_(0, kv.write_slots, hidden)
            if w.linear is not None:  # gated delta-net: the sequences' recurrent states, no KV
                mixed = deltanet.mix(self.norm(hidden, w.input_norm), w.linear, self.arch.linear, seqs, kv.states, i,
                                     rows, c.rms_norm_eps)
                hidden = self._mlp(w, hidden + mixed, rows)
                continue
            kind = self.kind(i)
            cos, sin = tables[kind]

            def attend(i, q, k, v, masks=masks[kind], kind=kind):
                if reads is not None:
                    return self._attention_invariant(i, q, k, v, reading[kind], reads[kind], kind)
                native = direct[kind] if direct is not None and v is not None and self.layers[i].sinks is None else None
                return self._attention(i, q, k, v, reading[kind], masks, None if spans is None else spans[kind],
                                       native, kind)

            hidden = self._layer(i, w, hidden, cos, sin, rows, attend)
        return hidden

    def _layer(self, i: int, w: LayerWeights, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               rows: Rows, attend) -> torch.Tensor:
        """One decoder layer over x [T, hidden] (cos, sin: its RoPE at the rows' positions);
        `attend(i, q, k, v)` stores the new keys and values of layer i and attends (the eager
        forward's per sequence, or a graph's batched one)."""
        c = self.config
        T = x.shape[0]
        if w.mla is not None:  # multi-head latent attention (stage_node.model.mla; never tensor-parallel)
            attn = mla_attention(i, w, self.norm(x, w.input_norm), self.arch.mla, c.num_heads, cos, sin, rows, attend)
            return self._mlp(w, x + linear(attn, w.o, w.o_bias, rows), rows)
        qkv = linear(self.norm(x, w.input_norm), w.qkv, w.qkv_bias, rows)  # [T, q + 2 kv]
        qk_heads = c.num_heads + c.num_kv_heads
        qk = qkv[:, : self._q_size + self._kv_size].view(T, qk_heads, c.head_dim)
        if w.q_norm is not None:  # per-head norms, before RoPE: q's heads by q_norm, k's by k_norm, in one call
            qk = head_norm(qk, self._qk_norms[i], c.rms_norm_eps, self._gemma)
        if self._ropes[i]:  # SmolLM3: some layers without RoPE
            qk = apply_rope(qk, cos, sin)
        q, k = qk[:, : c.num_heads], qk[:, c.num_heads:]  # q: [T, heads, hd]; k: [T, kv_heads, hd]
        v = qkv[:, self._q_size + self._kv_size: self._q_size + 2 * self._kv_size].view(T, c.num_kv_heads, c.head_dim)
        attended = attend(i, q, k, v)  # [T, heads * head_dim]
        if self.arch.attn_gate:  # Qwen3.5 / Qwen3-Next: each head's output gated by sigmoid(x W_gate)
            attended = attended * rowwise(torch.sigmoid, qkv[:, self._q_size + 2 * self._kv_size:])
        attn = self._reduced(linear(attended, w.o, None, rows), w.o_bias)
        return self._mlp(w, x + (attn if w.attn_out_norm is None else self.norm(attn, w.attn_out_norm)), rows)

    def _mlp(self, w: LayerWeights, x: torch.Tensor, rows: Rows) -> torch.Tensor:
        """The layer's second half over x [T, hidden] (the residual after attention): norm, MLP or
        experts, residual."""
        h = self.norm(x, w.post_norm)
        if w.experts is not None:
            mlp = self._reduced(experts_forward(h, w.experts, self.arch.moe, self._glu, rows), None)
        else:
            mlp = self._reduced(linear(self._glu(linear(h, w.gate_up, w.gate_up_bias, rows)), w.down, None, rows),
                                w.down_bias)
        return x + (mlp if w.mlp_out_norm is None else self.norm(mlp, w.mlp_out_norm))

    def _reduced(self, y: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """A row-parallel product's result: the ranks' partial sums added (tensor-parallel), then its bias."""
        if self.tp is not None:
            y = self.tp.all_reduce(y)
        return y if bias is None else y + bias

    def _attention(self, i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: StepKV,
                   masks: list, spans: list, native: tuple | None = None, kind: str = "full") -> torch.Tensor:
        """Store the new rows' k/v in their pool slots, then per sequence attend over its
        positions [0, stop) (`spans`: the step's `_spans`). `native` (the step's `_native_reads`): every row by
        cpu_quant.c's lp_attend instead, reading the pool in place. -> [T, heads * head_dim]"""
        pool, j = kv.pool, self._kv[i]
        k_pool, v_pool = pool.k[j], pool.v[j]  # [kv_heads, slots, head_dim]
        pool.store(j, kv.write_slots, k, v)  # (v None: MLA's latent rows, whose values are a part of k's: pool.v)
        # 8-bit keys and values stored rotated: so are the queries, and the output is un-rotated; float32 rows
        # read natively are rotated inside the native call (the same bits, two fewer calls a layer)
        inside = native is not None and pool.rotated and q.dtype == torch.float32
        if pool.rotated and not inside:
            q = rotate(q).to(q.dtype)
        if native is not None:
            table, row_seq, pos = native
            window = (self.arch.sliding_window if kind == "sliding" else 0) or 0
            scales = {} if pool.scales is None else {"ks": pool.scales[j, 0], "vs": pool.scales[j, 1]}
            out = cpu_native.attend(q, pool.kv[j, 0], pool.kv[j, 1], table, row_seq, pos, window, self._scale,
                                    signs=signs_on(q) if inside else None, **scales).to(q.dtype)
            return unrotate(out.view(q.shape)).reshape(q.shape[0], -1) if pool.rotated and not inside else out
        # per sequence few ops (ops.attention: the calls HF's sdpa path makes): a CPU decode step of
        # 8 sequences runs 240 of these loops
        qh = q.transpose(0, 1)[None]  # [1, heads, T, hd]
        one = len(kv.seqs) == 1
        outs, row = [], 0
        for s, mask, span in zip(kv.seqs, masks, spans):
            if span is not None:  # consecutive blocks: strided views of the pool, taken once a step
                keys, values = span[0][j], span[1][j]
                if pool.quantized:  # 8-bit KV: dequantized as read (MLA: the values are part of the keys)
                    keys = dequantize(keys, span[2][j], self.dtype)
                    values = keys[..., : v_pool.shape[-1]] if v is None else dequantize(values, span[3][j], self.dtype)
            else:
                keys = index_select(k_pool, 1, s.slots)[None]
                if pool.quantized:
                    keys = dequantize(keys, pool.ks[j].index_select(1, s.slots)[None], self.dtype)
                # MLA: the values are the first elements of the gathered latent rows (index_select of the
                # pool's non-contiguous value view would copy the whole pool first)
                if v is None:
                    values = keys[..., : v_pool.shape[-1]]
                else:
                    values = index_select(v_pool, 1, s.slots)[None]
                    if pool.quantized:
                        values = dequantize(values, pool.vs[j].index_select(1, s.slots)[None], self.dtype)
            outs.append(attention(qh if one else qh[:, :, row: row + s.num_tokens], keys, values, mask,
                                  scale=self._scale, cap=self.arch.attn_softcap, sinks=self.layers[i].sinks))
            row += s.num_tokens
        o = outs[0] if one else torch.cat(outs, 2)  # [1, heads, T, hd]
        return (unrotate(o[0]) if pool.rotated else o[0]).transpose(0, 1).reshape(q.shape[0], -1)

    def _spans(self, kv: StepKV) -> list:
        """Per sequence of the step: its keys and values of every layer, [layers, 1, kv_heads, stop - lo,
        head_dim] views of the pool, and with 8-bit KV their scales [layers, 1, kv_heads, stop - lo] (None
        for a sequence gathered by slot)."""
        pool = kv.pool
        k, v = pool.k[:, None], pool.v[:, None]
        ks, vs = (None, None) if pool.scales is None else (pool.ks[:, None], pool.vs[:, None])
        out = []
        for s in kv.seqs:
            if s.span is None:
                out.append(None)
                continue
            a, b = s.span, s.span + s.stop - s.lo
            out.append((k[:, :, :, a:b], v[:, :, :, a:b]) + ((None, None) if ks is None else (ks[..., a:b], vs[..., a:b])))
        return out

    def _reads_native(self, pool: KVPool) -> bool:
        """Whether attention reads `pool` in place by cpu_quant.c's lp_attend: a CPU stage with the native
        kernels, float32 or int8 KV, no soft-capping, no MLA, at most ATT_PAIRS (64) query heads a KV head
        (sinks are told per layer). Else torch's path: each sequence's keys gathered (or a view where its
        slots are consecutive), then SDPA (bf16 / fp16 compute, fp8 KV, Gemma 2's cap, MLA, gpt-oss' sinks)."""
        c = self.config
        return (self.device.type == "cpu" and self.arch.attn_softcap is None and self.arch.mla is None
                and c.num_heads // c.num_kv_heads <= 64 and cpu_native.library() is not None
                and (pool.kv_dtype == "int8" or (pool.scales is None and pool.kv.dtype == torch.float32
                                                 and self.dtype == torch.float32)))

    def in_place_rows(self, pool: KVPool) -> int:
        """A sequence with at most this many rows in a step reads its keys where they lie in `pool`
        (no gather: lp_attend, or a CUDA stage's paged kernels); 0: every sequence's are gathered."""
        if self.device.type == "cuda" and self.batch_invariant:
            return 1 << 30
        if self.device.type == "cpu" and self.native is not None:  # lp_layers: every row
            return 1 << 30
        if self.device.type == "cpu" and self._reads_native(pool):
            return 1 << 30
        return 0

    def _slot_table(self, seqs) -> torch.Tensor:
        """Each sequence's slot of each of its positions from its first read one (`lo`) [seqs, longest]
        int64 on the stage's device (a window's positions before lo, given back, are never read: zeros)."""
        table = torch.zeros(len(seqs), max(s.stop for s in seqs), dtype=torch.long, device=self.device)
        for i, s in enumerate(seqs):
            if s.span is not None:
                table[i, s.lo: s.stop] = torch.arange(s.span, s.span + s.stop - s.lo, device=self.device)
            else:
                table[i, s.lo: s.stop] = s.slots
        return table

    def _native_reads(self, kv: StepKV) -> tuple:
        """What lp_attend reads for every layer of a step, every row of every sequence (a row's bits must not
        depend on how many rows its sequence has in the step, or a replay's chunk would give other bits than
        the decode steps it recomputes): the slot table (`_slot_table`), each row's sequence and position
        [T] int64."""
        seqs = kv.seqs
        pos = torch.cat([torch.arange(s.start_pos, s.stop) for s in seqs])
        row_seq = torch.repeat_interleave(torch.arange(len(seqs)), torch.tensor([s.num_tokens for s in seqs]))
        return self._slot_table(seqs), row_seq, pos

    def _invariant_reads(self, kv: StepKV) -> tuple:
        """What the batch-invariant attention reads, for every layer of a step: each sequence's slot
        of each of its positions from its first read one (`lo`) [seqs, longest] int64, each row's position [T] int64, the tiles and
        their first rows (stage_node.invariant.attention)."""
        seqs = kv.seqs
        table = self._slot_table(seqs)
        positions = torch.tensor([p for s in seqs for p in range(s.start_pos, s.stop)], dtype=torch.long)
        tiles = invariant.seq_tiles([s.num_tokens for s in seqs], self.config.num_heads // self.config.num_kv_heads)
        return (table, positions.to(self.device, non_blocking=True), invariant.tiles_tensor(tiles, self.device),
                [t[0] for t in tiles])

    def _attention_invariant(self, i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: StepKV,
                             reads: tuple, kind: str) -> torch.Tensor:
        """Store the new rows' k/v, then every row attends by the batch-invariant kernel. -> [T, heads * hd]"""
        k_pool, v_pool = kv.pool.k[self._kv[i]], kv.pool.v[self._kv[i]]  # [kv_heads, slots, head_dim]
        k_pool.index_copy_(1, kv.write_slots, k.transpose(0, 1))
        if v is None:  # MLA: the kernel reads whole latent rows as values (the caller keeps the latent part)
            v_pool = k_pool
        else:
            v_pool.index_copy_(1, kv.write_slots, v.transpose(0, 1))
        table, positions, tiles, tiles_at = reads
        return invariant.attention(q, k_pool, v_pool, table, positions, tiles, scale=self._scale,
                                   cap=self.arch.attn_softcap, tiles_at=tiles_at,
                                   window=self.arch.sliding_window if kind == "sliding" else None,
                                   sinks=self.layers[i].sinks)


def quantize_layer(w: LayerWeights, fmt: str) -> LayerWeights:
    """A layer with its matrices quantized to `fmt` ("none": as it is), each expert's on its own
    (the router stays in floats); the float copies go."""
    if fmt == "none":
        return w
    if w.experts is not None:
        e = w.experts
        experts = dataclasses.replace(e, gate_up=[quantize_matrix(m, fmt) for m in e.gate_up.unbind(0)],
                                      down=[quantize_matrix(m, fmt) for m in e.down.unbind(0)])
        return dataclasses.replace(w, qkv=quantize_matrix(w.qkv, fmt), o=quantize_matrix(w.o, fmt), experts=experts)
    return dataclasses.replace(w, **{name: quantize_matrix(getattr(w, name), fmt)
                                     for name in ("qkv", "o", "gate_up", "down")})


def check_range(config: ModelConfig, start: int, end: int) -> None:
    if not (0 <= start < end <= config.num_layers):
        raise ValueError(f"layer range [{start}, {end}) must satisfy 0 <= start < end <= {config.num_layers}")


def check_step(hidden: torch.Tensor, kv: StepKV, num_layers: int) -> None:
    if hidden.dim() != 2:
        raise ValueError(f"hidden states must be [tokens, hidden], got shape {tuple(hidden.shape)}")
    if not kv.seqs:
        raise ValueError("forward needs at least one sequence")
    if kv.pool.num_layers != num_layers:
        raise ValueError(f"KV pool has {kv.pool.num_layers} layers, this shard {num_layers}")
    total = 0
    for s in kv.seqs:
        if s.num_tokens < 1:
            raise ValueError(f"each sequence needs at least one token, got {s.num_tokens}")
        if s.start_pos < 0:
            raise ValueError(f"start_pos {s.start_pos} is negative")
        total += s.num_tokens
    if total != hidden.shape[0] or kv.write_slots.numel() != total:
        raise ValueError(f"sequences hold {total} tokens but hidden states have {hidden.shape[0]} rows "
                         f"and {kv.write_slots.numel()} write slots")
