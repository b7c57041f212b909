"""KV mirrors (issue 34): a stage copies the full KV blocks of its running sequences, as they fill,
to the stages of other pipelines that hold the same layers with the same numerics (the controller
names them: SetMirror, controller.mesh.mirrors), which keep them in their prefix caches. When a
fault moves a request onto such a pipeline, its replay attaches its history's blocks there
(KVManager.attach_prefix) and computes only the positions past the last block copied, instead of
its whole prompt and every token so far: a storm's fault then costs a short replay, not one as long
as the request.

Sender: every MIRROR_S, for each target, the blocks of the open sequences (in order, a sequence's
first block first: the receiver's cache finds a prefix block by block) whose hash that target has
not taken yet, read from the pool between steps (the step lock held: no step writes meanwhile) and
sent in PutBlocks of at most MESSAGE_BYTES each, ROUND_BYTES a round. Each round is a task of its
own and sends to its targets at the same time, one catch-up a target at a time (`Target.task`): a
target that takes the connection but never answers (a SIGSTOPped stage: its call waits
PUT_TIMEOUT_S) holds up neither the other targets nor the next rounds. A target that answers with
another incarnation (it restarted, or its pool was replaced) gets everything again. A failed call is
counted and skipped: a mirror is an optimisation, and a request whose mirror is short replays more.
A stage that leaves (SIGTERM) first sends its targets everything they lack (`flush`, at most
FLUSH_S, every call bounded by that deadline; a round's catch-up under way is waited for, then
finished), then says it stops: the controller moves its sequences once their copies are there.

Receiver: PutBlocks carries the controller's mirror key (SetMirror gave every stage it holds the
same); the blocks must be of this stage's layers, model and block size; each is registered as a
cached block nobody holds (KVManager.adopt: on a free block, else in place of the least recently
cached one, never a block a sequence holds) and its KV written before any step can read it.

Exactness: a block copied from another stage holds the bits this stage would have computed only
where both run the same kernels on the same kind of device in the same dtypes; the controller pairs
only such stages (same device name, dtype, weight format, KV format and layers). Float KV only
(`handoff.movable`: not 8-bit KV, sliding-window pools, recurrent states or tensor-parallel stages).
"""
from __future__ import annotations

import asyncio
import hmac
import logging
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field

import grpc
import torch

from logicpipe import tensor_codec
from logicpipe.errors import FailedPrecondition, InvalidArgument, PermissionDenied, Unavailable
from logicpipe.formats import FLOAT_DTYPES
from logicpipe.stage_node.engine import handoff
from logicpipe.stage_node.engine.blocks import HOLE
from logicpipe.tensor_codec import RawTensor
from logicpipe.v1 import stage_pb2, stage_pb2_grpc

log = logging.getLogger(__name__)

MIRROR_S = 0.5              # a sender looks for new full blocks this often
MAX_TARGETS = 4             # stages one stage copies to at most
MESSAGE_BYTES = 8 * 2**20   # KV bytes of one PutBlocks at most (at least one block)
ROUND_BYTES = 64 * 2**20    # KV bytes sent to one target per round at most (a new target catches up in rounds)
MAX_BLOCKS = 1024           # blocks of one PutBlocks at most (a receiver refuses more)
SENT_CAP = 1 << 16          # hashes remembered per target as taken (the oldest forgotten first)
PUT_TIMEOUT_S = 10.0
RETRY_S = 2.0               # a target whose PutBlocks failed is left alone this long
FLUSH_S = 1.0               # a stage that leaves (SIGTERM) sends what its targets lack for at most this long first
                            # (each MIRROR_S round sends it anyway); the disk store's last round as long, at the same
                            # time (net.membership). Until the controller hears of the stop it gives the node work,
                            # whose steps hold the step lock the copies wait on: in a storm the two took 5 s one after
                            # the other when this was 5 s, the node neither serving nor left
MAX_KEY_CHARS = 128
MIN_CALL_S = 0.05           # a PutBlocks is not begun with less time than this left before a flush's deadline


@dataclass
class Target:
    address: str
    sent: OrderedDict = field(default_factory=OrderedDict)  # hashes it took (or held), oldest first
    incarnation: str = ""
    retry_at: float = 0.0
    task: asyncio.Task | None = None  # its catch-up under way (one at a time a target; the others go on meanwhile)

    def busy(self) -> bool:
        return self.task is not None and not self.task.done()


