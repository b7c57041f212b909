"""A mesh of real processes on this machine: stage nodes and a controller on 127.0.0.1, started
through their command lines (the stable contract) and always stopped.

Used by the mesh tests, the benchmarks and anyone who wants a throw-away mesh on one box:

    with LocalMesh(2, model_dir, workdir) as mesh:
        mesh.controller_address  # submit here

On exit (also after a failure) every process it started gets SIGTERM, then SIGKILL after a grace
period, by process group. Processes run as users run them: no environment tweaks beyond
unbuffered output (in particular no OMP_WAIT_POLICY, which doubles a CPU step). In the suite
($LOGICPIPE_TEST_ZYGOTE=1) they are forked from tests.zygote, which has their imports done: the same
command line and environment (and network namespace: tests.netns), seconds sooner.
"""
from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from logicpipe.common.security import ca
from logicpipe.common.security.bundle import Bundle
from logicpipe.common.transport import PLAINTEXT, Transport
from logicpipe.v1 import controller_pb2, controller_pb2_grpc
from tests.zygote import Zygote

READY_TIMEOUT_S = 120.0  # a process must report SERVING within this (model loading included)
STOP_GRACE_S = 10.0      # SIGTERM, then SIGKILL after this


def free_port() -> int:
    """A loopback TCP port nobody listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_CA_DIR: Path | None = None  # one CA per process: its meshes share it and the client bundle


def mesh_bundle(name: str, role: str) -> Path:
    """A bundle directory for party `name` of `role`, from this process's throw-away mesh CA."""
    global _CA_DIR
    if _CA_DIR is None:
        _CA_DIR = ca.init_ca(Path(tempfile.mkdtemp(prefix="logicpipe-ca-")) / "ca")
        atexit.register(_remove_ca, _CA_DIR.parent, os.getpid())
    out = _CA_DIR.parent / f"{role}-{name}"
    if not (out / f"{name}.crt").is_file():
        ca.issue(_CA_DIR, name, role, out)
    return out


def _remove_ca(top: Path, owner: int) -> None:
    """The throw-away CA's directory (its private keys included) removed as the process that made it
    exits (not as a forked child exits: it inherits the hook)."""
    if os.getpid() == owner:
        shutil.rmtree(top, ignore_errors=True)


def tls_by_default() -> bool:
    """Whether meshes of this process run over mutual TLS unless told (the mesh tests set
    $LOGICPIPE_LOCALMESH_TLS=1)."""
    return os.environ.get("LOGICPIPE_LOCALMESH_TLS") == "1"


def client_transport(tls: bool | None = None) -> Transport:
    """This process's transport as a client of its meshes: the client bundle of its throw-away CA
    when they run over TLS (`tls`, default `tls_by_default()`), else plaintext."""
    if tls if tls is not None else tls_by_default():
        return Transport(Bundle.load(mesh_bundle("client", "client")))
    return PLAINTEXT


def wait_serving(address: str, proc: subprocess.Popen, log: Path, timeout: float = READY_TIMEOUT_S,
                 peer_role: str = "stage", transport: Transport = PLAINTEXT) -> None:
    """Until grpc.health.v1 at `address` says SERVING; raises with the log's tail if the process dies."""
    deadline = time.monotonic() + timeout
    with transport.sync_channel(address, peer_role) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"process for {address} exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    raise TimeoutError(f"{address} not serving after {timeout:.0f} s:\n{log.read_text()[-3000:]}")


