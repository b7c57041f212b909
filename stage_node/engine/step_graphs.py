"""CUDA graphs of small steps: a stage's decode step replayed as one graph instead of hundreds of
kernel launches.

On a GPU a decode step of a large model is bound by kernel launches and Python, not by reading the
weights: an 8B-shaped model issues about 40 small kernels per layer, 1,300 a step, each costing the
host more than the GPU. A graph captured once per (rows, context) bucket replays the whole
step's layers with one launch.

What a graph needs is fixed shapes and fixed addresses, so the batched body differs from the eager
forward in how it attends:
  * every row is its own query: its position, the slot it writes and its sequence's block table
    (padded to the bucket's context) are inputs; a row attends to the positions below its own
    (`length` = position + 1), so several rows of one sequence (candidates, a short prompt) are
    causal as in the eager forward, because all rows' keys are written before any row reads;
  * keys and values are gathered from the paged pool by slot (the block table expanded in the
    graph) and padded positions are masked out;
  * the rows' query heads of one KV head are that head's queries (grouped-query attention without
    repeating keys);
  * rows past the step's own (the bucket's padding) write to the pool's scratch slot;
  * a sliding-window layer masks the positions before the window too, and soft-capped scores
    (Gemma 2) go the eager way (scores, cap, mask, softmax in float32); a mixture of experts
    runs the grouped kernel (stage_node.kernels.grouped), whose shapes are fixed by the rows;
  * with batch-invariant kernels (stage_node.invariant) every row attends by the same kernel as
    in the eager forward, reading its keys from the pool by slot (no gather, no padded context):
    a row gets the same bits in any bucket, and in a graph or not.
Sliding windows held (engine.window, Shard.hold_windows): a window sequence's block table starts
with the blocks it gave back (`HOLE`); a graph reads a held block in their place (masked, as every
position before the window is). Where the stage has full layers too, the window layers' own pool
(`KVPool.group`) has its own block table and write slot per row (`GraphRow.window_blocks`,
`window_slot`), static inputs of the graph beside the full layers'. A bucket's context is still the
rows' positions (masked below the window), so a step past the largest bucket runs eagerly.

The KV pool is static (allocated once for the stage's budget, zeroed: masked positions are read, and
a NaN there would pass the mask), and the RoPE tables are grown to the
largest bucket before the first capture and held, so the captured addresses stay valid.

Buckets: rows 1, 2, 4, 8, 16, 32, 64, 128, 256 (issue 32: a step of 64 rows ran eagerly, 27 ms
against 8.8 for 32 rows in a graph; past 32 only with the batch-invariant kernels, as the other
body gathers keys per row, and not for quantized experts); context a power of two from 256 up to the model's positions (at
most 8,192). A step with more rows or a longer context runs eagerly. Graphs are captured when a
bucket is first used (a few hundred ms for an 8B stage) into one shared memory pool. A capture that
fails turns graphs off for the stage (logged), and it goes on eagerly.

On a CPU the same body runs eagerly (`capture=False`): that is how the tests check its arithmetic
against the forward.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from logicpipe.stage_node.engine.blocks import HOLE
from logicpipe.stage_node.engine.kv_quant import dequantize, index_select, rotate, unrotate
from logicpipe.stage_node.kernels import invariant
from logicpipe.stage_node.model.ops import softcap

log = logging.getLogger(__name__)

ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
SMALL_ROWS = 32  # the largest bucket where the body gathers keys (batch-invariant kernels off)
MIN_CONTEXT = 256
MAX_CONTEXT = 8192


@dataclass(frozen=True)
class GraphRow:
    """One row of a step: its position, the pool slot it writes, its sequence's block table (and where
    the stage's sliding-window layers hold only their window in a pool of their own: the slot it writes
    there and its sequence's block table there)."""

    position: int
    write_slot: int
    blocks: list[int] | tuple[int, ...]
    window_slot: int = -1
    window_blocks: list[int] | tuple[int, ...] | None = None


