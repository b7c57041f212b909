"""Real processes on 127.0.0.1: stage nodes and a controller, started and always stopped.

`Mesh(n_stages, model_dir, workdir)` is a context manager: on exit (also after a failure) every
process it started gets SIGTERM, then SIGKILL after a grace period, by process group.
"""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

READY_TIMEOUT_S = 120.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_serving(address: str, proc: subprocess.Popen, log: Path, timeout: float = READY_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(address) as ch:
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


class Mesh:
    def __init__(self, n_stages: int, model_dir: Path, workdir: Path, *, threads: int = 1,
                 device: str = "cpu", controller_args: tuple[str, ...] = ()):
        self.device = device
        self.n_stages = n_stages
        self.model_dir = Path(model_dir)
        self.workdir = Path(workdir)
        self.threads = threads
        self.controller_args = controller_args
        self.procs: dict[str, subprocess.Popen] = {}
        self.stage_addresses: list[str] = []
        self.controller_address = ""

    def _spawn(self, name: str, args: list[str]) -> tuple[subprocess.Popen, Path]:
        log = self.workdir / f"{name}.log"
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_WAIT_POLICY="PASSIVE")
        with open(log, "wb") as out:
            proc = subprocess.Popen([sys.executable, *args], stdout=out, stderr=subprocess.STDOUT, env=env,
                                    start_new_session=True)
        self.procs[name] = proc
        return proc, log

    def start_stage(self, i: int) -> str:
        addr = f"127.0.0.1:{free_port()}"
        proc, log = self._spawn(f"stage{i}", ["-m", "stage_node.main", "--listen", addr, "--node-id", f"stage{i}",
                                              "--device", self.device, "--threads", str(self.threads)])
        wait_serving(addr, proc, log)
        return addr

    def __enter__(self) -> "Mesh":
        try:
            self.stage_addresses = [self.start_stage(i) for i in range(self.n_stages)]
            self.controller_address = f"127.0.0.1:{free_port()}"
            proc, log = self._spawn("controller", [
                "-m", "controller.main", "--listen", self.controller_address, "--model", str(self.model_dir),
                "--nodes", ",".join(self.stage_addresses), *self.controller_args])
            wait_serving(self.controller_address, proc, log)
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def kill(self, name: str) -> None:
        proc = self.procs[name]
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for proc in self.procs.values():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in sorted(self.workdir.glob("*.log")))
