"""What a fault and bad-input probe found, as regressions: garbage bytes on any RPC, unbounded
link probes, large Echo calls and Events subscribers, each refused with its status and a one-line
message while the node keeps serving."""
from __future__ import annotations

import asyncio
import contextlib
import json
import math
import socket
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from logicpipe.v1 import controller_pb2, controller_pb2_grpc, stage_pb2

from .conftest import (
    PROMPT,
    RPC_TIMEOUT_S,
    TINY_LAYERS,
    Events,
    assign,
    controller,
    expect_status,
    expect_stream_abort,
    new_session_id,
    open_request,
    prompt_step,
    run,
    serve_valid_request,
    single_stage,
    stage_node,
)

IA = grpc.StatusCode.INVALID_ARGUMENT
GARBAGE = b"\xff\xfe\x00\x12garbage that is no protobuf\x9a"

STAGE_METHODS = {  # method: streaming request?, streaming reply?
    "Assign": (False, False), "OpenSession": (False, False), "CloseSession": (False, False),
    "Stream": (True, True), "Events": (False, True), "Status": (False, False), "Echo": (False, False),
    "MeasureLink": (False, False),
}
CONTROLLER_METHODS = {"Submit": (False, True), "Status": (False, False), "Plan": (False, False)}


async def call_with_garbage(channel: grpc.aio.Channel, path: str, streaming_in: bool, streaming_out: bool):
    raw = dict(request_serializer=None, response_deserializer=None)
    if streaming_in:
        call = channel.stream_stream(path, **raw)(timeout=RPC_TIMEOUT_S)
        await call.write(GARBAGE)
        return await call.read()
    if streaming_out:
        call = channel.unary_stream(path, **raw)(GARBAGE, timeout=RPC_TIMEOUT_S)
        return await call.read()
    return await channel.unary_unary(path, **raw)(GARBAGE, timeout=RPC_TIMEOUT_S)


@pytest.mark.parametrize("method", list(STAGE_METHODS))
def test_garbage_bytes_on_a_stage_rpc_are_invalid_argument(method, tiny_model):
    async def main():
        async with single_stage(tiny_model.path, "garbage") as node:
            err = await expect_status(call_with_garbage(node.channel, f"/logicpipe.v1.StageNode/{method}",
                                                        *STAGE_METHODS[method]), IA, "does not parse")
            assert "\n" not in err.details()
            await serve_valid_request(node, expect=tiny_model.greedy)
    run(main())


def test_garbage_bytes_on_controller_rpcs_are_invalid_argument(model_dir):
    async def main():
        async with controller(model_dir, [], start=False) as ctl:
            for method, kinds in CONTROLLER_METHODS.items():
                await expect_status(call_with_garbage(ctl.channel, f"/logicpipe.v1.Controller/{method}", *kinds),
                                    IA, "does not parse")
    run(main())


def test_measure_link_is_bounded_and_says_what_failed_in_one_line(tiny_model):
    async def main():
        with socket.socket() as plain:  # a TCP listener that speaks no gRPC
            plain.bind(("127.0.0.1", 0))
            plain.listen()
            target = f"127.0.0.1:{plain.getsockname()[1]}"
            async with single_stage(tiny_model.path, "prober") as node:
                err = await expect_status(node.stub.MeasureLink(stage_pb2.MeasureLinkRequest(target_address=target),
                                                                timeout=60),
                                          grpc.StatusCode.UNAVAILABLE, target, "not a reachable stage node")
                assert "\n" not in err.details() and len(err.details()) < 400
                await expect_status(node.stub.MeasureLink(stage_pb2.MeasureLinkRequest(
                    target_address=node.address, probes=100_000), timeout=RPC_TIMEOUT_S), IA, "probes", "cap")
                ok = await node.stub.MeasureLink(stage_pb2.MeasureLinkRequest(target_address=node.address, probes=3,
                                                                              payload_bytes=1024), timeout=RPC_TIMEOUT_S)
                assert ok.latency_s > 0 and ok.bandwidth > 0
    run(main())


