"""Disaggregated prefill, a stage's half: a prefilled sequence's KV read out layer by layer
(the prefill pipeline's stage, SendKv) and written into a sequence of the decode pipeline (its
stage, ImportKv), whatever the two pipelines' splits: the controller asks each source stage for
the layers it shares with each destination stage (controller.jobs.handoff).

A destination sequence is opened with `import_length` L: its blocks for the prompt are taken at
once (the prefix cache is not attached: an imported block is never shared while it is written),
and it holds no position until every layer of the stage has received positions [0, L), in order;
then they are committed (the prefix cache registers the full blocks) and its first step may start
at L. A step before that is refused as any step past a sequence's length is (FailedPrecondition),
and a sequence closed meanwhile drops what came.

Float KV only (the wire's tensors are float; a receiver in another float dtype converts): 8-bit
KV, sliding-window pools, recurrent states and tensor-parallel stages are refused (`movable`).
"""
from __future__ import annotations

import hmac
from dataclasses import dataclass, field

import torch

from logicpipe import tensor_codec
from logicpipe.errors import FailedPrecondition, InvalidArgument, PermissionDenied
from logicpipe.stage_node.engine.kv import KVPool
from logicpipe.tensor_codec import RawTensor

CHUNK_BYTES = 8 * 2**20  # one KvChunk's tensor at most (positions of one layer per message)


@dataclass(frozen=True)
class KvRows:
    """One ImportKv chunk: layer `layer`'s KV of positions [start_pos, start_pos + n)."""

    session_id: str
    import_key: str
    layer: int          # absolute
    start_pos: int
    kv: RawTensor       # [parts, kv_heads, n, head_dim]

    @property
    def positions(self) -> int:
        return self.kv.shape[2]


@dataclass
class KvImport:
    """A destination sequence's KV still coming: positions received per layer of the stage."""

    length: int                       # positions [0, length) of every layer
    key: str                          # what each chunk must carry
    received: dict[int, int] = field(default_factory=dict)  # absolute layer -> positions received (from 0)

    def check(self, rows: KvRows, span: tuple[int, int], node_id: str) -> None:
        """Raise unless `rows` is the next run of positions of a layer this stage holds."""
        if not hmac.compare_digest(rows.import_key.encode(), self.key.encode()):
            raise PermissionDenied(f"session {rows.session_id} on node {node_id}: wrong import_key")
        if not span[0] <= rows.layer < span[1]:
            raise InvalidArgument(f"layer {rows.layer} is not held by node {node_id} (layers [{span[0]}, {span[1]}))")
        got = self.received.get(rows.layer, 0)
        if rows.start_pos != got or rows.start_pos + rows.positions > self.length:
            raise FailedPrecondition(f"session {rows.session_id} on node {node_id}: layer {rows.layer} rows "
                                     f"[{rows.start_pos}, {rows.start_pos + rows.positions}) but it holds {got} of "
                                     f"{self.length} positions (they come in order)")

    def took(self, rows: KvRows) -> None:
        self.received[rows.layer] = rows.start_pos + rows.positions

    def complete(self, span: tuple[int, int]) -> bool:
        return all(self.received.get(layer, 0) >= self.length for layer in range(*span))


def movable(pool: KVPool, *, states: bool, tensor_parallel: bool) -> str:
    """Why this stage's KV cannot be sent or received ("" when it can)."""
    if pool.quantized:
        return f"its KV is {pool.kv_dtype} (disaggregated prefill moves float KV only)"
    if pool.group is not None:
        return "its sliding-window layers keep a pool of their own"
    if states:
        return "its linear-attention layers keep a recurrent state per sequence"
    if tensor_parallel:
        return "it is tensor-parallel (each rank holds part of the heads)"
    return ""


def slots(blocks, block_size: int, start: int, n: int) -> torch.Tensor:
    """Pool slots of positions [start, start + n) of a sequence whose block table is `blocks`."""
    pos = torch.arange(start, start + n)
    return torch.tensor(list(blocks), dtype=torch.long)[pos // block_size] * block_size + pos % block_size


def chunk_positions(pool: KVPool) -> int:
    """Positions of one layer per chunk: CHUNK_BYTES at most."""
    per_position = pool.parts * pool.k.shape[1] * pool.kv.shape[-1] * pool.kv.element_size()
    return max(1, CHUNK_BYTES // per_position)


def read_rows(pool: KVPool, local_layer: int, where: torch.Tensor) -> RawTensor:
    """Runner thread: local layer's KV at slots `where`, [parts, kv_heads, n, head_dim], as bytes."""
    x = pool.kv[local_layer].index_select(2, where.to(pool.kv.device))  # [parts, heads, n, dim]
    return tensor_codec.from_tensor(x.cpu().contiguous())


def write_rows(pool: KVPool, local_layer: int, where: torch.Tensor, kv: RawTensor) -> None:
    """Runner thread: write a chunk's KV at slots `where`, in this pool's dtype."""
    x = tensor_codec.to_tensor(kv)
    want = (pool.parts, pool.k.shape[1], len(where), pool.kv.shape[-1])
    if tuple(x.shape) != want:
        raise InvalidArgument(f"kv of shape {list(x.shape)}, this stage holds {list(want)} per chunk")
    pool.kv[local_layer].index_copy_(2, where.to(pool.kv.device), x.to(pool.kv.device, pool.kv.dtype))
