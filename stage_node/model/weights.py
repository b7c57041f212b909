"""Reading a stage's weights from a safetensors checkpoint: exactly the tensors of its layers (and
embeddings / final norm / LM head where it holds them), fused per layer as the forward wants them.

Tensor names follow the family's checkpoint (common.families.Arch.checkpoint): Llama's
(q/k/v/o, gate/up/down, two norms; Qwen3 and Gemma 3 add q/k norms, Gemma its pre/post feed-forward
norms), Phi-3's (q/k/v and gate/up already fused), and the experts of Qwen3-MoE and Mixtral (and of
Qwen2-MoE, GLM-4.5, DeepSeek: Qwen3-MoE's names plus a correction bias and shared experts); gpt-oss's
experts are fused 3-D tensors ([experts, in, out], gate and up interleaved) or their MXFP4 blocks and
scales, dequantized here; DeepSeek's attention is multi-head latent attention (MlaWeights); the
linear-attention layers of Qwen3.5 / Qwen3-Next are gated delta-nets (DeltaNetWeights), and their
full-attention layers' q_proj holds each head's query and output gate side by side.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
from safetensors import safe_open

from logicpipe.common.modeldir import ModelConfig, ModelError

EMBED = "model.embed_tokens.weight"
FINAL_NORM = "model.norm.weight"
LM_HEAD = "lm_head.weight"


@dataclass(frozen=True)
class Experts:
    """A mixture of experts: the router, and every expert's gated MLP stacked along dim 0 (or, held
    quantized, a list of one matrix per expert)."""

    router: torch.Tensor  # [experts, hidden]
    gate_up: torch.Tensor | list  # [experts, 2 * expert_intermediate, hidden]
    down: torch.Tensor | list  # [experts, hidden, expert_intermediate]
    gate_up_bias: torch.Tensor | None = None  # [experts, 2 * expert_intermediate]
    down_bias: torch.Tensor | None = None  # [experts, hidden]
    router_bias: torch.Tensor | None = None  # [experts] (gpt-oss)
    correction_bias: torch.Tensor | None = None  # [experts] float32: added to the scores to choose (noaux_tc)
    shared_gate_up: torch.Tensor | None = None  # [2 * shared_intermediate, hidden]: the shared expert
    shared_down: torch.Tensor | None = None  # [hidden, shared_intermediate]
    shared_gate: torch.Tensor | None = None  # [1, hidden]: its sigmoid gate (Qwen2-MoE)
    first: int = 0  # the id of gate_up[0]: a tensor-parallel rank holds experts [first, first + len) (model.tp)

    def numel(self) -> int:
        return self.router.numel() + sum(_numel(x) for x in (
            self.gate_up, self.down, self.gate_up_bias, self.down_bias, self.router_bias, self.correction_bias,
            self.shared_gate_up, self.shared_down, self.shared_gate) if x is not None)


def _numel(x) -> int:
    return sum(m.numel() for m in x) if isinstance(x, list) else x.numel()


@dataclass(frozen=True)
class MlaWeights:
    """Multi-head latent attention's own weights (common.families.MLA); the layer's `qkv` holds the
    products of x (W_q_a or W_q, then W_kv_a), `o` the output projection. The rotary rows are
    reordered from interleaved pairs to halves when the checkpoint interleaves them."""

    q_norm: torch.Tensor | None  # [q_lora_rank] (None: q = x W_q)
    q_b: torch.Tensor | None  # [heads * (nope + rope), q_lora_rank]
    kv_norm: torch.Tensor  # [kv_lora_rank]
    uk: torch.Tensor  # [heads, nope, kv_lora_rank]: a head's W_uk transposed, absorbed into its query
    uv: torch.Tensor  # [heads, kv_lora_rank, v_dim]: a head's W_uv transposed, absorbed into its output

    def numel(self) -> int:
        return sum(t.numel() for t in vars(self).values() if t is not None)


@dataclass(frozen=True)
class DeltaNetWeights:
    """A gated delta-net layer's token mixer (common.families.LinearAttn): one input projection whose rows
    are [q (key heads) ; k ; v (value heads) ; z (value heads) ; b ; a], heads in order (Qwen3-Next's
    rows, grouped by key head in its checkpoint, are reordered so at load)."""

    in_proj: torch.Tensor  # [2 * key_heads * key_dim + 2 * value_heads * value_dim + 2 * value_heads, hidden]
    conv: torch.Tensor  # [conv_dim, conv_kernel]: the depthwise convolution's taps (no bias)
    a_log: torch.Tensor  # [value_heads]: the decay rate is -exp(a_log) * softplus(a + dt_bias)
    dt_bias: torch.Tensor  # [value_heads]
    norm: torch.Tensor  # [value_dim]: the output's RMSNorm weight (plain w, before the SiLU(z) gate)
    out: torch.Tensor  # [hidden, value_heads * value_dim]

    def numel(self) -> int:
        return sum(t.numel() for t in vars(self).values())


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer. q/k/v and gate/up are fused into one matrix each; every matrix is kept
    in the checkpoint's [out, in] layout (see `stage_node.ops.linear` for how it is multiplied)."""

    input_norm: torch.Tensor  # [hidden]
    qkv: torch.Tensor | None  # [(heads + 2 * kv_heads) * head_dim, hidden] (+ heads * head_dim rows of the
                              # output gate, Arch.attn_gate); None in a linear-attention layer
    qkv_bias: torch.Tensor | None  # [(heads + 2 * kv_heads) * head_dim]
    o: torch.Tensor | None  # [hidden, heads * head_dim]
    o_bias: torch.Tensor | None  # [hidden]
    post_norm: torch.Tensor  # [hidden]: the norm before the MLP (Llama's post_attention_layernorm)
    gate_up: torch.Tensor | None  # [2 * intermediate, hidden] (None: the layer routes to experts)
    gate_up_bias: torch.Tensor | None  # [2 * intermediate]
    down: torch.Tensor | None  # [hidden, intermediate]
    down_bias: torch.Tensor | None  # [hidden]
    q_norm: torch.Tensor | None = None  # [head_dim] (Qwen3, Gemma 3)
    k_norm: torch.Tensor | None = None  # [head_dim]
    attn_out_norm: torch.Tensor | None = None  # [hidden]: Gemma's post_attention_layernorm (of the attention's output)
    mlp_out_norm: torch.Tensor | None = None  # [hidden]: Gemma's post_feedforward_layernorm
    experts: Experts | None = None  # a mixture of experts in place of the MLP
    mla: MlaWeights | None = None  # multi-head latent attention (qkv: [q part + kv_lora + rope, hidden])
    sinks: torch.Tensor | None = None  # [heads]: each head's sink logit (gpt-oss)
    linear: DeltaNetWeights | None = None  # a linear-attention layer's mixer, in place of qkv and o

    def numel(self) -> int:
        return sum(t.numel() for t in vars(self).values() if t is not None)