class _Graph:
    """Static inputs and outputs of one (rows, context) bucket, and its captured graph."""

    def __init__(self, rows: int, context: int, block_size: int, hidden: int, dtype, device, window: bool = False):
        self.rows, self.context = rows, context
        self.nblocks = context // block_size
        self.x = torch.zeros(rows, hidden, dtype=dtype, device=device)  # x: [rows, hidden]
        # ints: positions [rows], write slots [rows], lengths [rows], block tables [rows, nblocks]; with
        # `window` (the window layers' own pool) their write slots [rows] and block tables [rows, nblocks] too
        self.window = window
        self.ints = torch.zeros(rows * (3 + self.nblocks) * (1 + window) - 2 * rows * window, dtype=torch.long,
                                device=device)
        cuda = torch.device(device).type == "cuda"
        # their host side: pinned, copied without a sync; the event says when the copy has read it
        self.host = [torch.zeros(self.ints.shape, dtype=torch.long, pin_memory=True) for _ in range(2)] if cuda else None
        self.copied = [torch.cuda.Event() for _ in range(2)] if cuda else None
        self.flip = 0
        # batch-invariant attention: a tile per row, row r reading slot table row r
        self.tiles = torch.arange(rows, dtype=torch.int32, device=device).repeat(3, 1)
        self.tiles[1] = 1
        self.out: torch.Tensor | None = None
        self.graph = None

    @property
    def positions(self) -> torch.Tensor:
        return self.ints[: self.rows]

    @property
    def write(self) -> torch.Tensor:
        return self.ints[self.rows: 2 * self.rows]

    @property
    def lengths(self) -> torch.Tensor:
        return self.ints[2 * self.rows: 3 * self.rows]

    @property
    def blocks(self) -> torch.Tensor:
        return self.ints[3 * self.rows: (3 + self.nblocks) * self.rows].view(self.rows, self.nblocks)

    @property
    def window_write(self) -> torch.Tensor:
        at = (3 + self.nblocks) * self.rows
        return self.ints[at: at + self.rows]

    @property
    def window_blocks(self) -> torch.Tensor:
        return self.ints[(4 + self.nblocks) * self.rows:].view(self.rows, self.nblocks)