class LocalMesh:
    """`n_stages` stage processes and a controller over them, on 127.0.0.1."""

    def __init__(self, n_stages: int, model_dir: Path | str, workdir: Path | str, *, threads: int = 1,
                 device: str = "cpu", controller_args: tuple[str, ...] = (), stage_args: tuple[str, ...] = (),
                 env: dict[str, str] | None = None, mdns: bool = False,
                 stage_env: dict[int, dict[str, str]] | None = None, tls: bool | None = None,
                 stage_extra: dict[int, tuple[str, ...]] | None = None):
        self.n_stages = n_stages
        self.model_dir = Path(model_dir)
        self.workdir = Path(workdir)
        self.threads = threads                  # torch threads per stage process
        self.device = device                    # "cpu" | "cuda"
        # extra logicpipe-controller flags; one pipeline over the stages unless they say --replicas
        # (the mesh tests are about a pipeline's stages; replicas are tested on their own)
        self.controller_args = tuple(controller_args) if any(a.startswith("--replicas") for a in controller_args) \
            else ("--replicas", "1", *controller_args)
        self.stage_args = tuple(stage_args)     # extra logicpipe-stage flags, every stage
        self.env = dict(env or {})              # extra environment of every process
        self.stage_env = dict(stage_env or {})  # stage index -> its own extra environment (e.g. CUDA_VISIBLE_DEVICES)
        self.stage_extra = dict(stage_extra or {})  # stage index -> its own extra flags (e.g. --tp 2)
        # mdns: the controller finds the stages by mDNS on 127.0.0.1 (a mesh name of its own keeps
        # other meshes on this host out); else it gets --nodes and nobody advertises
        self.mdns = mdns
        self.mesh_name = f"test-{os.getpid()}-{free_port()}"
        # tls: every process with a certificate of one CA, and this process as a client (default:
        # $LOGICPIPE_LOCALMESH_TLS=1; the mesh tests set it)
        self.tls = tls if tls is not None else tls_by_default()
        self.transport = client_transport(self.tls)  # this process's channels to the mesh
        self.procs: dict[str, subprocess.Popen] = {}
        self.stage_addresses: list[str] = []
        self.controller_address = ""

    # ---- processes --------------------------------------------------------------------------
    def _spawn(self, name: str, args: list[str], env: dict[str, str] | None = None,
               prefix: tuple[str, ...] = ()) -> tuple[subprocess.Popen, Path]:
        if name in self.procs and self.procs[name].poll() is None:  # it would be lost to stop(), and leak
            raise ValueError(f"a process named {name!r} still runs in this mesh; spawn under another name")
        self.workdir.mkdir(parents=True, exist_ok=True)
        log = self.workdir / f"{name}.log"
        env = dict(os.environ, PYTHONUNBUFFERED="1", **self.env, **(env or {}))
        # a prefix the zygote can stand in for: none, or `ip netns exec NS` (tests.netns; the child joins NS)
        netns = prefix[3] if len(prefix) == 4 and tuple(prefix[:3]) == ("ip", "netns", "exec") else None
        zygote = Zygote.get() if os.environ.get("LOGICPIPE_TEST_ZYGOTE") == "1" and (not prefix or netns) \
            and args[0] == "-m" else None
        if zygote is not None:  # the suite: forked from a process that has the imports done (tests.zygote)
            proc = zygote.spawn(args[1], args[2:], env, log, netns=netns)
            self.procs[name] = proc
            return proc, log
        with open(log, "ab") as out:
            proc = subprocess.Popen([*prefix, sys.executable, *args], stdout=out, stderr=subprocess.STDOUT, env=env,
                                    start_new_session=True)
        self.procs[name] = proc
        return proc, log

    def start_stage(self, i: int, address: str | None = None, *extra: str, prefix: tuple[str, ...] = ()) -> str:
        """Start stage process `stage{i}` (on `address`, else a free port) and wait until it serves.
        `prefix`: what its command line runs under (tests.netns: `ip netns exec NS`)."""
        addr, proc, log = self.spawn_stage(i, address, *extra, prefix=prefix)
        wait_serving(addr, proc, log, transport=self.transport)
        return addr

    def start_stages(self, extra: dict[int, tuple[str, ...]] | None = None) -> list[str]:
        """Start stages 0..n_stages-1 all at once (their start-ups overlap) and wait until every
        one serves; their addresses in order."""
        started = [self.spawn_stage(i, None, *(extra or {}).get(i, ())) for i in range(self.n_stages)]
        for addr, proc, log in started:
            wait_serving(addr, proc, log, transport=self.transport)
        return [addr for addr, _, _ in started]

    def start_spare(self, i: int, *extra: str) -> subprocess.Popen:
        """Start `stage{i}-spare`: stage i's own flags (its address, node id, state directory) and --spare.
        It starts up, waits until stage{i}'s process ends, then serves in its place (promote_spare)."""
        _, proc, _ = self.spawn_stage(i, self.stage_addresses[i], *self.stage_extra.get(i, ()), "--spare", *extra,
                                       name=f"stage{i}-spare")
        return proc

    def promote_spare(self, i: int) -> subprocess.Popen:
        """Once stage{i}'s process has ended: its spare is `stage{i}` from now on, waited for until it serves."""
        proc = self.procs.pop(f"stage{i}-spare")
        self.procs[f"stage{i}"] = proc
        wait_serving(self.stage_addresses[i], proc, self.workdir / f"stage{i}-spare.log", transport=self.transport)
        return proc

    def spawn_stage(self, i: int, address: str | None, *extra: str, prefix: tuple[str, ...] = (),
                    name: str = "") -> tuple[str, subprocess.Popen, Path]:
        """Start stage i's process (`name`, default stage{i}) on `address` (else a free port) without waiting."""
        addr = address or f"127.0.0.1:{free_port()}"
        found = ["--mdns-interface", "127.0.0.1", "--mesh", self.mesh_name] if self.mdns else ["--no-mdns"]
        if self.tls:
            found += ["--tls-dir", str(mesh_bundle(f"stage{i}", "stage"))]
        found += ["--model-root", str(self.model_dir.resolve().parent)]
        proc, log = self._spawn(name or f"stage{i}", ["-m", "logicpipe.stage_node.main", "--listen", addr, "--node-id", f"stage{i}",
                                              "--device", self.device, "--threads", str(self.threads),
                                              "--state-dir", str(self.workdir / f"state{i}"), *found,
                                              *self.stage_args, *extra], self.stage_env.get(i), prefix)
        return addr, proc, log

    def start_controller(self, *extra: str, ready: bool = True, env: dict[str, str] | None = None,
                         name: str = "controller", address: str | None = None, prefix: tuple[str, ...] = ()) -> str:
        """Start the controller (`env`: its own extra environment); `ready`: wait until a plan serves
        (its Status says "ready"). `name` and `address`: another controller (a standby), with
        its own journal (--state-dir under the work directory, by name: a restart keeps it).
        `prefix`: what its command line runs under (tests.netns: `ip netns exec NS`)."""
        if address is None:
            self.controller_address = address = self.controller_address or f"127.0.0.1:{free_port()}"
        found = (["--mdns-interface", "127.0.0.1", "--mesh", self.mesh_name] if self.mdns
                 else ["--no-mdns", "--nodes", ",".join(self.stage_addresses)])
        if self.tls:
            found += ["--tls-dir", str(mesh_bundle("controller", "controller"))]
        proc, log = self._spawn(name, [
            "-m", "logicpipe.controller.main", "--listen", address, "--model", str(self.model_dir),
            "--state-dir", str(self.workdir / f"{name}-state"), *found, *self.controller_args, *extra], env, prefix)
        wait_serving(address, proc, log, peer_role="controller", transport=self.transport)
        if ready:
            self.wait_plan(proc=proc, log=log, address=address)
        return address

    def lpctl(self) -> list[str]:
        """The command line of lpctl for this mesh (with the client bundle when it uses TLS)."""
        return [sys.executable, "-m", "logicpipe.controller.cli.lpctl", "--controller", self.controller_address,
                *(["--tls-dir", str(mesh_bundle("client", "client"))] if self.tls else [])]

    def controller_status(self, timeout: float = 5.0, address: str | None = None):
        with self.transport.sync_channel(address or self.controller_address, "controller") as ch:
            return controller_pb2_grpc.ControllerStub(ch).Status(controller_pb2.ControllerStatusRequest(),
                                                                 timeout=timeout)

    def wait_plan(self, stages: int | None = None, generation_above: int = 0, timeout: float = READY_TIMEOUT_S,
                  proc: subprocess.Popen | None = None, log: Path | None = None, address: str | None = None):
        """Until the controller serves a plan (of `stages` stages, of a generation above
        `generation_above`); returns its Status."""
        deadline = time.monotonic() + timeout
        st = None
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"the controller exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
            try:
                st = self.controller_status(address=address)
                if (st.state == "ready" and (stages is None or len(st.stages) == stages)
                        and st.plan_generation > generation_above):
                    return st
            except grpc.RpcError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"no plan{f' of {stages} stages' if stages else ''} after {timeout:.0f} s "
                           f"(state {st.state if st else '?'}: {st.waiting if st else ''}):\n{self.logs()}")

    def __enter__(self) -> "LocalMesh":
        # a SIGTERM (a timeout killing a benchmark) must still stop our processes: by default it
        # ends Python without running the `with` exits
        if threading.current_thread() is threading.main_thread() and \
                signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
        try:
            self.stage_addresses = self.start_stages(self.stage_extra)
            self.start_controller()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def restart_controller(self, model_dir: Path | str | None = None, *extra: str, env: dict[str, str] | None = None,
                           sig: int = signal.SIGTERM):
        """Stop the controller (`sig`, then wait) and start a new one on the same address, over
        the same stages and journal (with another model, if given: it must lie under the stages'
        --model-root, the first model's parent directory); returns its Status once a plan serves."""
        proc = self.procs.get("controller")
        if proc is not None and proc.poll() is None:
            self.signal("controller", sig)
            proc.wait(STOP_GRACE_S)
        if model_dir is not None:
            self.model_dir = Path(model_dir)
        self.start_controller(*extra, env=env)
        return self.controller_status()

    def signal(self, name: str, sig: int) -> None:
        """Send `sig` to process `name`'s group (SIGSTOP / SIGCONT / SIGTERM for fault tests)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.procs[name].pid, sig)

    def kill(self, name: str) -> None:
        """SIGKILL process `name` and reap it."""
        self.signal(name, signal.SIGKILL)
        self.procs[name].wait(STOP_GRACE_S)

    def stop(self) -> None:
        """Stop every process: SIGCONT (a stopped one cannot die of SIGTERM), SIGTERM, then SIGKILL.
        Controllers first: stages that stop under a live controller make it re-plan around them."""
        stages = [p for n, p in self.procs.items() if n.startswith("stage")]
        self._stop([p for p in self.procs.values() if p not in stages])
        self._stop(stages)

    @staticmethod
    def _stop(procs: list[subprocess.Popen]) -> None:
        live = [p for p in procs if p.poll() is None]
        for proc in live:
            for sig in (signal.SIGCONT, signal.SIGTERM):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, sig)
        deadline = time.monotonic() + STOP_GRACE_S
        for proc in live:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(STOP_GRACE_S)

    def logs(self, tail: int = 2000) -> str:
        """The last `tail` characters of every process's log, for a failing test's message."""
        return "\n".join(f"--- {p.name}\n{p.read_text()[-tail:]}" for p in sorted(self.workdir.glob("*.log")))
