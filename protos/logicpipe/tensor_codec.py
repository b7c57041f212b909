"""Tensors on the wire: raw little-endian bytes + dtype + shape, validated on receipt. Never pickled."""
from __future__ import annotations

import math

import torch

from logicpipe.v1 import tensor_pb2

# dtype name on the wire -> torch dtype. Anything else is rejected.
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
}
_NAMES = {v: k for k, v in DTYPES.items()}
MAX_RANK = 4
MAX_TENSOR_BYTES = 256 * 2**20  # one tensor on the wire, bytes


class TensorError(ValueError):
    """A tensor message that can never decode; the message says what is wrong."""


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _NAMES[dtype]
    except KeyError:
        raise TensorError(f"dtype {dtype} cannot travel; allowed: {', '.join(DTYPES)}") from None


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise TensorError(f"dtype {name!r} not allowed; allowed: {', '.join(DTYPES)}") from None


def encode(t: torch.Tensor) -> tensor_pb2.Tensor:
    """Tensor -> message (copies to host memory if needed)."""
    name = dtype_name(t.dtype)
    host = t.detach().contiguous().cpu()
    data = host.view(torch.uint8).numpy().tobytes() if host.numel() else b""
    return tensor_pb2.Tensor(dtype=name, shape=list(host.shape), data=data)


def decode(
    msg: tensor_pb2.Tensor,
    *,
    max_bytes: int = MAX_TENSOR_BYTES,
    rank: int | None = None,
    dtypes: tuple[torch.dtype, ...] | None = None,
) -> torch.Tensor:
    """Message -> CPU tensor, after checking dtype, shape and byte length. Raises TensorError."""
    dtype = dtype_from_name(msg.dtype)
    if dtypes is not None and dtype not in dtypes:
        raise TensorError(f"dtype {msg.dtype} not accepted here; expected one of {[_NAMES[d] for d in dtypes]}")
    shape = tuple(int(s) for s in msg.shape)
    if len(shape) > MAX_RANK or (rank is not None and len(shape) != rank):
        want = rank if rank is not None else f"<= {MAX_RANK}"
        raise TensorError(f"tensor rank {len(shape)} (shape {list(shape)}) but rank {want} expected")
    if any(s < 0 for s in shape):
        raise TensorError(f"negative dimension in shape {list(shape)}")
    itemsize = torch.empty((), dtype=dtype).element_size()
    expected = math.prod(shape) * itemsize
    if expected > max_bytes:
        raise TensorError(f"tensor of shape {list(shape)} {msg.dtype} is {expected} bytes, over the {max_bytes}-byte cap")
    if len(msg.data) != expected:
        raise TensorError(
            f"tensor data is {len(msg.data)} bytes but shape {list(shape)} x {msg.dtype} needs {expected}"
        )
    if expected == 0:
        return torch.empty(shape, dtype=dtype)
    flat = torch.frombuffer(bytearray(msg.data), dtype=torch.uint8)
    return flat.view(dtype).reshape(shape)