def test_large_echo_calls_are_limited_and_small_ones_always_answered(tiny_model, monkeypatch):
    import logicpipe.stage_node.net.service as service

    async def main():
        async with single_stage(tiny_model.path, "echo") as node:
            big = stage_pb2.EchoRequest(reply_bytes=2 * 2**20)
            assert len((await node.stub.Echo(big, timeout=RPC_TIMEOUT_S)).payload) == 2 * 2**20
            monkeypatch.setattr(service, "LARGE_ECHOES", 0)  # as if the large-echo slots were all taken
            await expect_status(node.stub.Echo(big, timeout=RPC_TIMEOUT_S), grpc.StatusCode.RESOURCE_EXHAUSTED,
                                "large Echo", "retry")
            await expect_status(node.stub.Echo(stage_pb2.EchoRequest(payload=bytes(2 * 2**20)), timeout=RPC_TIMEOUT_S),
                                grpc.StatusCode.RESOURCE_EXHAUSTED, "large Echo")
            small = await node.stub.Echo(stage_pb2.EchoRequest(reply_bytes=100), timeout=RPC_TIMEOUT_S)
            assert len(small.payload) == 100
            monkeypatch.setattr(service, "LARGE_ECHOES", 2)
            # many at once: each either answered or refused, none lost, the node then serves
            calls = await asyncio.gather(*(node.stub.Echo(big, timeout=RPC_TIMEOUT_S) for _ in range(12)),
                                         return_exceptions=True)
            for c in calls:
                assert not isinstance(c, Exception) or c.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, c
            await serve_valid_request(node, expect=tiny_model.greedy)
    run(main())


def test_events_subscribers_are_capped(tiny_model, monkeypatch):
    import logicpipe.stage_node.net.service as service

    monkeypatch.setattr(service, "MAX_SUBSCRIBERS", 3)

    async def main():
        async with single_stage(tiny_model.path, "popular") as node:
            subs = [Events(node, owner=f"o{i}") for i in range(3)]
            for s in subs:
                await s.__aenter__()
            try:
                await expect_status(node.stub.Events(stage_pb2.EventsRequest(owner="late"),
                                                     timeout=RPC_TIMEOUT_S).read(),
                                    grpc.StatusCode.RESOURCE_EXHAUSTED, "3 Events subscribers")
            finally:
                for s in subs:
                    await s.__aexit__()
            await asyncio.sleep(0.2)
            async with Events(node, owner="late"):
                pass
            await serve_valid_request(node, expect=tiny_model.greedy)
    run(main())


# ----------------------------------------------------------------------------- issue 23: flawed answers
# Each input below was answered wrongly (UNKNOWN, or accepted) by a bad-input probe; each now gets
# its status and a one-line message naming the field, and the node or controller serves on.

PD, RE, UNIMPL = grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNIMPLEMENTED
TEST_NET = "192.0.2"  # RFC 5737: never a host of this machine or its LAN, so never a stage that answers


@pytest.fixture(scope="module")
def node(runner, tiny_model):
    """One stage holding the whole tiny model, for the module's bad Assign and OpenSession calls."""
    stack = contextlib.AsyncExitStack()
    try:
        yield runner.run(stack.enter_async_context(single_stage(tiny_model.path, "flawed")))
    finally:
        runner.run(stack.aclose())


@dataclass
class AuthorityController:
    ctl: object          # conftest.Controller (its own server has no CA)
    stub: object         # a ControllerServicer with a join authority, on its own port
    ca_dir: Path


@contextlib.asynccontextmanager
async def authority_controller(model_dir, ca_dir: Path):
    """A controller with no stages (not started) whose servicer has a CA (--ca-dir): join tokens
    and revocations are served."""
    from logicpipe.common.security.revocations import Revocations
    from logicpipe.common.transport import PLAINTEXT
    from logicpipe.controller.mesh.join import JoinAuthority
    from logicpipe.controller.api.service import ControllerServicer

    async with controller(model_dir, [], start=False) as ctl:
        authority = JoinAuthority(ca_dir, Revocations.in_ca_dir(ca_dir))
        ctl.app.revocations = authority.revocations
        server = PLAINTEXT.server()
        servicer = ControllerServicer(ctl.app, ctl.door, PLAINTEXT, authority)
        controller_pb2_grpc.add_ControllerServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        channel = PLAINTEXT.channel(f"127.0.0.1:{port}", "controller")
        try:
            yield AuthorityController(ctl, controller_pb2_grpc.ControllerStub(channel), ca_dir)
        finally:
            await channel.close()
            await server.stop(None)


@pytest.fixture(scope="module")
def actl(runner, model_dir, tmp_path_factory):
    from logicpipe.common.security import ca as tls_ca

    ca_dir = tls_ca.init_ca(tmp_path_factory.mktemp("flawed-ca") / "ca")
    stack = contextlib.AsyncExitStack()
    try:
        yield runner.run(stack.enter_async_context(authority_controller(model_dir, ca_dir)))
    finally:
        runner.run(stack.aclose())


def arun(runner, coro, timeout: float = 120.0):
    return runner.run(asyncio.wait_for(coro, timeout))


async def still_serves(a: AuthorityController) -> None:
    st = await a.stub.Status(controller_pb2.ControllerStatusRequest(), timeout=RPC_TIMEOUT_S)
    assert st.state


