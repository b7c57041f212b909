"""What a model needs from the devices: per-layer weights, FLOPs, KV and activation sizes.

All decoder layers of a Llama-family model are alike, so one layer's numbers describe them all.
`ModelSpec.llama(...)` derives the numbers from a config (formulas in its docstring).

Weight formats. `weight_format` is the format the mesh runs the model in (the controller's --dtype).
Each device runs it in one format of its own (`device_weight_format`):
  * a node started quantized (it offers one of QUANT_FORMATS) holds a float model's layer matrices
    in that format, and its embeddings, head, activations and KV in its `compute_format`;
  * a device that lists the model's format runs it as it is;
  * one that does not, but lists "fp32", runs a 16-bit float model upcast to fp32 (lossless);
  * any other device cannot take part. A quantized model format is run only as it is.
Sizes in a ModelSpec are in the model's format; a device's bytes are scaled from them:
`weight_scale` for the layers' matrices, `float_scale` for everything held or sent in floats
(embeddings, head, KV, activations).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from logicpipe.planner.types import DeviceProfile

FORMAT_BYTES: dict[str, float] = {"fp32": 4.0, "fp16": 2.0, "bf16": 2.0, "int8": 1.0, "nf4": 0.5, "fp4": 0.5}
"""Nominal bytes per parameter of the weight formats the planner knows (quantization scales not
counted; a node measures its own, `DeviceProfile.weight_bytes_per_param`)."""

FLOAT_FORMATS = ("fp32", "fp16", "bf16")
QUANT_FORMATS = ("int8", "nf4", "fp4")

_LOSSLESS_UPCAST: dict[str, str] = {"fp16": "fp32", "bf16": "fp32"}


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


@dataclass(frozen=True)
class ModelSpec:
    """Sizes and costs of one model, in the checkpoint's weight format."""

    name: str                                  # human-readable name, e.g. "SmolLM2-135M-Instruct"
    num_layers: int                            # decoder layers
    layer_weight_bytes: int                    # bytes of one decoder layer's weights
    layer_flops_per_token: float               # FLOPs per token per layer, context-independent (~2 x layer params)
    attention_flops_per_context_token: float   # FLOPs per token per layer per context token attended (QK^T and AV)
    kv_bytes_per_token_per_layer: int          # bytes of K and V one token leaves in one layer's cache
    activation_bytes_per_token: int            # bytes of one token's hidden state sent from stage to stage
    embedding_bytes: int                       # bytes of the token embedding, held by the first stage
    lm_head_bytes: int                         # bytes of final norm + LM head, held by the last stage (never 0:
                                               # with tied embeddings the last stage holds its own copy)
    lm_head_flops_per_token: float             # FLOPs per token of the LM head (2 x hidden x vocab)
    tied_embeddings: bool = False              # LM head shares the embedding matrix: a single stage holds it once
    weight_format: str = "fp16"                # dtype of the checkpoint's weights ("fp32", "fp16", "bf16", "int8", "nf4")
    weights_digest: str = ""                   # opaque digest of the weight files ("" when unknown); part of the model digest

    def __post_init__(self) -> None:
        where = f"model spec {self.name!r}"
        _check(isinstance(self.name, str), "model spec name must be a string")
        for name in ("num_layers",):
            _check(isinstance(getattr(self, name), int) and getattr(self, name) >= 1, f"{where}: {name} must be an integer >= 1")
        for name in ("layer_weight_bytes", "kv_bytes_per_token_per_layer", "activation_bytes_per_token",
                     "embedding_bytes", "lm_head_bytes"):
            value = getattr(self, name)
            _check(isinstance(value, int) and not isinstance(value, bool) and value >= 0,
                   f"{where}: {name} must be an integer number of bytes >= 0, got {value!r}")
        for name in ("layer_flops_per_token", "attention_flops_per_context_token", "lm_head_flops_per_token"):
            value = getattr(self, name)
            _check(isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0,
                   f"{where}: {name} must be a finite number of FLOPs >= 0, got {value!r}")
        _check(isinstance(self.weight_format, str) and self.weight_format != "", f"{where}: weight_format must be a non-empty string")
        _check(isinstance(self.weights_digest, str), f"{where}: weights_digest must be a string")
        _check(not self.tied_embeddings or self.lm_head_bytes >= self.embedding_bytes,
               f"{where}: with tied embeddings lm_head_bytes (norm + matrix) must be >= embedding_bytes")

    @classmethod
    def llama(
        cls,
        *,
        name: str,
        hidden_size: int,
        intermediate_size: int,
        num_heads: int,
        num_kv_heads: int,
        vocab_size: int,
        num_layers: int,
        head_dim: int | None = None,
        bytes_per_param: float | None = None,
        tied_embeddings: bool = False,
        weight_format: str = "fp16",
        weights_digest: str = "",
    ) -> "ModelSpec":
        """A Llama-family model from its config.

        With h = hidden_size, i = intermediate_size, d = head_dim (default h / num_heads),
        a = num_heads, g = num_kv_heads, V = vocab_size, b = bytes_per_param (default from
        `weight_format`), e = compute bytes per element = max(b, 2):

        - layer params P = h*d*(2a + 2g)  [q, o; k, v]  + 3*h*i  [gate, up, down] + 2*h  [two norms]
        - layer_weight_bytes = ceil(P * b)
        - layer_flops_per_token = 2 * P  (one multiply-add per weight)
        - attention_flops_per_context_token = 4 * a * d  (QK^T and AV, 2 FLOPs per multiply-add)
        - kv_bytes_per_token_per_layer = 2 * g * d * e ;  activation_bytes_per_token = h * e
        - embedding_bytes = ceil(V*h*b) ;  lm_head_bytes = ceil((V*h + h) * b)  [matrix + final norm]
        - lm_head_flops_per_token = 2 * V * h
        """
        if bytes_per_param is None:
            _check(weight_format in FORMAT_BYTES, f"unknown weight format {weight_format!r}: pass bytes_per_param")
            bytes_per_param = FORMAT_BYTES[weight_format]
        _check(bytes_per_param > 0, "bytes_per_param must be > 0")
        for label, value in (("hidden_size", hidden_size), ("intermediate_size", intermediate_size),
                             ("num_heads", num_heads), ("num_kv_heads", num_kv_heads), ("vocab_size", vocab_size)):
            _check(isinstance(value, int) and value >= 1, f"{label} must be an integer >= 1, got {value!r}")
        d = head_dim if head_dim is not None else hidden_size // num_heads
        _check(isinstance(d, int) and d >= 1, f"head_dim must be an integer >= 1, got {d!r}")
        element_bytes = max(bytes_per_param, 2.0)
        layer_params = hidden_size * d * (2 * num_heads + 2 * num_kv_heads) + 3 * hidden_size * intermediate_size + 2 * hidden_size
        matrix = vocab_size * hidden_size
        return cls(
            name=name,
            num_layers=num_layers,
            layer_weight_bytes=math.ceil(layer_params * bytes_per_param),
            layer_flops_per_token=2.0 * layer_params,
            attention_flops_per_context_token=4.0 * num_heads * d,
            kv_bytes_per_token_per_layer=math.ceil(2 * num_kv_heads * d * element_bytes),
            activation_bytes_per_token=math.ceil(hidden_size * element_bytes),
            embedding_bytes=math.ceil(matrix * bytes_per_param),
            lm_head_bytes=math.ceil((matrix + hidden_size) * bytes_per_param),
            lm_head_flops_per_token=2.0 * matrix,
            tied_embeddings=tied_embeddings,
            weight_format=weight_format,
            weights_digest=weights_digest,
        )


