"""Each step of a running stage, one JSON line a step (issue 39: what puts a step over the bar): put into
a stage process from outside by `bench/trace_site/sitecustomize.py` when LOGICPIPE_STEP_LOG names a
folder. Nothing in the stage's code knows of it.

A line per computed plain step (`Engine._timed`), in DIR/steps-<pid>.jsonl:
  t          perf_counter when the step's time was taken (s)
  seqs       [start_pos, rows, decode (0/1)] of each sequence in the step
  rows, att, held   the cost model's features (engine.step_budget)
  pred       the model's seconds for the step before it saw it; coef its (fixed, row, position, held) then
  s          the step's measured seconds (what the bar is checked against: `_run`, lock and hop included)
  ex         host seconds of `runner.execute` on the runner thread; fwd: its `_forward`; smp: its `_sample`
             (where the step's tokens are read back: the wait for the device)
  gpu        device seconds from execute's start to its end (CUDA events)
  gc         [collections, their ms, the oldest generation] that ran during the step (gc.callbacks)
  mallocs    cudaMalloc calls during the step (torch.cuda.memory_stats num_device_alloc), reserved_mib after
  compiles   Triton kernels compiled during the step, and their ms
"""
from __future__ import annotations

import gc
import json
import os
import sys
import time

from bench import step_trace

_dir = os.environ.get("LOGICPIPE_STEP_LOG", "")
_cur = {"gc_n": 0, "gc_ms": 0.0, "gc_gen": -1, "gc_t0": 0.0, "comp_n": 0, "comp_ms": 0.0}
_last: dict = {}
_out = None


def _gc_cb(phase: str, info: dict) -> None:
    if phase == "start":
        _cur["gc_t0"] = time.perf_counter()
    else:
        _cur["gc_n"] += 1
        _cur["gc_ms"] += (time.perf_counter() - _cur["gc_t0"]) * 1000
        _cur["gc_gen"] = max(_cur["gc_gen"], info.get("generation", -1))


def _reset() -> None:
    _cur.update(gc_n=0, gc_ms=0.0, gc_gen=-1, comp_n=0, comp_ms=0.0)


def _timed_wrap(fn, into: str):
    def wrap(*a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            _last[into] = time.perf_counter() - t0
    return wrap


def _mem() -> tuple[int, float]:
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return 0, 0.0
    st = torch.cuda.memory_stats()
    mallocs = st.get("num_device_alloc", st.get("segment.all.allocated", 0))
    return int(mallocs), st.get("reserved_bytes.all.current", 0) / 2**20


def _runner(m) -> None:
    m._forward = _timed_wrap(m._forward, "fwd")
    m._sample = _timed_wrap(m._sample, "smp")


def _engine(m) -> None:
    orig_execute = m.execute

    def execute(shard, *a, **k):
        torch = sys.modules["torch"]
        cuda = shard.device.type == "cuda"
        _last["mallocs0"] = _mem()[0]
        if cuda:
            b, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            b.record()
        t0 = time.perf_counter()
        try:
            return orig_execute(shard, *a, **k)
        finally:
            _last["ex"] = time.perf_counter() - t0
            if cuda:
                e.record()
                e.synchronize()
                _last["gpu"] = b.elapsed_time(e) / 1000

    m.execute = execute
    E = m.Engine
    orig_timed = E._timed

    def _timed(self, step, seconds):
        global _out
        clock = self.clock
        w = clock.shape.window
        rows, att, held = step.rows, step.positions(w), step.held(clock)
        pred, coef = clock.seconds(rows, att, held), clock.coef
        orig_timed(self, step, seconds)
        n, mib = _mem()
        rec = dict(t=round(time.perf_counter(), 4),
                   seqs=[[p.work.start_pos, p.work.num_tokens, int(p.work.start_pos >= len(p.seq.spec.prompt))]
                         for p in step.seqs], rows=rows, att=att, held=held, pred=round(pred, 5),
                   coef=[float(f"{c:.4g}") for c in coef], s=round(seconds, 5),
                   ex=round(_last.pop("ex", 0.0), 5), fwd=round(_last.pop("fwd", 0.0), 5),
                   smp=round(_last.pop("smp", 0.0), 5), gpu=round(_last.pop("gpu", 0.0), 5),
                   gc=[_cur["gc_n"], round(_cur["gc_ms"], 2), _cur["gc_gen"]],
                   mallocs=n - _last.pop("mallocs0", n), reserved_mib=round(mib),
                   compiles=[_cur["comp_n"], round(_cur["comp_ms"], 1)])
        _reset()
        if _out is None:
            _out = open(os.path.join(_dir, f"steps-{os.getpid()}.jsonl"), "a", buffering=1)
        _out.write(json.dumps(rec) + "\n")

    E._timed = _timed


def _triton_jit(m) -> None:
    J = m.JITFunction
    if not hasattr(J, "_do_compile"):
        return
    orig = J._do_compile

    def _do_compile(self, *a, **k):
        t0 = time.perf_counter()
        try:
            return orig(self, *a, **k)
        finally:
            _cur["comp_n"] += 1
            _cur["comp_ms"] += (time.perf_counter() - t0) * 1000

    J._do_compile = _do_compile


PATCHES = {
    "logicpipe.stage_node.engine.engine": _engine,
    "logicpipe.stage_node.engine.runner": _runner,
    "triton.runtime.jit": _triton_jit,
}


def install() -> None:
    """Hooks in every module of PATCHES once it is imported (bench.step_trace's import hook)."""
    if not _dir:
        return
    os.makedirs(_dir, exist_ok=True)
    gc.callbacks.append(_gc_cb)
    step_trace.add_patches(PATCHES)


def summary(folder: str, bar_s: float = 0.1, top: int = 30) -> None:
    """Print the steps of DIR/steps-*.jsonl that held a decode row: how many went over the bar, and the
    `top` longest with what else happened in them."""
    recs = []
    for name in sorted(os.listdir(folder)):
        if name.startswith("steps-") and name.endswith(".jsonl"):
            with open(os.path.join(folder, name)) as f:
                recs += [json.loads(x) for x in f if x.strip()]
    dec = [r for r in recs if any(s[2] for s in r["seqs"])]
    over = [r for r in dec if r["s"] > bar_s]
    print(f"{len(recs)} steps, {len(dec)} with a decode row, {len(over)} over {bar_s * 1e3:.0f} ms")
    for label, xs in (("over the bar", over), ("the rest", [r for r in dec if r["s"] <= bar_s])):
        if xs:
            mean = {k: sum(r[k] for r in xs) / len(xs) for k in ("s", "pred", "ex", "fwd", "smp", "gpu")}
            print(label, {k: round(v * 1e3, 1) for k, v in mean.items()},
                  "gc ms", round(sum(r["gc"][1] for r in xs) / len(xs), 2),
                  "mallocs", round(sum(r["mallocs"] for r in xs) / len(xs), 2),
                  "compiles", sum(r["compiles"][0] for r in xs))
    for r in sorted(dec, key=lambda r: -r["s"])[:top]:
        print(json.dumps({k: r[k] for k in r if k != "coef"}))


if __name__ == "__main__":
    summary(sys.argv[1], *(float(x) for x in sys.argv[2:3]), *(int(x) for x in sys.argv[3:4]))