def test_assign_with_a_nul_in_model_dir_is_invalid_argument(runner, node, tiny_model):
    async def main():
        await expect_status(assign(node, f"{tiny_model.path}\x00/x"), IA, "model_dir", "control character '\\x00'")
        await expect_status(assign(node, f"{tiny_model.path}\n"), IA, "model_dir", "control character '\\n'")
        await serve_valid_request(node, expect=tiny_model.greedy)
    arun(runner, main())


@pytest.mark.parametrize("field,value,phrase", [
    ("next_address", "garbage::x", "port 'x'"), ("next_address", "127.0.0.1:0", "port '0'"),
    ("next_address", "::1:5000", "brackets"), ("next_address", "x" * 300 + ":1", "261-character cap"),
    ("first_address", "bad host:5", "DNS name"), ("first_address", "999.1.1.1:5", "IPv4"),
    ("controller_address", "ctl:99999", "port '99999'"),
    ("prev_node_id", "p" * 100_000, "256-character cap"), ("last_node_id", "l\x00", "control character"),
    ("plan_id", "q" * 300, "256-character cap"), ("model_digest", "d\x1b[2J", "control character"),
    ("controller_id", "c" * 100_000, "256-character cap"),
])
def test_assign_strings_are_bounded_and_addresses_are_host_port(runner, node, tiny_model, field, value, phrase):
    """Every string of AssignRequest: ids bounded and printable, addresses host:port (stage 0 of 2,
    so that next_address is needed; the last of 2, so that first_address is)."""
    where = {"first_address": dict(start=2, stage_index=1, num_stages=2, first_address=node.address),
             "next_address": dict(end=2, num_stages=2, next_address=node.address)}.get(field, {})
    fields = {k: v for k, v in where.items() if k not in ("start", "end")}
    fields[field] = value

    async def main():
        await expect_status(assign(node, tiny_model.path, where.get("start", 0), where.get("end", TINY_LAYERS),
                                   **fields), IA, field, phrase)
        await serve_valid_request(node, expect=tiny_model.greedy)
    arun(runner, main())


def test_assign_micro_batches_and_stages_are_capped(runner, node, tiny_model):
    async def main():
        await expect_status(assign(node, tiny_model.path, micro_batches=2**32 - 1), IA, "micro_batches",
                            "cap of 64", "--micro-batches")
        await expect_status(assign(node, tiny_model.path, num_stages=2**32 - 1), IA,
                            f"{2**32 - 1} stages for {TINY_LAYERS} layers")
        await serve_valid_request(node, expect=tiny_model.greedy)
    arun(runner, main())


@pytest.mark.parametrize("field,phrase", [("speculate", "cap of 64 candidates"), ("generated", "generated 4294967295")])
def test_open_session_speculate_and_generated_are_capped(runner, node, tiny_model, field, phrase):
    async def main():
        sid = new_session_id("capped")
        await expect_status(node.stub.OpenSession(open_request(sid, prompt_token_ids=list(PROMPT),
                                                               **{field: 2**32 - 1}), timeout=RPC_TIMEOUT_S),
                            IA, field, phrase)
        await serve_valid_request(node, expect=tiny_model.greedy)
    arun(runner, main())


@pytest.mark.parametrize("field,value", [("session_id", "a\x00b"), ("session_id", "a\nb"), ("owner", "o\x7f"),
                                         ("parent_session_id", "p\u2028")])
def test_ids_with_control_characters_are_invalid_argument(runner, node, tiny_model, field, value):
    async def main():
        fields = {"session_id": new_session_id("ctl-char"), field: value}
        await expect_status(node.stub.OpenSession(open_request(**fields), timeout=RPC_TIMEOUT_S), IA, field,
                            "control character")
        if field == "session_id":  # a step naming it: the stream ends at once
            err = await expect_stream_abort(node, prompt_step(value), IA, "session_id", "control character")
            assert "\n" not in err.details()
        await serve_valid_request(node, expect=tiny_model.greedy)
    arun(runner, main())


@pytest.mark.parametrize("address,phrase", [("garbage::x", "port 'x'"), ("[zz]:5", "not an IPv6 address"),
                                            ("10.0.0.1:0", "port '0'"), ("-bad-.local:5", "DNS name"),
                                            ("nohost", "no :port")])
def test_register_needs_a_host_port_address(runner, actl, address, phrase):
    async def main():
        await expect_status(actl.stub.Register(controller_pb2.RegisterRequest(address=address, node_id="n1"),
                                               timeout=RPC_TIMEOUT_S), IA, "address", phrase, "host:port")
        assert not any(a.startswith(address) for a in actl.ctl.app.members.by_address)
        bad_id = controller_pb2.RegisterRequest(address=f"{TEST_NET}.1:5", node_id="n\x00")
        await expect_status(actl.stub.Register(bad_id, timeout=RPC_TIMEOUT_S), IA, "node_id", "control character")
        await still_serves(actl)
    arun(runner, main())


