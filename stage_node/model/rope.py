"""Rotary position embedding: inverse frequencies from transformers, cos/sin tables grown on demand.

The frequencies (and the attention scaling of yarn) come from transformers' own
`ROPE_INIT_FUNCTIONS`, so every supported scaling type matches Hugging Face exactly; the tables are
computed with the same float32 arithmetic as `LlamaRotaryEmbedding`, so they are bit-identical. A
plain RoPE (no scaling) of the families whose config needs no transformers defaults is read from
config.json directly: transformers' config machinery costs a restarted stage 2-4 s of a core at its
first load on a small CPU (issue 34: a node back from a fault serves that much sooner; the stage no
longer imports it in advance, which cost every restart that CPU beside the stages serving).
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from logicpipe.common.modeldir import SUPPORTED_ROPE_TYPES, ModelError

log = logging.getLogger(__name__)

MIN_TABLE_POSITIONS = 1024  # first table size (positions); it doubles as longer contexts arrive
# families whose config class adds nothing to a plain RoPE that config.json does not say (rope_theta
# 10000 and head_dim hidden_size / heads when absent; qwen3's head_dim has a default of its own, so
# it must be written): `plain_rope` reads them without transformers
PLAIN_ROPE_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
ROPE_KEYS = ("rope_scaling", "rope_parameters")  # None, or transformers 5's spelling of a plain RoPE


def plain_rope(model_dir, kind: str = "full") -> tuple[torch.Tensor, float] | None:
    """`rope_parameters` for a RoPE without scaling of a PLAIN_ROPE_FAMILIES model, from its
    config.json alone (the formula transformers uses); None for anything else."""
    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if kind != "full" or not isinstance(cfg, dict) or cfg.get("model_type") not in PLAIN_ROPE_FAMILIES \
            or cfg.get("partial_rotary_factor") is not None or (cfg["model_type"] == "qwen3" and not cfg.get("head_dim")):
        return None
    theta = cfg.get("rope_theta")
    for key in ROPE_KEYS:
        params = cfg.get(key)
        if params is None:
            continue
        if not isinstance(params, dict) or set(params) - {"rope_theta", "rope_type", "type"} or \
                (params.get("rope_type") or params.get("type") or "default") != "default":
            return None
        theta = params.get("rope_theta", theta)
    try:
        theta = float(10000.0 if theta is None else theta)
        dim = int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return None
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0


def rope_parameters(model_dir, kind: str = "full") -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim // 2] float32, attention_scaling) of a model directory's RoPE for its
    layers of `kind` ("full", or "sliding": Gemma 3's local layers have a RoPE of their own)."""
    plain = plain_rope(model_dir, kind)
    if plain is not None:
        return plain
    return _hf_rope_parameters(model_dir, kind)


def _hf_rope_parameters(model_dir, kind: str) -> tuple[torch.Tensor, float]:
    """`rope_parameters` by transformers' config and ROPE_INIT_FUNCTIONS."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = AutoConfig.from_pretrained(str(model_dir))
    # transformers 5: `rope_parameters` (per layer type for Gemma 3); 4.x: `rope_scaling` + `rope_theta`.
    params = getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {}
    layer_type = None
    if params and all(isinstance(v, dict) for v in params.values()):  # per layer type
        layer_type = "sliding_attention" if kind == "sliding" and "sliding_attention" in params else "full_attention"
        params = params[layer_type]
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelError(f"RoPE type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    if rope_type == "default":  # the same formula for every family (transformers 5 keeps it per model class)
        theta = params.get("rope_theta", getattr(hf, "rope_theta", 10000.0))
        dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        dim = int(dim * params.get("partial_rotary_factor", 1.0))  # GLM-4.5: the first half of each head
        inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        return inv_freq, 1.0
    extra = {"layer_type": layer_type} if layer_type else {}
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf, None, **extra)
    return inv_freq.float(), float(scaling)


class RopeTables:
    """cos/sin per position, [positions, head_dim] in the model dtype, grown by doubling."""

    def __init__(self, inv_freq: torch.Tensor, attention_scaling: float, *,
                 dtype: torch.dtype, device: torch.device):
        self.inv_freq = inv_freq.to(device=device, dtype=torch.float32)  # inv_freq: [head_dim // 2]
        self.scaling = attention_scaling
        self.dtype = dtype
        self.device = device
        self.cos = self.sin = torch.empty(0, 2 * inv_freq.numel(), dtype=dtype, device=device)
        self.sin_signed = self.sin  # sin with the first half negated, for the roll form of rotate_half
        self._grow(MIN_TABLE_POSITIONS)

    def _grow(self, positions: int) -> None:
        n = max(MIN_TABLE_POSITIONS, self.cos.shape[0])
        while n < positions:
            n *= 2
        pos = torch.arange(n, device=self.device).float()
        freqs = pos[:, None] * self.inv_freq[None, :]  # freqs: [n, head_dim // 2]
        emb = torch.cat((freqs, freqs), dim=-1)  # emb: [n, head_dim]
        self.cos = (emb.cos() * self.scaling).to(self.dtype)
        self.sin = (emb.sin() * self.scaling).to(self.dtype)
        half = self.sin.shape[-1] // 2
        self.sin_signed = torch.cat((-self.sin[:, :half], self.sin[:, half:]), dim=-1)
        log.debug("RoPE tables grown to %d positions", n)

    def lookup(self, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin_signed for positions [start, stop): each [stop - start, head_dim]."""
        if stop > self.cos.shape[0]:
            self._grow(stop)
        return self.cos[start:stop], self.sin_signed[start:stop]

    def gather(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin_signed at arbitrary positions [T] int64: each [T, head_dim]."""
        top = int(positions.max()) + 1
        if top > self.cos.shape[0]:
            self._grow(top)
        return self.cos[positions], self.sin_signed[positions]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]; cos, sin_signed: [T, rotary_dim]. HF's x*cos + rotate_half(x)*sin over
    the first rotary_dim dims of each head (all of it but for a partial RoPE), the rest passed through."""
    r = cos.shape[-1]
    if r < x.shape[-1]:  # partial (GLM-4.5): rotate-half over x[..., :r], as HF's apply_rotary_pos_emb
        return torch.cat([apply_rope(x[..., :r], cos, sin_signed), x[..., r:]], dim=-1)
    # rotate_half(x) * sin == roll(x, half) * sin_signed, exactly (negation is exact).
    half = x.shape[-1] // 2
    return x * cos[:, None] + x.roll(half, dims=-1) * sin_signed[:, None]
