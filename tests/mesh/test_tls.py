"""Mesh tier, security: a 2-stage mesh over mutual TLS, and the attacks a probe made on an open mesh
replayed without a controller certificate (issue 13): each refused with the status that says what
to fix, the victim's request unaffected, the mesh serving on."""
from __future__ import annotations

import threading

import grpc
import pytest

from logicpipe.common.security import ca
from logicpipe.common.security.bundle import Bundle
from logicpipe.common.transport import Transport
from logicpipe.v1 import controller_pb2, controller_pb2_grpc, stage_pb2, stage_pb2_grpc
from tests.localmesh import LocalMesh, mesh_bundle

PROMPT = "Write a short poem about the sea."


@pytest.fixture(scope="module")
def mesh(model_dir, tmp_path_factory):
    ca_dir = mesh_bundle("client", "client").parent / "ca"  # the CA of the mesh: revocations live beside it
    with LocalMesh(2, model_dir, tmp_path_factory.mktemp("tls"), threads=1, tls=True,
                   controller_args=("--ca-dir", str(ca_dir))) as m:
        yield m


def bundle(name: str, role: str) -> Bundle:
    return Bundle.load(mesh_bundle(name, role))


def generate(mesh, bundle_=None, max_tokens: int = 24) -> list[int]:
    transport = Transport(bundle_) if bundle_ is not None else mesh.transport  # default: the mesh's client
    with transport.sync_channel(mesh.controller_address, "controller") as ch:
        replies = controller_pb2_grpc.ControllerStub(ch).Submit(
            controller_pb2.SubmitRequest(prompt=PROMPT, max_tokens=max_tokens, ignore_eos=True), timeout=300)
        return [t for r in replies for t in r.token_ids]


def code_of(call) -> tuple[grpc.StatusCode, str]:
    try:
        call()
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or ""
    return grpc.StatusCode.OK, ""


def stage_stub(mesh, node_id: str, who: Bundle | None):
    address = mesh.stage_addresses[int(node_id.removeprefix("stage"))]
    return stage_pb2_grpc.StageNodeStub(Transport(who).sync_channel(address, "stage"))


def plan_order(mesh) -> list[str]:
    return [s.node_id for s in mesh.controller_status().stages]


def test_the_mesh_serves_over_mutual_tls(mesh):
    st = mesh.controller_status()
    assert st.state == "ready" and sorted(s.node_id for s in st.stages) == ["stage0", "stage1"]
    assert len(generate(mesh)) == 24


def test_no_or_a_foreign_certificate_fails_the_handshake(mesh, tmp_path):
    with grpc.insecure_channel(mesh.controller_address) as ch:  # plaintext to a TLS port
        code, _ = code_of(lambda: controller_pb2_grpc.ControllerStub(ch).Status(
            controller_pb2.ControllerStatusRequest(), timeout=5))
    assert code == grpc.StatusCode.UNAVAILABLE
    ca.init_ca(tmp_path / "other-ca")  # a client of another mesh's CA
    ca.issue(tmp_path / "other-ca", "mallory", "client", tmp_path / "mallory")
    foreign = Bundle.load(tmp_path / "mallory")
    code, _ = code_of(lambda: generate(mesh, foreign))
    assert code == grpc.StatusCode.UNAVAILABLE
    assert len(generate(mesh, max_tokens=4)) == 4  # still serving