def test_register_of_silent_members_is_capped(runner, actl, monkeypatch):
    """New addresses are refused while MAX_SILENT_REGISTERED registered members do not answer;
    one already known registers again."""
    import logicpipe.controller.api.service as service

    async def main():
        app = actl.ctl.app
        silent = sum(1 for m in app.members.by_address.values() if m.source == "registered")
        monkeypatch.setattr(service, "MAX_SILENT_REGISTERED", silent + 2)
        for i in (1, 2):
            ok = await actl.stub.Register(controller_pb2.RegisterRequest(address=f"{TEST_NET}.{i}:50061",
                                                                         node_id=f"silent-{i}"), timeout=RPC_TIMEOUT_S)
            assert ok.admitted
        await expect_status(actl.stub.Register(controller_pb2.RegisterRequest(address=f"{TEST_NET}.3:50061",
                                                                              node_id="silent-3"),
                                               timeout=RPC_TIMEOUT_S), RE, "registered nodes do not answer",
                            f"cap of {silent + 2}")
        again = await actl.stub.Register(controller_pb2.RegisterRequest(address=f"{TEST_NET}.1:50061",
                                                                        node_id="silent-1"), timeout=RPC_TIMEOUT_S)
        assert again.admitted and f"{TEST_NET}.3:50061" not in app.members.by_address
        await still_serves(actl)
    arun(runner, main())


@pytest.mark.parametrize("ttl", [math.nan, math.inf, -math.inf, -5.0])
def test_create_join_token_refuses_a_ttl_that_is_no_lifetime(runner, actl, ttl):
    async def main():
        await expect_status(actl.stub.CreateJoinToken(controller_pb2.JoinTokenRequest(ttl_s=ttl),
                                                      timeout=RPC_TIMEOUT_S), IA, "ttl_s", "give seconds from 0")
        for asked, got in ((0.0, 3600.0), (60.0, 60.0), (1e12, 24 * 3600.0)):
            reply = await actl.stub.CreateJoinToken(controller_pb2.JoinTokenRequest(ttl_s=asked), timeout=RPC_TIMEOUT_S)
            assert reply.expires_in_s == got and reply.token.startswith("lpj1.")
    arun(runner, main())


@pytest.mark.parametrize("name", ["../x", "", "UPPER", "a" * 64, "n\x00", "a/b"])
def test_revoke_refuses_what_is_no_certificate_name(runner, actl, name):
    async def main():
        revoked = actl.ca_dir / "revoked.json"
        before = revoked.read_text() if revoked.exists() else None
        await expect_status(actl.stub.Revoke(controller_pb2.RevokeRequest(node=name), timeout=RPC_TIMEOUT_S),
                            IA, "node to revoke", "lowercase letters")
        assert (revoked.read_text() if revoked.exists() else None) == before
        ok = await actl.stub.Revoke(controller_pb2.RevokeRequest(node="gone-node"), timeout=RPC_TIMEOUT_S)
        assert "gone-node revoked" in ok.message and json.loads(revoked.read_text()) == ["gone-node"]
    arun(runner, main())


@pytest.mark.parametrize("prompt", ["   ", "\n", "Hello"])
def test_submit_with_a_prompt_and_messages_is_invalid_argument(runner, actl, prompt):
    async def main():
        call = actl.stub.Submit(controller_pb2.SubmitRequest(
            prompt=prompt, messages=[controller_pb2.ChatMessage(role="user", content="Hi")]), timeout=RPC_TIMEOUT_S)
        await expect_status(call.read(), IA, "not a prompt and messages")
        call = actl.stub.Submit(controller_pb2.SubmitRequest(prompt="  "), timeout=RPC_TIMEOUT_S)
        await expect_status(call.read(), IA, "the prompt is empty")
        await still_serves(actl)
    arun(runner, main())