class StepGraphs:
    """The graphs of one shard and its KV pool."""

    def __init__(self, shard, pool, *, capture: bool = True, warm: bool = True):
        self.shard, self.pool = shard, pool
        c = shard.config
        self.block_size = pool.block_size
        top = min(MAX_CONTEXT, c.max_position_embeddings or MAX_CONTEXT)
        self.max_context = max(self.block_size, top // self.block_size * self.block_size)
        self.tables = {}  # layer kind -> (cos, sin_signed) [max_context, head_dim], grown once and held
        for kind, rope in shard.ropes.items():
            rope.lookup(0, self.max_context)
            self.tables[kind] = (rope.cos, rope.sin_signed)
        # past 32 rows only with the batch-invariant kernels (attention reads the pool by slot; the
        # gathering body would copy rows x context keys); a mixture of experts too, its experts by
        # the grouped kernel (stage_node.kernels.grouped: fixed shapes, no sync), unless quantized
        big = shard.batch_invariant and not any(w.experts is not None and isinstance(w.experts.gate_up, list)
                                                for w in shard.layers)
        self.row_buckets = tuple(r for r in ROW_BUCKETS if big or r <= SMALL_ROWS)
        self.capture = capture
        self.disabled = False
        self.graphs: dict[tuple[int, int], _Graph] = {}
        self.mempool = torch.cuda.graph_pool_handle() if capture else None
        self.replays = 0
        self._arange = torch.arange(self.max_context, device=shard.device)
        if capture and warm and shard.batch_invariant:
            self.warm()

    def buckets(self) -> list[tuple[int, int]]:
        """Every (rows, context) bucket a step can fall in, smallest contexts first."""
        out, ctx = [], MIN_CONTEXT
        while True:
            top = -(-min(ctx, self.max_context) // self.block_size) * self.block_size
            out += [(r, top) for r in self.row_buckets if (r, top) not in out]
            if ctx >= self.max_context:
                return out
            ctx *= 2

    def warm(self) -> float:
        """At start-up, so that no step pays for it later (issue 25: steps of 1 to 4 s under
        concurrency): every Triton kernel variant of the eager forward compiled (Shard.warm_up), then
        every bucket's graph captured (about 0.1 s each for 32 layers of 8B). -> seconds taken"""
        t0 = time.perf_counter()
        self.shard.warm_up(self.pool)
        for key in self.buckets():
            if key not in self.graphs and self.make(*key) is None:
                break  # graphs are off for this stage (logged)
        took = time.perf_counter() - t0
        log.info("warm-up of layers [%d, %d): kernels compiled, %d graphs captured, %.1f s", self.shard.start,
                 self.shard.end, len(self.graphs), took)
        return took

    def bucket(self, rows: int, stop: int) -> tuple[int, int] | None:
        """The (rows, context) bucket of a step of `rows` rows reading up to position `stop`, or
        None when it is too large for a graph."""
        if self.disabled or rows > self.row_buckets[-1] or stop > self.max_context:
            return None
        r = next(b for b in self.row_buckets if b >= rows)
        ctx = MIN_CONTEXT
        while ctx < stop:
            ctx *= 2
        # max_context is a whole number of blocks, so rounding up to one stays within it
        return r, -(-min(ctx, self.max_context) // self.block_size) * self.block_size

    @torch.inference_mode()
    def forward(self, x: torch.Tensor, rows: list[GraphRow]) -> torch.Tensor | None:
        """x: [R, hidden] -> the layers' output [R, hidden], or None when the step has no bucket
        (the caller runs it eagerly)."""
        key = self.bucket(len(rows), max(r.position for r in rows) + 1)
        if key is None:
            return None
        g = self.graphs.get(key)
        if g is None:
            g = self.make(*key)
            if g is None:
                return None
        n = len(rows)
        if g.host is not None:
            g.flip = 1 - g.flip  # two pinned buffers in turn: one step's copy may still read the other
            host, done = g.host[g.flip], g.copied[g.flip]
            done.synchronize()  # the copy from this buffer, two uses ago, has read it
        else:
            host, done = torch.empty(g.ints.shape, dtype=torch.long), None
        self._fill(g, host.numpy(), rows)
        if done is not None:
            g.ints.copy_(host, non_blocking=True)
            done.record()
        else:
            g.ints.copy_(host)
        g.x[:n].copy_(x)
        mirror = self.shard.mirror
        if mirror is None:
            return self.replay(g)[:n].clone()
        with mirror.lost_on_error():  # a tensor-parallel stage's rank 0: every rank replays with it
            mirror.graph_step(g)
            return self.replay(g)[:n].clone()

    def replay(self, g: _Graph) -> torch.Tensor:
        """Run g's step over its static inputs (its graph, or on a CPU its body) -> [g.rows, hidden]."""
        self.replays += 1
        if g.graph is not None:
            g.graph.replay()
            return g.out
        return self._body(g)

    def _fill(self, g: _Graph, ints, rows: list[GraphRow]) -> None:
        """g's integer inputs for `rows` into the host array `ints` (numpy): positions, write slots
        and lengths of every row (padding rows: position 0, the scratch slot, length 1), then each
        row's block table padded with its first block (padding rows: block 0); with a window pool,
        its write slots and block tables the same way. Rows of one sequence share their table's
        conversion."""
        n, R, nb = len(rows), g.rows, g.nblocks
        ints[:n] = [r.position for r in rows]
        ints[n:R] = 0
        ints[R:R + n] = [r.write_slot for r in rows]
        ints[R + n:2 * R] = self.pool.scratch_slot
        ints[2 * R:2 * R + n] = [r.position + 1 for r in rows]
        ints[2 * R + n:3 * R] = 1
        _tables(ints[3 * R:(3 + nb) * R].reshape(R, nb), [r.blocks for r in rows])
        if g.window:
            at = (3 + nb) * R
            ints[at:at + n] = [r.window_slot for r in rows]
            ints[at + n:at + R] = self.pool.group.scratch_slot
            _tables(ints[at + R:].reshape(R, nb), [r.window_blocks for r in rows])

    def make(self, rows: int, context: int) -> _Graph | None:
        """The (rows, context) bucket's static inputs and (capture on) its graph, or None when the
        capture failed (graphs are then off for the stage). On rank 0 of a tensor-parallel stage
        every rank makes its own at the same moment (their all-reduces are joint), and a failure
        ends the stage: the ranks would be out of step (tp_group.Leader.lost_on_error)."""
        mirror = self.shard.mirror
        if mirror is None:
            return self._new(rows, context)
        with mirror.lost_on_error():
            mirror.capture(rows, context)
            return self._new(rows, context, strict=True)

    def _new(self, rows: int, context: int, strict: bool = False) -> _Graph | None:
        s = self.shard
        strict = strict or s.tp is not None  # a rank of a tensor-parallel stage: a failure is the stage's
        g = _Graph(rows, context, self.block_size, s.config.hidden_size, s.dtype, s.device, self.pool.group is not None)
        g.write.fill_(self.pool.scratch_slot)
        g.lengths.fill_(1)
        if g.window:
            g.window_write.fill_(self.pool.group.scratch_slot)
        if self.capture:
            t0 = time.perf_counter()
            try:
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    self._body(g)  # warm-up: lazy cuBLAS/attention set-up happens outside the capture
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.mempool):
                    g.out = self._body(g)
                g.graph = graph
            except Exception as exc:  # noqa: BLE001 — eager still works; say so once
                if strict:
                    raise
                self.disabled = True
                log.warning("capturing a CUDA graph of layers [%d, %d) failed (%s); this stage runs its steps "
                            "eagerly from now on", s.start, s.end, exc)
                return None
            log.info("captured the CUDA graph of layers [%d, %d) for %d rows, %d positions in %.0f ms",
                     s.start, s.end, rows, context, (time.perf_counter() - t0) * 1000)
        self.graphs[(rows, context)] = g
        return g

    def _body(self, g: _Graph) -> torch.Tensor:
        """The layers over g's static inputs -> [rows, hidden] (what the graph records)."""
        s, c = self.shard, self.shard.config
        R, C, bs = g.rows, g.context, self.block_size
        slots = (g.blocks[:, :, None] * bs + self._arange[:bs]).view(R, C)  # [R, C]: each row's slot of each position
        # per local layer: its pool, its layer there, the slots its rows write and read (the window layers'
        # own where the stage holds windows beside full layers)
        own = {"main": (self.pool, g.write, slots)}
        if g.window:
            own["window"] = (self.pool.group, g.window_write,
                             (g.window_blocks[:, :, None] * bs + self._arange[:bs]).view(R, C))
        group = set(s.window_layers)
        where = [own["window" if i in group else "main"] + (s._kv.get(i, i),) for i in range(len(s.layers))]
        window_kv = (g.window_write, self.pool.group.kv) if g.window else None
        if s.fused_layers:  # RoPE tables indexed and keys written by the fused kernels, read by slot

            def attend_fused(i: int, q: torch.Tensor, rounded: bool = False):
                pool, _, read, j = where[i]
                return invariant.attention(q, pool.k[j], pool.v[j], read, g.positions, g.tiles,
                                           scale=s._scale, cap=s.arch.attn_softcap,
                                           window=s.arch.sliding_window if s.kind(i) == "sliding" else None,
                                           rounded=rounded)

            return s.layers_fused(g.x, g.positions, g.write, self.pool.kv, self.tables, attend_fused, window_kv)
        kvh, hd = c.num_kv_heads, c.head_dim
        group_size = c.num_heads // kvh
        tables = {kind: (cos[g.positions], sin[g.positions]) for kind, (cos, sin) in self.tables.items()}  # [R, hd]
        keys_at = self._arange[:C][None, :]  # [1, C]
        full = keys_at < g.lengths[:, None]  # [R, C]: a row sees the positions up to its own
        masks = {"full": full[:, None, None, :]}  # [R, 1, 1, C]
        if "sliding" in self.tables:  # ... and no further back than the window
            masks["sliding"] = (full & (keys_at >= g.lengths[:, None] - s.arch.sliding_window))[:, None, None, :]
        cap = s.arch.attn_softcap

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            pool, write, read, j = where[i]
            kv = pool.kv[j]  # [2, kv_heads, slots, head_dim] (MLA: [1, 1, slots, latent])
            if pool.quantized:  # 8-bit KV (engine.kv_quant): quantized as written, dequantized as gathered
                pool.store(j, write, k, v)
            else:
                new = k[None] if v is None else torch.stack((k, v))
                kv.index_copy_(2, write, new.transpose(1, 2))  # [parts, kv_heads, R, hd]
            sinks = s.layers[i].sinks  # [heads] (gpt-oss) or None
            if s.batch_invariant:  # MLA: whole latent rows as values (the caller keeps their latent part)
                return invariant.attention(q, kv[0], kv[-1], read, g.positions, g.tiles, scale=s._scale,
                                           cap=cap, window=s.arch.sliding_window if s.kind(i) == "sliding" else None,
                                           sinks=sinks)
            flat = read.reshape(-1)  # [R * C]
            both = index_select(kv, 2, flat)
            if pool.quantized:
                both = dequantize(both, pool.scales[j].index_select(2, flat), s.dtype)
            both = both.view(kv.shape[0], kvh, R, C, hd).transpose(1, 2)  # [parts, R, kv_heads, C, hd]
            keys = both[0]
            values = keys[..., : pool.v.shape[-1]] if v is None else both[1]
            mask = masks[s.kind(i)]
            q = q.view(R, kvh, group_size, hd)
            if pool.rotated:  # 8-bit keys and values stored rotated (kv_quant.rotate): so are the queries
                q = rotate(q).to(q.dtype)
            if sinks is not None:  # ops.attention's form with sinks: [R, kv_heads, group, C + 1]
                scores = (q @ keys.transpose(-1, -2) * s._scale).masked_fill(~mask, float("-inf"))
                both = torch.cat([scores, sinks.to(scores.dtype).view(1, kvh, group_size, 1).expand(R, -1, -1, -1)], -1)
                both = both - both.max(dim=-1, keepdim=True).values
                o = torch.softmax(both, dim=-1, dtype=both.dtype)[..., :-1].to(values.dtype) @ values
            elif cap is None:
                o = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=s._scale)
            else:  # [R, kv_heads, group, C]
                scores = softcap(q @ keys.transpose(-1, -2) * s._scale, cap).masked_fill(~mask, float("-inf"))
                o = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype) @ values
            return (unrotate(o) if pool.rotated else o).reshape(R, -1)  # o: [R, kv_heads, group, hd]

        h = g.x
        for i, w in enumerate(s.layers):
            cos, sin = tables[s.kind(i)]
            h = s._layer(i, w, h, cos, sin, s.decode_rows, attend)
        return h

def _tables(blocks, tables) -> None:
    """Each row's block table into `blocks` [R, nblocks] (numpy; rows past `tables`: block 0), cut or
    padded to nblocks with a block it holds; the blocks a sliding window gave back (HOLE, a prefix of
    its table) read as that block too: their positions are masked."""
    n, nb = len(tables), blocks.shape[1]
    last, arr = None, None
    for i, t in enumerate(tables):
        if t is not last:
            last = t
            arr = np.asarray(t[:nb], dtype=np.int64)
            if arr[0] == HOLE:
                held = arr[arr != HOLE]
                arr = np.where(arr == HOLE, held[0] if held.size else t[-1], arr)
        blocks[i, :len(arr)] = arr
        blocks[i, len(arr):] = arr[0]
    blocks[n:] = 0
