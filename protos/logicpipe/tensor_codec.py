"""Tensors on the wire: raw little-endian bytes + dtype + shape, validated on receipt. Never pickled.

Two halves, so that a process can keep every torch operation on one thread:
  * `check` / `raw_to_proto` (no torch): validate a message into a `RawTensor`, or build one, on
    the event loop;
  * `to_tensor` / `from_tensor` (torch): bytes <-> tensor, on the thread that runs torch.
`encode` / `decode` do both halves at once, for callers with no such constraint.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from logicpipe.limits import MAX_MESSAGE_BYTES
from logicpipe.v1 import tensor_pb2

# dtype name on the wire -> torch dtype. Anything else is rejected.
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
}
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4}  # bytes per element
_NAMES = {v: k for k, v in DTYPES.items()}
MAX_RANK = 4
# One tensor on the wire, bytes: what a gRPC message can hold, less room for the rest of it.
MAX_TENSOR_BYTES = MAX_MESSAGE_BYTES - 2**20


class TensorError(ValueError):
    """A tensor message that can never decode; the message says what is wrong."""


@dataclass(frozen=True)
class RawTensor:
    """A validated tensor as bytes: `data` holds prod(shape) elements of `dtype`, little-endian."""

    dtype: str
    shape: tuple[int, ...]
    data: bytes

    @property
    def nbytes(self) -> int:
        return len(self.data)

    def take_rows(self, spans: list[tuple[int, int]]) -> "RawTensor":
        """Rows [a, b) of each span of a [rows, width] tensor, concatenated (bytes only)."""
        row_bytes = self.nbytes // self.shape[0] if self.shape[0] else 0
        data = b"".join(self.data[a * row_bytes: b * row_bytes] for a, b in spans)
        return RawTensor(self.dtype, (sum(b - a for a, b in spans), self.shape[1]), data)


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _NAMES[dtype]
    except KeyError:
        raise TensorError(f"dtype {dtype} cannot travel; allowed: {', '.join(DTYPES)}") from None


def check(msg: tensor_pb2.Tensor, *, max_bytes: int = MAX_TENSOR_BYTES, rank: int | None = None,
          dtypes: tuple[str, ...] | None = None) -> RawTensor:
    """Message -> RawTensor after checking dtype, shape and byte length (no torch). Raises TensorError."""
    if msg.dtype not in ITEMSIZE:
        raise TensorError(f"dtype {msg.dtype[:40]!r} not allowed; allowed: {', '.join(DTYPES)}")
    if dtypes is not None and msg.dtype not in dtypes:
        raise TensorError(f"dtype {msg.dtype} not accepted here; expected one of {list(dtypes)}")
    shape = tuple(int(s) for s in msg.shape)
    if len(shape) > MAX_RANK or (rank is not None and len(shape) != rank):
        want = rank if rank is not None else f"<= {MAX_RANK}"
        raise TensorError(f"tensor rank {len(shape)} (shape {list(shape[:8])}) but rank {want} expected")
    if any(s < 0 for s in shape):
        raise TensorError(f"negative dimension in shape {list(shape)}")
    expected = math.prod(shape) * ITEMSIZE[msg.dtype]
    if expected > max_bytes:
        raise TensorError(f"tensor of shape {list(shape)} {msg.dtype} is {expected} bytes, over the {max_bytes}-byte cap")
    if len(msg.data) != expected:
        raise TensorError(
            f"tensor data is {len(msg.data)} bytes but shape {list(shape)} x {msg.dtype} needs {expected}")
    return RawTensor(msg.dtype, shape, msg.data)


def raw_to_proto(raw: RawTensor) -> tensor_pb2.Tensor:
    return tensor_pb2.Tensor(dtype=raw.dtype, shape=list(raw.shape), data=raw.data)


def to_tensor(raw: RawTensor) -> torch.Tensor:
    """RawTensor -> CPU tensor (a copy: the message's bytes stay untouched)."""
    if not raw.data:
        return torch.empty(raw.shape, dtype=DTYPES[raw.dtype])
    flat = torch.frombuffer(bytearray(raw.data), dtype=torch.uint8)
    return flat.view(DTYPES[raw.dtype]).reshape(raw.shape)


def from_tensor(t: torch.Tensor) -> RawTensor:
    """Tensor -> RawTensor (copies to host memory if needed)."""
    name = dtype_name(t.dtype)
    host = t.detach().contiguous().cpu()
    data = host.reshape(-1).view(torch.uint8).numpy().tobytes() if host.numel() else b""  # 0-d too
    return RawTensor(name, tuple(host.shape), data)


def encode(t: torch.Tensor) -> tensor_pb2.Tensor:
    """Tensor -> message."""
    return raw_to_proto(from_tensor(t))


def decode(msg: tensor_pb2.Tensor, *, max_bytes: int = MAX_TENSOR_BYTES, rank: int | None = None,
           dtypes: tuple[torch.dtype, ...] | None = None) -> torch.Tensor:
    """Message -> CPU tensor, after `check`. Raises TensorError."""
    names = None if dtypes is None else tuple(dtype_name(d) for d in dtypes)
    return to_tensor(check(msg, max_bytes=max_bytes, rank=rank, dtypes=names))
