"""A tensor-parallel stage on one node (`logicpipe-stage --tp N`): the stage process is rank 0 and
starts N - 1 follower processes (ranks 1..N-1: `python -m logicpipe.stage_node.engine.tp_group`), each
holding its part of every layer (stage_node.model.tp) on its own device (CUDA: GPU r; CPU: a process
with the stage's --threads). To the controller the node stays one node and one stage.

Only rank 0 talks to the mesh. Every operation of its runner that involves the other ranks is
mirrored to them before it runs, in the same order on every rank: loading an assignment's layers,
making the KV pool, its copy-on-write block copies, a forward over the pool, the LM head's logits
and an overlapped step's greedy tokens (`Shard.mirror`, `KVPool.mirror`, `Shard.greedy`), and on
CUDA each step graph's capture and replay (`StepGraphs`: every rank captures the same bucket's graph at the same moment, its all-reduces inside; a step
sends its bucket, then the graph's integer inputs and rows into every rank's static buffers over
NCCL, and every rank replays). A follower is a loop over those messages; it keeps no scheduler
and no sessions: the slots each row writes and reads come with the step.

Messages are tensors, never pickles: an int64 header [op, ...] and the op's tables made from Python
ints, broadcast from rank 0 over gloo (the control group); what already lives on the device (the
slots a step writes and reads, the hidden states) goes over the data group (gloo on a CPU, NCCL on
CUDA, the group the layers' all-reduces use), so rank 0 never waits for its device to send a step.

Width. With `--tp N` the group is formed once, at start. With `--tp-max N` the plan chooses the width of
each assignment (planner.width): the group is formed at N at start only to measure the all-reduce for
the profile, then stopped (`Leader.stop`: STOP to every follower, the process group destroyed), and
`reform` forms it again at the width an assignment asks for (none at width 1) when that changes.

Several nodes (the controller's --tp-group, issue 36). A stage may also span several stage nodes, each
one device: the controller assigns rank 0 (a `Leader` with a `Remote`: it spawns nothing) and every
member (`Member`: the follower loop above in a subprocess of the member node, its own model directory
for LOAD). They meet at rank 0's --tp-port (`join_remote`: a TCPStore there, each member writing its
node id under the group's key; rank 0 waits JOIN_TIMEOUT, then fails the assignment naming the members
that did not come), then form gloo over TCP. A member that dies takes the stage down (rank 0's next
broadcast or all-reduce fails: it exits, status 75, and the mesh re-plans without it); when rank 0 dies
or stops the group, the member's follower ends and the member node is idle again, to be assigned anew.

Failure. A member that dies takes the stage down: rank 0 watches its followers and exits (status
75) the moment one is gone, so the controller re-plans and the requests replay elsewhere, as for any
lost node; a follower dies with rank 0 (the kernel's parent-death signal, and its next broadcast
fails).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from logicpipe.errors import InvalidArgument
from logicpipe.stage_node.engine.kv import KVPool, SeqSlice, StepKV
from logicpipe.stage_node.engine.step_graphs import StepGraphs
from logicpipe.stage_node.model.shard import Shard
from logicpipe.common.modeldir import ModelConfig
from logicpipe.stage_node.model.tp import ONE_SHOT_ROWS, TensorParallel, check_split

log = logging.getLogger(__name__)

STOP, LOAD, POOL, COPY, FORWARD, LOGITS, MEASURE, CAPTURE, GRAPH, GREEDY = range(10)
HEADER = 8  # int64s of a message's header
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
IDLE_TIMEOUT = timedelta(days=365)  # a follower waits for the next message as long as the stage lives
EXIT_MEMBER_LOST = 75
WATCH_S = 0.2  # rank 0 checks its followers this often
MEASURE_SIZES = (256, 1 << 20)  # float32 elements of the small and the large timed all-reduce
MEASURE_REPS = 10
DESTROYED = [False]  # this process has ended a group (Leader.stop): CUDA does not form one again here
STOP_WAIT_S = 10.0  # a stopped follower gets this long to exit before it is killed
JOIN_TIMEOUT = timedelta(seconds=60)  # a group over several nodes: how long rank 0 waits for its members
JOIN_POLL_S = 0.1
DATA_TIMEOUT = timedelta(seconds=120)  # a group over several nodes: a step's data operation waits this long at most
_STORES: dict = {}  # port -> the TCPStore rank 0 serves there (join_remote)


@dataclasses.dataclass(frozen=True)
class Remote:
    """A group over several nodes (module docstring): where it meets, its key (the plan generation that
    formed it: a member of an older forming never joins a newer one) and its node ids by rank."""

    init: str                # rank 0's tcp://HOST:PORT
    key: str = dataclasses.field(compare=False)  # its key in the store (a kept group keeps its first key)
    members: tuple[str, ...]  # node ids by rank

    @property
    def world(self) -> int:
        return len(self.members)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port() -> int:
    """A TCP port free on every interface now (--tp-port 0: rank 0 serves it once a group forms there)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _die_with_parent(parent: int) -> None:
    """In a follower, first thing: SIGKILL this process when its parent (rank 0) dies (Linux prctl
    PR_SET_PDEATHSIG), and exit now if it is gone already. (Set here, not in a preexec_fn: a fork of the
    stage process, whose gRPC threads hold locks, must exec before it runs any Python.)"""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)
    except OSError:
        pass
    if parent and os.getppid() != parent:
        sys.exit(1)


