"""Mesh tier, Jepsen-style: two controllers (an active and its standby, each in a network namespace
of its own) over two stages, and the active paused (SIGSTOP), killed, and cut off the network in
turn. Clients submit to both all along; a request that one controller completes while the other
completes one too would be two controllers serving at once: never. After each fault exactly one
controller is active and serves. Needs root (network namespaces), which the test machines have."""
from __future__ import annotations

import signal
import threading
import time

import grpc
import pytest

from logicpipe.v1 import controller_pb2, controller_pb2_grpc
from tests import netns
from tests.localmesh import LocalMesh, free_port

pytestmark = pytest.mark.skipif(not netns.available(), reason="needs root for network namespaces")

EXIT_FENCED = 75   # a controller that finds another in charge exits with this (systemd starts it again)
ROLE_WAIT_S = 30.0


class Prober:
    """Submits a 2-token request to each controller, one after another, and keeps every answer:
    (controller, sent, answered, ok)."""

    def __init__(self, mesh: LocalMesh, addresses: dict[str, str]):
        self.mesh, self.addresses = mesh, addresses
        self.answers: list[tuple[str, float, float, bool]] = []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(name,), daemon=True) for name in addresses]

    def _run(self, name: str) -> None:
        while not self.stop.is_set():
            t0 = time.monotonic()
            ok = False
            try:
                with self.mesh.transport.sync_channel(self.addresses[name], "controller") as ch:
                    replies = list(controller_pb2_grpc.ControllerStub(ch).Submit(controller_pb2.SubmitRequest(
                        prompt_token_ids=[1, 2, 3], max_tokens=2, ignore_eos=True), timeout=3))
                ok = sum(len(r.token_ids) for r in replies) == 2
            except grpc.RpcError:
                pass
            self.answers.append((name, t0, time.monotonic(), ok))
            time.sleep(0.1)

    def served(self, name: str, since: float = 0.0) -> int:
        return sum(1 for n, t0, _, ok in self.answers if n == name and ok and t0 >= since)

    def overlaps(self) -> list[tuple]:
        """Pairs of requests the two controllers both completed, at overlapping times."""
        done = [(n, t0, t1) for n, t0, t1, ok in self.answers if ok]
        return [(x, y) for x in done for y in done if x[0] < y[0] and x[1] < y[2] and y[1] < x[2]]


def status(mesh: LocalMesh, address: str):
    try:
        return mesh.controller_status(timeout=2, address=address)
    except grpc.RpcError:
        return None


def test_at_most_one_controller_serves_through_a_pause_a_kill_and_a_partition(chat_model, tmp_path):
    with netns.Namespaces(["a", "b"]) as ns:
        mesh = LocalMesh(2, chat_model, tmp_path, threads=1, tls=False)
        addr = {n: f"{ns.address(n)}:{free_port()}" for n in ("a", "b")}
        peer = {"a": addr["b"], "b": addr["a"]}
        secret = tmp_path / "peer.secret"  # the journal streams only to the standby that sends it
        secret.write_text("0123456789abcdef" * 2 + "\n")

        def start(name: str, ready: bool) -> None:
            mesh.start_controller("--peer", peer[name], "--peer-secret-file", str(secret), "--insecure", name=f"controller-{name}", address=addr[name],
                                  ready=ready, prefix=tuple(ns.prefix(name)))

        def restart_if_exited(name: str) -> None:  # as systemd does (Restart=on-failure)
            proc = mesh.procs[f"controller-{name}"]
            if proc.poll() is not None:
                assert proc.returncode in (EXIT_FENCED, -signal.SIGKILL), mesh.logs()
                start(name, ready=False)

        def wait_role(name: str, want: set[str], other: str | None = None) -> None:
            deadline = time.monotonic() + ROLE_WAIT_S
            while True:
                if other is not None:
                    restart_if_exited(other)
                st = status(mesh, addr[name])
                if st is not None and st.role in want:
                    return
                assert time.monotonic() < deadline, f"{name} is not {want} within {ROLE_WAIT_S} s\n{mesh.logs()}"
                time.sleep(0.2)

        prober = Prober(mesh, addr)
        try:
            mesh.stage_addresses = [mesh.start_stage(i, f"{ns.stage_host}:{free_port()}", "--insecure") for i in range(2)]
            start("a", ready=True)
            start("b", ready=False)
            wait_role("b", {"standby"})
            for t in prober.threads:
                t.start()
            active, standby = "a", "b"
            for fault in ("pause", "kill", "partition"):
                t_fault = time.monotonic()
                if fault == "pause":
                    mesh.signal(f"controller-{active}", signal.SIGSTOP)
                elif fault == "kill":
                    mesh.kill(f"controller-{active}")
                else:
                    ns.partition(active)
                wait_role(standby, {"active"})  # the standby takes over
                time.sleep(2.0)  # both sides run a while in their new roles
                if fault == "pause":
                    mesh.signal(f"controller-{active}", signal.SIGCONT)
                elif fault == "kill":
                    start(active, ready=False)
                else:
                    ns.heal(active)
                wait_role(active, {"standby"}, other=active)  # the old active follows the new one
                time.sleep(1.0)
                assert prober.served(standby, since=t_fault) > 0, f"{standby} served nothing after the {fault}"
                active, standby = standby, active
            prober.stop.set()
            for t in prober.threads:
                t.join(10)
            assert not prober.overlaps(), f"two controllers served at once: {prober.overlaps()[:3]}\n{mesh.logs()}"
            roles = [getattr(status(mesh, addr[n]), "role", None) for n in ("a", "b")]
            assert sorted(roles) == ["active", "standby"], roles
        finally:
            prober.stop.set()
            mesh.stop()
