"""A model directory, read once for everyone: config.json (and generation_config.json) as the
forward needs it (its family's description: common.families), EOS ids, the safetensors headers,
and the digest that tells two copies of a model apart. The controller and every stage use this
module; it imports neither torch nor transformers, so checking a directory is cheap.

Anything the forward cannot run exactly (another architecture, a RoPE variant whose frequencies
depend on the sequence length, weights not in safetensors) is refused with a ModelError that says
what to do.
"""
from __future__ import annotations

import hashlib
import json
import logging
import struct
from dataclasses import dataclass
from pathlib import Path

from logicpipe.common.families import MODEL_TYPES, TIED_BY_DEFAULT, Arch, ModelError, arch_of

log = logging.getLogger(__name__)

__all__ = ["SUPPORTED_MODEL_TYPES", "SUPPORTED_ROPE_TYPES", "Arch", "ModelConfig", "ModelError", "checkpoint_index",
           "model_digest", "read_config_json", "safetensors_files", "safetensors_header", "safetensors_layout"]

SUPPORTED_MODEL_TYPES = tuple(MODEL_TYPES)
# RoPE types whose inverse frequencies are fixed (do not depend on the current sequence length),
# so one cos/sin table serves every position. "dynamic" and "longrope" recompute them per batch.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class ModelConfig:
    """A decoder of one of the supported families, as the stage forward needs it."""

    model_type: str  # Hugging Face model_type; always one of SUPPORTED_MODEL_TYPES
    num_layers: int  # decoder layers in the whole model (count)
    hidden_size: int  # residual stream width (elements per token)
    intermediate_size: int  # gated MLP inner width (elements per token; an expert's, for Mixtral)
    num_heads: int  # query heads (count)
    num_kv_heads: int  # key/value heads (count); num_heads is a multiple of it (GQA); MLA: 1 (the latent)
    head_dim: int  # elements per attention head; MLA: of a token's cached latent row (arch.mla.latent)
    vocab_size: int  # tokens in the vocabulary (rows of embed_tokens / LM head)
    rms_norm_eps: float  # epsilon added to the mean square in RMSNorm (dimensionless)
    tie_word_embeddings: bool  # LM head shares embed_tokens' weight
    attention_bias: bool  # q/k/v/o projections carry a bias
    mlp_bias: bool  # gate/up/down projections carry a bias
    max_position_embeddings: int  # longest context the model was configured for (tokens)
    eos_token_ids: tuple[int, ...]  # token ids that end a generation (may be empty)
    rope_type: str = "default"  # one of SUPPORTED_ROPE_TYPES
    arch: Arch = Arch("llama")  # where its forward differs from Llama's (common.families)

    @property
    def family(self) -> str:
        return self.arch.family

    @property
    def kv_parts(self) -> int:
        """Tensors the KV cache keeps per head and token: keys and values (2), or MLA's one latent row (1)."""
        return 1 if self.arch.mla is not None else 2

    @classmethod
    def from_dir(cls, model_dir, require_weights: bool = True) -> "ModelConfig":
        """Read and check `config.json` (+ `generation_config.json`) of a model directory
        (`require_weights` False: one whose weights are still to come, a pull cache)."""
        path = Path(model_dir)
        raw = read_config_json(path)
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelError(
                f"{path / 'config.json'}: model_type {model_type!r} is not supported; "
                f"supported model types: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        if require_weights and not safetensors_files(path):
            raise ModelError(
                f"{path} has no *.safetensors weights; convert the checkpoint to safetensors first "
                "(e.g. `model.save_pretrained(dir, safe_serialization=True)` in transformers)"
            )
        rope_type = _rope_type(raw, path)
        try:
            num_heads = int(raw["num_attention_heads"])
            hidden = int(raw["hidden_size"])
            head_dim = int(raw.get("head_dim") or hidden // num_heads)
            num_layers = int(raw["num_hidden_layers"])
            arch = arch_of(raw, path, num_layers=num_layers, hidden_size=hidden, head_dim=head_dim)
            num_kv_heads = int(raw.get("num_key_value_heads") or num_heads)
            if arch.mla is not None:  # the cache's view: one "head" per token, the latent row
                num_kv_heads, head_dim = 1, arch.mla.latent
            cfg = cls(
                model_type=model_type,
                num_layers=num_layers,
                hidden_size=hidden,
                intermediate_size=int(raw["intermediate_size"]),
                num_heads=num_heads,
                num_kv_heads=num_kv_heads,
                head_dim=head_dim,
                vocab_size=int(raw["vocab_size"]),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", MODEL_TYPES[model_type] in TIED_BY_DEFAULT)),
                attention_bias=bool(raw.get("attention_bias", False)),
                mlp_bias=bool(raw.get("mlp_bias", False)),
                max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
                eos_token_ids=_eos_token_ids(path, raw),
                rope_type=rope_type,
                arch=arch,
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ModelError(f"{path / 'config.json'} is incomplete or malformed: {e!r}") from e
        if cfg.num_layers < 1 or cfg.num_heads % cfg.num_kv_heads:
            raise ModelError(
                f"{path / 'config.json'}: need num_hidden_layers >= 1 and num_attention_heads a multiple "
                f"of num_key_value_heads (got {cfg.num_layers}, {cfg.num_heads}, {cfg.num_kv_heads})"
            )
        return cfg


def read_config_json(path: Path) -> dict:
    """The parsed `config.json` of a model directory, or ModelError."""
    if not path.is_dir():
        raise ModelError(f"model directory {path} does not exist (or is not a directory)")
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise ModelError(
            f"{path} has no config.json; expected a Hugging Face model directory "
            "(config.json + *.safetensors + tokenizer files)"
        )
    try:
        raw = json.loads(cfg_path.read_text())
    except (OSError, ValueError) as e:
        raise ModelError(f"{cfg_path} is not readable JSON: {e}") from e
    if not isinstance(raw, dict):
        raise ModelError(f"{cfg_path} must hold a JSON object")
    return raw


def safetensors_files(path: Path) -> list[Path]:
    """The *.safetensors files of a model directory, sorted by name."""
    return sorted(p for p in Path(path).glob("*.safetensors") if p.is_file())


def _rope_type(raw: dict, path: Path) -> str:
    """The RoPE type of the (full-attention) layers, every layer type's checked."""
    # transformers 5 writes `rope_parameters` (per layer type for Gemma 3); 4.x wrote `rope_scaling`.
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    per_type = params if params and all(isinstance(v, dict) for v in params.values()) else {"full_attention": params}
    types = {}
    for layer_type, p in per_type.items():
        rope_type = p.get("rope_type") or p.get("type") or "default"
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ModelError(
                f"{path / 'config.json'}: RoPE type {rope_type!r} is not supported (its frequencies depend on "
                f"the sequence length); supported RoPE types: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        types[layer_type] = rope_type
    return types.get("full_attention", next(iter(types.values()), "default"))


def _eos_token_ids(path: Path, raw: dict) -> tuple[int, ...]:
    eos = raw.get("eos_token_id")
    gen_path = path / "generation_config.json"
    if gen_path.is_file():
        try:
            gen = json.loads(gen_path.read_text())
            if gen.get("eos_token_id") is not None:
                eos = gen["eos_token_id"]
        except (OSError, ValueError) as e:
            log.warning("ignoring unreadable %s: %s", gen_path, e)
    if eos is None:
        return ()
    return tuple(int(t) for t in (eos if isinstance(eos, list) else [eos]))


def safetensors_header(file: Path) -> dict:
    """The JSON header of a safetensors file: tensor name -> {dtype, shape, data_offsets}."""
    return safetensors_layout(file)[0]


def safetensors_layout(file: Path) -> tuple[dict, int]:
    """The header of a safetensors file and the file offset its data starts at (data_offsets
    count from there)."""
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ModelError(f"{file} is truncated (no safetensors header)")
        (size,) = struct.unpack("<Q", head)
        try:
            header = json.loads(f.read(size))
        except ValueError as e:
            raise ModelError(f"{file} has a corrupt safetensors header: {e}") from e
    if not isinstance(header, dict):
        raise ModelError(f"{file} has a corrupt safetensors header: not a JSON object")
    return header, 8 + size


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


def model_digest(model_dir) -> str:
    """16 hex chars of sha256 over config.json and the tensor table: every tensor's name, dtype and
    shape from the safetensors headers, sorted by name, so it does not depend on how the weights are
    split into files. The weights themselves are not read: fast, and tells models apart, not bit flips."""
    path = Path(model_dir)
    read_config_json(path)  # ModelError for a missing directory or config
    h = hashlib.sha256((path / "config.json").read_bytes())
    table = {}
    for file in safetensors_files(path):
        for name, meta in safetensors_header(file).items():
            if name != "__metadata__":
                table[name] = (meta["dtype"], list(meta["shape"]))
    h.update(json.dumps(sorted(table.items()), separators=(",", ":")).encode())
    return h.hexdigest()[:16]
