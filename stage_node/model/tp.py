"""Tensor parallelism inside one stage (issue 36): a stage's layers split over `world` ranks (the GPUs
of one node through NCCL, or several CPU processes or hosts through gloo), Megatron-style.

Per layer, rank r of w holds (`split_layer`):
  * attention: query heads [r * H / w, (r + 1) * H / w) and their key/value heads (kv_heads / w each,
    so H / kv_heads query heads keep sharing theirs), its rows of the fused q/k/v matrix (and bias,
    per-head norms are shared), the matching columns of the output projection; its KV pool holds its
    heads only;
  * a dense MLP: intermediate columns [r * I / w, (r + 1) * I / w) of gate and of up (rows of the
    fused gate_up), the matching columns of down;
  * a mixture of experts (expert parallelism): the whole experts [r * E / w, (r + 1) * E / w) (the
    router and its biases on every rank, so every rank routes every row the same); a row's routed
    experts that live elsewhere count zero here; a shared expert split as a dense MLP;
  * norms everywhere.
After the output projection and after the MLP (or the experts) each rank holds a partial sum of
the whole result: one all-reduce (`TensorParallel.all_reduce`) each, then the biases of those
products, once. Every rank then holds the same residual stream, so the next layer, the next stage's
input and the sampled tokens are the same on every rank; rank 0 is the one that talks to the mesh.

The LM head is split over the vocabulary (rank r: rows [r * V / w, (r + 1) * V / w)), its logits
gathered; the embeddings stay whole on every rank (one row per token, nothing to gain).

Reduction order. An all-reduce of w ranks adds the same partial sums in the same order every time
(gloo's and NCCL's ring / tree for a fixed world and size; on CUDA, PyTorch's one-shot kernel over
symmetric memory for every all-reduce of up to ONE_SHOT_ROWS rows, each GPU adding the ranks' copies
in rank order), so a row's bits do not depend on the
step it is in any more than without TP; they differ from one rank's whole product by float rounding.
The fused layers on CUDA (Shard.layers_fused) reduce the o and down products by
`TensorParallel.reduce_add_norm` instead: one kernel (stage_node.kernels.tp_reduce) that pushes each
rank's partial sum into its peers' buffers and adds them in rank order with the residual, then the
next norm; on two ranks the same bits as the one-shot all-reduce and the separate norm kernel.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from logicpipe.common.modeldir import ModelConfig, ModelError
from logicpipe.stage_node.kernels import fused as fused_kernels
from logicpipe.stage_node.kernels import invariant, tp_reduce
from logicpipe.stage_node.model.weights import Experts, LayerWeights

try:  # PyTorch's symmetric memory (CUDA): the one-shot all-reduce
    import torch.distributed._symmetric_memory as symm_mem
except ImportError:
    symm_mem = None

log = logging.getLogger(__name__)

ONE_SHOT_ROWS = 512  # the one-shot buffer holds this many rows (--max-step-tokens' default); larger steps: NCCL


@dataclass
class TensorParallel:
    """This process's place in a tensor-parallel stage: rank of world, and the torch.distributed
    process group that links the ranks (None: the default group)."""

    rank: int
    world: int
    group: object = None
    one_shot: torch.Tensor | None = field(default=None, compare=False, repr=False)  # CUDA: the symmetric buffer of the one-shot all-reduce (enable_one_shot)
    _one_shot_group: str = field(default="", compare=False, repr=False)  # its process group's name
    _copy_in: bool = field(default=False, compare=False, repr=False)  # one_shot_all_reduce_copy works here
    # CUDA: the symmetric buffer of the fused all-reduce + residual add + norm (`reduce_add_norm`,
    # stage_node.kernels.tp_reduce: 2 slots x world regions x ONE_SHOT_ROWS rows), every rank's as mapped here
    push: torch.Tensor | None = field(default=None, compare=False, repr=False)
    _push_bufs: list = field(default_factory=list, compare=False, repr=False)
    _push_handle: object = field(default=None, compare=False, repr=False)  # keeps the mappings

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's x (same shape on every rank); returned (x itself over NCCL or gloo).
        On CUDA, where it fits the symmetric buffer, PyTorch's one-shot all-reduce: every GPU reads the
        others' copies over NVLink and adds them in rank order, about 7 us for a decode row of 4096 on
        two H200s where NCCL's takes 16 (bench.gpu_allreduce), inside a CUDA graph too. Which one runs
        depends only on the size against the buffer, never on the step, so a row's bits do not depend
        on the rows beside it (batch invariance)."""
        buf = self.one_shot
        if buf is not None and x.dtype == buf.dtype and x.numel() <= buf.numel():
            part = buf[: x.numel()]
            if self._copy_in:  # x copied into the symmetric buffer by the all-reduce's own kernel
                return torch.ops.symm_mem.one_shot_all_reduce_copy(part, x.reshape(-1), "sum",
                                                                   self._one_shot_group).view(x.shape)
            part.copy_(x.reshape(-1))
            return torch.ops.symm_mem.one_shot_all_reduce(part, "sum", self._one_shot_group).view(x.shape)
        x = x.contiguous()
        dist.all_reduce(x, group=self.group)
        return x

    def reduce_add_norm(self, ws: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, eps: float,
                        slot: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """fused.add_norm of the sum over the ranks of this rank's product (its parts over K, `ws`
        [parts, M, N]) and the residual x [M, N], then the norm `weight` (None: none) -> (x', h). On
        CUDA where the push buffer is on and M <= ONE_SHOT_ROWS: one kernel (tp_reduce.push_add_norm;
        `slot` 0 or 1 in turn: a layer's o product 0, its down product 1), about 4 us for a decode row
        of 4096 on two H200s where the parts' sum, the one-shot all-reduce and add_norm took 8 to 10
        (bench.gpu_tp_fuse); else those three. On two ranks both give the same bits (one rounding of
        the two partial sums; with more ranks the kernel is on only where its sums equalled the
        one-shot's at load); which one runs depends on the shape only, never on the step."""
        if self.push is not None and x.dtype == self.push.dtype and x.shape[0] <= ONE_SHOT_ROWS:
            return tp_reduce.push_add_norm(ws, x, weight, eps, bufs=self._push_bufs, slot=slot, rank=self.rank,
                                           rows=ONE_SHOT_ROWS)
        return fused_kernels.add_norm(self.all_reduce(invariant.add_parts(ws, x.dtype))[None], x, weight, eps, tp=True)

    def enable_one_shot(self, hidden: int, dtype: torch.dtype, device: torch.device) -> bool:
        """CUDA ranks, every one at the same point (a shard's load): allocate and exchange the
        symmetric buffer of ONE_SHOT_ROWS rows of `hidden` in `dtype`, check one sum, and agree (over
        NCCL) to use it only where every rank could. -> whether it is on."""
        if device.type != "cuda" or symm_mem is None or self.world < 2:
            return False
        n = ONE_SHOT_ROWS * hidden
        if self.one_shot is not None and self.one_shot.dtype == dtype and self.one_shot.numel() >= n:
            return True
        self.one_shot, ok = None, True
        self._one_shot_group = (self.group or dist.group.WORLD).group_name
        try:
            buf = symm_mem.empty(n, dtype=dtype, device=device)
            symm_mem.rendezvous(buf, self._one_shot_group)
            probe = buf[:3 * hidden]
            probe.fill_(self.rank + 1)
            got = torch.ops.symm_mem.one_shot_all_reduce(probe, "sum", self._one_shot_group)
            ok = bool((got == self.world * (self.world + 1) // 2).all())
        except Exception as exc:  # noqa: BLE001 — NCCL's all-reduce still works; say why once
            log.warning("the one-shot all-reduce (symmetric memory) is not available here (%s): NCCL's is used", exc)
            ok = False
        copy_in = ok
        if ok:  # its form that copies the input in itself (one kernel instead of a copy and the all-reduce)
            try:
                local = torch.full((2 * hidden,), self.rank + 1, dtype=dtype, device=device)
                got = torch.ops.symm_mem.one_shot_all_reduce_copy(buf[:2 * hidden], local, "sum", self._one_shot_group)
                copy_in = bool((got == self.world * (self.world + 1) // 2).all())
            except Exception as exc:  # noqa: BLE001 — the copy and the plain one-shot kernel then
                log.info("one_shot_all_reduce_copy is not available here (%s): a copy, then the one-shot kernel", exc)
                copy_in = False
        agree = torch.tensor([int(ok), int(copy_in)], device=device)
        dist.all_reduce(agree, op=dist.ReduceOp.MIN, group=self.group)
        ok, copy_in = agree.tolist()
        self._copy_in = bool(copy_in)
        if ok:
            self.one_shot = buf
            log.info("tensor-parallel all-reduces of up to %d rows by the one-shot kernel (symmetric memory%s)",
                     ONE_SHOT_ROWS, ", the input copied in by it" if self._copy_in else "")
            self._enable_push(hidden, dtype, device)
        return self.one_shot is not None

    def _enable_push(self, hidden: int, dtype: torch.dtype, device: torch.device) -> None:
        """After the one-shot buffer, every rank at the same point: the push kernel's symmetric buffer,
        marked empty on every rank before any rank writes into it (agreed over NCCL before the first
        kernel runs, so that no rank waits for a peer that could not map it), then three sums (slots 0,
        1, 0) checked bit for bit against the one-shot all-reduce + add_norm, and agreed again (logged)."""
        self.push, ok = None, True
        try:
            if self.world > tp_reduce.MAX_WORLD:
                raise ValueError(f"{self.world} ranks: it serves {tp_reduce.MAX_WORLD} at most")
            buf = symm_mem.empty(2 * self.world * ONE_SHOT_ROWS * hidden, dtype=dtype, device=device)
            handle = symm_mem.rendezvous(buf, self._one_shot_group)
            tp_reduce.clear(buf)
            bufs = [buf if r == self.rank else handle.get_buffer(r, (buf.numel(),), dtype) for r in range(self.world)]
            torch.cuda.synchronize(device)
        except Exception as exc:  # noqa: BLE001 — the one-shot all-reduce and add_norm still work; say why once
            log.warning("the fused all-reduce + norm kernel is not available here (%s)", exc)
            ok = False
        if self._every_rank(ok, device):
            try:
                gen = torch.Generator(device=device).manual_seed(1234)
                x = torch.randn(3, hidden, generator=gen, device=device).to(dtype)
                w = (1 + 0.1 * torch.randn(hidden, generator=gen, device=device)).to(dtype)
                ws = torch.randn(2, 3, hidden, generator=gen, device=device) * (self.rank + 1)
                summed = self.all_reduce(invariant.add_parts(ws, dtype))[None]
                want = fused_kernels.add_norm(summed, x, w, 1e-5, tp=True)
                for slot in (0, 1, 0):
                    got = tp_reduce.push_add_norm(ws, x, w, 1e-5, bufs=bufs, slot=slot, rank=self.rank,
                                                  rows=ONE_SHOT_ROWS)
                    ok = ok and all(torch.equal(a, b) for a, b in zip(got, want))
            except Exception as exc:  # noqa: BLE001
                log.warning("the fused all-reduce + norm kernel failed here (%s)", exc)
                ok = False
            if self._every_rank(ok, device):
                self.push, self._push_bufs, self._push_handle = buf, bufs, handle
                log.info("tensor-parallel all-reduce, residual add and norm in one kernel (pushed over symmetric "
                         "memory)")
                return
        log.warning("tensor-parallel all-reduce, residual add and norm: the one-shot all-reduce and the norm kernel "
                    "(the fused kernel is not available or disagreed on some rank)")

    def _every_rank(self, ok: bool, device: torch.device) -> bool:
        """Whether `ok` holds on every rank (an all-reduce of the group, every rank at the same point)."""
        agree = torch.tensor([int(ok)], device=device)
        dist.all_reduce(agree, op=dist.ReduceOp.MIN, group=self.group)
        return bool(agree.item())

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's x [..., n] side by side along the last dim, in rank order -> [..., world * n]."""
        parts = [torch.empty_like(x) for _ in range(self.world)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def all_gather_rows(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's x [...] stacked in rank order -> [world, ...] (one collective)."""
        out = torch.empty((self.world * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        dist.all_gather_into_tensor(out, x.contiguous(), group=self.group)
        return out.view(self.world, *x.shape)

    def span(self, n: int) -> tuple[int, int]:
        """This rank's [start, stop) of n things split evenly."""
        return self.rank * n // self.world, (self.rank + 1) * n // self.world


def check_split(config: ModelConfig, world: int) -> None:
    """Refuse, with the reason, a model that cannot be split over `world` ranks."""
    c, a = config, config.arch
    problems = []
    if a.mla is not None:
        problems.append("multi-head latent attention (one latent KV head) is not split yet")
    if a.hybrid:
        problems.append("linear-attention layers (gated delta-net, a recurrent state per sequence) are not split yet")
    if c.num_kv_heads % world:
        problems.append(f"{c.num_kv_heads} key/value heads do not divide by {world}")
    if c.num_heads % world:
        problems.append(f"{c.num_heads} query heads do not divide by {world}")
    if a.moe is None and c.intermediate_size % world:
        problems.append(f"the MLP's {c.intermediate_size} do not divide by {world}")
    if a.moe is not None and a.moe.num_experts % world:
        problems.append(f"{a.moe.num_experts} experts do not divide by {world}")
    if a.moe is not None and a.moe.shared_intermediate_size and a.moe.shared_intermediate_size % world:
        problems.append(f"the shared expert's {a.moe.shared_intermediate_size} do not divide by {world}")
    if c.vocab_size % world:
        problems.append(f"a vocabulary of {c.vocab_size} does not divide by {world}")
    if problems:
        raise ModelError(f"{c.model_type} cannot run tensor-parallel over {world}: " + "; ".join(problems))


def local_config(config: ModelConfig, world: int) -> ModelConfig:
    """The config one rank's layers look like: its share of the heads and of the MLP."""
    check_split(config, world)
    return dataclasses.replace(config, num_heads=config.num_heads // world,
                               num_kv_heads=config.num_kv_heads // world,
                               intermediate_size=config.intermediate_size // world if config.arch.moe is None
                               else config.intermediate_size)


def _rows(x: torch.Tensor | None, parts: list[tuple[int, int]]) -> torch.Tensor | None:
    """The rows [a, b) of each part of x, concatenated (x None: None)."""
    return None if x is None else torch.cat([x[a:b] for a, b in parts]).contiguous()


def _gated_rows(inter: int, tp: TensorParallel) -> list[tuple[int, int]]:
    """Rows of a fused [gate; up] matrix of `inter` each that are this rank's."""
    a, b = tp.span(inter)
    return [(a, b), (inter + a, inter + b)]


def split_layer(w: LayerWeights, config: ModelConfig, tp: TensorParallel) -> LayerWeights:
    """Rank tp.rank's part of a whole layer (module docstring); `config` is the whole model's."""
    c = config
    hd = c.head_dim
    q0, q1 = tp.span(c.num_heads)
    k0, k1 = tp.span(c.num_kv_heads)
    qn, kvn = c.num_heads * hd, c.num_kv_heads * hd
    qkv_rows = [(q0 * hd, q1 * hd), (qn + k0 * hd, qn + k1 * hd), (qn + kvn + k0 * hd, qn + kvn + k1 * hd)]
    parts = dict(qkv=_rows(w.qkv, qkv_rows), qkv_bias=_rows(w.qkv_bias, qkv_rows),
                 o=w.o[:, q0 * hd: q1 * hd].contiguous(),
                 sinks=None if w.sinks is None else w.sinks[q0:q1].contiguous())
    if w.experts is not None:
        parts["experts"] = split_experts(w.experts, tp)
    else:
        inter = w.gate_up.shape[0] // 2
        rows = _gated_rows(inter, tp)
        a, b = rows[0]
        parts.update(gate_up=_rows(w.gate_up, rows), gate_up_bias=_rows(w.gate_up_bias, rows),
                     down=w.down[:, a:b].contiguous())
    return dataclasses.replace(w, **parts)


def part_of(w: LayerWeights, config: ModelConfig, tp: TensorParallel | None) -> LayerWeights:
    """`split_layer`, or the whole layer without tensor parallelism."""
    return w if tp is None else split_layer(w, config, tp)


def split_experts(e: Experts, tp: TensorParallel) -> Experts:
    """This rank's whole experts (E / world of them, `first` = the first one's id), the router whole,
    a shared expert split as a dense MLP."""
    n = e.router.shape[0]
    a, b = tp.span(n)
    shared = {}
    if e.shared_gate_up is not None:
        inter = e.shared_gate_up.shape[0] // 2
        s0, s1 = tp.span(inter)
        shared = dict(shared_gate_up=_rows(e.shared_gate_up, _gated_rows(inter, tp)),
                      shared_down=e.shared_down[:, s0:s1].contiguous())
    return dataclasses.replace(
        e, gate_up=e.gate_up[a:b], down=e.down[a:b],
        gate_up_bias=None if e.gate_up_bias is None else e.gate_up_bias[a:b],
        down_bias=None if e.down_bias is None else e.down_bias[a:b], first=a, **shared)
