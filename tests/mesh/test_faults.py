"""Mesh tier, faults of real processes: a stopped (SIGSTOP) middle stage is detected within seconds
and the mesh recovers after SIGCONT with nothing leaked; a controller stopped with SIGTERM closes
every session it opened."""
from __future__ import annotations

import signal
import threading
import time

import grpc
import pytest

from logicpipe.localmesh import LocalMesh
from logicpipe.v1 import controller_pb2, controller_pb2_grpc, stage_pb2, stage_pb2_grpc

pytestmark = pytest.mark.mesh


class LongRequest(threading.Thread):
    """A request that would run for minutes; records how it ended."""

    def __init__(self, address: str):
        super().__init__(daemon=True)
        self.address, self.error, self.tokens = address, None, 0
        self.producing = threading.Event()
        self.start()

    def run(self) -> None:
        try:
            with grpc.insecure_channel(self.address) as ch:
                for reply in controller_pb2_grpc.ControllerStub(ch).Submit(controller_pb2.SubmitRequest(
                        prompt="Tell me a very long story.", max_tokens=3000, ignore_eos=True), timeout=300):
                    self.tokens += len(reply.token_ids)
                    if self.tokens >= 3:
                        self.producing.set()
        except grpc.RpcError as exc:
            self.error = exc
        self.producing.set()


def controller_status(address: str, timeout: float) -> controller_pb2.ControllerStatusReply:
    with grpc.insecure_channel(address) as ch:
        return controller_pb2_grpc.ControllerStub(ch).Status(controller_pb2.ControllerStatusRequest(), timeout=timeout)


def open_sessions(address: str) -> int:
    with grpc.insecure_channel(address) as ch:
        return stage_pb2_grpc.StageNodeStub(ch).Status(stage_pb2.StatusRequest(), timeout=10).open_sessions


def eventually(check, within: float, what: str):
    deadline = time.monotonic() + within
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"{what} did not happen within {within:.0f} s"
        time.sleep(0.2)


def test_a_stopped_stage_fails_its_requests_quickly_and_the_mesh_recovers(model_dir, tmp_path):
    with LocalMesh(3, model_dir, tmp_path, threads=1, controller_args=("--strategy", "uniform")) as mesh:
        addr = mesh.controller_address
        requests = [LongRequest(addr), LongRequest(addr)]
        for r in requests:
            assert r.producing.wait(60) and r.error is None, mesh.logs()
        stopped = mesh.stage_addresses[1]
        mesh.signal("stage1", signal.SIGSTOP)
        try:
            for r in requests:  # detected: both fail, naming the stage, long before their tokens would run out
                r.join(10)
                assert not r.is_alive(), "a request still hangs 10 s after its stage stopped"
                assert r.error.code() == grpc.StatusCode.UNAVAILABLE and stopped in r.error.details()
            st = controller_status(addr, timeout=2)  # answers at once, and says what is true
            assert st.state == "degraded"
            assert [n.reachable for n in st.nodes] == [True, False, True]
            with pytest.raises(grpc.RpcError) as new:
                with grpc.insecure_channel(addr) as ch:
                    list(controller_pb2_grpc.ControllerStub(ch).Submit(
                        controller_pb2.SubmitRequest(prompt="Hi", max_tokens=2), timeout=5))
            assert new.value.code() == grpc.StatusCode.UNAVAILABLE and stopped in new.value.details()
        finally:
            mesh.signal("stage1", signal.SIGCONT)
        eventually(lambda: controller_status(addr, 2).state == "ready", 15, "the controller's return to ready")
        eventually(lambda: all(open_sessions(s) == 0 for s in mesh.stage_addresses), 15,
                   "every stage freeing the failed requests' sessions")
        with grpc.insecure_channel(addr) as ch:
            replies = list(controller_pb2_grpc.ControllerStub(ch).Submit(
                controller_pb2.SubmitRequest(prompt="Hi", max_tokens=4), timeout=60))
        assert replies[-1].finished


def test_a_controller_stopped_with_sigterm_closes_every_session(model_dir, tmp_path):
    # a TTL far longer than the test: only the controller's own shutdown can free the sessions
    with LocalMesh(2, model_dir, tmp_path, threads=1, stage_args=("--session-ttl-s", "600")) as mesh:
        requests = [LongRequest(mesh.controller_address), LongRequest(mesh.controller_address)]
        for r in requests:
            assert r.producing.wait(60) and r.error is None, mesh.logs()
        assert all(open_sessions(s) == 2 for s in mesh.stage_addresses)
        mesh.signal("controller", signal.SIGTERM)
        mesh.procs["controller"].wait(30)
        for r in requests:
            r.join(10)
            assert r.error is not None and r.error.code() == grpc.StatusCode.UNAVAILABLE
        assert all(open_sessions(s) == 0 for s in mesh.stage_addresses), mesh.logs()
