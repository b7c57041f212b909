"""Fault injection against a live mesh: SIGKILL, SIGSTOP (then SIGCONT) and SIGTERM of a middle
stage and of the controller, each while two long requests run, on a fresh 3-stage mesh of real
processes on 127.0.0.1. Prints one row per fault:

  resumed    seconds from the fault until every running request had a new token (a stage fault:
             the controller re-plans over the survivors and replays them), or ended
  status     seconds the controller's Status took while the fault was in force
  lost       running requests that failed (a stage fault loses none; a controller fault ends them)
  leaked     sessions still open on the live stages once things settle (after the session TTL)
  state      the controller's state once things settle

Durability rows (issue 22), each with four requests of 400 tokens whose clients resume by
request id (Resume) when their stream breaks:

  controller-restart-sigkill / -sigterm   the controller killed (stopped) mid-generation and
                                          started again at once, as systemd does
  standby-takeover                        two controllers (--peer); the active one killed
  storm                                   21 stage faults (SIGKILL, SIGSTOP 3 s, SIGTERM; killed
                                          stages started again at once) one every 4 s, every 4th
                                          0.3 s after the one before; 12 requests (--spares: each
                                          node's spare process serves when it ends, and the ended
                                          one is started again as the next spare; --spares fork:
                                          each node --keep-spare, the fault hitting the process
                                          that serves, its keeper forking the next spare)
  replay                                  one fault's replays: 12 requests of --history tokens, the
                                          middle stage SIGKILLed and started again 2 s later

The storm and replay run one of two shapes over the 3 stage processes (--shape): `pipeline` (the
default, the rows of issue 34's earlier sittings: one 3-stage pipeline, --strategy uniform) or
`replicas` (--replicas 3, the planner's default strategy: each process holds the whole default
model, so 3 pipelines of one stage; a fault breaks one of them and moves only its requests). The
row says the plan the mesh started with (`plan`: per pipeline, its stages).

  lost       requests that failed (or hung)
  resumed    seconds until every request had a token again: after the restarted controller's
             start (restarts), after the kill (takeover); for the storm, the median and the
             largest gap between two tokens of a request

The storm's JSON row also has, per fault, `fault_resume_s` (seconds until every request running at
it had a new token) and `fault_paused` ("paused/running": the running requests that had no token
for 2 s after it), `fault_slowest` (for each fault, by its index, whose wait passed 5 s: the id of the
request that waited longest, to find in the controller's log), and the load average while it ran.

    python -m bench.fault_bench                 # every row
    python -m bench.fault_bench --faults stage-sigstop --ttl 3
    python -m bench.fault_bench --faults controller-restart-sigkill,standby-takeover,storm
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc

from logicpipe.stage_node.net.spare import ServingLock, lock_path
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
DURABILITY = ("controller-restart-sigkill", "controller-restart-sigterm", "standby-takeover", "storm", "replay")
PROMPTS = ("Tell me a long story about a dragon.", "Describe every planet of the solar system.",
           "Write a poem about the sea.", "List the kings of France.")


RESUMABLE = "request_id" in controller_pb2.SubmitRequest.DESCRIPTOR.fields_by_name  # (older versions: not)


class Resuming:
    """A request whose client resumes it by id at any of `addresses` when its stream breaks."""

    def __init__(self, addresses: list[str], prompt: str, max_tokens: int = MAX_TOKENS):
        self.addresses, self.prompt, self.max_tokens = addresses, prompt, max_tokens
        self.id = f"bench-{random.getrandbits(48):012x}"
        self.tokens, self.times, self.error, self.ended = [], [], "", None
        self.started = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        resume, i, deadline = False, 0, time.monotonic() + 600
        while time.monotonic() < deadline:
            try:
                with grpc.insecure_channel(self.addresses[i % len(self.addresses)]) as ch:
                    stub = controller_pb2_grpc.ControllerStub(ch)
                    if resume and not hasattr(controller_pb2, "ResumeRequest"):
                        self.error = "UNAVAILABLE, and this version has no Resume"
                        break
                    ident = {"request_id": self.id} if RESUMABLE else {}
                    call = (stub.Resume(controller_pb2.ResumeRequest(request_id=self.id, have_tokens=len(self.tokens)),
                                        timeout=600) if resume else
                            stub.Submit(controller_pb2.SubmitRequest(prompt=self.prompt, max_tokens=self.max_tokens,
                                                                     ignore_eos=True, **ident), timeout=600))
                    for reply in call:
                        self.tokens += reply.token_ids
                        self.times += [time.monotonic()] * len(reply.token_ids)
                        if len(self.tokens) >= 3:
                            self.started.set()
                    break
            except grpc.RpcError as exc:
                retry = exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED) or (
                    exc.code() == grpc.StatusCode.FAILED_PRECONDITION and "standby" in (exc.details() or ""))
                if not retry:
                    self.error = f"{exc.code().name}: {exc.details()}"
                    break
                resume, i = True, i + 1
                time.sleep(0.2)
        if len(self.tokens) < self.max_tokens and not self.error:
            self.error = "incomplete"
        self.ended = time.monotonic()
        self.started.set()

    def first_after(self, t: float) -> float | None:
        return next((x for x in self.times if x > t), None)


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


class StageWatch:
    """Polls every stage's Status every 0.25 s in a thread: when none answered (every stage dead,
    restarting or stopped: nothing could serve, whatever the controller does)."""

    def __init__(self, addresses: list[str]):
        self.addresses, self.samples, self._stop = addresses, [], threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        channels = [grpc.insecure_channel(a) for a in self.addresses]
        stubs = [stage_pb2_grpc.StageNodeStub(ch) for ch in channels]
        while not self._stop.wait(0.25):
            futures = [s.Status.future(stage_pb2.StatusRequest(), timeout=0.5) for s in stubs]
            up = 0
            for f in futures:
                try:
                    f.result()
                    up += 1
                except grpc.RpcError:
                    pass
            self.samples.append((time.monotonic(), up, os.getloadavg()[0]))
        for ch in channels:
            ch.close()

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(5)

    def none_up_s(self, start: float, end: float) -> float:
        """Seconds within [start, end] during which no stage answered."""
        total, prev = 0.0, None
        for t, up, _ in self.samples:
            if prev is not None and start <= t <= end and prev[1] == 0:
                total += t - max(prev[0], start)
            prev = (t, up)
        return total

    def load(self) -> list[float]:
        """The 1-minute load average's lowest and highest while watched."""
        loads = [x for _, _, x in self.samples]
        return [round(min(loads), 1), round(max(loads), 1)] if loads else []