def test_join_on_the_main_port_is_unimplemented_naming_the_bootstrap_port(runner, actl, tmp_path):
    """In plaintext (the servicer has no Join), over mutual TLS (no role may call it there: the role
    check refuses it), and the bootstrap port's other methods."""
    from logicpipe.common.security import ca as tls_ca
    from logicpipe.common.security.bundle import Bundle
    from logicpipe.common.transport import PLAINTEXT, Transport
    from logicpipe.controller.mesh.join import JoinAuthority
    from logicpipe.controller.api.service import ControllerServicer, JoinServicer
    from logicpipe.policy import CONTROLLER_POLICY

    join = controller_pb2.JoinRequest(token_id="t", csr_pem=b"x", mac=bytes(32))
    ca = actl.ca_dir

    async def main():
        await expect_status(actl.stub.Join(join, timeout=RPC_TIMEOUT_S), UNIMPL, "bootstrap port (--join-listen) only")
        await still_serves(actl)
        served = Transport(Bundle.load(tls_ca.issue(ca, "ctl", "controller", tmp_path / "ctl")))
        for role in ("client", "stage", "controller"):
            caller = Transport(Bundle.load(tls_ca.issue(ca, f"a-{role}", role, tmp_path / role)))
            server = served.server(CONTROLLER_POLICY)
            controller_pb2_grpc.add_ControllerServicer_to_server(
                ControllerServicer(actl.ctl.app, actl.ctl.door, served), server)
            port = served.add_port(server, "127.0.0.1:0")
            await server.start()
            try:
                async with caller.channel(f"127.0.0.1:{port}", "controller") as ch:
                    stub = controller_pb2_grpc.ControllerStub(ch)
                    await expect_status(stub.Join(join, timeout=RPC_TIMEOUT_S), UNIMPL,
                                        "bootstrap port (--join-listen) only")
                    assert (await stub.Status(controller_pb2.ControllerStatusRequest(), timeout=RPC_TIMEOUT_S)).state
            finally:
                await server.stop(None)
        boot = PLAINTEXT.server()
        controller_pb2_grpc.add_ControllerServicer_to_server(JoinServicer(JoinAuthority(ca, actl.ctl.app.revocations)),
                                                             boot)
        port = boot.add_insecure_port("127.0.0.1:0")
        await boot.start()
        try:
            async with PLAINTEXT.channel(f"127.0.0.1:{port}", "controller") as ch:
                stub = controller_pb2_grpc.ControllerStub(ch)
                await expect_status(stub.Register(controller_pb2.RegisterRequest(address="127.0.0.1:5", node_id="n"),
                                                  timeout=RPC_TIMEOUT_S), UNIMPL, "Register is not served on this port")
                await expect_status(stub.Join(join, timeout=RPC_TIMEOUT_S), PD, "join token")  # served here
        finally:
            await boot.stop(None)
    arun(runner, main())


def test_register_calls_are_rate_capped_per_caller_and_a_real_stage_still_plans(model_dir):
    """300 plaintext Registers at once from one host: the first REGISTER_BURST (and what refills
    meanwhile) are admitted, the rest RESOURCE_EXHAUSTED naming the cap; a real stage then
    registers and is planned on."""
    from logicpipe.controller.api import service

    async def main():
        async with stage_node("rate-real") as real, controller(model_dir, [], start=False) as ctl:
            t0 = asyncio.get_running_loop().time()
            calls = await asyncio.gather(*(ctl.stub.Register(controller_pb2.RegisterRequest(
                address=f"{TEST_NET}.{1 + i % 250}:{50000 + i}", node_id=f"flood-{i}"), timeout=RPC_TIMEOUT_S)
                for i in range(300)), return_exceptions=True)
            took = asyncio.get_running_loop().time() - t0
            refused = [c for c in calls if isinstance(c, grpc.aio.AioRpcError)]
            assert all(c.code() == RE for c in refused), {c.code() for c in refused}
            assert "Register calls at once" in refused[0].details() and "\n" not in refused[0].details()
            admitted = 300 - len(refused)
            assert service.REGISTER_BURST <= admitted <= service.REGISTER_BURST + service.REGISTER_PER_S * took + 1
            await asyncio.sleep(1.5 / service.REGISTER_PER_S)  # a token refills
            ok = await ctl.stub.Register(controller_pb2.RegisterRequest(
                address=f":{real.address.rpartition(':')[2]}", node_id="rate-real"), timeout=RPC_TIMEOUT_S)
            assert ok.admitted
            await ctl.app.start()
            assert await ctl.app.wait_ready(120), ctl.app.state.reason
            assert [h.node_id for h in ctl.app.pipelines.stages] == ["rate-real"]
    run(main(), timeout=240)


AT_ONCE_S = 5.0  # a refusal's deadline: a call that hangs fails as DEADLINE_EXCEEDED, not as a slow answer
FLAWED_SUBMITS = {  # issue 34's flawed answers: SubmitRequest fields, fragments of the message
    "request-id-65-chars": (dict(request_id="r" * 65), ["request_id 'rrrr", "(65 characters)", "1 to 64 of"]),
    "request-id-a-path": (dict(request_id="../x"), ["request_id '../x'", "A-Z a-z 0-9 . _ -"]),
    "request-id-a-space": (dict(request_id="a b"), ["request_id 'a b'"]),
    "request-id-non-ascii": (dict(request_id="caf\u00e9"), ["request_id 'caf\u00e9'"]),
    "prefill-chunk-2^32-1": (dict(prefill_chunk=2**32 - 1), ["prefill_chunk", "not 4294967295", "the model's context"]),
    "json-schema-ref-itself": (dict(json_schema='{"$ref": "#"}'), ["json_schema", "can never be satisfied"]),
    "json-schema-required-self": (dict(json_schema=json.dumps({"type": "object", "properties": {"a": {"$ref": "#"}},
                                                               "required": ["a"]})), ["json_schema", "never ends"]),
    "json-schema-any-of-nothing": (dict(json_schema='{"anyOf": []}'), ["json_schema", "only the empty text"]),
    # fields that were dropped without a word: an outline's without outline, a plain request's with one
    "max-points-without-outline": (dict(max_points=4, sequential_points=True),
                                   ["max_points, sequential_points: for an outline request only"]),
    "outline-with-plain-fields": (dict(outline=True, ignore_eos=True, prefill_chunk=8),
                                  ["ignore_eos, prefill_chunk: not available for an outline request"]),
    "raw-with-token-ids": (dict(prompt="", prompt_token_ids=[1, 2], raw=True), ["raw is for a prompt text"]),
}