def block_slots(block_ids, block_size: int) -> torch.Tensor:
    """Pool slots of whole blocks, in order (handoff.slots over the blocks as one table)."""
    return handoff.slots(block_ids, block_size, 0, len(block_ids) * block_size)


def read_blocks(pool, block_ids, block_size: int) -> RawTensor:
    """Runner thread: the KV of whole blocks, [layers x parts, kv_heads, blocks x block_size, head_dim]."""
    x = pool.kv.index_select(3, block_slots(block_ids, block_size).to(pool.kv.device))
    return tensor_codec.from_tensor(x.flatten(0, 1).cpu().contiguous())


def write_blocks(pool, block_ids, block_size: int, kv: RawTensor, rows) -> None:
    """Runner thread: write the blocks `rows` (indices into `kv`'s blocks) of `kv` into `block_ids`."""
    x = tensor_codec.to_tensor(kv).unflatten(0, tuple(pool.kv.shape[:2]))
    if len(rows) != x.shape[3] // block_size:
        x = x.index_select(3, block_slots(rows, block_size))
    pool.kv.index_copy_(3, block_slots(block_ids, block_size).to(pool.kv.device), x.to(pool.kv.device, pool.kv.dtype))


def why_not_movable(runtime, eng) -> str:
    """Why `eng`'s KV blocks cannot be copied out of its pool and into another ("" when they can):
    handoff.movable on this node (the KV mirrors and the node's disk store, net.kv_disk)."""
    return handoff.movable(eng.pool, states=eng.pool.states is not None, tensor_parallel=runtime.options.tp is not None)