def test_the_probes_attacks_are_refused_and_the_victim_unaffected(mesh):
    """hijack (Assign), eavesdrop (Events, CloseSession), denial (20 OpenSession), SSRF
    (MeasureLink) with a client's and a stage's certificate, while a victim's request runs."""
    want = generate(mesh)
    got: list[int] = []
    victim = threading.Thread(target=lambda: got.extend(generate(mesh)))
    victim.start()
    first, second = plan_order(mesh)
    client, stage = bundle("client", "client"), bundle(first, "stage")
    for who in (client, stage):
        last = stage_stub(mesh, second, who)
        hijack = stage_pb2.AssignRequest(model_dir="/", start_layer=15, end_layer=30, num_layers=30, stage_index=1,
                                         num_stages=2, first_address="127.0.0.1:1")
        code, msg = code_of(lambda: last.Assign(hijack, timeout=5))
        assert code == grpc.StatusCode.PERMISSION_DENIED and "Assign accepts controller" in msg, msg
        code, msg = code_of(lambda: next(iter(last.Events(stage_pb2.EventsRequest(), timeout=5))))
        assert code == grpc.StatusCode.PERMISSION_DENIED, msg
        code, _ = code_of(lambda: last.CloseSession(stage_pb2.CloseSessionRequest(session_id="x"), timeout=5))
        assert code == grpc.StatusCode.PERMISSION_DENIED
        for _ in range(20):
            code, _ = code_of(lambda: last.OpenSession(stage_pb2.OpenSessionRequest(session_id="dos"), timeout=5))
            assert code == grpc.StatusCode.PERMISSION_DENIED
        code, _ = code_of(lambda: last.MeasureLink(stage_pb2.MeasureLinkRequest(target_address="127.0.0.1:9"),
                                                   timeout=5))
        assert code == grpc.StatusCode.PERMISSION_DENIED
    victim.join(timeout=300)
    assert got == want  # greedy: the same tokens as before the attacks
    assert mesh.controller_status().state == "ready"


def test_wrong_roles_and_wrong_peers_are_refused(mesh):
    first, second = plan_order(mesh)
    client, stage = bundle("client", "client"), bundle(second, "stage")
    # a stage cannot submit, nor speak for another node
    code, msg = code_of(lambda: generate(mesh, stage))
    assert code == grpc.StatusCode.PERMISSION_DENIED and "Submit accepts client" in msg
    with Transport(stage).sync_channel(mesh.controller_address, "controller") as ch:
        code, msg = code_of(lambda: controller_pb2_grpc.ControllerStub(ch).Leave(
            controller_pb2.LeaveRequest(node_id=first), timeout=5))
    assert code == grpc.StatusCode.PERMISSION_DENIED and f"cannot speak for node {first!r}" in msg
    # a client cannot pull weights or register
    with Transport(client).sync_channel(mesh.controller_address, "controller") as ch:
        code, _ = code_of(lambda: controller_pb2_grpc.ControllerStub(ch).Register(
            controller_pb2.RegisterRequest(address="127.0.0.1:1", node_id="evil"), timeout=5))
    assert code == grpc.StatusCode.PERMISSION_DENIED
    # the second stage takes steps only from the first: its own certificate streaming to it is refused
    call = stage_stub(mesh, second, stage).Stream(iter([stage_pb2.StepBatch()]), timeout=5)
    code, msg = code_of(lambda: list(call))
    assert code == grpc.StatusCode.PERMISSION_DENIED and f"only from {first}" in msg, msg
    # a channel that expects a controller but reaches a stage: the stage's certificate does not match
    with Transport(client).sync_channel(mesh.stage_addresses[0], "controller") as ch:
        code, _ = code_of(lambda: controller_pb2_grpc.ControllerStub(ch).Status(
            controller_pb2.ControllerStatusRequest(), timeout=5))
    assert code == grpc.StatusCode.UNAVAILABLE
    assert len(generate(mesh, max_tokens=4)) == 4