@pytest.mark.parametrize("case", list(FLAWED_SUBMITS))
def test_flawed_submits_are_invalid_argument_at_once(runner, actl, case):
    fields, fragments = FLAWED_SUBMITS[case]

    async def main():
        call = actl.stub.Submit(controller_pb2.SubmitRequest(**{"prompt": "Hello", "max_tokens": 4, **fields}),
                                timeout=AT_ONCE_S)
        await expect_status(call.read(), IA, *fragments)
        assert not actl.ctl.app.scheduler.requests
        await still_serves(actl)
    arun(runner, main())


def test_resume_past_what_a_request_can_have_is_invalid_argument_at_once(runner, actl):
    """A request waiting for a plan (this controller has no stages) with max_tokens 8: Resume with
    have_tokens 2^32 - 1 (or 9) is refused at once naming have_tokens, not left to wait for tokens
    that can never come; an id that is no request id is refused before it is looked up."""
    async def main():
        submitted = actl.stub.Submit(controller_pb2.SubmitRequest(prompt="Hello", max_tokens=8, request_id="wait-1"),
                                     timeout=60)
        reading = asyncio.ensure_future(submitted.read())
        try:
            deadline = asyncio.get_running_loop().time() + 20
            while "wait-1" not in actl.ctl.app.scheduler.requests:
                assert asyncio.get_running_loop().time() < deadline, "the request was not admitted"
                await asyncio.sleep(0.02)
            for have in (2**32 - 1, 9):
                call = actl.stub.Resume(controller_pb2.ResumeRequest(request_id="wait-1", have_tokens=have),
                                        timeout=AT_ONCE_S)
                await expect_status(call.read(), IA, f"have_tokens {have}", "its max_tokens is 8", "0 to 8")
            call = actl.stub.Resume(controller_pb2.ResumeRequest(request_id="a/../b"), timeout=AT_ONCE_S)
            await expect_status(call.read(), IA, "request_id 'a/../b'", "1 to 64 of")
            assert "wait-1" in actl.ctl.app.scheduler.requests  # a refused resume leaves it to its client
        finally:
            submitted.cancel()
            reading.cancel()
            with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
                await reading
        deadline = asyncio.get_running_loop().time() + 10
        while "wait-1" in actl.ctl.app.scheduler.requests:  # its client went away: it ends
            assert asyncio.get_running_loop().time() < deadline, "the cancelled request stayed"
            await asyncio.sleep(0.02)
        await still_serves(actl)
    arun(runner, main())


# ----------------------------------------------------------------------------- issue 34: the fence
def keyed(key: str) -> tuple:
    from logicpipe.policy import KEY_HEADER

    return ((KEY_HEADER, key),)


def test_an_assign_that_cannot_load_never_takes_the_fence(runner, tiny_model):
    """An Assign refused for its content (layers the model does not have: found only by loading)
    leaves the fence as it was: unheld stays unheld, and a holder stays the holder."""
    from .conftest import assign_request

    async def main():
        async with stage_node("unloaded") as node:
            fence = node.runtime.fence
            bad = assign_request(tiny_model.path, 0, TINY_LAYERS + 2, num_layers=TINY_LAYERS + 2,
                                 controller_id="rogue", controller_epoch=9)
            await expect_status(node.stub.Assign(bad, timeout=RPC_TIMEOUT_S, metadata=keyed("rogue")),
                                grpc.StatusCode.FAILED_PRECONDITION, "has 4 layers")
            assert fence.holder is None and fence.epoch == 0
            good = assign_request(tiny_model.path, controller_id="real", controller_epoch=1)
            await node.stub.Assign(good, timeout=RPC_TIMEOUT_S, metadata=keyed("real"))
            assert (fence.controller_id, fence.epoch) == ("real", 1)
            fence.lease_s = 0.0  # as if the holder were gone: a takeover may be tried (epoch 2, the next) ...
            bad.controller_epoch = 2**62
            await expect_status(node.stub.Assign(bad, timeout=RPC_TIMEOUT_S, metadata=keyed("rogue")),
                                grpc.StatusCode.FAILED_PRECONDITION, "FENCED", "only with epoch 2")
            bad.controller_epoch = 2  # ... and is refused for its content, holding nothing
            await expect_status(node.stub.Assign(bad, timeout=RPC_TIMEOUT_S, metadata=keyed("rogue")),
                                grpc.StatusCode.FAILED_PRECONDITION, "has 4 layers")
            assert (fence.controller_id, fence.epoch, node.runtime.engine.assignment.end) == ("real", 1, TINY_LAYERS)
    run(main())