def unsent_blocks(eng, have, cap: int) -> list[tuple]:
    """(sequence, block id, index, hash, previous hash or None, tokens) of the full blocks of the
    open sequences whose hash is not in `have`, each sequence's in order, at most `cap` (the KV
    mirrors' sender and the node's disk store, net.kv_disk)."""
    kv, bs = eng.kv, eng.kv.block_size
    out, seen = [], set()
    for sid, table in list(kv.tables.items()):
        for i in range(min(table.length // bs, len(table.hashes), len(table.blocks))):
            h, b = table.hashes[i], table.blocks[i]
            if h in have or h in seen:
                continue
            if b == HOLE:
                break
            seen.add(h)
            out.append((sid, b, i, h, table.hashes[i - 1] if i else None, tuple(table.tokens[i * bs:(i + 1) * bs])))
            if len(out) >= cap:
                return out
    return out


def still_held(eng, x) -> bool:
    """Block `x` (an unsent_blocks entry) is still that sequence's, with that hash, and full (a step
    may have rolled it back since it was listed)."""
    sid, b, i, h = x[:4]
    table = eng.kv.tables.get(sid)
    return (table is not None and i < len(table.blocks) and table.blocks[i] == b and i < len(table.hashes)
            and table.hashes[i] == h and (i + 1) * eng.kv.block_size <= table.length)


class KvMirror:
    """One stage node's mirror: its targets (sender) and the key it takes blocks with (receiver)."""

    def __init__(self, runtime):
        self.runtime = runtime  # stage_node.runtime.StageRuntime: its engine, step lock, runner, transport, stats
        self.targets: list[Target] = []
        self.key = ""
        self.process = uuid.uuid4().hex[:12]

    # ---- the controller's word (SetMirror) -------------------------------------------------------
    def set(self, targets: list[str], key: str, generation: int) -> int:
        eng = self.runtime.require_ready()
        if len(targets) > MAX_TARGETS:
            raise InvalidArgument(f"targets: {len(targets)} mirror targets, over the cap of {MAX_TARGETS}")
        if len(key) > MAX_KEY_CHARS or (targets and not key):
            raise InvalidArgument(f"key: a mirror key of 1 to {MAX_KEY_CHARS} characters is needed")
        if generation != eng.assignment.generation:
            raise FailedPrecondition(f"generation {generation}: node {self.runtime.node_id} serves plan generation "
                                     f"{eng.assignment.generation} (a stale SetMirror)")
        if targets:
            why = self._why_not(eng)
            if why:
                raise FailedPrecondition(f"node {self.runtime.node_id} cannot mirror its KV: {why}")
        old = {t.address: t for t in self.targets}
        self.targets = [old.get(a) or Target(a) for a in dict.fromkeys(targets)]
        self.key = key
        return len(self.targets)

    def _why_not(self, eng) -> str:
        return why_not_movable(self.runtime, eng)

    def incarnation(self, eng) -> str:
        """Names the prefix cache the blocks went into: another after a restart or a new pool."""
        return f"{self.process}-{eng.assignment.generation}-{id(eng.kv):x}"

    # ---- sender ----------------------------------------------------------------------------------
    async def run(self) -> None:
        """A round every MIRROR_S, each in a task of its own: a target that does not answer (SIGSTOPped:
        its PutBlocks waits PUT_TIMEOUT_S) holds up neither the next rounds nor the other targets."""
        rounds: set[asyncio.Task] = set()
        try:
            while True:
                await asyncio.sleep(MIRROR_S)
                task = asyncio.create_task(self._logged_round(), name="kv-mirror-round")
                rounds.add(task)
                task.add_done_callback(rounds.discard)
        finally:  # (stopped: no round may read the pool or hold the step lock once this returns)
            pending = list(rounds)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)

    async def _logged_round(self) -> None:
        try:
            await self.round()
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 — a mirror only saves replays their time; the node serves on
            log.exception("a KV mirror round failed")

    async def round(self) -> None:
        """Every target that is due and not caught up by an earlier round still sending gets what it
        lacks (ROUND_BYTES at most), the targets at the same time."""
        rt = self.runtime
        eng = rt.engine
        if eng is None or eng.retired or not self.targets or self._why_not(eng):
            return
        due = [t for t in list(self.targets) if t.retry_at <= time.monotonic() and not t.busy()]
        tasks = [self._start(eng, t, ROUND_BYTES, float("inf")) for t in due]
        for t, r in zip(due, await asyncio.gather(*tasks, return_exceptions=True)):
            if isinstance(r, Exception):
                log.error("copying KV blocks to %s failed", t.address, exc_info=r)

    async def flush(self, within_s: float = FLUSH_S) -> int:
        """Leaving (SIGTERM): send every target what it lacks now, for at most `within_s`, before the
        controller moves the sequences away (they replay there from these copies). Returns the KV
        bytes sent."""
        rt = self.runtime
        eng = rt.engine
        if eng is None or eng.retired or not self.targets or self._why_not(eng):
            return 0
        deadline = time.monotonic() + within_s

        async def one(t: Target) -> int:
            if t.busy():  # a round's catch-up under way: it ends first (what it sends is not counted here)
                await asyncio.wait({t.task}, timeout=max(0.0, deadline - time.monotonic()))
                if t.busy():
                    return 0
            return await self._start(eng, t, float("inf"), deadline)

        # (the targets at the same time: one that does not answer leaves the others their copies)
        targets = list(self.targets)
        sent = 0
        for t, r in zip(targets, await asyncio.gather(*map(one, targets), return_exceptions=True)):
            if isinstance(r, Exception):
                log.error("copying KV blocks to %s before leaving failed", t.address, exc_info=r)
            elif isinstance(r, int):
                sent += r
        if sent:
            log.info("sent %.1f MiB of KV blocks to the mirrors before leaving", sent / 2**20)
        return sent

    def _start(self, eng, t: Target, most_bytes: float, deadline: float) -> asyncio.Task:
        """`t`'s catch-up, as its task (`t.busy()` until it ends)."""
        t.task = asyncio.ensure_future(self._catch_up(eng, t, most_bytes, deadline))
        return t.task

    async def _catch_up(self, eng, t: Target, most_bytes: float, deadline: float) -> int:
        """PutBlocks to `t` until it lacks nothing, a call fails, `most_bytes` went or `deadline`
        passed (or is closer than MIN_CALL_S: no call cut short by it); the KV bytes sent."""
        sent = 0
        while (sent < most_bytes and deadline - time.monotonic() > MIN_CALL_S and self.runtime.engine is eng
               and not eng.retired):
            n = await self._send(eng, t, deadline)
            if not n:
                break
            sent += n
        return sent

    async def _send(self, eng, t: Target, deadline: float = float("inf")) -> int:
        """One PutBlocks of the blocks `t` lacks, answered by `deadline` (and within PUT_TIMEOUT_S); the
        KV bytes sent (0: none to send, or it failed)."""
        rt = self.runtime
        todo = self._unsent(eng, t)
        if not todo:
            return 0
        bs = eng.kv.block_size
        async with rt._step_lock:
            if eng.retired or rt.engine is not eng:
                return 0
            todo = [x for x in todo if still_held(eng, x)]  # (a step may have rolled one back meanwhile)
            if not todo:
                return 0
            kv = await rt.runner.call(read_blocks, eng.pool, [x[1] for x in todo], bs)
        a = eng.assignment
        req = stage_pb2.PutBlocksRequest(
            key=self.key, model_digest=a.model_digest, start_layer=a.start, end_layer=a.end, block_size=bs,
            blocks=[stage_pb2.MirrorBlock(hash=h, previous=p or 0, first=p is None, tokens=tok)
                    for _, _, _, h, p, tok in todo], kv=tensor_codec.raw_to_proto(kv))
        timeout = max(MIN_CALL_S, min(PUT_TIMEOUT_S, deadline - time.monotonic()))
        try:
            async with rt.transport.channel(t.address, "stage") as channel:
                reply = await stage_pb2_grpc.StageNodeStub(channel).PutBlocks(req, timeout=timeout)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED and timeout < PUT_TIMEOUT_S:
                return 0  # a flush's deadline, not the target's fault: the rounds go on with it as before
            rt.stats.mirror_errors += 1
            t.retry_at = time.monotonic() + RETRY_S
            log.debug("mirror %s took no KV blocks: %s %s", t.address, exc.code().name, exc.details())
            return 0
        if reply.incarnation != t.incarnation:  # a new pool there: what it took before is gone
            t.sent.clear()
            t.incarnation = reply.incarnation
        for x in todo:
            t.sent[x[3]] = None
        while len(t.sent) > SENT_CAP:
            t.sent.popitem(last=False)
        rt.stats.mirrored_out_blocks += reply.taken
        return len(kv.data)

    def _unsent(self, eng, t: Target) -> list[tuple]:
        cap = min(MAX_BLOCKS, max(1, MESSAGE_BYTES // max(1, eng.pool.block_bytes)))
        return unsent_blocks(eng, t.sent, cap)

    # ---- receiver (PutBlocks) --------------------------------------------------------------------
    async def put(self, req: stage_pb2.PutBlocksRequest) -> stage_pb2.PutBlocksReply:
        rt = self.runtime
        if not self.key or not hmac.compare_digest(req.key.encode()[:MAX_KEY_CHARS + 1], self.key.encode()):
            raise PermissionDenied(f"node {rt.node_id} takes KV blocks only with its controller's mirror key")
        eng = rt.require_ready()
        why = self._why_not(eng)
        if why:
            raise FailedPrecondition(f"node {rt.node_id} takes no mirrored KV: {why}")
        a, bs = eng.assignment, eng.kv.block_size
        if (req.start_layer, req.end_layer, req.model_digest, req.block_size) != (a.start, a.end, a.model_digest, bs):
            raise FailedPrecondition(
                f"node {rt.node_id} holds layers [{a.start}, {a.end}) of model {a.model_digest[:12]} in blocks of {bs}; "
                f"these blocks are of layers [{req.start_layer}, {req.end_layer}) of {req.model_digest[:12]} in "
                f"blocks of {req.block_size}")
        n = len(req.blocks)
        if not 1 <= n <= MAX_BLOCKS:
            raise InvalidArgument(f"blocks: {n} blocks, give 1 to {MAX_BLOCKS}")
        try:
            kv = tensor_codec.check(req.kv, rank=4, dtypes=FLOAT_DTYPES)
        except tensor_codec.TensorError as exc:
            raise InvalidArgument(f"kv: {exc}") from exc
        pool = eng.pool
        want = [(a.end - a.start) * pool.parts, pool.kv.shape[2], n * bs, pool.kv.shape[-1]]
        if list(kv.shape) != want:
            raise InvalidArgument(f"kv of shape {list(kv.shape)}: this stage takes {want} for {n} blocks")
        entries = [(m.hash, None if m.first else m.previous, m.tokens) for m in req.blocks]
        async with rt._step_lock:  # no step computes meanwhile: an adopted block is written before any reads it
            if eng.retired or rt.engine is not eng:
                raise Unavailable(f"node {rt.node_id} was re-assigned while KV blocks came")
            try:
                ids = eng.kv.adopt(entries)
            except ValueError as exc:
                raise InvalidArgument(str(exc)) from exc
            rows = [j for j, b in enumerate(ids) if b is not None]
            if rows:
                await rt.runner.call(write_blocks, pool, [ids[j] for j in rows], bs, kv, rows)
        rt.stats.mirrored_in_blocks += len(rows)
        rt.kv_disk.note_adopted([entries[j] for j in rows])  # kept on this stage's disk too (net.kv_disk)
        return stage_pb2.PutBlocksReply(taken=len(rows), held=n - len(rows), incarnation=self.incarnation(eng))
