"""Mesh tier, the one front door: the HTTP API and gRPC Submit refuse the same over-size prompt and
the same excess of one client's requests, each with its own status; a 20 MiB HTTP body does not
hold up another client's tokens by more than a step."""
from __future__ import annotations

import statistics
import subprocess
import sys
import time

import grpc
import openai
import pytest

from logicpipe.controller.jobs.rules import MAX_PROMPT_CHARS
from logicpipe.v1 import controller_pb2, controller_pb2_grpc
from tests.localmesh import LocalMesh, free_port

CAP = 2  # --max-requests-per-client


@pytest.fixture(scope="module")
def mesh(model_dir, tmp_path_factory):
    http = f"127.0.0.1:{free_port()}"
    with LocalMesh(1, model_dir, tmp_path_factory.mktemp("door"), threads=1,
                   controller_args=("--http", http, "--max-requests-per-client", str(CAP))) as m:
        m.http = http
        yield m


@pytest.fixture(scope="module")
def client(mesh):
    return openai.OpenAI(base_url=f"http://{mesh.http}/v1", api_key="none", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def stub(mesh):
    with mesh.transport.sync_channel(mesh.controller_address, "controller") as ch:
        yield controller_pb2_grpc.ControllerStub(ch)


def grpc_error(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value


def long_submit(stub):
    """A streaming Submit that runs until cancelled (its first token already here)."""
    call = stub.Submit(controller_pb2.SubmitRequest(prompt="Tell me a long story.", max_tokens=500, ignore_eos=True),
                       timeout=300)
    next(call)
    return call


def test_both_doors_refuse_the_same_oversize_prompt(mesh, client, stub):
    prompt = "x" * (MAX_PROMPT_CHARS + 1)
    err = grpc_error(lambda: list(stub.Submit(controller_pb2.SubmitRequest(prompt=prompt, raw=True, max_tokens=4),
                                              timeout=60)))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "over the cap" in err.details()
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=mesh.model_dir.name, prompt=prompt, max_tokens=4)
    assert info.value.status_code == 400 and info.value.body["message"] == err.details()


def test_both_doors_refuse_the_same_excess_of_one_client(mesh, client, stub):
    """CAP requests of one client run; one more is refused (429 / RESOURCE_EXHAUSTED) with the same
    reason, naming the flag; once they end, the client is served again."""
    streams = [client.completions.create(model=mesh.model_dir.name, prompt="Once upon a time", max_tokens=500,
                                         stream=True, extra_body={"ignore_eos": True}) for _ in range(CAP)]
    try:
        for s in streams:
            next(iter(s))
        with pytest.raises(openai.RateLimitError) as info:
            client.completions.create(model=mesh.model_dir.name, prompt="Hi", max_tokens=2)
        http_reason = info.value.body["message"]
    finally:
        for s in streams:
            s.close()
    calls = [long_submit(stub) for _ in range(CAP)]
    try:
        err = grpc_error(lambda: next(stub.Submit(controller_pb2.SubmitRequest(prompt="Hi", max_tokens=2), timeout=60)))
    finally:
        for c in calls:
            c.cancel()
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    who_http, _, rest_http = http_reason.partition(" has ")
    who_grpc, _, rest_grpc = err.details().partition(" has ")
    assert rest_http == rest_grpc and f"{CAP} requests running" in rest_grpc and "--max-requests-per-client" in rest_grpc
    assert who_http == "host 127.0.0.1" and who_grpc == "client:client"
    deadline = time.monotonic() + 30  # the cancelled requests end, and the client is served again
    while True:
        try:
            r = client.completions.create(model=mesh.model_dir.name, prompt="Hi", max_tokens=2, temperature=0)
            break
        except openai.RateLimitError:
            assert time.monotonic() < deadline, "the cancelled requests still count against the client"
            time.sleep(0.2)
    assert r.usage.completion_tokens >= 1


# client B, a process of its own (a real other client: its sending costs the test process nothing)
SENDER = """
import http.client, sys
host, port = sys.argv[1].split(":")
body = b'{"prompt": "' + b"x" * (20 * 2**20 - 32) + b'", "max_tokens": 1}'
parts = [body[i: i + 2**20] for i in range(0, len(body), 2**20)]
print("ready", flush=True)
sys.stdin.readline()  # go
for chunked in (False, False, True):
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        if chunked:
            conn.request("POST", "/v1/completions", body=iter(parts), encode_chunked=True,
                         headers={"Content-Type": "application/json"})
        else:
            conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
        print(conn.getresponse().status, flush=True)
    except ConnectionError as exc:  # refused before the whole body went out
        print(type(exc).__name__, flush=True)
    finally:
        conn.close()
"""


def test_a_20_mib_body_does_not_hold_up_another_clients_tokens(mesh, client):
    """Client A streams a long answer; after its first 40 tokens client B sends 20 MiB bodies (with
    and without a length), each refused with 413. A's tokens keep coming: no gap while B sends is
    longer than A's usual gap (a step) by more than a step, or by more than the worst A saw before
    (but one: a single late token)."""
    arrivals: list[float] = []
    sender = subprocess.Popen([sys.executable, "-c", SENDER, mesh.http], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert sender.stdout.readline().strip() == "ready"  # B's body is built before A begins
        stream = client.completions.create(model=mesh.model_dir.name, prompt="Once upon a time", max_tokens=160,
                                           temperature=0, stream=True, extra_body={"ignore_eos": True})
        done_at = None  # how many tokens A had when B was done
        for _ in stream:
            arrivals.append(time.monotonic())
            if len(arrivals) == 40:
                sender.stdin.write("go\n")
                sender.stdin.flush()
            if done_at is None and len(arrivals) > 40 and sender.poll() is not None:
                done_at = len(arrivals)
        out = sender.communicate(timeout=120)[0]
    finally:
        sender.kill()
    assert out.split() == ["413", "413", "413"], out
    assert done_at is not None, "B was still sending when A's answer ended"
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    before, during = gaps[5:39], gaps[39:done_at]
    step = statistics.median(before)
    # the second longest: a body that held the loop up would do it once per body (three times), while
    # one late token can be the machine's other work (the suite runs two test files at once)
    second = sorted(during)[-2]
    assert second - step <= max(step, max(before) - step), (
        f"gaps of {', '.join(f'{g * 1e3:.0f}' for g in sorted(during)[-3:])} ms while the bodies came in; "
        f"usual {step * 1e3:.0f} ms, longest before {max(before) * 1e3:.0f} ms")