class Channel:
    """The messages between ranks (rank 0 sends, the others receive): the control group for headers and
    tables, the data group for the hidden states."""

    def __init__(self, tp: TensorParallel, control, device: torch.device):
        self.tp, self.control, self.device = tp, control, device

    def ints(self, values: torch.Tensor | None, n: int) -> torch.Tensor:
        """An int64 table of n elements, from rank 0 (values) to every rank."""
        t = values.contiguous() if values is not None else torch.empty(n, dtype=torch.long)
        if n:
            dist.broadcast(t, 0, group=self.control)
        return t

    def header(self, *fields: int) -> torch.Tensor:
        t = torch.zeros(HEADER, dtype=torch.long)
        t[: len(fields)] = torch.tensor(fields, dtype=torch.long)
        return self.ints(t if self.tp.rank == 0 else None, HEADER)

    def data(self, x: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A tensor from rank 0 (x) to every rank, on each rank's device, over the data group: what lives
        on the device already (hidden states, a step's slots) never waits for a copy to the host."""
        t = x.to(self.device).contiguous() if x is not None else torch.empty(shape, dtype=dtype, device=self.device)
        if t.numel():
            dist.broadcast(t, 0, group=self.tp.group)
        return t


def _seq_table(seqs) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(int64 [S, 4] on the host, from Python ints: start_pos, num_tokens, span or -1, decode_from; the
    slot tables of the sequences read by slot, where they are)"""
    table = torch.tensor([[s.start_pos, s.num_tokens, -1 if s.span is None else s.span, s.decode_from] for s in seqs],
                         dtype=torch.long).reshape(-1, 4)
    return table, [s.slots[: s.stop] for s in seqs if s.span is None]


def _seqs_of(table: torch.Tensor, slots: torch.Tensor) -> tuple[SeqSlice, ...]:
    out, at = [], 0
    for start, n, span, decode_from in table.tolist():
        if span >= 0:
            out.append(SeqSlice(start, n, span, None, decode_from))
        else:
            out.append(SeqSlice(start, n, None, slots[at: at + start + n], decode_from))
            at += start + n
    return tuple(out)


class Leader:
    """Rank 0 of a node's tensor-parallel stage: starts the followers, mirrors the runner's operations to
    them (Shard.mirror / KVPool.mirror), and exits when one of them is lost."""

    def __init__(self, world: int, device: str, threads: int, remote: Remote | None = None):
        self.world = world
        self.remote = remote  # a group over several nodes: its members join from their nodes, none is spawned
        self.device = torch.device("cuda:0" if device == "cuda" else "cpu")
        self.procs: list[subprocess.Popen] = []
        self.tp: TensorParallel | None = None
        self.channel: Channel | None = None
        self._device_kind, self._threads = device, threads
        self._closing = threading.Event()  # set once rank 0 ends the group itself: its followers' ends are no loss
        self.stopped = False  # ended (stop): a group of another width or other nodes replaces it

    def start(self) -> None:
        """Runner thread: start the followers and join the process groups with them (a group over several
        nodes: wait for its members, JOIN_TIMEOUT at most)."""
        if self.remote is not None:
            self.tp, control = join_remote(0, self.remote, self._device_kind)
            self.channel = Channel(self.tp, control, self.device)
            log.info("tensor-parallel stage over %d nodes (%s) formed at %s", self.world, ", ".join(self.remote.members),
                     self.remote.init)
            return
        init = f"tcp://127.0.0.1:{_free_port()}"
        for r in range(1, self.world):
            cmd = [sys.executable, "-m", "logicpipe.stage_node.engine.tp_group", "--rank", str(r), "--world",
                   str(self.world), "--init", init, "--device", self._device_kind, "--threads", str(self._threads),
                   "--parent", str(os.getpid())]
            self.procs.append(subprocess.Popen(cmd))
        self.tp, control = join(0, self.world, init, self._device_kind)
        self.channel = Channel(self.tp, control, self.device)
        threading.Thread(target=self._watch, name="tp-watch", daemon=True).start()
        log.info("tensor-parallel stage of %d ranks (%s): followers %s", self.world, self._device_kind,
                 ", ".join(str(p.pid) for p in self.procs))

    def _watch(self) -> None:
        while not self._closing.is_set():
            for r, p in enumerate(self.procs, 1):
                if p.poll() is not None and not self._closing.is_set():
                    log.error("tensor-parallel rank %d (pid %d) is gone (status %s): this stage cannot compute "
                              "without it; exiting so the mesh re-plans", r, p.pid, p.returncode)
                    self.close()
                    os._exit(EXIT_MEMBER_LOST)
            time.sleep(WATCH_S)

    @contextlib.contextmanager
    def lost_on_error(self):
        """Around rank 0's part of a mirrored operation: if it fails, the ranks no longer agree on what
        comes next (a follower may wait in an all-reduce), so the stage exits and the mesh re-plans."""
        try:
            yield
        except BaseException as exc:
            log.error("a tensor-parallel operation failed on rank 0 (%s): the ranks are out of step; exiting so "
                      "the mesh re-plans", exc)
            self.close()
            os._exit(EXIT_MEMBER_LOST)

    def close(self) -> None:
        self._closing.set()
        for p in self.procs:
            if p.poll() is None:
                p.kill()

    def stop(self, wait_s: float = STOP_WAIT_S) -> None:
        """Runner thread: end the group on purpose (a width change, the start's measurement): STOP to
        every follower, each waited for (killed after `wait_s`), and this process's groups destroyed, so
        a group of another width can be formed."""
        self._closing.set()
        self.stopped = True
        try:
            self.channel.header(STOP)
        except Exception as exc:  # noqa: BLE001 — a follower already gone: the rest are killed below
            log.warning("tensor-parallel group: STOP not sent to every rank (%s)", exc)
        for p in self.procs:
            try:
                p.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        dist.destroy_process_group()
        DESTROYED[0] = True
        log.info("tensor-parallel group of %d ranks stopped", self.world)

    # ---- what rank 0 runs, mirrored first ---------------------------------------------------
    def load(self, model_dir: str, start: int, end: int, *, first: bool, last: bool, dtype: torch.dtype,
             quantize: str, invariant: bool) -> Shard:
        # a model that does not split over the ranks is refused here, before any rank hears of it: the
        # assignment fails and the stage stays up (a follower that failed the load would end the stage)
        check_split(ModelConfig.from_dir(model_dir), self.world)
        text = torch.tensor(list(f"{model_dir}\0{quantize}".encode()), dtype=torch.long)
        self.channel.header(LOAD, start, end, int(first), int(last), DTYPES.index(dtype), text.numel(), int(invariant))
        self.channel.ints(text, text.numel())
        shard = Shard.load(model_dir, start, end, first=first, last=last, device=self.device, dtype=dtype,
                           quantize=quantize, tp=self.tp)
        shard.batch_invariant = invariant
        shard.mirror = self
        self._settled()
        return shard

    def new_pool(self, shard: Shard, num_blocks: int, block_size: int, graphs: bool = False) -> KVPool:
        """The KV pool on every rank; `graphs`: each rank also keeps the step graphs of its layers
        (StepGraphs, captured on CUDA), which rank 0's StepGraphs then mirrors (`capture`, `graph_step`)."""
        self.channel.header(POOL, num_blocks, block_size, int(graphs))
        pool = shard.new_pool(num_blocks, block_size)
        pool.mirror = self
        self._settled()
        return pool

    def _settled(self) -> None:
        """A group over several nodes: wait (on the control group, without end) until every member has
        loaded too, so that the steps' data operations, bounded by DATA_TIMEOUT, wait only for a step."""
        if self.remote is not None:
            dist.barrier(group=self.channel.control)

    def capture(self, rows: int, context: int) -> None:
        """Before rank 0 makes the (rows, context) bucket's graph: every rank makes its own at once
        (the all-reduces of its warm-up run, and of the capture, are the ranks' together)."""
        self.channel.header(CAPTURE, rows, context)

    def graph_step(self, g) -> None:
        """Before rank 0 replays the step graph `g` (its static inputs filled): every rank replays
        its own over the same inputs, g's integers and rows sent into the others' static buffers on
        the device (no host copy, no wait for rank 0's device)."""
        self.channel.header(GRAPH, g.rows, g.context)
        dist.broadcast(g.ints, 0, group=self.tp.group)
        dist.broadcast(g.x, 0, group=self.tp.group)

    def copy(self, copies) -> None:
        pairs = torch.tensor(list(copies), dtype=torch.long).reshape(-1, 2)
        with self.lost_on_error():
            self.channel.header(COPY, pairs.shape[0])
            self.channel.ints(pairs.flatten(), pairs.numel())

    def forward(self, hidden: torch.Tensor, kv: StepKV) -> None:
        table, slots = _seq_table(kv.seqs)
        n_slots = sum(s.numel() for s in slots)
        self.channel.header(FORWARD, hidden.shape[0], table.shape[0], n_slots, DTYPES.index(hidden.dtype))
        self.channel.ints(table.flatten(), table.numel())
        if n_slots:
            self.channel.data(torch.cat(slots), (n_slots,), torch.long)
        self.channel.data(kv.write_slots, (hidden.shape[0],), torch.long)
        self.channel.data(hidden, tuple(hidden.shape), hidden.dtype)

    def logits(self, hidden: torch.Tensor) -> None:
        self.channel.header(LOGITS, hidden.shape[0], DTYPES.index(hidden.dtype))
        self.channel.data(hidden, tuple(hidden.shape), hidden.dtype)

    def greedy(self, hidden: torch.Tensor) -> None:
        """Before rank 0 takes the greedy tokens of `hidden` (Shard.greedy): every rank takes its share."""
        self.channel.header(GREEDY, hidden.shape[0], DTYPES.index(hidden.dtype))
        self.channel.data(hidden, tuple(hidden.shape), hidden.dtype)

    def measure(self, reps: int = MEASURE_REPS) -> tuple[float, float]:
        """Runner thread: the all-reduce over the ranks, timed (seconds of one small one: its
        latency; bytes/s of a large one, its latency included: a launch-bound small one can take
        as long as the large one on NVLink), for the planner's cost of a step (issue 36)."""
        times = []
        for n in MEASURE_SIZES:
            self.channel.header(MEASURE, n, reps)
            times.append(_all_reduces(self.tp, self.device, n, reps))
        return times[0], MEASURE_SIZES[1] * 4 / max(times[1], 1e-9)


def width_for(tp_width: int, leader: Leader | None, tp_max: int, node_id: str) -> int:
    """The width an assignment's `tp_width` asks of this node (0: its own), or InvalidArgument naming it: a
    node of fixed width (--tp N) takes only N; a --tp-max node any of 1..N."""
    own = leader.world if leader is not None and not tp_max else 1
    if not tp_max:
        if tp_width not in (0, own):
            raise InvalidArgument(f"tp_width {tp_width}: node {node_id} has a fixed tensor-parallel width of {own} "
                                  f"(--tp {own}); start it with --tp-max N to let the plan choose the width")
        return own
    if tp_width > tp_max:
        raise InvalidArgument(f"tp_width {tp_width}: node {node_id} offers 1 to {tp_max} devices (--tp-max {tp_max})")
    return tp_width or 1


def check_model_split(model_dir: str, width: int) -> None:
    """Runner thread: refuse (ModelError, by name) a model that does not split over `width` ranks."""
    check_split(ModelConfig.from_dir(model_dir), width)


def reform(leader: Leader | None, width: int, device: str, threads: int, remote: Remote | None = None) -> Leader | None:
    """Runner thread: the group at `width` (None at 1), or over the nodes of `remote`: `leader` kept if it
    is that group, else stopped and a new one started (its followers spawned, or its members waited for)."""
    if leader is not None and leader.world == width and leader.remote == remote:
        return leader
    if leader is not None:
        leader.stop()
    if width <= 1:
        return None
    new = Leader(width, device, threads, remote)
    new.start()
    return new


def _all_reduces(tp: TensorParallel, device: torch.device, n: int, reps: int) -> float:
    """Seconds one all-reduce of n float32 takes over the data group (after one untimed). CUDA: as a
    step's graph runs it (`_in_graph`) where every rank can, else eagerly (NCCL, each launch timed too)."""
    if device.type == "cuda":
        seconds = _in_graph(tp, device, n, reps)
        if seconds is not None:
            return seconds
    x = torch.ones(n, dtype=torch.float32, device=device)
    dist.all_reduce(x, group=tp.group)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        dist.all_reduce(x, group=tp.group)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - t0) / reps


def _in_graph(tp: TensorParallel, device: torch.device, n: int, reps: int) -> float | None:
    """CUDA: seconds one all-reduce of n float32 takes replayed in a CUDA graph, the one-shot kernel
    where it fits (`TensorParallel.all_reduce`), as a step's graph runs it: no launch cost, which an
    eager NCCL call adds (on 2 H200s that made the planner keep one GPU where --tp 2 was 1.32x); None
    where any rank cannot capture it (every rank agrees first, so none replays alone)."""
    x = torch.ones(n, dtype=torch.float32, device=device)
    graph, ok = torch.cuda.CUDAGraph(), 1
    try:
        tp.enable_one_shot(MEASURE_SIZES[-1] // ONE_SHOT_ROWS, torch.float32, device)
        tp.all_reduce(x)
        torch.cuda.synchronize(device)
        with torch.cuda.graph(graph):
            for _ in range(reps):
                tp.all_reduce(x)
    except Exception as exc:  # noqa: BLE001 — timed eagerly then
        log.info("the all-reduce could not be timed in a CUDA graph (%s): timed eagerly", exc)
        ok = 0
    agree = torch.tensor([ok], device=device)
    dist.all_reduce(agree, op=dist.ReduceOp.MIN, group=tp.group)
    if not agree.item():
        return None
    graph.replay()
    torch.cuda.synchronize(device)
    dist.all_reduce(agree, group=tp.group)  # (the ranks start the timed replay together)
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    graph.replay()
    torch.cuda.synchronize(device)
    return (time.perf_counter() - t0) / reps


def join(rank: int, world: int, init: str, device: str) -> tuple[TensorParallel, object]:
    """Join the stage's process groups: (this rank's TensorParallel over the data group, the control
    group). CPU: one gloo group for both; CUDA: NCCL for the data, gloo for the control."""
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=init, rank=rank, world_size=world,
                            timeout=IDLE_TIMEOUT)
    control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT) if device == "cuda" else None
    return TensorParallel(rank, world), control


def serve_store(port: int) -> int:
    """The TCPStore this process serves at `port` (0: a free one) for the groups over several nodes it is rank
    0 of (it listens on every interface, whatever host it is given); returns the port."""
    store = dist.TCPStore("0.0.0.0", port, None, is_master=True, timeout=JOIN_TIMEOUT, wait_for_workers=False)
    _STORES[store.port] = store
    return store.port


def _served_store(port: int):
    """Rank 0: the TCPStore this process serves at `port`, made once (at start with --tp-port, else at the
    first forming) and kept: a group formed again meets there under its own key (a store made anew on the port of one whose
    group was destroyed found it still bound, EADDRINUSE)."""
    if port not in _STORES:
        serve_store(port)
    store = _STORES[port]
    store.set_timeout(JOIN_TIMEOUT)
    return store


def join_remote(rank: int, remote: Remote, device: str) -> tuple[TensorParallel, object]:
    """`join` for a group over several nodes (CPU, gloo over TCP): every rank meets at rank 0's TCPStore
    (rank 0 serves it at remote.init's port); a member writes its node id under the group's key; rank 0
    waits JOIN_TIMEOUT for every member, then raises naming those that did not come."""
    if device != "cpu":
        raise ValueError("a tensor-parallel stage over several nodes computes on CPUs (gloo over TCP) only")
    host, _, port = remote.init.removeprefix("tcp://").rpartition(":")
    if rank:
        store = dist.TCPStore(host, int(port), remote.world, is_master=False, timeout=JOIN_TIMEOUT)
    else:
        store = _served_store(int(port))
    store = dist.PrefixStore(f"lp-tp/{remote.key}", store)
    if rank:
        store.set(f"member/{rank}", remote.members[rank])
    else:
        keys = [f"member/{r}" for r in range(1, remote.world)]
        deadline = time.monotonic() + JOIN_TIMEOUT.total_seconds()
        while not store.check(keys):
            if time.monotonic() > deadline:
                missing = [remote.members[r] for r in range(1, remote.world) if not store.check([f"member/{r}"])]
                raise TimeoutError(f"tensor-parallel group over {', '.join(remote.members)}: member "
                                   f"{', '.join(missing)} did not join at {remote.init} within "
                                   f"{JOIN_TIMEOUT.total_seconds():.0f} s")
            time.sleep(JOIN_POLL_S)
    # the data (a step's broadcasts and all-reduces) bounded by DATA_TIMEOUT: a member host that vanishes
    # without closing its connections ends rank 0's step then, not at TCP's own timeout; the control group
    # (the headers a follower waits for between steps) waits without end
    dist.init_process_group("gloo", store=store, rank=rank, world_size=remote.world, timeout=DATA_TIMEOUT)
    return TensorParallel(rank, remote.world), dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)