def supports(flag: str, module: str = "logicpipe.stage_node.main") -> bool:
    out = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True)
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


SHAPES = {"pipeline": ("--strategy", "uniform"), "replicas": ("--replicas", "3")}


def _plan_shape(address: str) -> list[list[str]]:
    """The plan in force, per pipeline its stages as node[start,end)."""
    st = _status(address)
    if st is None:
        return []
    out: dict[int, list[str]] = {}
    for s in st.stages:
        out.setdefault(s.pipeline, []).append(f"{s.node_id}[{s.start_layer},{s.end_layer})")
    return [out[k] for k in sorted(out)]


def _resume_s(requests: list[Resuming], since: float) -> float | None:
    after = [r.first_after(since) for r in requests if not r.error]
    return max(after) - since if after and all(a is not None for a in after) else None


def _fault_waits(requests: list[Resuming], fault: float) -> list[float]:
    """Per request still running at a storm's fault, seconds until its next token (one that ended
    after it without one counts at its end)."""
    waits = []
    for r in requests:
        if not r.times or r.times[0] > fault or (r.ended is not None and r.ended <= fault):
            continue
        nxt = r.first_after(fault)
        waits.append((nxt if nxt is not None else (r.ended or fault)) - fault)
    return waits


def _fault_resume_s(requests: list[Resuming], fault: float) -> float | None:
    """Seconds from a storm's fault until every request still running at it had a new token; None
    when none was running."""
    waits = _fault_waits(requests, fault)
    return max(waits) if waits else None


def _slowest(requests: list[Resuming], fault: float) -> str:
    """The id of the request still running at a storm's fault that waited longest for its next token."""
    waits = {r.id: (r.first_after(fault) or r.ended or fault) - fault for r in requests
             if r.times and r.times[0] <= fault and not (r.ended is not None and r.ended <= fault)}
    return max(waits, key=waits.get) if waits else ""


PAUSED_S = 2.0  # a request whose next token came this long after a fault was paused by it


