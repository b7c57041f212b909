"""Quantized linear weights for a stage started with `--quantize int8|nf4|fp4`.

Each of a layer's matrices (fused q/k/v, o, fused gate/up, down) is quantized right after it is
read and fused, so the shard never holds more than one layer in float at a time. Embeddings, norms
and the LM head stay in the compute dtype (a stage that holds them keeps them exact).

Kernels, by format and device:
- **int8 on the CPU**: torch's fbgemm dynamic-quantized linear (weights per output channel,
  activations per tensor at run time). It is the fastest int8 kernel here: measured 3x faster
  than the float32 product per decode matrix on this CPU, where bitsandbytes' int8 ran slower than
  float32 (11 vs 25 tok/s in transformers).
- **nf4 / fp4**: bitsandbytes 4-bit (blocks of 64 weights, one absmax each), on the CPU and CUDA.
- int8 on CUDA is refused with a message saying what to use instead (not built yet).
torch 2.13 warns that its quantized tensors (which the fbgemm kernel takes) are deprecated; when
they go, int8 on the CPU moves to bitsandbytes' int8 (slower here) or a kernel of our own.

A quantized product scales each step's activations as a whole, so unlike the float path
(`stage_node.ops`) a row's numbers can depend on the other rows of its step: greedy tokens on a
quantized stage are deterministic for a given batch, but may differ between a request alone and
one among others (or with candidate tokens and without).
"""
from __future__ import annotations

import warnings

import torch

FORMATS = ("none", "int8", "nf4", "fp4")
BLOCK_4BIT = 64


class QuantError(ValueError):
    """A format this node cannot run, or its library missing."""


def check_format(fmt: str, device: str) -> None:
    """Raise QuantError unless `fmt` can run on `device` here."""
    if fmt not in FORMATS:
        raise QuantError(f"unknown weight format {fmt!r}: use one of {', '.join(FORMATS)}")
    if fmt == "int8":
        if device != "cpu":
            raise QuantError("--quantize int8 runs on the CPU only for now (torch's fbgemm kernel); "
                             "on CUDA use --quantize nf4")
        if "fbgemm" not in torch.backends.quantized.supported_engines:
            raise QuantError("--quantize int8 needs torch's fbgemm engine, which this torch build lacks; "
                             "use --quantize nf4")
    if fmt in ("nf4", "fp4"):
        try:
            import bitsandbytes  # noqa: F401
        except ImportError as exc:
            raise QuantError(f"--quantize {fmt} needs bitsandbytes: pip install 'logicpipe[quant]' "
                             f"(or bitsandbytes>=0.45) ({exc})") from exc


class QuantMatrix:
    """A quantized [out, in] weight: `m(x)` is x @ W.T for x [rows, in]."""

    format = ""

    def __init__(self, out_features: int, in_features: int):
        self.shape = (out_features, in_features)

    def numel(self) -> int:
        return self.shape[0] * self.shape[1]

    @property
    def nbytes(self) -> int:
        raise NotImplementedError

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class Int8Fbgemm(QuantMatrix):
    format = "int8"

    def __init__(self, w: torch.Tensor):
        super().__init__(*w.shape)
        w = w.float()
        scales = (w.abs().amax(1) / 127.0).clamp(min=1e-12).double()
        with warnings.catch_warnings():  # torch deprecates its quantized tensors; see the module docstring
            warnings.simplefilter("ignore", UserWarning)
            q = torch.quantize_per_channel(w, scales, torch.zeros(w.shape[0], dtype=torch.long), 0, torch.qint8)
        self._packed = torch.ops.quantized.linear_prepack(q, None)
        self._bytes = q.numel() + 8 * w.shape[0]  # int8 weights + a float64 scale per row

    @property
    def nbytes(self) -> int:
        return self._bytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # one call per row: the activations' scale is the row's own (LLM activations have outlier
        # rows; one scale for a whole step halves the agreement with float32), and a row's result
        # never depends on its step
        xf = x.float()
        out = [torch.ops.quantized.linear_dynamic(xf[i:i + 1], self._packed, False) for i in range(xf.shape[0])]
        return (out[0] if len(out) == 1 else torch.cat(out)).to(x.dtype)


class Bnb4bit(QuantMatrix):
    def __init__(self, w: torch.Tensor, quant_type: str):
        import bitsandbytes as bnb
        from bitsandbytes.functional import quantize_4bit

        super().__init__(*w.shape)
        self._matmul = bnb.matmul_4bit  # bound once: __call__ is on the per-token path
        self.format = quant_type
        self._dtype = w.dtype
        self._q, self._state = quantize_4bit(w.contiguous(), quant_type=quant_type, blocksize=BLOCK_4BIT)
        self._bytes = self._q.numel() * self._q.element_size() + self._state.absmax.numel() * self._state.absmax.element_size()

    @property
    def nbytes(self) -> int:
        return self._bytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self._matmul(x.to(self._dtype), self._q.t(), quant_state=self._state).to(x.dtype)


def quantize(w: torch.Tensor, fmt: str) -> QuantMatrix:
    """w: [out, in] float, on its device -> the quantized matrix."""
    if fmt == "int8":
        return Int8Fbgemm(w)
    if fmt in ("nf4", "fp4"):
        return Bnb4bit(w, fmt)
    raise QuantError(f"cannot quantize to {fmt!r}")


def tensor_bytes(x) -> int:
    """Bytes a weight takes: a tensor's storage, a quantized matrix's, a list's or a dataclass's
    (a layer's experts) in all."""
    if x is None:
        return 0
    if isinstance(x, QuantMatrix):
        return x.nbytes
    if isinstance(x, (list, tuple)):
        return sum(tensor_bytes(m) for m in x)
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    return sum(tensor_bytes(v) for v in vars(x).values())
