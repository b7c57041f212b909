"""Mesh tier, the OpenAI-compatible HTTP API (`logicpipe-controller --http`, with API keys from
`--http-token-file`), with the official `openai` package as the client: greedy output equal to the
same request through `lpctl --json`, streaming, multi-turn, completions, the models list, bad
requests, a missing or wrong key refused with 401, 16 concurrent streams, and a client gone
mid-stream leaving no sequence behind."""
from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from logicpipe.v1 import stage_pb2, stage_pb2_grpc
from tests.localmesh import LocalMesh, client_transport, free_port

PROMPT = "What is the capital of France?"
TOKEN = "tester-" + "t" * 32     # the API key of this module's clients
OTHER = "other-" + "o" * 32      # another key of the same file


@pytest.fixture(scope="module")
def mesh(model_dir, tmp_path_factory):
    http = f"127.0.0.1:{free_port()}"
    work = tmp_path_factory.mktemp("http")
    keys = work / "http-keys"
    keys.write_text(f"# API keys of the test\ntester {TOKEN}\nother {OTHER}\n")
    os.chmod(keys, 0o600)
    with LocalMesh(2, model_dir, work, threads=1, controller_args=("--http", http, "--http-token-file", str(keys))) as m:
        m.http = http
        yield m


@pytest.fixture(scope="module")
def client(mesh):
    return openai.OpenAI(base_url=f"http://{mesh.http}/v1", api_key=TOKEN, max_retries=0, timeout=300)


def lpctl_json(mesh, *args: str) -> dict:
    out = subprocess.run([*mesh.lpctl(), "submit", *args, "--json"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_models_and_health(mesh, client, model_dir):
    assert [m.id for m in client.models.list().data] == [model_dir.name]
    with urllib.request.urlopen(f"http://{mesh.http}/health", timeout=10) as r:
        assert r.status == 200 and json.loads(r.read())["status"] == "ok"


def test_chat_completion_equals_lpctl(mesh, client):
    want = lpctl_json(mesh, PROMPT, "--max-tokens", "16")
    r = client.chat.completions.create(model=mesh.model_dir.name, messages=[{"role": "user", "content": PROMPT}],
                                       max_tokens=16, temperature=0)
    assert r.choices[0].message.content == want["text"] and r.choices[0].message.role == "assistant"
    assert r.usage.completion_tokens == len(want["token_ids"]) and r.usage.prompt_tokens > 0
    assert r.choices[0].finish_reason in ("stop", "length")
    # streamed: the same text in chunks, a finish reason, then [DONE] (the client ends the iteration)
    chunks = list(client.chat.completions.create(model=mesh.model_dir.name, max_tokens=16, temperature=0, stream=True,
                                                 messages=[{"role": "user", "content": PROMPT}]))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want["text"]
    assert chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason and len(chunks) > 2


def test_multi_turn_and_completions(mesh, client):
    messages = [{"role": "system", "content": "You answer in one short sentence."},
                {"role": "user", "content": "Name a primary colour."},
                {"role": "assistant", "content": "Red is a primary colour."},
                {"role": "user", "content": "Name another one."}]
    a = client.chat.completions.create(model=mesh.model_dir.name, messages=messages, max_tokens=12, temperature=0)
    b = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=mesh.model_dir.name, messages=messages, max_tokens=12, temperature=0, stream=True))
    assert a.choices[0].message.content == b and b.strip()
    want = lpctl_json(mesh, "The capital of France is", "--raw", "--max-tokens", "8")
    c = client.completions.create(model=mesh.model_dir.name, prompt="The capital of France is", max_tokens=8,
                                  temperature=0)
    assert c.choices[0].text == want["text"] and c.usage.completion_tokens == len(want["token_ids"])
    # a stop string ends the text before it
    s = client.completions.create(model=mesh.model_dir.name, prompt="The capital of France is", max_tokens=8,
                                  temperature=0, stop=[want["text"].strip()[-2:]])
    assert s.choices[0].finish_reason == "stop" and want["text"].startswith(s.choices[0].text)


def post(mesh, path: str, data: bytes, token: str | None = TOKEN) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
    req = urllib.request.Request(f"http://{mesh.http}{path}", data=data, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read()) | {"headers": dict(err.headers)}


def test_v1_needs_one_of_the_keys(mesh, model_dir):
    """No key or a wrong one: 401 with an OpenAI error and WWW-Authenticate, before the body is
    looked at; each key of the file is served; /health and /metrics need none (tested above and
    below)."""
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode()
    for token in (None, "wrong-" + "w" * 32):
        code, answer = post(mesh, "/v1/chat/completions", body, token)
        assert code == 401 and answer["error"]["code"] == "invalid_api_key", answer
        assert answer["headers"]["WWW-Authenticate"].startswith("Bearer")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"http://{mesh.http}/v1", api_key="x" * 32, max_retries=0).models.list()
    other = openai.OpenAI(base_url=f"http://{mesh.http}/v1", api_key=OTHER, max_retries=0, timeout=300)
    assert other.chat.completions.create(model=model_dir.name, messages=[{"role": "user", "content": "hi"}],
                                         max_tokens=2, temperature=0).usage.completion_tokens >= 1


def test_bad_requests_get_openai_errors_and_the_mesh_serves_on(mesh, client):
    code, body = post(mesh, "/v1/chat/completions", b"{not json")
    assert code == 400 and body["error"]["type"] == "invalid_request_error" and "JSON" in body["error"]["message"]
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "hi"}])
    assert "does not exist" in info.value.message
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.chat.completions.create(model=mesh.model_dir.name, messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=-1)
    with pytest.raises(openai.BadRequestError, match="context"):
        client.completions.create(model=mesh.model_dir.name, prompt="word " * 9000, max_tokens=4)
    code, body = post(mesh, "/v1/chat/completions", json.dumps({"messages": [{"role": "robot", "content": "hi"}]}).encode())
    assert code == 400 and "role" in body["error"]["message"]
    r = client.chat.completions.create(model=mesh.model_dir.name, messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=4, temperature=0)
    assert r.usage.completion_tokens >= 1


