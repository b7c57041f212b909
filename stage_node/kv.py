"""KV cache of one session on one stage: preallocated, one slab per tensor for all local layers."""
from __future__ import annotations

import logging
from typing import NamedTuple

import torch

log = logging.getLogger(__name__)


class SessionKV:
    """Keys and values of one sequence for this stage's layers, `capacity` positions preallocated.

    Positions [0, length) are valid. A forward writes its new positions in place and advances
    `length`; `truncate` rolls back (rejected candidate tokens) without touching memory.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, capacity: int, head_dim: int, *,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        if capacity < 1:
            raise ValueError(f"KV capacity must be at least 1 token, got {capacity}")
        shape = (num_layers, num_kv_heads, capacity, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # k: [layers_local, kv_heads, capacity, head_dim]
        self.v = torch.zeros(shape, dtype=dtype, device=device)  # v: [layers_local, kv_heads, capacity, head_dim]
        self.capacity = capacity  # positions preallocated (tokens)
        self.length = 0  # positions written and valid (tokens)

    @property
    def num_layers(self) -> int:
        return self.k.shape[0]

    @property
    def nbytes(self) -> int:
        """Bytes held by the preallocated keys and values (whole capacity, not just length)."""
        return self.k.nbytes + self.v.nbytes

    def truncate(self, new_length: int) -> None:
        """Forget positions [new_length, length), e.g. rejected candidate tokens."""
        if not 0 <= new_length <= self.length:
            raise ValueError(f"cannot truncate a KV cache of length {self.length} to {new_length}")
        self.length = new_length

    def fork(self, capacity: int | None = None) -> "SessionKV":
        """A new cache holding a copy of this one's valid positions (for a shared prefix)."""
        capacity = self.capacity if capacity is None else capacity
        if capacity < self.length:
            raise ValueError(f"fork capacity {capacity} is below the cache length {self.length}")
        layers, heads, _, head_dim = self.k.shape
        new = SessionKV(layers, heads, capacity, head_dim, dtype=self.k.dtype, device=self.k.device)
        new.k[:, :, : self.length] = self.k[:, :, : self.length]
        new.v[:, :, : self.length] = self.v[:, :, : self.length]
        new.length = self.length
        return new


class SeqSlice(NamedTuple):
    """One sequence's rows in a packed forward: `num_tokens` new tokens at positions start_pos.."""

    cache: SessionKV
    start_pos: int  # position of the first new token (== cache.length before the forward)
    num_tokens: int  # rows of this sequence in the packed hidden states


def kv_bytes_per_token(config, num_layers_local: int, dtype: torch.dtype) -> int:
    """Bytes of K and V one token costs on a stage with `num_layers_local` layers."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers_local * config.num_kv_heads * config.head_dim * itemsize
