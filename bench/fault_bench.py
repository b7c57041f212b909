"""Fault injection against a live mesh: SIGKILL, SIGSTOP (then SIGCONT) and SIGTERM of a middle
stage and of the controller, each while two long requests run, on a fresh 3-stage mesh of real
processes on 127.0.0.1. Prints one row per fault:

  resumed    seconds from the fault until every running request had a new token (a stage fault:
             the controller re-plans over the survivors and replays them), or ended
  status     seconds the controller's Status took while the fault was in force
  lost       running requests that failed (a stage fault loses none; a controller fault ends them)
  leaked     sessions still open on the live stages once things settle (after the session TTL)
  state      the controller's state once things settle

    python -m bench.fault_bench                 # all faults
    python -m bench.fault_bench --faults stage-sigstop --ttl 3
"""
from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc

from logicpipe.v1 import controller_pb2, controller_pb2_grpc, stage_pb2, stage_pb2_grpc
from tests.localmesh import LocalMesh

FAULTS = {
    # name: (process, signal)
    "stage-sigkill": ("stage1", signal.SIGKILL),
    "stage-sigstop": ("stage1", signal.SIGSTOP),
    "stage-sigterm": ("stage1", signal.SIGTERM),
    "controller-sigkill": ("controller", signal.SIGKILL),
    "controller-sigterm": ("controller", signal.SIGTERM),
}
WAIT_S = 90.0  # a request still running this long after the fault counts as hung
MAX_TOKENS = 400


class Running:
    """A long request in a thread: when it started producing tokens, when and how it ended."""

    def __init__(self, address: str, prompt: str):
        self.tokens, self.ended, self.error, self.times = 0, None, "", []
        self.started = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(address, prompt), daemon=True)
        self.thread.start()

    def _run(self, address: str, prompt: str) -> None:
        try:
            with grpc.insecure_channel(address) as ch:
                for reply in controller_pb2_grpc.ControllerStub(ch).Submit(controller_pb2.SubmitRequest(
                        prompt=prompt, max_tokens=MAX_TOKENS, ignore_eos=True), timeout=WAIT_S + 60):
                    self.tokens += len(reply.token_ids)
                    self.times.append(time.monotonic())
                    if self.tokens >= 3:
                        self.started.set()
        except grpc.RpcError as exc:
            self.error = f"{exc.code().name}: {exc.details()}"
        self.ended = time.monotonic()
        self.started.set()


def timed_status(address: str) -> tuple[float, str]:
    t0 = time.monotonic()
    try:
        with grpc.insecure_channel(address) as ch:
            st = controller_pb2_grpc.ControllerStub(ch).Status(controller_pb2.ControllerStatusRequest(), timeout=30)
            return time.monotonic() - t0, st.state
    except grpc.RpcError as exc:
        return time.monotonic() - t0, f"({exc.code().name})"


def open_sessions(address: str) -> int | None:
    try:
        with grpc.insecure_channel(address) as ch:
            return stage_pb2_grpc.StageNodeStub(ch).Status(stage_pb2.StatusRequest(), timeout=5).open_sessions
    except grpc.RpcError:
        return None


def supports(flag: str) -> bool:
    out = subprocess.run([sys.executable, "-m", "logicpipe.stage_node.main", "--help"], capture_output=True, text=True)
    return flag in out.stdout


def run_fault(name: str, model_dir: Path, work: Path, ttl: float) -> dict:
    proc, sig = FAULTS[name]
    stage_args = ("--session-ttl-s", str(ttl)) if supports("--session-ttl-s") else ()
    with LocalMesh(3, model_dir, work / name, threads=1, stage_args=stage_args,
                   controller_args=("--strategy", "uniform")) as mesh:
        requests = [Running(mesh.controller_address, p) for p in ("Tell me a long story about a dragon.",
                                                                  "Describe every planet of the solar system.")]
        for r in requests:
            r.started.wait(120)
        t0 = time.monotonic()
        mesh.signal(proc, sig)
        status_s, _ = timed_status(mesh.controller_address) if proc != "controller" else (0.0, "")
        deadline = t0 + WAIT_S
        while time.monotonic() < deadline and any(r.ended is None for r in requests):
            time.sleep(0.05)
        hung = [r for r in requests if r.ended is None]
        after = [min([t for t in r.times if t > t0] + [r.ended]) for r in requests if not (r in hung)]
        detection = None if hung else max(after) - t0
        if sig == signal.SIGSTOP:
            mesh.signal(proc, signal.SIGCONT)
        time.sleep(ttl + 4)  # leases run out; closes are retried; probes see the truth
        live = [a for i, a in enumerate(mesh.stage_addresses) if not (f"stage{i}" == proc and sig != signal.SIGSTOP)]
        leaked = sum(n for n in (open_sessions(a) for a in live) if n)
        _, state = timed_status(mesh.controller_address) if proc != "controller" else (0.0, "-")
        return {"fault": name, "resumed_s": detection, "status_s": status_s,
                "lost": sum(1 for r in requests if r.error), "hung": len(hung), "leaked_sessions": leaked,
                "state": state, "errors": sorted({r.error.split(":")[0] for r in requests if r.error})}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--faults", default=",".join(FAULTS))
    ap.add_argument("--ttl", type=float, default=5.0, help="the stages' --session-ttl-s (where they have it)")
    ap.add_argument("--model", default=None)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    from logicpipe.controller.model_prep import prepare_default_model

    model_dir = Path(args.model) if args.model else prepare_default_model()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.faults.split(","):
            rows.append(run_fault(name, model_dir, Path(tmp), args.ttl))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    print("| fault | resumed (or ended) | controller Status during it | requests lost | sessions leaked | state after |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        det = f"{r['resumed_s']:.1f} s" if r["resumed_s"] is not None else f"hung > {WAIT_S:.0f} s"
        st = f"{r['status_s']:.1f} s" if r["status_s"] else "-"
        print(f"| {r['fault']} | {det} | {st} | {r['lost']} of 2 | {r['leaked_sessions']} | {r['state']} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