def shard_tensor_names(config: ModelConfig, start: int, end: int, *, first: bool, last: bool,
                       tied: bool) -> list[str]:
    """The tensors a shard of layers [start, end) reads: its layers, the embeddings on the first
    stage (and on the last when the LM head is tied to them), the final norm and the untied LM
    head on the last."""
    names = [n for i in range(start, end) for n in layer_tensor_names(config, i)]
    if first or (last and tied):
        names.append(EMBED)
    if last:
        names += [FINAL_NORM] + ([] if tied else [LM_HEAD])
    return names


def read_tensors(model_dir: Path, names: Sequence[str], index: dict[str, Path]) -> dict[str, torch.Tensor]:
    """Read exactly `names` from the checkpoint, each file opened once, nothing else touched."""
    missing = [n for n in names if n not in index]
    if missing:
        raise ModelError(f"{model_dir}: checkpoint lacks {len(missing)} tensor(s), e.g. {missing[:3]}")
    by_file: dict[Path, list[str]] = defaultdict(list)
    for name in names:
        by_file[index[name]].append(name)
    out = {}
    for file, file_names in by_file.items():
        if not file.is_file():
            raise ModelError(f"{model_dir}: weight file {file.name} named by the index is missing")
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in file_names:
                out[name] = f.get_tensor(name)
    return out


def _expert_names(config: ModelConfig, p: str, e: int) -> tuple[str, str, str]:
    """(gate, up, down) of expert e of the layer whose prefix is p."""
    if config.arch.checkpoint == "mixtral":
        q = f"{p}block_sparse_moe.experts.{e}."
        return q + "w1.weight", q + "w3.weight", q + "w2.weight"
    q = f"{p}mlp.experts.{e}."
    return q + "gate_proj.weight", q + "up_proj.weight", q + "down_proj.weight"