def test_measure_link_dials_only_for_the_holder(runner, tiny_model):
    """A stage nobody holds dials nowhere (it used to connect to any listener a local caller
    named); a held one dials only for its holder."""
    from .conftest import assign_request

    async def main():
        with socket.socket() as listener:
            listener.bind(("127.0.0.1", 0))
            listener.listen()
            target = f"127.0.0.1:{listener.getsockname()[1]}"
            async with stage_node("dialer") as node:
                probe = stage_pb2.MeasureLinkRequest(target_address=target, controller_id="x", controller_epoch=2**62)
                await expect_status(node.stub.MeasureLink(probe, timeout=RPC_TIMEOUT_S, metadata=keyed("x")), PD,
                                    "none does yet")
                assert node.runtime.fence.holder is None  # measuring takes nothing either
                await node.stub.Assign(assign_request(tiny_model.path, controller_id="real", controller_epoch=1),
                                       timeout=RPC_TIMEOUT_S, metadata=keyed("real"))
                await expect_status(node.stub.MeasureLink(probe, timeout=RPC_TIMEOUT_S, metadata=keyed("x")), PD,
                                    "only from the controller that holds it")
                own = stage_pb2.MeasureLinkRequest(target_address=node.address, probes=2, payload_bytes=1024)
                ok = await node.stub.MeasureLink(own, timeout=RPC_TIMEOUT_S, metadata=keyed("real"))
                assert ok.latency_s > 0 and node.runtime.fence.controller_id == "real"
    run(main())


def test_pull_weights_serves_only_the_stages_this_controller_assigns(runner, actl):
    """PullWeights served tokenizer.json (and every tensor) to any anonymous caller; now only a
    caller showing the stream key of a plan this controller assigned gets anything."""
    from logicpipe.policy import STREAM_KEY_HEADER

    app = actl.ctl.app
    request = controller_pb2.PullWeightsRequest(model_digest=app.digest, files=["tokenizer.json", "config.json"])

    async def pull(metadata=None):
        return [c async for c in actl.stub.PullWeights(request, timeout=RPC_TIMEOUT_S, metadata=metadata)]

    async def main():
        for metadata in (None, ((STREAM_KEY_HEADER, "guessed"),), ((STREAM_KEY_HEADER, ""),)):
            await expect_status(pull(metadata), PD, "PullWeights serves only the stages this controller assigns")
        app.pipelines.identity.stream_keys.append("k" * 32)  # what Pipeline.install does for each plan
        chunks = await pull(((STREAM_KEY_HEADER, "k" * 32),))
        assert {c.name for c in chunks if c.is_file} >= {"config.json"}
        await still_serves(actl)
    arun(runner, main())


def test_replicate_streams_the_journal_only_to_the_named_standby(runner, actl):
    """Controller.Replicate streamed the whole journal (every running prompt's tokens) to any
    anonymous caller; now only to the standby that sends --peer-secret-file's secret (plaintext),
    and by default to nobody."""
    from dataclasses import replace

    from logicpipe.controller.jobs.standby import PEER_SECRET_HEADER

    app = actl.ctl.app
    secret = "s3cret-" + "x" * 25

    async def first_op(metadata=None):
        call = actl.stub.Replicate(controller_pb2.ReplicateRequest(follower="b"), timeout=RPC_TIMEOUT_S,
                                   metadata=metadata)
        try:
            return await call.read()
        finally:
            call.cancel()

    async def main():
        before = app.options
        try:
            await expect_status(first_op(), PD, "to no one", "--peer-secret-file")
            app.options = replace(before, peer_secret=secret.encode())
            await expect_status(first_op(), PD, "sent none")
            await expect_status(first_op(((PEER_SECRET_HEADER, secret[:-1] + "y"),)), PD, "does not match")
            assert (await first_op(((PEER_SECRET_HEADER, secret),))).kind == "snapshot"
        finally:
            app.options = before
        await still_serves(actl)
    arun(runner, main())