def run_restart(sig: int, model_dir: Path, work: Path) -> dict:
    """The controller stopped by `sig` mid-generation and started again at once over its journal."""
    with LocalMesh(3, model_dir, work, threads=1, controller_args=("--strategy", "uniform")) as mesh:
        reqs = [Resuming([mesh.controller_address], p) for p in PROMPTS]
        for r in reqs:
            r.started.wait(120)
        mesh.signal("controller", sig)
        mesh.procs["controller"].wait(30)
        t0 = time.monotonic()
        mesh.start_controller(ready=False)
        for r in reqs:
            r.thread.join(WAIT_S + 60)
        name = "controller-restart-" + ("sigkill" if sig == signal.SIGKILL else "sigterm")
        return {"fault": name, "lost": sum(1 for r in reqs if r.error), "of": len(reqs),
                "resumed_s": _resume_s(reqs, t0), "errors": sorted({r.error for r in reqs if r.error})}


def run_takeover(model_dir: Path, work: Path) -> dict:
    """Two controllers naming each other (--peer); the active one SIGKILLed mid-generation."""
    if not supports("--peer", "logicpipe.controller.main"):
        return {"fault": "standby-takeover", "lost": len(PROMPTS), "of": len(PROMPTS), "resumed_s": None,
                "errors": ["no standby controller in this version"]}
    from tests.localmesh import free_port

    mesh = LocalMesh(3, model_dir, work, threads=1, controller_args=("--strategy", "uniform"))
    a, b = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    try:
        mesh.stage_addresses = [mesh.start_stage(i) for i in range(3)]
        secret = Path(work) / "peer.secret"  # the journal streams only to the standby that sends it
        secret.parent.mkdir(parents=True, exist_ok=True)
        secret.write_text("0123456789abcdef" * 2 + "\n")
        pair = ("--peer-secret-file", str(secret), "--standby-name", "controller") \
            if supports("--peer-secret-file", "logicpipe.controller.main") else ()
        mesh.start_controller("--peer", b, *pair, address=a)
        mesh.start_controller("--peer", a, *pair, name="controller-b", address=b, ready=False)
        while not mesh.controller_status(address=b).active:
            time.sleep(0.2)
        reqs = [Resuming([a, b], p) for p in PROMPTS]
        for r in reqs:
            r.started.wait(120)
        t0 = time.monotonic()
        mesh.signal("controller", signal.SIGKILL)
        for r in reqs:
            r.thread.join(WAIT_S + 60)
        return {"fault": "standby-takeover", "lost": sum(1 for r in reqs if r.error), "of": len(reqs),
                "resumed_s": _resume_s(reqs, t0), "errors": sorted({r.error for r in reqs if r.error})}
    finally:
        mesh.stop()


def run_replay(model_dir: Path, work: Path, history: int = 200, shape: str = "pipeline", extra: tuple = (),
               stage_extra: tuple = ()) -> dict:
    """The cost of one fault's replays (issue 34): 12 requests run until each has `history` tokens on
    a 3-stage pipeline; the middle stage is SIGKILLed (and started again 2 s later). `resumed`: seconds
    from the kill until every request had a new token (the re-plan over the survivors and the
    replays); `back`: seconds from the install of the plan with the node back until every request had
    a new token (that move's replays); `pause`: the longest gap between two tokens of a request."""
    tokens = history + 150
    with LocalMesh(3, model_dir, work, threads=1, controller_args=SHAPES[shape] + extra, stage_args=stage_extra) as mesh:
        plan = _plan_shape(mesh.controller_address)
        reqs = [Resuming([mesh.controller_address], PROMPTS[i % 4], tokens) for i in range(12)]
        deadline = time.monotonic() + 600
        while min(len(r.tokens) for r in reqs) < history and time.monotonic() < deadline:
            time.sleep(0.05)
        gen0 = _generation(mesh.controller_address)
        t0 = time.monotonic()
        mesh.signal("stage1", signal.SIGKILL)
        mesh.procs["stage1"].wait(30)
        resumed = _wait_resume(reqs, t0)
        time.sleep(max(0.0, t0 + 2.0 - time.monotonic()))
        mesh.start_stage(1, mesh.stage_addresses[1])
        t1, gen = None, gen0
        while time.monotonic() < deadline and any(r.ended is None for r in reqs):
            st = _status(mesh.controller_address)
            if st is not None and st.plan_generation != gen and len({s.node_id for s in st.stages}) == 3:
                t1 = time.monotonic()
                break
            gen = st.plan_generation if st is not None and st.plan_generation != gen0 else gen
            time.sleep(0.05)
        back = _wait_resume([r for r in reqs if r.ended is None or (t1 and r.ended > t1)], t1) if t1 else None
        for r in reqs:
            r.thread.join(WAIT_S + 300)
        gaps = [max(b - a for a, b in zip(r.times, r.times[1:])) for r in reqs if len(r.times) > 1]
        return {"fault": f"replay (12 requests of {history} tokens, middle stage killed and back; {shape})", "plan": plan,
                "lost": sum(1 for r in reqs if r.error), "of": len(reqs), "resumed_s": resumed, "back_s": back,
                "pause_max_s": max(gaps) if gaps else None, "errors": sorted({r.error for r in reqs if r.error})}


