"""Where a decode step's time goes in a running stage (issue 36): timing hooks put into a stage process
and its tensor-parallel followers from outside, by `bench/trace_site/sitecustomize.py` when
LOGICPIPE_STEP_TRACE names a folder (`python -m bench.gpu_tp --trace DIR` sets both up). Nothing in
the stage's code knows of it.

Each process writes DIR/trace-<role>-<pid>.json every TRACE_EVERY steps: per key, the count, mean,
median and 90th percentile in ms (host phases by perf_counter, GPU spans by CUDA events resolved
later), keyed by the step's rows (`launch|1`: a one-row step's launch). Keys:
  period       between two `Engine._step_ahead` entries (the overlapped greedy path): a token's pace
  ahead        one `_step_ahead` on the event loop, all of it
  launch       runner.launch on the runner thread (embedding, graph, LM head, argmax queued)
  hop          a runner.call's thread hand-off: its await minus the function's own time
  read_wait    read_tokens: the wait for the launched step's tokens
  take, feed   last_stage.take_tokens; Engine._feed_back
  starved      1 when the previous launched step had finished before this launch began (the GPU idle)
  gpu_idle     GPU ms between the previous step's last work and this step's first (idle for the host)
  gpu_period   GPU ms between two launched steps' ends
  graph_host / replay_host / replay_gpu / logits_host / logits_gpu / embed_host
  mirror_graph / mirror_logits   rank 0: the messages to the followers before a replay, the LM head
  bcast_cpu / bcast_cuda         host ms of torch.distributed.broadcast by device (gloo / NCCL)
  f_period     a follower: between two replays
With LOGICPIPE_STEP_PROFILE=N (N > 0), rank 0 (or the one-GPU stage) also runs torch.profiler over
16 one-row launches from its Nth and writes profile-<role>-<pid>.txt: the GPU time of each kernel, and
profile-<role>-<pid>.trace.json.gz: torch.profiler's chrome trace of them (the kernels' timeline).
"""
from __future__ import annotations

import functools
import gzip
import importlib.abc
import json
import os
import statistics
import sys
import time
from collections import defaultdict

TRACE_EVERY = 100
PROFILE_STEPS = 16
_dir = os.environ.get("LOGICPIPE_STEP_TRACE", "")
_role = "stage"
for i, a in enumerate(sys.argv):
    if a == "--rank" and i + 1 < len(sys.argv):
        _role = f"rank{sys.argv[i + 1]}"
_samples: dict[str, list[float]] = defaultdict(list)
_pending: list = []  # (key, start event, end event)
_state = {"rows": 0, "last_ahead": None, "last": None, "n1": 0, "prof": None, "prof_at": 0, "paused": False,
          "steps": 0, "last_replay": None}


def _add(key: str, ms: float) -> None:
    if not _state["paused"]:
        _samples[f"{key}|{_state['rows']}"].append(ms)


def _gpu(key: str, start, end) -> None:
    if not _state["paused"]:
        _pending.append((f"{key}|{_state['rows']}", start, end))


def _resolve() -> None:
    keep = []
    for key, a, b in _pending:
        if b.query():
            _samples[key].append(a.elapsed_time(b))
        else:
            keep.append((key, a, b))
    _pending[:] = keep


