"""What a model needs from the devices: per-layer weights, FLOPs, KV and activation sizes.

The decoder layers of a model are taken to be alike (where they are not, as in a mixture of
experts with some dense layers, a layer's numbers are the average), so one layer's numbers
describe them all. `ModelSpec.decoder(...)` derives them from a config (formulas in its docstring).

A mixture-of-experts layer holds every expert but a step reads only those its rows route to:
`layer_weight_bytes` counts them all (memory), `layer_flops_per_token` the experts one token runs,
and `layer_read_bytes(rows)` the experts a step of `rows` rows is expected to read.

Weight formats. `weight_format` is the format the mesh runs the model in (the controller's --dtype).
Each device runs it in one format of its own (`device_weight_format`):
  * a node started quantized (it offers one of QUANT_FORMATS) holds a float model's layer matrices
    in that format, and its embeddings, head, activations and KV in its `compute_format`;
  * a device that lists the model's format runs it as it is;
  * one that does not, but lists "fp32", runs a 16-bit float model upcast to fp32 (lossless);
  * any other device cannot take part. A quantized model format is run only as it is.
Sizes in a ModelSpec are in the model's format; a device's bytes are scaled from them:
`weight_scale` for the layers' matrices, `float_scale` for everything held or sent in floats
(embeddings, head, activations, recurrent states), `kv_scale` for the KV cache: in the compute
format, or 8-bit where the node was started with `--kv-dtype int8|fp8` (its profile's `kv_format`):
a byte an element and a float32 scale per (token, KV head) vector.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from logicpipe.planner.types import DeviceProfile

FORMAT_BYTES: dict[str, float] = {"fp32": 4.0, "fp16": 2.0, "bf16": 2.0, "int8": 1.0, "int4": 0.5, "nf4": 0.5, "fp4": 0.5}
"""Nominal bytes per parameter of the weight formats the planner knows (quantization scales not
counted; a node measures its own, `DeviceProfile.weight_bytes_per_param`)."""

FLOAT_FORMATS = ("fp32", "fp16", "bf16")
QUANT_FORMATS = ("int4", "int8", "nf4", "fp4")
KV_FORMATS = ("int8", "fp8")  # 8-bit KV (a node's --kv-dtype): a byte an element ...
KV_SCALE_BYTES = 4            # ... and a float32 scale per (token, KV head) vector

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
    num_experts: int = 0                       # a mixture of experts: experts per layer (0: a dense model)
    experts_per_token: int = 0                 # ... the experts each token routes to
    expert_bytes: int = 0                      # ... bytes of one expert's matrices (averaged over the layers)
    # what each layer keeps per sequence (issue 37): () every layer full attention; else per layer "full"
    # (kv_bytes_per_token_per_layer x context), "sliding" (x min(context, sliding_window)) or "linear"
    # (state_bytes_per_layer, whatever the context)
    layer_kinds: tuple[str, ...] = ()
    sliding_window: int = 0                    # positions a "sliding" layer attends to (tokens)
    state_bytes_per_layer: int = 0             # bytes of one sequence's recurrent state in a "linear" layer
    # what kv_bytes_per_token_per_layer counts (0: not known; a byte an element of it then, no scales): its elements
    # (2 x kv heads x head dim; MLA: the latent row) and vectors (2 x kv heads; MLA: 1), for 8-bit KV's bytes
    kv_elements_per_token_per_layer: int = 0
    kv_vectors_per_token_per_layer: int = 0
    # sizes a tensor-parallel width must divide (issue 36): query heads, KV heads, the MLP's intermediate
    # size or the experts (a shared expert's too), the vocabulary; (): the model does not split (width 1 only)
    tp_sizes: tuple[int, ...] = ()

    def kv_bytes_per_sequence(self, context: int, start: int = 0, end: int | None = None, *,
                              kv_scale: float = 1.0, state_scale: float = 1.0, whole: bool = False) -> float:
        """Bytes one sequence of `context` tokens keeps in layers [start, end) (default all), in the
        model's float format (or with the KV's and the states' bytes scaled by `kv_scale` and
        `state_scale`: a device's, cost.kv_scale): full layers its context, sliding layers their
        window (`whole`: their context too, on a stage whose windows keep every position:
        DeviceProfile.full_sliding_kv), linear layers a fixed state. O(1) from prefix counts of each kind."""
        end = self.num_layers if end is None else end
        _check(0 <= start <= end <= self.num_layers, f"layers [{start}, {end}) are not a range of {self.num_layers}")
        full, sliding, linear = (self._kind_counts[end][k] - self._kind_counts[start][k] for k in range(3))
        window = min(context, self.sliding_window) if self.sliding_window and not whole else context
        kv = (full * context + sliding * window) * self.kv_bytes_per_token_per_layer
        if kv_scale == 1.0 and state_scale == 1.0:
            return kv + linear * self.state_bytes_per_layer
        return kv * kv_scale + linear * self.state_bytes_per_layer * state_scale

    def kv8_bytes_per_token_per_layer(self) -> float:
        """Bytes of K and V one token leaves in one layer's cache as 8-bit KV (int8 or fp8): a byte an
        element and a float32 scale a (token, KV head) vector."""
        elements = self.kv_elements_per_token_per_layer or self.kv_bytes_per_token_per_layer / max(
            FORMAT_BYTES.get(self.weight_format, 2.0), 2.0)
        return elements + KV_SCALE_BYTES * self.kv_vectors_per_token_per_layer

    def mean_kv_bytes_per_layer(self, context: int, *, kv_scale: float = 1.0, state_scale: float = 1.0,
                                whole: bool = False) -> float:
        """The average layer's bytes for one sequence of `context` tokens (`kv_bytes_per_sequence` / layers)."""
        return self.kv_bytes_per_sequence(context, kv_scale=kv_scale, state_scale=state_scale,
                                          whole=whole) / self.num_layers

    @property
    def _kind_counts(self) -> tuple[tuple[int, int, int], ...]:
        """Layers of each kind (full, sliding, linear) before layer i, for i in 0..num_layers."""
        cached = self.__dict__.get("_counts")
        if cached is None:
            kinds = self.layer_kinds or ("full",) * self.num_layers
            counts, c = [(0, 0, 0)], [0, 0, 0]
            for k in kinds:
                c[("full", "sliding", "linear").index(k)] += 1
                counts.append(tuple(c))
            cached = tuple(counts)
            object.__setattr__(self, "_counts", cached)
        return cached

    def layer_read_bytes(self, rows: int) -> float:
        """Bytes of one layer's weights a step of `rows` rows reads: all of a dense layer; of a
        mixture, its dense part and the distinct experts the rows are expected to route to,
        E * (1 - (1 - k/E)^rows) with routing taken as uniform."""
        if not self.num_experts:
            return float(self.layer_weight_bytes)
        e, k = self.num_experts, self.experts_per_token
        distinct = e * (1.0 - (1.0 - k / e) ** max(1, rows))
        return self.layer_weight_bytes - e * self.expert_bytes + distinct * self.expert_bytes

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
        _check(self.num_experts == 0 or 1 <= self.experts_per_token <= self.num_experts,
               f"{where}: experts_per_token must lie in [1, num_experts]")
        _check(self.num_experts * self.expert_bytes <= self.layer_weight_bytes,
               f"{where}: a layer's experts cannot outweigh the layer")
        _check(not self.layer_kinds or (len(self.layer_kinds) == self.num_layers and
                                        set(self.layer_kinds) <= {"full", "sliding", "linear"}),
               f"{where}: layer_kinds must name each of the {self.num_layers} layers full, sliding or linear")
        _check(isinstance(self.sliding_window, int) and self.sliding_window >= 0 and
               (self.sliding_window > 0 or "sliding" not in self.layer_kinds),
               f"{where}: sliding layers need a sliding_window >= 1")
        _check(isinstance(self.state_bytes_per_layer, int) and self.state_bytes_per_layer >= 0,
               f"{where}: state_bytes_per_layer must be an integer number of bytes >= 0")
        object.__setattr__(self, "tp_sizes", tuple(self.tp_sizes))
        _check(all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in self.tp_sizes),
               f"{where}: tp_sizes must be integers >= 1, got {self.tp_sizes!r}")

    def tp_widths(self, most: int) -> tuple[int, ...]:
        """The tensor-parallel widths 1..`most` this model splits into: those that divide every one of
        `tp_sizes` (only 1 where the model does not split)."""
        if not self.tp_sizes:
            return (1,)
        return tuple(w for w in range(1, max(1, most) + 1) if all(n % w == 0 for n in self.tp_sizes))

    @classmethod
    def llama(cls, **kwargs) -> "ModelSpec":
        """A Llama-shaped decoder (`decoder` with none of the other families' extras)."""
        return cls.decoder(**kwargs)

    @classmethod
    def decoder(
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
        qkv_bias: bool = False,
        o_bias: bool = False,
        qk_norm: bool = False,
        norms: int = 2,
        num_experts: int = 0,
        experts_per_token: int = 0,
        expert_intermediate_size: int = 0,
        moe_layers: int | None = None,
        attention_params: int | None = None,
        kv_elements_per_token: int | None = None,
        kv_vectors_per_token: int | None = None,
        attention_flops_per_context_token: float | None = None,
        sinks: bool = False,
        expert_bias: bool = False,
        router_bias: bool = False,
        moe_shared_params: int = 0,
        layer_kinds: tuple[str, ...] = (),
        sliding_window: int = 0,
        state_elements_per_layer: int = 0,
        tp_sizes: tuple[int, ...] | None = None,
    ) -> "ModelSpec":
        """A decoder from its config.

        With h = hidden_size, i = intermediate_size, d = head_dim (default h / num_heads),
        a = num_heads, g = num_kv_heads, V = vocab_size, b = bytes_per_param (default from
        `weight_format`), e = compute bytes per element = max(b, 2):

        - attention params A = h*d*(2a + 2g)  [q, o; k, v]  + d*(a + 2g) [q/k/v biases]  + h [o bias]
          + 2*d [q/k norms]  + norms*h [the layer's norms: 2, Gemma's 4]  + a [`sinks`: a logit per head]
        - a dense MLP's params M = 3*h*i  [gate, up, down]
        - a mixture (E = num_experts, k = experts_per_token, f = expert_intermediate_size, on s of
          the layers, `moe_layers`, default all): X = 3*h*f (+ 2*f + h, `expert_bias`) per expert,
          router R = E*h (+ E, `router_bias`) + S, where S = `moe_shared_params` is what every token of a
          routing layer reads besides (shared experts, their gate, the correction bias); the average
          layer's MLP holds (s*(R + E*X) + (L - s)*M) / L and runs (s*(R + k*X) + (L - s)*M) / L
        - layer_weight_bytes = ceil((A + MLP held) * b) ;  layer_flops_per_token = 2 * (A + MLP run)
        - expert_bytes = ceil(X * b * s / L)  (the average layer's share of one expert)
        - attention_flops_per_context_token = 4 * a * d  (QK^T and AV, 2 FLOPs per multiply-add)
        - kv_bytes_per_token_per_layer = 2 * g * d * e ;  activation_bytes_per_token = h * e
        - attention of another shape (multi-head latent attention) passes its own A
          (`attention_params`, norms included), KV elements a token caches per layer
          (`kv_elements_per_token`, in place of 2*g*d; its vectors `kv_vectors_per_token`, in place of
          2*g, each with a scale in 8-bit KV) and attention FLOPs per context token
        - embedding_bytes = ceil(V*h*b) ;  lm_head_bytes = ceil((V*h + h) * b)  [matrix + final norm]
        - lm_head_flops_per_token = 2 * V * h
        - per layer kind (`layer_kinds`): a "sliding" layer keeps min(context, `sliding_window`)
          tokens of KV, a "linear" one a recurrent state of `state_elements_per_layer` float32
          elements (state_bytes_per_layer = 4 x that), whatever the context
        - tp_sizes (the sizes a tensor-parallel width must divide; None: derived) = (a, g, i or E, V)
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
        h, a, g, L = hidden_size, num_heads, num_kv_heads, num_layers
        element_bytes = max(bytes_per_param, 2.0)
        attn = h * d * (2 * a + 2 * g) + (d * (a + 2 * g) if qkv_bias else 0) + (h if o_bias else 0) \
            + (2 * d if qk_norm else 0) + norms * h + (a if sinks else 0)
        if attention_params is not None:
            attn = attention_params
        dense = 3 * h * intermediate_size
        held = run = float(dense)
        expert = 0
        if num_experts:
            s = L if moe_layers is None else moe_layers
            expert = 3 * h * expert_intermediate_size + ((2 * expert_intermediate_size + h) if expert_bias else 0)
            router = num_experts * h + (num_experts if router_bias else 0) + moe_shared_params
            held = (s * (router + num_experts * expert) + (L - s) * dense) / L
            run = (s * (router + experts_per_token * expert) + (L - s) * dense) / L
            expert = expert * s / L
        matrix = vocab_size * hidden_size
        return cls(
            name=name,
            num_layers=num_layers,
            layer_weight_bytes=math.ceil((attn + held) * bytes_per_param),
            layer_flops_per_token=2.0 * (attn + run),
            attention_flops_per_context_token=(4.0 * num_heads * d if attention_flops_per_context_token is None
                                               else attention_flops_per_context_token),
            kv_bytes_per_token_per_layer=math.ceil((2 * num_kv_heads * d if kv_elements_per_token is None
                                                    else kv_elements_per_token) * element_bytes),
            activation_bytes_per_token=math.ceil(hidden_size * element_bytes),
            embedding_bytes=math.ceil(matrix * bytes_per_param),
            lm_head_bytes=math.ceil((matrix + hidden_size) * bytes_per_param),
            lm_head_flops_per_token=2.0 * matrix,
            tied_embeddings=tied_embeddings,
            weight_format=weight_format,
            weights_digest=weights_digest,
            num_experts=num_experts,
            experts_per_token=experts_per_token if num_experts else 0,
            expert_bytes=math.floor(expert * bytes_per_param),
            layer_kinds=tuple(layer_kinds),
            sliding_window=sliding_window if "sliding" in layer_kinds else 0,
            state_bytes_per_layer=4 * state_elements_per_layer,
            kv_elements_per_token_per_layer=2 * num_kv_heads * d if kv_elements_per_token is None else kv_elements_per_token,
            kv_vectors_per_token_per_layer=2 * num_kv_heads if kv_vectors_per_token is None else kv_vectors_per_token,
            tp_sizes=(num_heads, num_kv_heads, num_experts or intermediate_size, vocab_size) if tp_sizes is None
            else tuple(tp_sizes),
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


def kv_scale(profile: DeviceProfile, model: ModelSpec) -> float:
    """Bytes of the KV cache the device holds (and its attention reads) per byte in the model's format:
    `float_scale` for KV in its compute format, else 8-bit KV's (`ModelSpec.kv8_bytes_per_token_per_layer`)."""
    if profile.kv_format not in KV_FORMATS:
        return float_scale(profile, model)
    return model.kv8_bytes_per_token_per_layer() / max(1, model.kv_bytes_per_token_per_layer)


def wire_scale(src: DeviceProfile, dst: DeviceProfile, model: ModelSpec) -> float:
    """Bytes of the hidden states `src` sends to `dst` per byte in the model's format: they travel
    in the narrower of the two compute formats (the receiver converts on receipt)."""
    return min(float_scale(src, model), float_scale(dst, model))