def _status(address: str):
    try:
        with grpc.insecure_channel(address) as ch:
            return controller_pb2_grpc.ControllerStub(ch).Status(controller_pb2.ControllerStatusRequest(), timeout=2)
    except grpc.RpcError:
        return None


def _generation(address: str) -> int:
    st = _status(address)
    return st.plan_generation if st is not None else 0


def _wait_resume(reqs: list[Resuming], since: float) -> float | None:
    """Seconds from `since` until every request still running had a token after it."""
    deadline = since + WAIT_S
    while time.monotonic() < deadline:
        after = [r.first_after(since) for r in reqs if not r.error]
        if all(a is not None or r.ended is not None for a, r in zip(after, reqs)):
            got = [a for a in after if a is not None]
            return (max(got) - since) if got else 0.0
        time.sleep(0.05)
    return None


def run_storm(model_dir: Path, work: Path, faults: int = 21, spacing: float = 4.0, shape: str = "pipeline",
              extra: tuple = (), stage_extra: tuple = (), spares: str = "") -> dict:
    """`faults` stage faults, one every `spacing` s and every 4th 0.3 s after the one before, on a
    3-stage mesh serving 12 requests long enough to outlast the storm. `spares`: every node has a
    spare process (--spare) that serves when its process ends; the ended one is started again as
    the next spare (a fault hits the serving process); "fork": every node --keep-spare (its keeper forks
    the next spare; a fault hits the serving process, never the keeper)."""
    fork = spares == "fork"
    if fork:
        stage_extra = (*stage_extra, "--keep-spare")
    rng = random.Random(22)
    tokens = int(faults * spacing * 9)  # ~ the storm's length at a few tokens per second per request
    with LocalMesh(3, model_dir, work, threads=1, controller_args=SHAPES[shape] + extra, stage_args=stage_extra) as mesh:
        plan = _plan_shape(mesh.controller_address)
        reqs = [Resuming([mesh.controller_address], PROMPTS[i % 4], tokens) for i in range(12)]
        for r in reqs:
            r.started.wait(120)
        restarting: dict[int, threading.Thread] = {}
        if spares and not fork:
            for i in range(3):
                mesh.start_spare(i)
            for i in range(3):
                _wait_spare(mesh, i)
        watch = StageWatch(mesh.stage_addresses)

        def serving(i: int) -> int:
            """The pid of the process that serves stage i (the keeper's children take turns)."""
            return ServingLock(lock_path(mesh.workdir / f"state{i}", f"stage{i}")).holder() or 0

        def hit(i: int, sig: int, pid: int) -> None:
            if not fork:
                mesh.signal(f"stage{i}", sig)
                return
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

        def taken_over(i: int, pid: int) -> None:
            """Until the keeper's spare serves in place of `pid` (its lock's pid another)."""
            deadline = time.monotonic() + 60
            while serving(i) == pid and time.monotonic() < deadline:
                time.sleep(0.02)

        def restart(i: int, proc) -> None:
            if fork:
                taken_over(i, proc)
                return
            proc.wait(60)
            if not spares:
                mesh.start_stage(i, mesh.stage_addresses[i])
                return
            mesh.promote_spare(i)  # it serves now: this node's next spare starts up behind it
            mesh.start_spare(i)

        kinds = [signal.SIGKILL, signal.SIGSTOP, signal.SIGTERM]
        fault_times: list[float] = []
        fault_log: list[str] = []  # "seconds after the first fault, stage, signal" for each fault
        for n in range(faults):
            time.sleep(0.3 if n % 4 == 3 else spacing)
            live = [i for i in range(3) if not (i in restarting and restarting[i].is_alive())]
            if not live:
                continue
            i, sig = rng.choice(live), kinds[n % 3]
            pid = serving(i) if fork else 0
            if fork and (pid <= 0 or pid == os.getpid()):  # (never os.kill(0, ...): that is this whole process group)
                continue
            fault_times.append(time.monotonic())
            fault_log.append(f"{fault_times[-1] - fault_times[0]:.1f}s stage{i} {signal.Signals(sig).name}")
            hit(i, sig, pid)
            if sig == signal.SIGSTOP:
                threading.Timer(3.0, hit, (i, signal.SIGCONT, pid)).start()
            else:
                restarting[i] = threading.Thread(target=restart, args=(i, pid if fork else mesh.procs[f"stage{i}"]),
                                                 daemon=True)
                restarting[i].start()
        for r in reqs:
            r.thread.join(WAIT_S + 300)
        watch.stop()
        st = _status(mesh.controller_address)  # replays' positions: computed, or attached (prefix caches, KV mirrors)
        replayed = [getattr(st, "replay_tokens", 0), getattr(st, "replay_cached_tokens", 0)] if st is not None else None
        gaps = [max(b - a for a, b in zip(r.times, r.times[1:])) for r in reqs if len(r.times) > 1]
        each = [_fault_resume_s(reqs, t) for t in fault_times]
        per_fault = [s for s in each if s is not None]
        # the same, less the time within each fault's wait during which no stage answered at all
        served = [s - watch.none_up_s(t, t + s) for s, t in zip(each, fault_times) if s is not None]
        return {"fault": f"storm ({faults} faults, {spacing:g} s apart; {shape})", "plan": plan, "lost": sum(1 for r in reqs if r.error),
                "of": len(reqs), "resumed_s": statistics.median(gaps) if gaps else None,
                "resumed_max_s": max(gaps) if gaps else None,
                "fault_resume_median_s": statistics.median(per_fault) if per_fault else None,
                "fault_resume_max_s": max(per_fault) if per_fault else None,
                "fault_resume_s": [None if s is None else round(s, 1) for s in each], "faults": fault_log,
                # per fault: "paused/running": requests it paused (no token for PAUSED_S) of those running
                "fault_paused": [f"{sum(w > PAUSED_S for w in ws)}/{len(ws)}"
                                 for ws in (_fault_waits(reqs, t) for t in fault_times)],
                # per fault over 5 s: the request that waited longest, to find in the controller's log
                "fault_slowest": {i: _slowest(reqs, t) for i, (t, s) in enumerate(zip(fault_times, each))
                                  if s is not None and s > 5},
                "fault_resume_stage_up_median_s": statistics.median(served) if served else None,
                "fault_resume_stage_up_max_s": max(served) if served else None,
                "no_stage_up_s": round(watch.none_up_s(fault_times[0], time.monotonic()), 1) if fault_times else 0.0,
                "load_average": watch.load(), "replay_tokens_cached": replayed,
                "evacuated": getattr(st, "evacuated_requests", 0) if st is not None else None,  # off silent replicas
                "controller_args": list(extra),
                "stage_args": list(stage_extra), "spares": spares,
                "errors": sorted({r.error for r in reqs if r.error})}


