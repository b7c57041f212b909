"""Reading a stage's weights from a safetensors checkpoint: exactly the tensors of its layers (and
embeddings / final norm / LM head where it holds them), fused per layer as the forward wants them.

Tensor names follow the family's checkpoint (common.families.Arch.checkpoint): Llama's
(q/k/v/o, gate/up/down, two norms; Qwen3 and Gemma 3 add q/k norms, Gemma its pre/post feed-forward
norms), Phi-3's (q/k/v and gate/up already fused), and the experts of Qwen3-MoE and Mixtral (and of
Qwen2-MoE, GLM-4.5, DeepSeek: Qwen3-MoE's names plus a correction bias and shared experts).
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
    correction_bias: torch.Tensor | None = None  # [experts] float32: added to the scores to choose (noaux_tc)
    shared_gate_up: torch.Tensor | None = None  # [2 * shared_intermediate, hidden]: the shared expert
    shared_down: torch.Tensor | None = None  # [hidden, shared_intermediate]
    shared_gate: torch.Tensor | None = None  # [1, hidden]: its sigmoid gate (Qwen2-MoE)

    def numel(self) -> int:
        return self.router.numel() + sum(_numel(x) for x in (
            self.gate_up, self.down, self.gate_up_bias, self.down_bias, self.correction_bias, self.shared_gate_up,
            self.shared_down, self.shared_gate) if x is not None)


def _numel(x) -> int:
    return sum(m.numel() for m in x) if isinstance(x, list) else x.numel()


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer. q/k/v and gate/up are fused into one matrix each; every matrix is kept
    in the checkpoint's [out, in] layout (see `stage_node.ops.linear` for how it is multiplied)."""

    input_norm: torch.Tensor  # [hidden]
    qkv: torch.Tensor  # [(heads + 2 * kv_heads) * head_dim, hidden]
    qkv_bias: torch.Tensor | None  # [(heads + 2 * kv_heads) * head_dim]
    o: torch.Tensor  # [hidden, heads * head_dim]
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


def _router_name(config: ModelConfig, p: str) -> str:
    return f"{p}block_sparse_moe.gate.weight" if config.arch.checkpoint == "mixtral" else f"{p}mlp.gate.weight"


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


def layer_tensor_names(config: ModelConfig, layer: int) -> list[str]:
    a = config.arch
    p = f"model.layers.{layer}."
    names = [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
    if a.sandwich:
        names += [p + "pre_feedforward_layernorm.weight", p + "post_feedforward_layernorm.weight"]
    if a.checkpoint == "phi3":
        names += [p + "self_attn.qkv_proj.weight", p + "self_attn.o_proj.weight"]
    else:
        names += [f"{p}self_attn.{x}_proj.weight" for x in "qkvo"]
    if a.qkv_bias:
        names += [f"{p}self_attn.{x}_proj.bias" for x in "qkv"]
    if a.o_bias:
        names.append(p + "self_attn.o_proj.bias")
    if a.qk_norm:
        names += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
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
    qkv = (matrix(attn + "qkv_proj.weight") if a.checkpoint == "phi3"
           else matrix(*(f"{attn}{x}_proj.weight" for x in "qkv")))
    experts = gate_up = gate_up_bias = down = down_bias = None
    if a.routes(layer):
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
        qkv=qkv,
        qkv_bias=cat(*(f"{attn}{x}_proj.bias" for x in "qkv")) if a.qkv_bias else None,
        o=matrix(attn + "o_proj.weight"),
        o_bias=get(attn + "o_proj.bias"),
        post_norm=get("pre_feedforward_layernorm.weight" if sandwich else "post_attention_layernorm.weight"),
        gate_up=gate_up, gate_up_bias=gate_up_bias, down=down, down_bias=down_bias,
        q_norm=get(attn + "q_norm.weight"), k_norm=get(attn + "k_norm.weight"),
        attn_out_norm=get("post_attention_layernorm.weight") if sandwich else None,
        mlp_out_norm=get("post_feedforward_layernorm.weight") if sandwich else None,
        experts=experts,
    )