def follow(rank: int, world: int, init: str, device: str, remote: Remote | None = None, model_dir: str = "") -> None:
    """A follower's life: join, then run every mirrored operation until STOP (or rank 0 is gone).
    `remote`: a member of a group over several nodes; `model_dir`: its own copy of the model (LOAD names
    rank 0's)."""
    tp, control = join_remote(rank, remote, device) if remote is not None else join(rank, world, init, device)
    dev = torch.device(f"cuda:{rank}" if device == "cuda" else "cpu")
    channel = Channel(tp, control, dev)
    remote_dir = model_dir
    shard: Shard | None = None
    pool: KVPool | None = None
    hidden_size = 0
    with torch.inference_mode():
        while True:
            h = channel.header().tolist()
            op = h[0]
            if op == STOP:
                return
            if op == LOAD:
                text = bytes(channel.ints(None, h[6]).tolist()).decode()
                model_dir, quantize = text.split("\0")
                model_dir = model_dir if not remote_dir else remote_dir
                shard = Shard.load(model_dir, h[1], h[2], first=bool(h[3]), last=bool(h[4]), device=dev,
                                   dtype=DTYPES[h[5]], quantize=quantize, tp=tp)
                shard.batch_invariant = bool(h[7])
                hidden_size, pool = shard.config.hidden_size, None
                if remote is not None:  # (Leader._settled)
                    dist.barrier(group=control)
            elif op == POOL:
                pool = shard.new_pool(h[1], h[2])
                if h[3]:  # a graph reads masked positions too: none may hold a NaN (a CUDA pool is zeroed already)
                    pool.kv.zero_()
                shard.graphs = StepGraphs(shard, pool, capture=dev.type == "cuda", warm=False) if h[3] else None
                if remote is not None:  # (Leader._settled)
                    dist.barrier(group=control)
            elif op == CAPTURE:
                if shard.graphs.make(h[1], h[2]) is None:
                    raise RuntimeError(f"the step graph of {h[1]} rows, {h[2]} positions could not be made")
            elif op == GRAPH:
                g = shard.graphs.graphs[h[1], h[2]]
                dist.broadcast(g.ints, 0, group=tp.group)
                dist.broadcast(g.x, 0, group=tp.group)
                shard.graphs.replay(g)
            elif op == COPY:
                pool.copy_blocks([tuple(p) for p in channel.ints(None, 2 * h[1]).reshape(-1, 2).tolist()])
            elif op == FORWARD:
                T, S, n_slots, dtype = h[1], h[2], h[3], DTYPES[h[4]]
                table = channel.ints(None, 4 * S).reshape(S, 4)
                slots = channel.data(None, (n_slots,), torch.long)
                write = channel.data(None, (T,), torch.long)
                x = channel.data(None, (T, hidden_size), dtype)
                shard.forward(x, StepKV(pool, write, _seqs_of(table, slots)))
            elif op == LOGITS:
                shard.logits(channel.data(None, (h[1], hidden_size), DTYPES[h[2]]))
            elif op == GREEDY:
                shard.greedy(channel.data(None, (h[1], hidden_size), DTYPES[h[2]]))
            elif op == MEASURE:
                _all_reduces(tp, dev, h[1], h[2])
            else:
                raise RuntimeError(f"tensor-parallel follower {rank}: unknown operation {op}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description="A follower rank of a tensor-parallel stage (started by the stage).")
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--init", required=True, help="torch.distributed init method (tcp://HOST:PORT)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--parent", type=int, default=0, help="rank 0's pid: this rank dies with it")
    ap.add_argument("--members", default="", help="a group over several nodes: their node ids by rank, comma-separated")
    ap.add_argument("--key", default="", help="a group over several nodes: its key (the plan generation that formed it)")
    ap.add_argument("--model-dir", default="", help="a group over several nodes: this node's model directory")
    args = ap.parse_args(argv)
    _die_with_parent(args.parent)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s tp-rank-{args.rank}: %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        remote = Remote(args.init, args.key, tuple(args.members.split(","))) if args.members else None
        follow(args.rank, args.world, args.init, args.device, remote, args.model_dir)
    except Exception as exc:  # noqa: BLE001 — rank 0 gone (its broadcast fails) or a broken step: this rank ends
        log.error("tensor-parallel follower %d stops: %s", args.rank, exc)
        _exit_now(1)
    _exit_now(0)


def _exit_now(status: int) -> None:
    """End the follower without the interpreter's teardown: the process group's C++ threads outlive it,
    and their destructors at exit may call std::terminate (seen: a follower told STOP ended by SIGABRT,
    status -6, instead of 0)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    main()