def _dump() -> None:
    _resolve()
    out = {}
    for key, xs in sorted(_samples.items()):
        xs = xs[5:] if len(xs) > 20 else xs  # the first few of a kind: warm-up
        if not xs:
            continue
        s = sorted(xs)
        out[key] = dict(n=len(xs), mean=round(statistics.fmean(xs), 4), p50=round(s[len(s) // 2], 4),
                        p90=round(s[int(len(s) * 0.9)], 4), sum=round(sum(xs), 2))
    path = os.path.join(_dir, f"trace-{_role}-{os.getpid()}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(out, f, indent=1)
    os.replace(path + ".tmp", path)


def _tick() -> None:
    _state["steps"] += 1
    if _state["steps"] % TRACE_EVERY == 0:
        _dump()


def _timed(key: str, fn):
    @functools.wraps(fn)
    def wrap(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            _add(key, (time.perf_counter() - t0) * 1000)
    return wrap


def _atimed(key: str, fn):
    @functools.wraps(fn)
    async def wrap(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return await fn(*args, **kwargs)
        finally:
            _add(key, (time.perf_counter() - t0) * 1000)
    return wrap


def _events():
    torch = sys.modules["torch"]
    return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)


def _gpu_timed(key: str, fn, host_key: str):
    @functools.wraps(fn)
    def wrap(*args, **kwargs):
        t0 = time.perf_counter()
        a, b = _events()
        a.record()
        out = fn(*args, **kwargs)
        b.record()
        _gpu(key, a, b)
        _add(host_key, (time.perf_counter() - t0) * 1000)
        return out
    return wrap


# ---- the patches, each applied once its module is imported -------------------------------------------
def _engine(m) -> None:
    E = m.Engine
    if os.environ.get("LOGICPIPE_STEP_TRACE_CPU"):  # (checking the hooks on a CPU: the overlapped path there too)
        E.OVERLAP_DEVICES = ("cuda", "cpu")
    orig_ahead = E._step_ahead

    async def step_ahead(self):
        now = time.perf_counter()
        _state["rows"] = len(self.ahead.step.seqs) if self.ahead is not None else 0
        if _state["last_ahead"] is not None:
            _add("period", (now - _state["last_ahead"]) * 1000)
        _state["last_ahead"] = now
        try:
            return await orig_ahead(self)
        finally:
            _add("ahead", (time.perf_counter() - now) * 1000)
            _tick()

    E._step_ahead = step_ahead
    E._feed_back = _atimed("feed", E._feed_back)
    E._run = _atimed("run_plain", E._run)
    m.read_tokens = _timed("read_wait", m.read_tokens)
    orig_launch = m.launch

    def launch(shard, pool, step, source=None):
        torch = sys.modules["torch"]
        _state["rows"] = len(step.seqs)
        cuda = shard.device.type == "cuda"
        last = _state["last"]
        if cuda and last is not None and last.ready is not None:
            _add("starved", float(last.ready.query()))
        begin = None
        if cuda:
            begin = torch.cuda.Event(enable_timing=True)
            begin.record()
        if cuda and _state["rows"] == 1:
            _profile(torch)
        t0 = time.perf_counter()
        out = orig_launch(shard, pool, step, source)
        _add("launch", (time.perf_counter() - t0) * 1000)
        if cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            prev = _state.get("last_end")
            if prev is not None:
                _gpu("gpu_idle", prev, begin)
                _gpu("gpu_period", prev, end)
            _state["last_end"] = end
        _state["last"] = out
        return out

    m.launch = launch


def _profile(torch) -> None:
    at = int(os.environ.get("LOGICPIPE_STEP_PROFILE", "0") or 0)
    if not at:
        return
    _state["n1"] += 1
    n = _state["n1"]
    if n == at:
        _state["prof"] = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                            torch.profiler.ProfilerActivity.CUDA])
        _state["prof"].__enter__()
        _state["paused"] = True
    elif n == at + PROFILE_STEPS and _state["prof"] is not None:
        prof, _state["prof"] = _state["prof"], None
        torch.cuda.synchronize()
        prof.__exit__(None, None, None)
        ka = prof.key_averages()
        lines = [f"{PROFILE_STEPS} one-row launches"]
        for key in ("self_device_time_total", "self_cuda_time_total", "self_cpu_time_total"):
            try:
                lines.append(ka.table(sort_by=key, row_limit=70, max_name_column_width=90))
            except Exception as exc:  # noqa: BLE001
                lines.append(f"(sort by {key}: {exc})")
        with open(os.path.join(_dir, f"profile-{_role}-{os.getpid()}.txt"), "w") as f:
            f.write("\n".join(lines))
        try:  # the kernels on the GPU's timeline (gaps between them included), gzipped
            path = os.path.join(_dir, f"profile-{_role}-{os.getpid()}.trace.json")
            prof.export_chrome_trace(path)
            with open(path, "rb") as f, gzip.open(path + ".gz", "wb") as g:
                g.write(f.read())
            os.remove(path)
        except Exception as exc:  # noqa: BLE001
            print("step_trace: no chrome trace:", exc, file=sys.stderr)
        _state["paused"] = False


def _runner(m) -> None:
    orig = m.Runner.call

    async def call(self, fn, *args, **kwargs):
        inner = {}

        def timed(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                inner["s"] = time.perf_counter() - t

        t0 = time.perf_counter()
        out = await orig(self, timed, *args, **kwargs)
        _add("hop", (time.perf_counter() - t0 - inner.get("s", 0.0)) * 1000)
        return out

    m.Runner.call = call


def _last_stage(m) -> None:
    m.take_tokens = _timed("take", m.take_tokens)


def _graphs(m) -> None:
    G = m.StepGraphs
    G.forward = _timed("graph_host", G.forward)
    orig = G.replay

    def replay(self, g):
        if _role != "stage" and _role != "rank0":
            _state["rows"] = g.rows
            now = time.perf_counter()
            if _state["last_replay"] is not None:
                _add("f_period", (now - _state["last_replay"]) * 1000)
            _state["last_replay"] = now
            _tick()
        if g.graph is None:
            return orig(self, g)
        return _gpu_timed("replay_gpu", orig, "replay_host")(self, g)

    G.replay = replay


def _shard(m) -> None:
    S = m.Shard
    S.embed = _timed("embed_host", S.embed)
    S.logits = _timed("logits_host", S.logits)
    orig = S._logits

    def _logits(self, hidden):
        if self.device.type != "cuda":
            return orig(self, hidden)
        return _gpu_timed("logits_gpu", orig, "logits_inner_host")(self, hidden)

    S._logits = _logits


def _tp_group(m) -> None:
    m.Leader.graph_step = _timed("mirror_graph", m.Leader.graph_step)
    m.Leader.logits = _timed("mirror_logits", m.Leader.logits)


def _dist(m) -> None:
    orig = m.broadcast

    def broadcast(tensor, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return orig(tensor, *args, **kwargs)
        finally:
            _add("bcast_cpu" if tensor.device.type == "cpu" else "bcast_cuda", (time.perf_counter() - t0) * 1000)

    m.broadcast = broadcast


PATCHES = {
    "logicpipe.stage_node.engine.engine": _engine,
    "logicpipe.stage_node.engine.runner": _runner,
    "logicpipe.stage_node.engine.last_stage": _last_stage,
    "logicpipe.stage_node.engine.step_graphs": _graphs,
    "logicpipe.stage_node.model.shard": _shard,
    "logicpipe.stage_node.engine.tp_group": _tp_group,
    "torch.distributed": _dist,
}


EXTRA: dict[str, list] = defaultdict(list)  # more patches by module (add_patches: bench.step_log's)


class _Hook(importlib.abc.MetaPathFinder):
    """Patches a module of PATCHES (and EXTRA) right after it is executed."""

    def find_spec(self, name, path, target=None):
        if name not in PATCHES and name not in EXTRA:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        patches = ([PATCHES[name]] if name in PATCHES and _dir else []) + EXTRA.get(name, [])
        orig = loader.exec_module

        def exec_module(module):
            orig(module)
            for patch in patches:
                try:
                    patch(module)
                except Exception as exc:  # noqa: BLE001 — a trace that fails must not change the run
                    print(f"step trace: patching {name} failed: {exc}", file=sys.stderr)

        loader.exec_module = exec_module
        return spec


def _insert_hook() -> None:
    if not any(isinstance(f, _Hook) for f in sys.meta_path):
        sys.meta_path.insert(0, _Hook())


def install() -> None:
    if not _dir:
        return
    os.makedirs(_dir, exist_ok=True)
    _insert_hook()


def add_patches(patches: dict) -> None:
    """Patch these modules too (name -> fn(module)) once imported, with or without LOGICPIPE_STEP_TRACE."""
    for name, fn in patches.items():
        EXTRA[name].append(fn)
    _insert_hook()