def open_sessions(mesh) -> int:
    total = 0
    for addr in mesh.stage_addresses:
        with client_transport().sync_channel(addr, "stage") as ch:
            total += stage_pb2_grpc.StageNodeStub(ch).Status(stage_pb2.StatusRequest(), timeout=10).open_sessions
    return total


def test_16_concurrent_streams_and_a_client_gone_mid_stream(mesh, client):
    def one(i: int) -> str:
        stream = client.chat.completions.create(model=mesh.model_dir.name, max_tokens=12, temperature=0, stream=True,
                                                messages=[{"role": "user", "content": f"Count to {i + 3}."}])
        return "".join(c.choices[0].delta.content or "" for c in stream)

    with ThreadPoolExecutor(16) as pool:
        texts = list(pool.map(one, range(16)))
    assert all(t for t in texts)
    # a client that reads two chunks of a long answer and hangs up
    stream = client.chat.completions.create(model=mesh.model_dir.name, max_tokens=400, stream=True,
                                            extra_body={"ignore_eos": True},
                                            messages=[{"role": "user", "content": "Tell me a very long story."}])
    it = iter(stream)
    next(it), next(it)
    assert open_sessions(mesh) >= 1
    stream.close()
    deadline = time.monotonic() + 30
    while open_sessions(mesh):
        assert time.monotonic() < deadline, "a sequence was left behind on a stage"
        time.sleep(0.2)


def scrape(mesh) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://{mesh.http}/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[s.name + "".join(f"{{{k}={v}}}" for k, v in sorted(s.labels.items()))] = s.value
    return out


def test_metrics_parse_and_move(mesh, client):
    before = scrape(mesh)
    client.chat.completions.create(model=mesh.model_dir.name, messages=[{"role": "user", "content": PROMPT}],
                                   max_tokens=6, temperature=0)
    after = scrape(mesh)
    assert after["logicpipe_requests_total{outcome=completed}"] == before["logicpipe_requests_total{outcome=completed}"] + 1
    assert after["logicpipe_tokens_total{direction=out}"] >= before["logicpipe_tokens_total{direction=out}"] + 1
    assert after["logicpipe_tokens_total{direction=in}"] > before["logicpipe_tokens_total{direction=in}"]
    assert after["logicpipe_time_to_first_token_seconds_count"] == before["logicpipe_time_to_first_token_seconds_count"] + 1
    assert after["logicpipe_inter_token_latency_seconds_count"] >= 1
    stages = [k for k in after if k.startswith("logicpipe_stage_step_seconds{node=")]
    assert len(stages) == 2 and all(after[k] > 0 for k in stages)
    assert any(k.startswith("logicpipe_stage_kv_blocks_used{node=") for k in after)
    assert "logicpipe_active_sequences" in after and "logicpipe_replans_total" in after
    assert any(k.startswith("logicpipe_link_latency_seconds{") for k in after)


def test_lpctl_chat_keeps_the_history_and_ctrl_c_stops_only_the_answer(mesh, client):
    """Two turns through `lpctl chat` (stdin): the second answer is what the same conversation gives
    through the HTTP API; then a long answer interrupted with SIGINT: the program goes on to the
    next turn and ends on EOF with status 0."""
    import signal

    turns = ["Name a primary colour.", "Name another one."]
    proc = subprocess.run([*mesh.lpctl(), "chat", "--max-tokens", "12"], input="\n".join(turns) + "\n",
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr

    def answer(msgs):
        return client.chat.completions.create(model=mesh.model_dir.name, messages=msgs, max_tokens=12,
                                              temperature=0).choices[0].message.content

    first = answer([{"role": "user", "content": turns[0]}])
    second = answer([{"role": "user", "content": turns[0]}, {"role": "assistant", "content": first},
                     {"role": "user", "content": turns[1]}])
    assert proc.stdout == f"{first}\n{second}\n" and first.strip() and second.strip()
    # Ctrl-C during an answer
    # SIGINT as a terminal gives it: a suite run in the background (`cmd &`) ignores SIGINT, and a
    # child Python that starts with it ignored never raises KeyboardInterrupt
    p = subprocess.Popen([*mesh.lpctl(), "chat", "--max-tokens", "400"], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        p.stdin.write("Tell me a very long story about a dragon.\n")
        p.stdin.flush()
        p.stdout.read(20)  # the answer is streaming
        p.send_signal(signal.SIGINT)
        out, err = p.communicate("Say hi.\n", timeout=120)
    finally:
        p.kill()
    assert p.returncode == 0, err
    assert "[stopped]" in out and out.count("\n") >= 2


def test_an_outline_request_over_http(mesh, client):
    """`outline: true` as an extra field: the answer is the outline's points in order, and the
    response carries them (at least 2, dependencies only on earlier points)."""
    r = client.chat.completions.create(model=mesh.model_dir.name, max_tokens=24, temperature=0,
                                       messages=[{"role": "user", "content": "Explain how a bicycle works."}],
                                       extra_body={"outline": True, "max_points": 4})
    points = r.model_extra["outline"]
    assert len(points) >= 2 and all(p["text"] for p in points)
    assert all(d < p["id"] for p in points for d in p["deps"])
    assert r.choices[0].message.content.startswith("1. ") and r.usage.completion_tokens > 0