GPT_OSS_EXPERTS = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")  # under mlp.experts.
MXFP4_EXPERTS = ("gate_up_proj_blocks", "gate_up_proj_scales", "gate_up_proj_bias", "down_proj_blocks",
                 "down_proj_scales", "down_proj_bias")
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)  # e2m1 codes


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """MXFP4 -> float32, as transformers' integrations/mxfp4.py reads gpt-oss: blocks [..., G, 16] uint8 (32
    e2m1 codes per block, two a byte, the low nibble first), scales [..., G] uint8 (e8m0: 2 ** (s - 127) a
    block) -> [..., G * 32]. gpt-oss stores its experts so that this is [experts, out, in]."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ModelError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not match "
                         "(expected blocks [..., G, 16] and scales [..., G])")
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    blocks = blocks.to(torch.uint8)
    out = torch.empty(*blocks.shape[:-1], 32, dtype=torch.float32, device=blocks.device)
    out[..., 0::2] = lut[(blocks & 0x0F).long()]
    out[..., 1::2] = lut[(blocks >> 4).long()]
    out = torch.ldexp(out, scales.to(torch.int32)[..., None] - 127)
    return out.flatten(-2)


def _gpt_oss_names(config: ModelConfig, p: str) -> list[str]:
    q = f"{p}mlp.experts."
    return [f"{p}mlp.router.weight", f"{p}mlp.router.bias"] + [
        q + n for n in (MXFP4_EXPERTS if config.arch.mxfp4_experts else GPT_OSS_EXPERTS)]


def _gpt_oss_experts(t: dict[str, torch.Tensor], p: str, config: ModelConfig, *, device, dtype) -> Experts:
    """gpt-oss's experts as Experts: [experts, out, in] matrices, gate/up de-interleaved into [gate; up]
    (HF's gate is gate_up[..., ::2], its up gate_up[..., 1::2]) so that ops.glu's halves are gate and up."""
    q = f"{p}mlp.experts."
    if config.arch.mxfp4_experts:  # dequantized in float32: [experts, out, in] already
        gate_up = dequantize_mxfp4(t.pop(q + "gate_up_proj_blocks"), t.pop(q + "gate_up_proj_scales"))
        down = dequantize_mxfp4(t.pop(q + "down_proj_blocks"), t.pop(q + "down_proj_scales"))
    else:  # [experts, in, out] (x @ w in HF's forward)
        gate_up, down = t.pop(q + "gate_up_proj").transpose(1, 2), t.pop(q + "down_proj").transpose(1, 2)
    gate_up_bias, down_bias = t.pop(q + "gate_up_proj_bias"), t.pop(q + "down_proj_bias")
    inter = config.arch.moe.intermediate_size
    want = (config.arch.moe.num_experts, 2 * inter, config.hidden_size)
    want_down = (want[0], want[2], inter)
    if tuple(gate_up.shape) != want or tuple(down.shape) != want_down:
        raise ModelError(f"{p}mlp.experts: gate_up {tuple(gate_up.shape)} / down {tuple(down.shape)} are not "
                         f"[experts, out, in] = {want} / {want_down}")

    def to(x: torch.Tensor) -> torch.Tensor:
        return x.to(device=device, dtype=dtype).contiguous()

    return Experts(router=to(t.pop(f"{p}mlp.router.weight")),
                   gate_up=to(torch.cat([gate_up[:, 0::2], gate_up[:, 1::2]], dim=1)),  # [experts, 2 * inter, hidden]
                   down=to(down),  # [experts, hidden, inter]
                   gate_up_bias=to(torch.cat([gate_up_bias[:, 0::2], gate_up_bias[:, 1::2]], dim=1)),
                   down_bias=to(down_bias), router_bias=to(t.pop(f"{p}mlp.router.bias")))


def _router_name(config: ModelConfig, p: str) -> str:
    return f"{p}block_sparse_moe.gate.weight" if config.arch.checkpoint == "mixtral" else f"{p}mlp.gate.weight"


def _mla_names(mla, p: str, bias: bool) -> list[str]:
    a = p + "self_attn."
    names = [a + "kv_a_proj_with_mqa.weight", a + "kv_a_layernorm.weight", a + "kv_b_proj.weight", a + "o_proj.weight"]
    if mla.q_lora_rank:
        names += [a + "q_a_proj.weight", a + "q_a_layernorm.weight", a + "q_b_proj.weight"]
    else:
        names.append(a + "q_proj.weight")
    if bias:
        names += [a + "kv_a_proj_with_mqa.bias", a + "o_proj.bias"] + ([a + "q_a_proj.bias"] if mla.q_lora_rank else [])
    return names


def _halves(rows: torch.Tensor, start: int, n: int) -> torch.Tensor:
    """rows with [start, start + n) reordered from interleaved pairs (x0, x1, x2, ...) to halves (x0, x2, ...,
    x1, x3, ...): RoPE of interleaved pairs is then the rotate-half RoPE, the same products per pair."""
    idx = torch.arange(rows.shape[0])
    idx[start: start + n] = torch.cat([torch.arange(start, start + n, 2), torch.arange(start + 1, start + n, 2)])
    return rows.index_select(0, idx.to(rows.device))


def _mla_layer(get, config: ModelConfig) -> dict:
    """The MLA fields of a layer (qkv, qkv_bias, o, o_bias, mla) from its checkpoint tensors (`get`)."""
    m, heads = config.arch.mla, config.num_heads
    a = "self_attn."
    qk = m.nope_dim + m.rope_dim

    def rope_halves(w: torch.Tensor | None, per: int, at: int) -> torch.Tensor | None:
        if w is None or not m.interleaved:
            return w
        for start in range(at, w.shape[0], per):
            w = _halves(w, start, m.rope_dim)
        return w

    kv_a = rope_halves(get(a + "kv_a_proj_with_mqa.weight"), m.latent, m.kv_lora_rank)  # [kv_lora + rope, hidden]
    kv_a_bias = rope_halves(get(a + "kv_a_proj_with_mqa.bias"), m.latent, m.kv_lora_rank)
    if m.q_lora_rank:
        q, q_bias = get(a + "q_a_proj.weight"), get(a + "q_a_proj.bias")  # [q_lora, hidden]
        q_b = rope_halves(get(a + "q_b_proj.weight"), qk, m.nope_dim)  # [heads * qk, q_lora]
    else:
        q, q_bias, q_b = rope_halves(get(a + "q_proj.weight"), qk, m.nope_dim), None, None  # [heads * qk, hidden]
    if kv_a_bias is not None and q_bias is None:  # q = x W_q has no bias: zeros add exactly nothing
        q_bias = kv_a_bias.new_zeros(q.shape[0])
    kv_b = get(a + "kv_b_proj.weight").view(heads, m.nope_dim + m.v_dim, m.kv_lora_rank)
    return dict(
        qkv=torch.cat([q, kv_a]).contiguous(),
        qkv_bias=None if kv_a_bias is None else torch.cat([q_bias, kv_a_bias]),
        o=get(a + "o_proj.weight").contiguous(), o_bias=get(a + "o_proj.bias"),
        mla=MlaWeights(q_norm=get(a + "q_a_layernorm.weight"), q_b=None if q_b is None else q_b.contiguous(),
                       kv_norm=get(a + "kv_a_layernorm.weight"), uk=kv_b[:, : m.nope_dim].contiguous(),
                       uv=kv_b[:, m.nope_dim:].transpose(1, 2).contiguous()))


def _moe_extra_names(config: ModelConfig, p: str) -> list[str]:
    """The correction bias and the shared expert's (gate, up, down[, gate vector]) of a routing layer."""
    moe = config.arch.moe
    names = [f"{p}mlp.gate.e_score_correction_bias"] if moe.correction_bias else []
    if moe.shared_intermediate_size:
        q = f"{p}mlp.shared_expert." if moe.shared_gate else f"{p}mlp.shared_experts."
        names += [q + "gate_proj.weight", q + "up_proj.weight", q + "down_proj.weight"]
        if moe.shared_gate:
            names.append(f"{p}mlp.shared_expert_gate.weight")
    return names


LINEAR = ("A_log", "dt_bias", "conv1d.weight", "norm.weight", "out_proj.weight")  # under linear_attn.


def _linear_names(lin, p: str) -> list[str]:
    proj = ("in_proj_qkvz", "in_proj_ba") if lin.fused else ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
    return [f"{p}linear_attn.{x}" for x in LINEAR] + [f"{p}linear_attn.{x}.weight" for x in proj]


def _linear_layer(get, lin) -> DeltaNetWeights:
    """A linear-attention layer's weights (`get`: its checkpoint tensors by name under the layer), the
    input projections in DeltaNetWeights' row order."""
    a = "linear_attn."
    if lin.fused:  # rows grouped by key head: [q_h, k_h, v of its value heads, z of them]; [b of them, a of them]
        r = lin.value_heads // lin.key_heads
        kd, vd = lin.key_dim, r * lin.value_dim
        qkvz = get(a + "in_proj_qkvz.weight")
        qkvz = qkvz.view(lin.key_heads, 2 * kd + 2 * vd, qkvz.shape[-1])
        ba = get(a + "in_proj_ba.weight")
        ba = ba.view(lin.key_heads, 2 * r, ba.shape[-1])
        parts = [qkvz[:, :kd], qkvz[:, kd: 2 * kd], qkvz[:, 2 * kd: 2 * kd + vd], qkvz[:, 2 * kd + vd:],
                 ba[:, :r], ba[:, r:]]
        in_proj = torch.cat([x.reshape(-1, x.shape[-1]) for x in parts])
    else:
        in_proj = torch.cat([get(a + f"in_proj_{x}.weight") for x in ("qkv", "z", "b", "a")])
    return DeltaNetWeights(in_proj=in_proj.contiguous(), conv=get(a + "conv1d.weight").flatten(0, 1).contiguous(),
                           a_log=get(a + "A_log"), dt_bias=get(a + "dt_bias"), norm=get(a + "norm.weight"),
                           out=get(a + "out_proj.weight").contiguous())


def _gated_q(q: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q_proj's rows of a gated attention ([heads * 2 * head_dim, hidden], each head's query then its
    gate) -> (the queries' rows, the gates' rows), heads in order."""
    w = q.view(heads, 2, -1, q.shape[-1])
    return w[:, 0].reshape(-1, q.shape[-1]), w[:, 1].reshape(-1, q.shape[-1])


def layer_tensor_names(config: ModelConfig, layer: int) -> list[str]:
    a = config.arch
    p = f"model.layers.{layer}."
    names = [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
    if a.sandwich:
        names += [p + "pre_feedforward_layernorm.weight", p + "post_feedforward_layernorm.weight"]
    if a.is_linear(layer):
        names += _linear_names(a.linear, p)
    elif a.mla is not None:
        names += _mla_names(a.mla, p, a.o_bias)
    elif a.checkpoint == "phi3":
        names += [p + "self_attn.qkv_proj.weight", p + "self_attn.o_proj.weight"]
    else:
        names += [f"{p}self_attn.{x}_proj.weight" for x in "qkvo"]
    if a.qkv_bias and a.mla is None:
        names += [f"{p}self_attn.{x}_proj.bias" for x in "qkv"]
    if a.o_bias and a.mla is None:
        names.append(p + "self_attn.o_proj.bias")
    if a.qk_norm and not a.is_linear(layer):
        names += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
    if a.sinks:
        names.append(p + "self_attn.sinks")
    if a.checkpoint == "gpt_oss":
        return names + _gpt_oss_names(config, p)
    if a.routes(layer):
        names.append(_router_name(config, p))
        names += [n for e in range(a.moe.num_experts) for n in _expert_names(config, p, e)]
        return names + _moe_extra_names(config, p)
    mlp = ("gate_up_proj", "down_proj") if a.checkpoint == "phi3" else ("gate_proj", "up_proj", "down_proj")
    names += [f"{p}mlp.{x}.weight" for x in mlp]
    if a.mlp_bias:
        names += [f"{p}mlp.{x}.bias" for x in mlp]
    return names


def build_layer(t: dict[str, torch.Tensor], layer: int, config: ModelConfig, *, device, dtype) -> LayerWeights:
    """Take (pop) layer `layer`'s tensors out of `t`, so the unfused copies are freed as we go."""
    a = config.arch
    p = f"model.layers.{layer}."

    def get(name: str) -> torch.Tensor | None:
        x = t.pop(p + name, None)
        return None if x is None else x.to(device=device, dtype=dtype)

    def cat(*names: str) -> torch.Tensor | None:
        parts = [get(n) for n in names]
        return None if parts[0] is None else torch.cat(parts, dim=0)

    def matrix(*names: str) -> torch.Tensor:  # [out, in], the parts stacked along out
        return cat(*names).contiguous()

    attn, mlp = "self_attn.", "mlp."
    linear = None
    if a.is_linear(layer):
        linear = _linear_layer(get, a.linear)
        attention = dict(qkv=None, qkv_bias=None, o=None, o_bias=None)
    elif a.attn_gate:  # the gate's rows after v's: qkv = [q ; k ; v ; gate]
        q, gate = _gated_q(get(attn + "q_proj.weight"), config.num_heads)
        attention = dict(qkv=torch.cat([q, get(attn + "k_proj.weight"), get(attn + "v_proj.weight"), gate]).contiguous(),
                         qkv_bias=None, o=matrix(attn + "o_proj.weight"), o_bias=None)
    elif a.mla is not None:
        attention = _mla_layer(get, config)
    else:
        attention = dict(
            qkv=(matrix(attn + "qkv_proj.weight") if a.checkpoint == "phi3"
                 else matrix(*(f"{attn}{x}_proj.weight" for x in "qkv"))),
            qkv_bias=cat(*(f"{attn}{x}_proj.bias" for x in "qkv")) if a.qkv_bias else None,
            o=matrix(attn + "o_proj.weight"), o_bias=get(attn + "o_proj.bias"))
    experts = gate_up = gate_up_bias = down = down_bias = None
    if a.checkpoint == "gpt_oss":
        experts = _gpt_oss_experts(t, p, config, device=device, dtype=dtype)
    elif a.routes(layer):
        gates, downs = [], []
        for e in range(a.moe.num_experts):
            g, u, d = (t.pop(n) for n in _expert_names(config, p, e))
            gates.append(torch.cat([g, u], dim=0).to(device=device, dtype=dtype))  # [2 * inter, hidden]
            downs.append(d.to(device=device, dtype=dtype))  # [hidden, inter]
        moe = a.moe
        # DeepSeek / GLM keep the router (and the correction bias) in float32 whatever the model dtype, as HF does
        router = t.pop(_router_name(config, p)).to(device=device, dtype=torch.float32 if moe.router_in_float else dtype)
        extra = [t.pop(n) for n in _moe_extra_names(config, p)]
        bias = extra.pop(0).to(device=device, dtype=torch.float32) if moe.correction_bias else None
        shared = {}
        if moe.shared_intermediate_size:
            g, u, d = (x.to(device=device, dtype=dtype) for x in extra[:3])
            shared = dict(shared_gate_up=torch.cat([g, u], dim=0).contiguous(), shared_down=d.contiguous(),
                          shared_gate=extra[3].to(device=device, dtype=dtype) if moe.shared_gate else None)
        experts = Experts(router, torch.stack(gates), torch.stack(downs), correction_bias=bias, **shared)
    elif a.checkpoint == "phi3":
        gate_up, gate_up_bias = matrix(mlp + "gate_up_proj.weight"), get(mlp + "gate_up_proj.bias")
        down, down_bias = matrix(mlp + "down_proj.weight"), get(mlp + "down_proj.bias")
    else:
        gate_up = matrix(mlp + "gate_proj.weight", mlp + "up_proj.weight")
        gate_up_bias = cat(mlp + "gate_proj.bias", mlp + "up_proj.bias")
        down, down_bias = matrix(mlp + "down_proj.weight"), get(mlp + "down_proj.bias")
    sandwich = a.sandwich
    return LayerWeights(
        input_norm=get("input_layernorm.weight"),
        **attention,
        post_norm=get("pre_feedforward_layernorm.weight" if sandwich else "post_attention_layernorm.weight"),
        gate_up=gate_up, gate_up_bias=gate_up_bias, down=down, down_bias=down_bias,
        q_norm=get(attn + "q_norm.weight"), k_norm=get(attn + "k_norm.weight"),
        attn_out_norm=get("post_attention_layernorm.weight") if sandwich else None,
        mlp_out_norm=get("post_feedforward_layernorm.weight") if sandwich else None,
        experts=experts,
        sinks=get(attn + "sinks"),
        linear=linear,
    )