def test_a_node_joins_with_a_one_time_token_and_is_revoked(model_dir, tmp_path):
    """A controller with the CA (--ca-dir) and a bootstrap port: `lpctl token create`, a new node
    joins with the token (one command) and is planned with; the same token again is refused;
    `lpctl revoke` drops the node, the mesh serves on, and its certificate is refused from then on."""
    import time

    from tests.localmesh import free_port, wait_serving

    ca_dir = mesh_bundle("client", "client").parent / "ca"
    join = f"127.0.0.1:{free_port()}"
    client = bundle("client", "client")
    with LocalMesh(1, model_dir, tmp_path / "mesh", threads=1, tls=True,
                   controller_args=("--ca-dir", str(ca_dir), "--join-listen", join)) as mesh:
        with Transport(client).sync_channel(mesh.controller_address, "controller") as ch:
            stub = controller_pb2_grpc.ControllerStub(ch)
            token = stub.CreateJoinToken(controller_pb2.JoinTokenRequest(ttl_s=120), timeout=10).token

            def start(name: str, tls_dir, token=token):
                addr = f"127.0.0.1:{free_port()}"
                proc, log = mesh._spawn(f"join-{name}", [  # not a name of the mesh's own processes
                    "-m", "logicpipe.stage_node.main", "--listen", addr, "--node-id", name, "--threads", "1", "--no-mdns",
                    "--controller", mesh.controller_address, "--state-dir", str(tmp_path / f"{name}-state"),
                    "--model-root", str(model_dir.parent), "--join-token", token, "--join-address", join,
                    "--tls-dir", str(tls_dir)])
                return addr, proc, log

            addr, proc, log = start("newbie", tmp_path / "newbie-tls")
            wait_serving(addr, proc, log, transport=mesh.transport)
            st = mesh.wait_plan(stages=2, timeout=120)
            assert "newbie" in [s.node_id for s in st.stages]
            assert Bundle.load(tmp_path / "newbie-tls").name == "newbie"
            # the token is spent: a second node with it is refused and says why
            _, again, again_log = start("copycat", tmp_path / "copycat-tls")
            assert again.wait(timeout=60) != 0
            assert "used or expired" in again_log.read_text()
            # a join under a name a node of the mesh goes by is refused, and the token stays good
            other = stub.CreateJoinToken(controller_pb2.JoinTokenRequest(ttl_s=120), timeout=10).token
            _, thief, thief_log = start("stage0", tmp_path / "thief-tls", other)
            assert thief.wait(timeout=60) != 0
            assert "node id 'stage0' is taken" in thief_log.read_text()
            _, fresh, _ = start("fresh", tmp_path / "fresh-tls", other)
            try:
                deadline = time.monotonic() + 60
                while not (tmp_path / "fresh-tls" / "fresh.crt").is_file():
                    assert time.monotonic() < deadline and fresh.poll() is None
                    time.sleep(0.1)
            finally:
                fresh.terminate()
                fresh.wait(timeout=30)
            # revoke: a plan without it serves, requests go on, its certificate is refused
            msg = stub.Revoke(controller_pb2.RevokeRequest(node="newbie"), timeout=120).message
            assert "revoked" in msg
            assert [s.node_id for s in mesh.controller_status().stages] == ["stage0"]
            assert len(generate(mesh, max_tokens=4)) == 4
        newbie = Bundle.load(tmp_path / "newbie-tls")
        with Transport(newbie).sync_channel(mesh.controller_address, "controller") as ch:
            code, msg = code_of(lambda: controller_pb2_grpc.ControllerStub(ch).Register(
                controller_pb2.RegisterRequest(address=addr, node_id="newbie"), timeout=5))
        assert code == grpc.StatusCode.PERMISSION_DENIED and "revoked" in msg
        time.sleep(1.0)
        assert [s.node_id for s in mesh.controller_status().stages] == ["stage0"]