def test_replicate_over_tls_only_to_the_standby_certificate_and_secret_files_are_checked(tmp_path):
    from logicpipe.controller.jobs.standby import PeerAuth, read_peer_secret
    from logicpipe.errors import PermissionDenied

    with pytest.raises(PermissionDenied, match="--standby-name"):
        PeerAuth("", b"any secret at all").check(True, "ctl-b", ())  # a secret proves nothing over TLS
    with pytest.raises(PermissionDenied, match="'ctl-rogue' is not it"):
        PeerAuth("ctl-b").check(True, "ctl-rogue", ())
    PeerAuth("ctl-b").check(True, "ctl-b", ())
    good, short, missing = tmp_path / "good", tmp_path / "short", tmp_path / "missing"
    good.write_text("a" * 32 + "\n")
    short.write_text("abc\n")
    assert read_peer_secret(str(good)) == b"a" * 32
    for path, phrase in ((short, "16 to"), (missing, "cannot read")):
        with pytest.raises(ValueError, match=phrase):
            read_peer_secret(str(path))


def test_an_active_whose_probe_finds_a_newer_epoch_steps_down_at_once(runner, actl, tiny_model):
    """After a SIGSTOP the active's first membership probe sees its stage held by another
    controller of a newer epoch (the standby took over meanwhile): it steps down at once instead
    of serving on; a stage it still holds changes nothing."""
    from logicpipe.stage_node.net.fence import Caller

    app = actl.ctl.app
    stepped: list[str] = []

    async def main():
        async with stage_node("probed") as node:
            before = (app.pipelines.epoch, app.fenced, list(app.on_step_down))
            app.on_step_down.append(lambda: stepped.append(app.fenced))
            try:
                app.pipelines.epoch = 3
                node.runtime.fence.take(Caller("", app.pipelines.identity.metadata[0][1]), app.pipelines.owner, 3)
                st = await app._probe(node.address, timeout=RPC_TIMEOUT_S)
                assert st.controller_epoch == 3 and not app.fenced and not stepped
                node.runtime.fence.lease_s = 0.0
                node.runtime.fence.take(Caller("", "standby-key"), "controller-b", 4)  # the takeover
                await app._probe(node.address, timeout=RPC_TIMEOUT_S)
                assert stepped and "controller-b of epoch 4" in app.fenced
            finally:
                app.pipelines.epoch, app.fenced, app.on_step_down[:] = before[0], before[1], before[2]
    arun(runner, main())


def test_a_standby_does_not_take_over_without_a_majority_of_the_stages_or_under_a_newer_epoch(runner, actl):
    from logicpipe.common.transport import PLAINTEXT
    from logicpipe.controller.jobs.standby import Standby
    from logicpipe.stage_node.net.fence import Caller

    from .conftest import closed_port_address

    app = actl.ctl.app

    async def main():
        async with stage_node("s1") as s1, stage_node("s2") as s2:
            standby = Standby(app, [closed_port_address()], PLAINTEXT)
            standby.nodes = {"s1": s1.address, "gone1": closed_port_address(), "gone2": closed_port_address()}
            assert "reaches 1 of the plan's 3 stages, no majority" in await standby._cannot_take_over()
            standby.nodes = {"s1": s1.address, "s2": s2.address, "gone": closed_port_address()}
            assert await standby._cannot_take_over() == ""
            s2.runtime.fence.take(Caller("", "k"), "controller-c", app.journal.epoch + 1)  # another took over
            assert "follows controller controller-c" in await standby._cannot_take_over()
    arun(runner, main())


def test_a_controller_whose_journal_was_lost_is_readmitted_by_the_operator(runner, model_dir):
    """The stages remember epoch 7; a controller started on an empty journal would take epoch 1
    and be refused by every stage. With --readmit (ControllerApp.readmit) it takes 8, which a stage
    whose holder's lease expired accepts."""
    from logicpipe.errors import Fenced
    from logicpipe.stage_node.net.fence import Caller

    async def main():
        async with stage_node("remembers") as node:
            fence = node.runtime.fence
            fence.take(Caller("", "the lost controller's key"), "controller-lost", 7)
            fence.lease_s = 0.0  # the lost controller is gone
            async with controller(model_dir, [node.address], start=False) as ctl:
                me = Caller("", ctl.app.pipelines.identity.metadata[0][1])
                assert ctl.app.journal.epoch + 1 == 1
                with pytest.raises(Fenced):
                    fence.may_take(me, ctl.app.pipelines.owner, 1)  # locked out without it
                assert await ctl.app.readmit() == 7
                ctl.app.take_journal()
                assert ctl.app.pipelines.epoch == 8
                fence.take(me, ctl.app.pipelines.owner, ctl.app.pipelines.epoch)
                assert fence.controller_id == ctl.app.pipelines.owner
            async with controller(model_dir, [], start=False) as ctl:
                with pytest.raises(ValueError, match="--nodes"):
                    await ctl.app.readmit()
    arun(runner, main())
