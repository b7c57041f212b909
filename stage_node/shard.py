"""A stage's slice of a Llama-family model: the weights of decoder layers [start, end) and their forward.

The forward runs on packed rows: the new tokens of several sequences, one after the other, go
through every projection and MLP together (one matmul per weight), and only attention is done per
sequence, against that sequence's own preallocated KV cache. The arithmetic follows transformers'
`LlamaForCausalLM` operation for operation (RMSNorm in float32, HF's RoPE tables, SDPA with GQA),
so logits agree to float32 rounding (a prefill on CPU is bit-identical) and greedy tokens match.
"""
from __future__ import annotations

import json
import logging
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F
from safetensors import safe_open

from .config import ModelConfig, ModelError, safetensors_files, safetensors_header
from .kv import SeqSlice, SessionKV
from .rope import RopeTables, apply_rope, rope_parameters

log = logging.getLogger(__name__)

EMBED = "model.embed_tokens.weight"
FINAL_NORM = "model.norm.weight"
LM_HEAD = "lm_head.weight"

__all__ = ["Shard", "SeqSlice", "SessionKV"]


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer. q/k/v and gate/up are fused into one matrix each, and every matrix is
    stored transposed, [in, out], for `x @ w`: on CPU that is the faster GEMV for decode (1-3 rows)."""

    input_norm: torch.Tensor  # [hidden]
    qkv: torch.Tensor  # [hidden, (heads + 2 * kv_heads) * head_dim]
    qkv_bias: torch.Tensor | None  # [(heads + 2 * kv_heads) * head_dim]
    o: torch.Tensor  # [heads * head_dim, hidden]
    o_bias: torch.Tensor | None  # [hidden]
    post_norm: torch.Tensor  # [hidden]
    gate_up: torch.Tensor  # [hidden, 2 * intermediate]
    gate_up_bias: torch.Tensor | None  # [2 * intermediate]
    down: torch.Tensor  # [intermediate, hidden]
    down_bias: torch.Tensor | None  # [hidden]

    def numel(self) -> int:
        return sum(t.numel() for t in vars(self).values() if t is not None)


# ----------------------------------------------------------------------------- checkpoint reading

def checkpoint_index(model_dir: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file holding it (from the index of a sharded model, else the headers)."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError) as e:
            raise ModelError(f"{index} is unreadable or has no weight_map: {e!r}") from e
        return {name: model_dir / file for name, file in weight_map.items()}
    return {name: file for file in safetensors_files(model_dir)
            for name in safetensors_header(file) if name != "__metadata__"}


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

    def matrix(*names: str) -> torch.Tensor:  # [out, in] checkpoint layout -> [in, out]
        return cat(*names).t().contiguous()

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


# ----------------------------------------------------------------------------- math

def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """x: [T, in] @ w: [in, out] (+ b) -> [T, out]"""
    return torch.mm(x, w) if b is None else torch.addmm(b, x, w)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF LlamaRMSNorm: normalise in float32, scale in the model dtype. x: [T, hidden]"""
    if x.dtype == torch.float32:  # one fused op, bit-identical to the formula below in float32
        return F.rms_norm(x, weight.shape, weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def causal_mask(start_pos: int, n: int, device) -> torch.Tensor | None:
    """Bool mask [n, start_pos + n] for new rows at start_pos.., or None where SDPA needs none."""
    if n == 1 or start_pos == 0:
        return None  # one row sees everything; a fresh prefill uses is_causal
    keys = torch.arange(start_pos + n, device=device)
    return keys[None, :] <= torch.arange(start_pos, start_pos + n, device=device)[:, None]


# ----------------------------------------------------------------------------- the shard

class Shard:
    """Weights and forward of the contiguous decoder-layer range [start, end)."""

    def __init__(self, config: ModelConfig, start: int, end: int, *, first: bool, last: bool,
                 layers: list[LayerWeights], embed_tokens: torch.Tensor | None,
                 final_norm: torch.Tensor | None, lm_head_t: torch.Tensor | None, lm_head_tied: bool,
                 rope: RopeTables, device: torch.device, dtype: torch.dtype):
        self.config = config
        self.start, self.end = start, end  # decoder layers [start, end) of the whole model
        self.first, self.last = first, last  # first: holds embed_tokens; last: final norm + LM head
        self.device, self.dtype = device, dtype
        self.layers = layers
        self.embed_tokens = embed_tokens  # [vocab, hidden] (first only); a view of lm_head_t when tied
        self.final_norm = final_norm  # [hidden] (last only)
        self.lm_head_t = lm_head_t  # [hidden, vocab] (last only): the LM head, transposed like the layers
        self.rope = rope
        owned = sum(w.numel() for w in layers)
        owned += embed_tokens.numel() if first else 0
        owned += (final_norm.numel() + (0 if lm_head_tied else lm_head_t.numel())) if last else 0
        self.parameter_count = owned  # parameters this stage owns (count)
        # parameters held as a copy of a tied weight owned by the first stage (count)
        self.tied_copy_count = lm_head_t.numel() if last and lm_head_tied and not first else 0
        c = config
        self._q_size = c.num_heads * c.head_dim
        self._kv_size = c.num_kv_heads * c.head_dim
        self._scale = c.head_dim ** -0.5

    @classmethod
    def load(cls, model_dir, start: int, end: int, *, first: bool, last: bool,
             device="cpu", dtype=torch.float32) -> "Shard":
        """Load layers [start, end) (+ embeddings if first, + final norm and LM head if last)."""
        t0 = time.perf_counter()
        model_dir = Path(model_dir)
        config = ModelConfig.from_dir(model_dir)
        check_range(config, start, end)
        device = torch.device(device)
        index = checkpoint_index(model_dir)
        tied = config.tie_word_embeddings or LM_HEAD not in index
        if tied and not config.tie_word_embeddings and last:
            log.warning("%s has no %s: using the input embeddings as LM head", model_dir, LM_HEAD)
        names = [n for i in range(start, end) for n in layer_tensor_names(config, i)]
        if first or (last and tied):
            names.append(EMBED)
        if last:
            names += [FINAL_NORM] + ([] if tied else [LM_HEAD])
        t = read_tensors(model_dir, names, index)
        layers = [build_layer(t, i, device=device, dtype=dtype) for i in range(start, end)]
        embed = t.pop(EMBED).to(device=device, dtype=dtype) if EMBED in t else None  # [vocab, hidden]
        norm = t.pop(FINAL_NORM).to(device=device, dtype=dtype) if last else None
        head_t = None
        if last:  # tied: one [hidden, vocab] copy serves as head and (viewed back) as embeddings
            head_t = (embed if tied else t.pop(LM_HEAD).to(device=device, dtype=dtype)).t().contiguous()
            embed = head_t.t() if tied else embed
        del t
        inv_freq, scaling = rope_parameters(model_dir)
        rope = RopeTables(inv_freq, scaling, dtype=dtype, device=device)
        shard = cls(config, start, end, first=first, last=last, layers=layers,
                    embed_tokens=embed if first else None, final_norm=norm, lm_head_t=head_t,
                    lm_head_tied=tied, rope=rope, device=device, dtype=dtype)
        log.info("loaded layers [%d, %d) of %s%s%s: %.1fM params (+%.1fM tied copy), %s %s, %.2f s",
                 start, end, model_dir.name, " +embed" if first else "", " +head" if last else "",
                 shard.parameter_count / 1e6, shard.tied_copy_count / 1e6, device, dtype,
                 time.perf_counter() - t0)
        return shard

    @property
    def num_layers(self) -> int:
        return self.end - self.start

    def new_cache(self, capacity: int) -> SessionKV:
        """An empty KV cache for this shard's layers, `capacity` tokens preallocated."""
        c = self.config
        return SessionKV(self.num_layers, c.num_kv_heads, capacity, c.head_dim,
                         dtype=self.dtype, device=self.device)

    @torch.inference_mode()
    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """token_ids: [T] int64 -> hidden states [T, hidden] (first stage only)."""
        if not self.first:
            raise RuntimeError(f"shard [{self.start}, {self.end}) is not a first stage: it has no embeddings")
        token_ids = token_ids.to(device=self.device, dtype=torch.long)
        if token_ids.numel() and (int(token_ids.min()) < 0 or int(token_ids.max()) >= self.config.vocab_size):
            raise ValueError(f"token ids must lie in [0, {self.config.vocab_size})")
        return F.embedding(token_ids, self.embed_tokens)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [B, hidden] -> logits [B, vocab] float32 (last stage only)."""
        if not self.last:
            raise RuntimeError(f"shard [{self.start}, {self.end}) is not a last stage: it has no LM head")
        hidden = hidden.to(device=self.device, dtype=self.dtype)
        return torch.mm(rms_norm(hidden, self.final_norm, self.config.rms_norm_eps), self.lm_head_t).float()

    @torch.inference_mode()
    def forward(self, hidden: torch.Tensor, seqs: Sequence[SeqSlice]) -> torch.Tensor:
        """hidden: [T, hidden], rows of seqs[0], seqs[1], ... packed in order -> [T, hidden].

        Writes each sequence's new keys/values at [start_pos, start_pos + num_tokens) of its cache
        and sets cache.length to start_pos + num_tokens.
        """
        hidden = hidden.to(device=self.device, dtype=self.dtype)
        check_seqs(hidden, seqs, self.num_layers)
        if len(seqs) == 1:
            s = seqs[0]
            cos, sin = self.rope.lookup(s.start_pos, s.start_pos + s.num_tokens)  # [T, head_dim]
        else:
            positions = torch.cat([torch.arange(s.start_pos, s.start_pos + s.num_tokens) for s in seqs])
            cos, sin = self.rope.gather(positions.to(self.device))  # [T, head_dim]
        masks = [causal_mask(s.start_pos, s.num_tokens, self.device) for s in seqs]
        for i, w in enumerate(self.layers):
            hidden = self._layer(i, w, hidden, seqs, cos, sin, masks)
        for s in seqs:
            s.cache.length = s.start_pos + s.num_tokens
        return hidden

    def _layer(self, i: int, w: LayerWeights, x: torch.Tensor, seqs: Sequence[SeqSlice],
               cos: torch.Tensor, sin: torch.Tensor, masks: list) -> torch.Tensor:
        c = self.config
        T = x.shape[0]
        qkv = linear(rms_norm(x, w.input_norm, c.rms_norm_eps), w.qkv, w.qkv_bias)  # [T, q + 2 kv]
        qk_heads = c.num_heads + c.num_kv_heads
        qk = apply_rope(qkv[:, : self._q_size + self._kv_size].view(T, qk_heads, c.head_dim), cos, sin)
        q, k = qk[:, : c.num_heads], qk[:, c.num_heads:]  # q: [T, heads, hd]; k: [T, kv_heads, hd]
        v = qkv[:, self._q_size + self._kv_size:].view(T, c.num_kv_heads, c.head_dim)
        attn = self._attention(i, q, k, v, seqs, masks)  # [T, heads * head_dim]
        x = x + linear(attn, w.o, w.o_bias)
        gate, up = linear(rms_norm(x, w.post_norm, c.rms_norm_eps), w.gate_up, w.gate_up_bias).chunk(2, -1)
        return x + linear(F.silu(gate) * up, w.down, w.down_bias)

    def _attention(self, i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   seqs: Sequence[SeqSlice], masks: list) -> torch.Tensor:
        """Per sequence: store k/v in its cache, attend over [0, start_pos + n). -> [T, heads * head_dim]"""
        outs = []
        row = 0
        for s, mask in zip(seqs, masks):
            n, stop = s.num_tokens, s.start_pos + s.num_tokens
            k_cache, v_cache = s.cache.k[i], s.cache.v[i]  # [kv_heads, capacity, head_dim]
            k_cache[:, s.start_pos:stop] = k[row: row + n].transpose(0, 1)
            v_cache[:, s.start_pos:stop] = v[row: row + n].transpose(0, 1)
            outs.append(self._sdpa(q[row: row + n], k_cache[None, :, :stop], v_cache[None, :, :stop], mask))
            row += n
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask) -> torch.Tensor:
        """q: [n, heads, hd]; k, v: [1, kv_heads, L, hd] -> [n, heads * hd]"""
        # enable_gqa, no mask for one row, is_causal for a fresh prefill: the calls HF's sdpa path makes
        n = q.shape[0]
        o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k, v, attn_mask=mask,
                                           is_causal=mask is None and n > 1, scale=self._scale, enable_gqa=True)
        return o[0].transpose(0, 1).reshape(n, -1)  # o: [1, heads, n, hd]


def check_range(config: ModelConfig, start: int, end: int) -> None:
    if not (0 <= start < end <= config.num_layers):
        raise ValueError(f"layer range [{start}, {end}) must satisfy 0 <= start < end <= {config.num_layers}")


def check_seqs(hidden: torch.Tensor, seqs: Sequence[SeqSlice], num_layers: int) -> None:
    if hidden.dim() != 2:
        raise ValueError(f"hidden states must be [tokens, hidden], got shape {tuple(hidden.shape)}")
    if not seqs:
        raise ValueError("forward needs at least one sequence")
    total = 0
    for s in seqs:
        if s.num_tokens < 1:
            raise ValueError(f"each sequence needs at least one token, got {s.num_tokens}")
        if s.start_pos < 0 or s.start_pos > s.cache.length:
            raise ValueError(f"start_pos {s.start_pos} is past the cached length {s.cache.length}")
        if s.start_pos + s.num_tokens > s.cache.capacity:
            raise ValueError(f"{s.start_pos} + {s.num_tokens} tokens exceed the KV capacity {s.cache.capacity}")
        if s.cache.num_layers != num_layers:
            raise ValueError(f"KV cache has {s.cache.num_layers} layers, this shard {num_layers}")
        total += s.num_tokens
    if len({id(s.cache) for s in seqs}) != len(seqs):
        raise ValueError("a KV cache appears twice in one forward; give each sequence its own cache")
    if total != hidden.shape[0]:
        raise ValueError(f"sequences hold {total} tokens but hidden states have {hidden.shape[0]} rows")