def _wait_spare(mesh: LocalMesh, i: int, timeout_s: float = 120.0) -> None:
    """Until stage i's spare has started up and waits to take over."""
    log = mesh.workdir / f"stage{i}-spare.log"
    deadline = time.monotonic() + timeout_s
    while "waiting to take over" not in (log.read_text() if log.exists() else ""):
        if time.monotonic() > deadline or mesh.procs[f"stage{i}-spare"].poll() is not None:
            raise RuntimeError(f"stage{i}'s spare did not start up:\n{log.read_text()[-3000:] if log.exists() else ''}")
        time.sleep(0.1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--faults", default=",".join((*FAULTS, *DURABILITY)))
    ap.add_argument("--ttl", type=float, default=5.0, help="the stages' --session-ttl-s (where they have it)")
    ap.add_argument("--model", default=None)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--spacing", type=float, default=4.0, help="the storm's seconds between faults")
    ap.add_argument("--history", type=int, default=200, help="replay: tokens each request has when the stage dies")
    ap.add_argument("--shape", default="pipeline", choices=list(SHAPES),
                    help="storm and replay: one 3-stage pipeline (--strategy uniform; the default) or 3 replicas of "
                         "one stage each (--replicas 3)")
    ap.add_argument("--controller-arg", action="append", default=[], metavar="ARG",
                    help="storm and replay: one more controller flag (repeat it), e.g. --controller-arg=--kv-mirror=off")
    ap.add_argument("--stage-arg", action="append", default=[], metavar="ARG",
                    help="storm and replay: one more flag of every stage (repeat it), e.g. --stage-arg=--kv-disk-mib=0")
    ap.add_argument("--spares", nargs="?", const="process", default="", choices=["process", "fork"],
                    help="storm: every node with a spare process (logicpipe-stage --spare) that serves when the "
                         "node's process ends; the ended one is started again as its next spare. --spares fork: "
                         "every node --keep-spare (one process tree: its keeper forks the next spare)")
    ap.add_argument("--work-dir", type=Path, default=None,
                    help="keep each mesh's work dir (its logs) here instead of a temporary one")
    args = ap.parse_args()
    from logicpipe.controller.cli.model_prep import prepare_default_model

    model_dir = Path(args.model) if args.model else prepare_default_model()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = args.work_dir or tmp
        for name in args.faults.split(","):
            work = Path(tmp) / name
            if name in FAULTS:
                rows.append(run_fault(name, model_dir, work, args.ttl))
            elif name.startswith("controller-restart-"):
                rows.append(run_restart(signal.SIGKILL if name.endswith("sigkill") else signal.SIGTERM, model_dir, work))
            elif name == "standby-takeover":
                rows.append(run_takeover(model_dir, work))
            elif name == "storm":
                rows.append(run_storm(model_dir, work, spacing=args.spacing, shape=args.shape,
                                      extra=tuple(args.controller_arg), stage_extra=tuple(args.stage_arg),
                                      spares=args.spares))
            elif name == "replay":
                rows.append(run_replay(model_dir, work, history=args.history, shape=args.shape,
                                       extra=tuple(args.controller_arg), stage_extra=tuple(args.stage_arg)))
            else:
                raise SystemExit(f"--faults: no fault {name!r}")
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    durable = [r for r in rows if "of" in r]
    rows = [r for r in rows if "of" not in r]
    if durable:
        print("| fault | requests lost | resumed |")
        print("|---|---|---|")
        for r in durable:
            res = "-" if r["resumed_s"] is None else f"{r['resumed_s']:.1f} s"
            if r.get("resumed_max_s") is not None:
                res = f"longest pause of a request: median {r['resumed_s']:.1f} s, max {r['resumed_max_s']:.1f} s"
            if "back_s" in r:
                res += ("; after the node is back: -" if r["back_s"] is None else
                        f"; after the node is back: {r['back_s']:.1f} s") + \
                    ("" if r["pause_max_s"] is None else f"; longest pause of a request {r['pause_max_s']:.1f} s")
            if r.get("fault_resume_max_s") is not None:
                res += (f"; per fault, until every running request had a token: median "
                        f"{r['fault_resume_median_s']:.1f} s, max {r['fault_resume_max_s']:.1f} s")
            if r.get("fault_resume_stage_up_max_s") is not None:
                res += (f"; the same less the time no stage was up: median {r['fault_resume_stage_up_median_s']:.1f} s, "
                        f"max {r['fault_resume_stage_up_max_s']:.1f} s; no stage up {r['no_stage_up_s']:.1f} s in all; "
                        f"load average {r['load_average'][0]}-{r['load_average'][1]}")
            print(f"| {r['fault']} | {r['lost']} of {r['of']} | {res} |")
    if rows:
        print("| fault | resumed (or ended) | controller Status during it | requests lost | sessions leaked | state after |")
        print("|---|---|---|---|---|---|")
    for r in rows:
        det = f"{r['resumed_s']:.1f} s" if r["resumed_s"] is not None else f"hung > {WAIT_S:.0f} s"
        st = f"{r['status_s']:.1f} s" if r["status_s"] else "-"
        print(f"| {r['fault']} | {det} | {st} | {r['lost']} of 2 | {r['leaked_sessions']} | {r['state']} |")
    if args.json:
        args.json.write_text(json.dumps(durable + rows, indent=2))


if __name__ == "__main__":
    main()