def quantized_format(profile: DeviceProfile) -> str | None:
    """The quantized format a node offers (it was started with --quantize), else None."""
    return next((f for f in profile.weight_formats if f in QUANT_FORMATS), None)


def device_weight_format(profile: DeviceProfile, model: ModelSpec) -> str | None:
    """The format `profile` runs `model`'s layers in (see the module docstring), or None when the
    device cannot take part."""
    quant = quantized_format(profile)
    if quant is not None and model.weight_format in FLOAT_FORMATS:
        return quant
    if model.weight_format in profile.weight_formats:
        return model.weight_format
    upcast = _LOSSLESS_UPCAST.get(model.weight_format)
    if upcast is not None and upcast in profile.weight_formats:
        return upcast
    return None


def device_compute_format(profile: DeviceProfile, model: ModelSpec) -> str:
    """The float format of `profile`'s activations, KV, embeddings and head for `model`."""
    fmt = _runnable(profile, model)
    if fmt in QUANT_FORMATS and model.weight_format in FLOAT_FORMATS:
        return profile.compute_format or "fp32"
    return fmt


def _runnable(profile: DeviceProfile, model: ModelSpec) -> str:
    fmt = device_weight_format(profile, model)
    if fmt is None:
        raise ValueError(f"node {profile.node_id!r} cannot run weight format {model.weight_format!r} "
                         f"(it offers {', '.join(profile.weight_formats)})")
    return fmt


def weight_scale(profile: DeviceProfile, model: ModelSpec) -> float:
    """Bytes of the layers' matrices on the device per byte in the model's format (2 for an fp32
    upcast, 0.25 for int8 of an fp32 model, ...). ValueError if the device cannot run the model."""
    fmt = _runnable(profile, model)
    if fmt == model.weight_format:
        return 1.0
    per_param = profile.weight_bytes_per_param if fmt in QUANT_FORMATS and profile.weight_bytes_per_param else FORMAT_BYTES[fmt]
    return per_param / FORMAT_BYTES[model.weight_format]


def float_scale(profile: DeviceProfile, model: ModelSpec) -> float:
    """Bytes of what the device holds or sends in floats (embeddings, head, KV, activations) per
    byte in the model's format."""
    fmt = device_compute_format(profile, model)
    if fmt == model.weight_format:
        return 1.0
    return FORMAT_BYTES[fmt] / max(FORMAT_BYTES[model.weight_format], 2.0)


def wire_scale(src: DeviceProfile, dst: DeviceProfile, model: ModelSpec) -> float:
    """Bytes of the hidden states `src` sends to `dst` per byte in the model's format: they travel
    in the narrower of the two compute formats (the receiver converts on receipt)."""
    return min(float_scale(src, model), float_scale(dst, model))