def test_only_the_holding_controller_steers_a_stage_and_stages_refuse_a_revoked_one(mesh):
    """Another controller certificate of the mesh's CA, which knows the controller's owner id (as
    any stage learns it from Register), cannot read a stage's events, open, close or measure there
    while the controller that holds the stage serves; once revoked (`lpctl revoke`), the stages
    themselves refuse it on every method, whatever fencing epoch it claims on Assign. The victim's
    request finishes unchanged and the controller stays ready on the same plan."""
    want = generate(mesh, max_tokens=40)
    got: list[int] = []
    victim = threading.Thread(target=lambda: got.extend(generate(mesh, max_tokens=40)))
    victim.start()
    rogue = bundle("ctl-rogue", "controller")
    first, last = plan_order(mesh)[0], plan_order(mesh)[-1]
    generation = mesh.controller_status().plan_generation
    with Transport(bundle(first, "stage")).sync_channel(mesh.controller_address, "controller") as ch:
        owner = controller_pb2_grpc.ControllerStub(ch).Register(controller_pb2.RegisterRequest(
            address=mesh.stage_addresses[int(first.removeprefix("stage"))], node_id=first), timeout=10).controller_id
    for node in (first, last):
        stub = stage_stub(mesh, node, rogue)
        code, msg = code_of(lambda: next(iter(stub.Events(stage_pb2.EventsRequest(owner=owner), timeout=10))))
        assert code == grpc.StatusCode.PERMISSION_DENIED and "only from the controller that holds it" in msg, msg
        for call in (lambda: stub.CloseSession(stage_pb2.CloseSessionRequest(session_id="x"), timeout=5),
                     lambda: stub.OpenSession(stage_pb2.OpenSessionRequest(session_id="x", capacity=8, owner=owner),
                                              timeout=5)):
            code, msg = code_of(call)
            assert code == grpc.StatusCode.PERMISSION_DENIED and "holds it" in msg, msg
        code, msg = code_of(lambda: stub.MeasureLink(stage_pb2.MeasureLinkRequest(  # dials for its holder only
            target_address="127.0.0.1:9", controller_id=owner), timeout=5))
        assert code == grpc.StatusCode.PERMISSION_DENIED and "holds it" in msg, msg
        # issue 34: a controller certificate not named as the holder's standby cannot take the
        # stage, whatever epoch it read off Status and adds to (it took it with 2^62 before)
        epoch = stub.Status(stage_pb2.StatusRequest(), timeout=5).controller_epoch
        steal = stage_pb2.AssignRequest(model_dir="/", start_layer=0, end_layer=30, num_layers=30, stage_index=0,
                                        num_stages=1, generation=generation + 1, controller_epoch=2**62,
                                        controller_id="rogue")
        for claimed in (epoch + 1, 2**62):
            steal.controller_epoch = claimed
            code, msg = code_of(lambda: stub.Assign(steal, timeout=5))
            assert code == grpc.StatusCode.PERMISSION_DENIED and "may take it over" in msg, msg
    with mesh.transport.sync_channel(mesh.controller_address, "controller") as ch:
        msg = controller_pb2_grpc.ControllerStub(ch).Revoke(controller_pb2.RevokeRequest(node="ctl-rogue"),
                                                            timeout=60).message
    assert "2 of 2 nodes refuse it now" in msg, msg
    hijack = stage_pb2.AssignRequest(model_dir="/", start_layer=0, end_layer=30, num_layers=30, stage_index=0,
                                     num_stages=1, generation=generation + 1, controller_epoch=2**63,
                                     controller_id="rogue")
    for node in (first, last):
        stub = stage_stub(mesh, node, rogue)
        for call in (lambda: stub.Assign(hijack, timeout=5),
                     lambda: next(iter(stub.Events(stage_pb2.EventsRequest(owner="rogue"), timeout=5))),
                     lambda: stub.OpenSession(stage_pb2.OpenSessionRequest(session_id="x", capacity=8), timeout=5)):
            code, msg = code_of(call)
            assert code == grpc.StatusCode.PERMISSION_DENIED and "'ctl-rogue' was revoked" in msg, msg
        assert stage_stub(mesh, node, bundle("client", "client")).Status(stage_pb2.StatusRequest(),
                                                                          timeout=5).revoked >= 1
    victim.join(timeout=300)
    assert got == want
    st = mesh.controller_status()
    assert st.state == "ready" and st.plan_generation == generation
