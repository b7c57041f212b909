"""Reading a stage's weights from a safetensors checkpoint: exactly the tensors of its layers (and
embeddings / final norm / LM head where it holds them), fused per layer as the forward wants them."""
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
class LayerWeights:
    """One decoder layer. q/k/v and gate/up are fused into one matrix each; every matrix is kept
    in the checkpoint's [out, in] layout (see `stage_node.ops.linear` for how it is multiplied)."""

    input_norm: torch.Tensor  # [hidden]
    qkv: torch.Tensor  # [(heads + 2 * kv_heads) * head_dim, hidden]
    qkv_bias: torch.Tensor | None  # [(heads + 2 * kv_heads) * head_dim]
    o: torch.Tensor  # [hidden, heads * head_dim]
    o_bias: torch.Tensor | None  # [hidden]
    post_norm: torch.Tensor  # [hidden]
    gate_up: torch.Tensor  # [2 * intermediate, hidden]
    gate_up_bias: torch.Tensor | None  # [2 * intermediate]
    down: torch.Tensor  # [hidden, intermediate]
    down_bias: torch.Tensor | None  # [hidden]

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


def layer_tensor_names(config: ModelConfig, layer: int) -> list[str]:
    p = f"model.layers.{layer}."
    names = [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
        names.append(f"{p}self_attn.{proj}.weight")
        if config.attention_bias:
            names.append(f"{p}self_attn.{proj}.bias")
    for proj in ("gate_proj", "up_proj", "down_proj"):
        names.append(f"{p}mlp.{proj}.weight")
        if config.mlp_bias:
            names.append(f"{p}mlp.{proj}.bias")
    return names


def build_layer(t: dict[str, torch.Tensor], layer: int, *, device, dtype) -> LayerWeights:
    """Take (pop) layer `layer`'s tensors out of `t`, so the unfused copies are freed as we go."""
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
    return LayerWeights(
        input_norm=get("input_layernorm.weight"),
        qkv=matrix(*(f"{attn}{x}_proj.weight" for x in "qkv")),
        qkv_bias=cat(*(f"{attn}{x}_proj.bias" for x in "qkv")),
        o=matrix(attn + "o_proj.weight"),
        o_bias=get(attn + "o_proj.bias"),
        post_norm=get("post_attention_layernorm.weight"),
        gate_up=matrix(mlp + "gate_proj.weight", mlp + "up_proj.weight"),
        gate_up_bias=cat(mlp + "gate_proj.bias", mlp + "up_proj.bias"),
        down=matrix(mlp + "down_proj.weight"),
        down_bias=get(mlp + "down_proj.bias"),
    )
