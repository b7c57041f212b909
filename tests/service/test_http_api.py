"""Service tier, the HTTP API in-process (tests/service/http_harness.py: the real front door and
tokenizer over a fake scheduler): what a probe of issue 23 found, as regressions. Each bad input is
answered with its status and an OpenAI error body naming the field; a body over the cap is refused
from its header before it is read, also when the client asks `Expect: 100-continue`; /v1/* takes
only a valid API key; the per-client cap counts each key (and a body being read) and answers 429
naming the flag."""
from __future__ import annotations

import asyncio
import json
import time

import pytest

from logicpipe.controller.api.http_api import MAX_BODY_BYTES
from logicpipe.controller.api.http_auth import ApiKeys, parse
from logicpipe.errors import ResourceExhausted

from .conftest import run
from .http_harness import http_api, tokenizer

TOKEN_A, TOKEN_B = "a" * 32, "b" * 32
KEYS = ApiKeys(parse(f"alice {TOKEN_A}\nbob {TOKEN_B}\n"))
AUTH_A = {"Authorization": f"Bearer {TOKEN_A}"}
AUTH_B = {"Authorization": f"Bearer {TOKEN_B}"}
CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


def chat(**fields) -> bytes:
    return json.dumps({"messages": MESSAGES, "max_tokens": 4, **fields}).encode()


def openai_error(body) -> dict:
    """The error of an OpenAI error body (asserting its shape)."""
    assert isinstance(body, dict) and set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"} and isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str)
    return err


BAD = [  # (what, path, raw body, status, param: None for "not asserted")
    ("100,000 [", CHAT, b"[" * 100_000, 400, None),
    ("nested 40 deep", CHAT, chat(user=None)[:-1] + b', "stop": ' + b"[" * 40 + b"]" * 40 + b"}", 400, "stop" + "[0]" * 31),
    ("a lone surrogate", CHAT, b'{"messages": [{"role": "user", "content": "hi \\ud800"}]}', 400, "messages[0].content"),
    ("a lone surrogate in a stop", CHAT, chat()[:-1] + b', "stop": ["\\udfff"]}', 400, "stop[0]"),
    ("stream \"yes\"", CHAT, chat(stream="yes"), 400, "stream"),
    ("ignore_eos \"false\"", CHAT, chat(ignore_eos="false"), 400, "ignore_eos"),
    ("outline 1", CHAT, chat(outline=1), 400, "outline"),
    ("include_usage \"true\"", CHAT, chat(stream=True, stream_options={"include_usage": "true"}), 400,
     "stream_options.include_usage"),
    ("stream_options without stream", CHAT, chat(stream_options={"include_usage": True}), 400, "stream_options"),
    ("frequency_penalty NaN", CHAT, chat()[:-1] + b', "frequency_penalty": NaN}', 400, "frequency_penalty"),
    ("temperature Infinity", CHAT, chat()[:-1] + b', "temperature": Infinity}', 400, "temperature"),
    ("top_p -Infinity", "/v1/completions", b'{"prompt": "hi", "top_p": -Infinity}', 400, "top_p"),
    ("a NaN token id", "/v1/completions", b'{"prompt": [1, NaN]}', 400, "prompt[1]"),
    ("frequency_penalty 2.5", CHAT, chat(frequency_penalty=2.5), 400, "frequency_penalty"),
    ("presence_penalty -3", CHAT, chat(presence_penalty=-3), 400, "presence_penalty"),
    ("presence_penalty \"1\"", CHAT, chat(presence_penalty="1"), 400, "presence_penalty"),
    ("logprobs 1 (chat)", CHAT, chat(logprobs=1), 400, "logprobs"),
    ("logprobs true (completions)", "/v1/completions", b'{"prompt": "hi", "logprobs": true}', 400, "logprobs"),
    ("logprobs 21 (completions)", "/v1/completions", b'{"prompt": "hi", "logprobs": 21}', 400, "logprobs"),
    ("top_logprobs without logprobs", CHAT, chat(top_logprobs=3), 400, "top_logprobs"),
    ("top_logprobs 21", CHAT, chat(logprobs=True, top_logprobs=21), 400, "top_logprobs"),
    ("top_logprobs on completions", "/v1/completions", b'{"prompt": "hi", "top_logprobs": 2}', 400, "top_logprobs"),
    ("logprobs of an outline", CHAT, chat(logprobs=True, outline=True), 400, "logprobs"),
    ("stop with an outline", CHAT, chat(stop=["x"], outline=True), 400, None),  # was dropped without a word
    ("two different token caps", CHAT, chat(max_completion_tokens=8), 400, "max_tokens"),  # (one was dropped)
    ("echo on chat", CHAT, chat(echo=True), 400, "echo"),
    ("max_tokens 0 without echo", "/v1/completions", b'{"prompt": "hi", "max_tokens": 0}', 400, "max_tokens"),
    ("echo \"true\"", "/v1/completions", b'{"prompt": "hi", "echo": "true"}', 400, "echo"),
    ("n 17", CHAT, chat(n=17), 400, "n"),
    ("n 0", CHAT, chat(n=0), 400, "n"),
    ("n 2 with echo", "/v1/completions", b'{"prompt": "hi", "n": 2, "echo": true}', 400, "echo"),
    ("response_format xml", CHAT, chat(response_format={"type": "xml"}), 400, "response_format"),
    ("response_format bad schema", CHAT, chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "nope"}}}), 400, "response_format"),
    ("tools bad name", CHAT, chat(tools=[{"type": "function", "function": {"name": "f g"}}]), 400, "tools[0]"),
    ("tool_choice unknown", CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}],
                                       tool_choice={"type": "function", "function": {"name": "g"}}), 400, "tool_choice"),
    ("logit_bias of a word", CHAT, chat(logit_bias={"hello": -100}), 400, "logit_bias.hello"),
    ("logit_bias 101", CHAT, chat(logit_bias={"5": 101}), 400, "logit_bias.5"),
    ("logit_bias a list", CHAT, chat(logit_bias=[5, 1]), 400, "logit_bias"),
    ("logit_bias past the vocabulary", CHAT, chat(logit_bias={"99999999": 1}), 400, None),
    ("an unknown parameter", CHAT, chat(repetition_penalty=1.2), 400, "repetition_penalty"),
    ("prompt on chat", CHAT, chat(prompt="hi"), 400, "prompt"),
    ("an image part", CHAT, json.dumps({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}).encode(), 400, "messages[0].content[0]"),
    ("a message's name", CHAT, json.dumps({"messages": [{"role": "user", "content": "hi", "name": "x"}]}).encode(),
     400, "messages[0].name"),
    ("a batch of 65 prompts", "/v1/completions", json.dumps({"prompt": ["a"] * 65}).encode(), 400, "prompt"),
    ("an empty prompt in a batch", "/v1/completions", b'{"prompt": ["a", ""]}', 400, "prompt[1]"),
    ("a role of another name", CHAT, json.dumps({"messages": [{"role": "function", "content": "x"}]}).encode(), 400,
     "messages[0].role"),
    ("max_points without outline", CHAT, chat(max_points=3), 400, "max_points"),
    ("max_tokens 1e400 (an integer)", CHAT, chat(max_tokens=10**400), 400, None),
    ("temperature 10^400", CHAT, chat(temperature=10**400), 400, "temperature"),
    ("a model that is a number", CHAT, chat(model=7), 400, "model"),
    ("not JSON", CHAT, b"{not json", 400, None),
    ("not UTF-8", CHAT, b'{"messages": "\xff\xfe"}', 400, None),
    ("a JSON array", CHAT, b"[1, 2]", 400, None),
    ("another model", CHAT, chat(model="gpt-9"), 404, "model"),
]


@pytest.mark.parametrize("what,path,raw,status,param", BAD, ids=[b[0] for b in BAD])
def test_a_bad_body_is_answered_with_its_status_naming_the_field(model_dir, what, path, raw, status, param):
    async def go():
        async with http_api(model_dir) as (client, _):
            got, _, body = await client.post(path, data=raw, headers={"Content-Type": "application/json"})
            err = openai_error(body)
            assert got == status, (what, body)
            if param is not None:
                assert err["param"] == param, err
                assert param.split("[")[0].split(".")[-1] in err["message"], err
            # and the API serves on
            assert (await client.post(CHAT, data=chat()))[0] == 200
    run(go())


def test_the_no_op_values_of_unimplemented_parameters_are_taken(model_dir):
    """What clients send by default (logprobs false, penalties 0, n 1, user ...) is no request for
    anything: served as without it."""
    async def go():
        async with http_api(model_dir) as (client, _):
            fields = dict(logprobs=False, frequency_penalty=0, presence_penalty=0.0, n=1, user="u1", logit_bias={},
                          response_format={"type": "text"}, tool_choice="none", top_logprobs=None, stream=False)
            status, _, body = await client.post(CHAT, data=chat(**fields))
            assert status == 200 and body["choices"][0]["message"]["content"], body
            status, _, body = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2,
                                                                          "echo": False, "best_of": 1, "logprobs": None})
            assert status == 200 and body["choices"][0]["text"], body
    run(go())


def test_stream_options_include_usage_adds_a_last_usage_chunk(model_dir):
    async def go():
        async with http_api(model_dir) as (client, _):
            status, _, text = await client.post(CHAT, data=chat(stream=True, stream_options={"include_usage": True}))
            assert status == 200 and text.endswith("data: [DONE]\n\n")
            events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
            last = events[-1]
            assert last["choices"] == [] and last["usage"]["completion_tokens"] == 4
            assert events[-2]["choices"][0]["finish_reason"] == "length"
    run(go())


async def raw_request(port: int, head: bytes, body: bytes = b"", wait_s: float = 5.0) -> tuple[bytes, float]:
    """What the server answers first to `head` (+ `body`) on a fresh connection, and how fast."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        t0 = time.monotonic()
        writer.write(head + body)
        await writer.drain()
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = await asyncio.wait_for(reader.read(65536), wait_s)
            if not chunk:
                break
            data += chunk
        return data, time.monotonic() - t0
    finally:
        writer.close()


def test_a_declared_body_over_the_cap_gets_413_at_once_before_it_is_read(model_dir):
    """Content-Length 10^12: 413 at once (a few bytes of the body sent, the rest never); with
    `Expect: 100-continue` the 413 comes instead of the 100 (the body is never asked for)."""
    async def go():
        async with http_api(model_dir) as (client, _):
            for expect in (b"", b"Expect: 100-continue\r\n"):
                head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" + expect
                        + b"Content-Length: 1000000000000\r\n\r\n")
                data, took = await raw_request(client.port, head, b"" if expect else b'{"messages": [')
                assert data.startswith(b"HTTP/1.1 413 "), data[:200]
                assert b"Connection: close" in data and took < 2.0, (data[:300], took)
            # under the cap, Expect gets its 100 and the request is served
            body = chat()
            head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
                    b"Content-Length: %d\r\n\r\n" % len(body))
            data, _ = await raw_request(client.port, head)
            assert data.startswith(b"HTTP/1.1 100 Continue"), data[:100]
    run(go())


def test_a_chunked_body_over_the_cap_gets_413(model_dir):
    async def go():
        async with http_api(model_dir) as (client, _):
            async def chunks():
                piece = b'{"messages": [{"role": "user", "content": "' + b"x" * 2**20
                yield piece
                for _ in range(MAX_BODY_BYTES // 2**20 + 1):
                    yield b"x" * 2**20
            status, _, body = await client.post(CHAT, data=chunks())
            assert status == 413 and "cap" in openai_error(body)["message"]
    run(go())


def test_v1_needs_a_key_health_does_not(model_dir):
    async def go():
        async with http_api(model_dir, keys=KEYS) as (client, fake):
            for headers in ({}, {"Authorization": "Bearer " + "c" * 32}, {"Authorization": TOKEN_A},
                            {"Authorization": f"Basic {TOKEN_A}"}):
                for method, path in (("POST", CHAT), ("GET", "/v1/models"), ("GET", "/v1/requests/abc/stream"),
                                     ("GET", "/v1/nothing")):
                    status, hdrs, body = await client.request(method, path, data=chat(), headers=headers)
                    err = openai_error(body)
                    assert status == 401 and err["code"] == "invalid_api_key", (path, headers, body)
                    assert err["type"] == "authentication_error" and "--http-token-file" in err["message"]
                    assert hdrs["WWW-Authenticate"].startswith("Bearer")
            # refused before the body: Expect gets the 401 instead of the 100
            head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
                    b"Content-Length: 100\r\n\r\n")
            data, _ = await raw_request(client.port, head)
            assert data.startswith(b"HTTP/1.1 401 "), data[:100]
            status, _, body = await client.post(CHAT, data=chat(), headers=AUTH_A)
            assert status == 200 and body["choices"][0]["message"]["content"]
            status, _, body = await client.get("/v1/models", headers={"Authorization": f"bearer {TOKEN_B}"})
            assert status == 200 and body["data"]
            status, _, body = await client.get("/health")
            assert status == 200 and body["status"] == "ok" and body["journal"].startswith("in memory")
            # a journal that cannot be written (as its writer records a failed commit): not healthy
            fake.journal.failure = ResourceExhausted("the request journal in /s cannot be written (full)")
            status, _, body = await client.get("/health")
            assert status == 503 and body["status"] == "journal_failing", body
            assert body["journal"] == "failing: the request journal in /s cannot be written (full)", body
    run(go())


def test_the_cap_per_client_counts_each_key_and_answers_429_naming_the_flag(model_dir):
    """--max-requests-per-client 2: two held streams of one key, a third request of that key is
    429 (also one whose body is still on its way); the other key is served; once they end, the
    first is served again."""
    async def go():
        async with http_api(model_dir, requests_per_client=2, keys=KEYS) as (client, fake):
            fake.gate.clear()  # held after their first token
            held = [asyncio.create_task(client.post(CHAT, data=chat(stream=True), headers=AUTH_A)) for _ in range(2)]
            deadline = time.monotonic() + 10
            while len(fake.requests) < 2:
                assert time.monotonic() < deadline, "the held requests did not start"
                await asyncio.sleep(0.01)
            status, _, body = await client.post(CHAT, data=chat(), headers=AUTH_A)
            err = openai_error(body)
            assert status == 429 and "--max-requests-per-client" in err["message"] and "key alice" in err["message"]
            # the cap is taken before the body is read: a third upload in progress is refused at once
            head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + TOKEN_A.encode()
                    + b"\r\nContent-Length: 5000000\r\n\r\n")
            data, took = await raw_request(client.port, head, b'{"messages": ')
            assert data.startswith(b"HTTP/1.1 429 ") and took < 2.0, data[:200]
            status, _, body = await client.post(CHAT, data=chat(max_tokens=1), headers=AUTH_B)
            assert status == 200, body
            fake.gate.set()
            assert [s for s, _, _ in await asyncio.gather(*held)] == [200, 200]
            assert (await client.post(CHAT, data=chat(), headers=AUTH_A))[0] == 200
    run(go())


def deltas(stream: str) -> list[str]:
    """The text of each chunk of a chat stream that carries some."""
    chunks = [json.loads(line[6:]) for line in stream.splitlines() if line.startswith("data: {")]
    return [c["choices"][0]["delta"]["content"] for c in chunks if c["choices"] and c["choices"][0]["delta"]]


def test_a_request_is_resumed_only_by_its_own_key(model_dir):
    """Another key is told the request does not exist (404) and cannot submit under its id (409);
    its own key resumes it after event 1 and gets the rest."""
    async def go():
        async with http_api(model_dir, keys=KEYS) as (client, fake):
            fake.gate.clear()
            first = asyncio.create_task(client.post(CHAT, data=chat(stream=True),
                                                    headers={**AUTH_A, "X-Request-Id": "req-1"}))
            deadline = time.monotonic() + 10
            while "req-1" not in fake.requests:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.01)
            status, _, body = await client.get("/v1/requests/req-1/stream", headers=AUTH_B)
            assert status == 404 and openai_error(body)["code"] == "request_not_found"
            status, _, body = await client.post(CHAT, data=chat(), headers={**AUTH_B, "X-Request-Id": "req-1"})
            assert status == 409 and openai_error(body)["code"] == "request_exists"
            again = asyncio.create_task(client.get("/v1/requests/req-1/stream", headers={**AUTH_A, "Last-Event-ID": "1"}))
            await asyncio.sleep(0.05)
            fake.gate.set()
            (status, _, text), (status_again, _, text_again) = await first, await again
            assert status == status_again == 200 and text_again.endswith("data: [DONE]\n\n")
            assert deltas(text)[1:] == deltas(text_again) and len(deltas(text_again)) == 3  # the rest, after event 1
    run(go())


def test_last_event_id_must_be_a_small_number(model_dir):
    async def go():
        async with http_api(model_dir) as (client, _):
            for last in ("²", "1" * 40, "-1", "x"):
                status, _, body = await client.get("/v1/requests/abc/stream", headers={"Last-Event-ID": last})
                assert status == 400 and openai_error(body)["param"] == "Last-Event-ID", (last, body)
    run(go())


def test_models_by_id(model_dir):
    """GET /v1/models/{id}: the model for its own id, OpenAI's 404 body for another."""
    async def go():
        async with http_api(model_dir) as (client, _):
            status, _, body = await client.get(f"/v1/models/{model_dir.name}")
            assert status == 200 and body["id"] == model_dir.name and body["object"] == "model", body
            status, _, body = await client.get("/v1/models/gpt-9")
            err = openai_error(body)
            assert status == 404 and err["code"] == "model_not_found" and "gpt-9" in err["message"], body
    run(go())


def test_the_developer_role_is_taken_as_system(model_dir):
    """OpenAI's `developer` turn is the model's system turn: the same prompt tokens."""
    async def go():
        async with http_api(model_dir) as (client, fake):
            seen = []
            submit = fake.submit
            fake.submit = lambda job: (seen.append(job.prompt_ids), submit(job))[1]
            for role in ("developer", "system"):
                status, _, body = await client.post(CHAT, data=json.dumps({"max_tokens": 2, "messages": [
                    {"role": role, "content": "Answer in French."}, *MESSAGES]}).encode())
                assert status == 200, body
            assert seen[0] == seen[1] and len(seen[0]) > 10
    run(go())


def test_a_batch_of_prompts_gets_a_choice_each(model_dir):
    """A list of prompts (strings, or token-id lists): one choice per prompt, `index` its place,
    whole and streamed (each choice ends with its own finish_reason); the usage sums them; each
    prompt counts toward the client's cap; X-Request-Id names one request, so not a batch."""
    async def go():
        async with http_api(model_dir, requests_per_client=3) as (client, fake):
            seen = []
            submit = fake.submit
            fake.submit = lambda job: (seen.append(job.prompt_ids), submit(job))[1]
            for prompt in (["The capital of France is", "Two plus two is", "Red"], [[1, 2, 3], [4, 5], [6]]):
                seen.clear()
                status, _, body = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 3})
                assert status == 200, body
                assert [c["index"] for c in body["choices"]] == [0, 1, 2] and len(seen) == 3
                assert all(c["text"] and c["finish_reason"] == "length" for c in body["choices"])
                assert body["usage"]["completion_tokens"] == 9
                assert body["usage"]["prompt_tokens"] == sum(len(p) for p in seen)
                if isinstance(prompt[0], list):
                    assert seen == [tuple(p) for p in prompt]
            status, _, text = await client.post("/v1/completions", json={
                "prompt": ["a", "b"], "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}})
            assert status == 200 and text.endswith("data: [DONE]\n\n")
            chunks = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
            assert "id: " not in text  # a batch is not resumable: its events carry no token counts
            texts, finishes = {0: "", 1: ""}, {}
            for c in chunks[:-1]:
                (choice,) = c["choices"]
                texts[choice["index"]] += choice["text"]
                if choice["finish_reason"]:
                    finishes[choice["index"]] = choice["finish_reason"]
            assert texts[0] == texts[1] != "" and finishes == {0: "length", 1: "length"}
            assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6
            # 4 prompts are 4 requests: over the cap of 3
            status, _, body = await client.post("/v1/completions", json={"prompt": ["a", "b", "c", "d"]})
            assert status == 429 and "--max-requests-per-client" in openai_error(body)["message"]
            status, _, body = await client.post("/v1/completions", json={"prompt": ["a", "b"]},
                                                headers={"X-Request-Id": "batch-1"})
            assert status == 400 and openai_error(body)["param"] == "X-Request-Id"
            assert not fake.requests  # every request of the batch released
    run(go())


def test_logprobs_in_openais_shapes(model_dir):
    """Chat: choices[].logprobs.content[{token, logprob, bytes, top_logprobs}], whole and per
    chunk; completions: {tokens, token_logprobs, top_logprobs, text_offset}; the tokens' bytes
    make the answer; asked for nothing, logprobs is null."""
    async def go():
        async with http_api(model_dir) as (client, fake):
            assert len(fake.answer) >= 4
            status, _, body = await client.post(CHAT, data=chat(logprobs=True, top_logprobs=2))
            assert status == 200, body
            (choice,) = body["choices"]
            content = choice["logprobs"]["content"]
            assert [e["logprob"] for e in content] == [-0.1, -0.2, -0.3, -0.4]
            assert all(len(e["top_logprobs"]) == 2 and e["top_logprobs"][0]["token"] == e["token"]
                       and e["top_logprobs"][0]["logprob"] == e["logprob"] > e["top_logprobs"][1]["logprob"]
                       for e in content), content
            assert bytes(b for e in content for b in e["bytes"]).decode() == choice["message"]["content"]
            status, _, text = await client.post(CHAT, data=chat(logprobs=True, stream=True))
            chunks = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
            streamed = [e for c in chunks for e in (c["choices"][0].get("logprobs") or {}).get("content", [])]
            assert [e["logprob"] for e in streamed] == [-0.1, -0.2, -0.3, -0.4]
            assert all(e["top_logprobs"] == [] for e in streamed)
            status, _, body = await client.post(CHAT, data=chat())
            assert body["choices"][0]["logprobs"] is None
            for stream in (False, True):
                status, _, got = await client.post("/v1/completions", json={
                    "prompt": "The capital of France is", "max_tokens": 4, "logprobs": 3, "stream": stream})
                assert status == 200, got
                if stream:
                    parts = [json.loads(line[6:])["choices"][0] for line in got.splitlines()
                             if line.startswith("data: {")]
                    lp = {k: [v for p in parts if p["logprobs"] for v in p["logprobs"][k]]
                          for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
                    text = "".join(p["text"] for p in parts)
                else:
                    lp, text = got["choices"][0]["logprobs"], got["choices"][0]["text"]
                assert lp["token_logprobs"] == [-0.1, -0.2, -0.3, -0.4] and "".join(lp["tokens"]) == text
                assert [len(t) for t in lp["top_logprobs"]] == [3] * 4
                assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(4)]
                assert all(t[tok] == v for t, tok, v in zip(lp["top_logprobs"], lp["tokens"], lp["token_logprobs"]))
    run(go())


def test_echo_gives_the_prompt_and_its_logprobs(model_dir):
    """completions `echo`: the text starts with the prompt; with logprobs, the prompt's tokens come
    first (the first with null logprobs), text_offset runs over prompt and answer; max_tokens 0
    (what loglikelihood evaluation sends) answers the prompt alone; streamed, the prompt is the
    first chunk."""
    async def go():
        async with http_api(model_dir) as (client, fake):
            prompt = "The capital of France is"
            n = len(tokenizer(model_dir)(prompt)["input_ids"])
            status, _, body = await client.post("/v1/completions", json={"prompt": prompt, "echo": True,
                                                                          "max_tokens": 0, "logprobs": 1})
            assert status == 200, body
            (choice,) = body["choices"]
            lp = choice["logprobs"]
            assert choice["text"] == prompt and "".join(lp["tokens"]) == prompt and len(lp["tokens"]) == n
            assert lp["token_logprobs"] == [None] + [-1 - i / 10 for i in range(n - 1)]
            assert lp["top_logprobs"][0] is None and body["usage"]["completion_tokens"] == 0
            status, _, body = await client.post("/v1/completions", json={"prompt": prompt, "echo": True,
                                                                          "max_tokens": 2, "logprobs": 0})
            (choice,) = body["choices"]
            lp = choice["logprobs"]
            assert choice["text"].startswith(prompt) and len(choice["text"]) > len(prompt)
            assert len(lp["tokens"]) == n + 2 and lp["token_logprobs"][n:] == [-0.1, -0.2]
            assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(n + 2)]
            status, _, text = await client.post("/v1/completions", json={"prompt": prompt, "echo": True,
                                                                          "max_tokens": 2, "stream": True})
            parts = [json.loads(line[6:])["choices"][0] for line in text.splitlines() if line.startswith("data: {")]
            assert parts[0]["text"] == prompt and parts[0]["logprobs"] is None
            assert "".join(p["text"] for p in parts) == choice["text"]
            status, _, body = await client.post("/v1/completions", json={"prompt": prompt, "echo": True})
            assert status == 200 and body["choices"][0]["text"].startswith(prompt)
    run(go())


def test_n_choices_of_one_prompt(model_dir):
    """n: the prompt computed once (one sequence of its own, then n forks of it), n choices with
    their index, whole and streamed; a batch of prompts with n gets n choices per prompt in order;
    the usage counts each prompt once; X-Request-Id names one request (400)."""
    async def go():
        async with http_api(model_dir) as (client, fake):
            jobs = []
            submit = fake.submit
            fake.submit = lambda job: (jobs.append(job), submit(job))[1]
            status, _, body = await client.post(CHAT, data=chat(n=3))
            assert status == 200, body
            assert [c["index"] for c in body["choices"]] == [0, 1, 2]
            assert len({c["message"]["content"] for c in body["choices"]}) == 1
            parent, *forks = jobs
            assert parent.keep_open and parent.max_tokens == 1 and len(forks) == 3
            assert [f.sequence for f in forks] == [0, 1, 2] and all(f.parent[1] == len(parent.prompt_ids) for f in forks)
            assert body["usage"]["prompt_tokens"] == len(parent.prompt_ids) and body["usage"]["completion_tokens"] == 12
            status, _, text = await client.post(CHAT, data=chat(n=2, stream=True))
            chunks = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
            assert {c["choices"][0]["index"] for c in chunks} == {0, 1} and text.endswith("data: [DONE]\n\n")
            assert sum(1 for c in chunks if c["choices"][0]["finish_reason"]) == 2
            status, _, body = await client.post("/v1/completions", json={"prompt": ["a", "b"], "n": 2, "max_tokens": 2})
            assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
            status, _, body = await client.post(CHAT, data=chat(n=2), headers={"X-Request-Id": "n-1"})
            assert status == 400 and openai_error(body)["param"] == "X-Request-Id"
            assert not fake.requests  # the prompt's sequence and every choice released
    run(go())


def test_the_openai_client_gets_400_naming_each_unsupported_parameter(model_dir):
    """Every OpenAI parameter this server does not implement, sent by the official client with a
    value that asks for something: 400 naming it, never ignored."""
    import openai

    asks = {"tool_choice": "required", "store": True, "metadata": {"k": "v"},
            "service_tier": "flex", "reasoning_effort": "low", "modalities": ["audio"],
            "audio": {"voice": "x", "format": "wav"}, "prediction": {"type": "content", "content": "x"},
            "web_search_options": {}}
    async def go():
        async with http_api(model_dir) as (client, _):
            oa = openai.AsyncOpenAI(base_url=client.base + "/v1", api_key="none", max_retries=0)
            try:
                for name, value in asks.items():
                    with pytest.raises(openai.BadRequestError) as info:
                        await oa.chat.completions.create(model=model_dir.name, messages=MESSAGES, max_tokens=2,
                                                         **{name: value})
                    assert info.value.body["param"] == name and name in info.value.message, (name, info.value.body)
                for name, value in (("best_of", 2), ("suffix", "!")):
                    with pytest.raises(openai.BadRequestError) as info:
                        await oa.completions.create(model=model_dir.name, prompt="hi", max_tokens=2, **{name: value})
                    assert info.value.body["param"] == name, (name, info.value.body)
            finally:
                await oa.close()
    run(go())


def test_a_tool_loop_conversation_is_taken(model_dir):
    """An agent sends the assistant's tool_calls and the tool's answer back: both reach the
    prompt (the call as <tool_call> text, the answer as a <tool_response> turn for SmolLM2's
    template, which lays out no tools itself); malformed ones are 400 naming the field."""
    from logicpipe.controller.jobs.text import load_tokenizer

    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    loop = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "18 C and sunny"}]

    async def go():
        async with http_api(model_dir) as (client, fake):
            seen = []
            submit = fake.submit
            fake.submit = lambda job: (seen.append(job.prompt_ids), submit(job))[1]
            status, _, body = await client.post(CHAT, data=json.dumps({"max_tokens": 2, "messages": loop}).encode())
            assert status == 200, body
            text = load_tokenizer(model_dir).decode(seen[0])
            assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
            assert "<tool_response>\n18 C and sunny\n</tool_response>" in text
            for bad, param in (
                    ({"role": "tool", "content": "x"}, "messages[2].tool_call_id"),
                    ({"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]},
                     "messages[2].tool_calls[0]"),
                    ({"role": "user", "content": "x", "tool_call_id": "c"}, "messages[2].tool_call_id")):
                status, _, body = await client.post(CHAT, data=json.dumps({"messages": [*loop[:2], bad]}).encode())
                assert status == 400 and body["error"]["param"] == param, body
    run(go())


AT_ONCE = 5.0  # s: a refusal's deadline (a hang fails as a timeout, not as a slow answer)


def test_flawed_request_ids_stops_and_resumes_are_400_at_once(model_dir):
    """Issue 34's flawed answers over HTTP: an X-Request-Id that is no request id (a path, spaces,
    non-ASCII, 65 characters), a resume path of one, a stop string over the byte cap (1 MiB) or
    more than 4 of them, and a Last-Event-ID past what the request can ever have (its max_tokens)
    are each a 400 naming the parameter, well before a 5 s deadline; a good id still serves."""
    import aiohttp

    at_once = aiohttp.ClientTimeout(total=AT_ONCE)

    async def go():
        async with http_api(model_dir) as (client, fake):
            for rid in ("a/../b", "../x", "a b", "caf\xe9", "r" * 65, ".."):
                status, _, body = await client.post(CHAT, data=chat(), headers={"X-Request-Id": rid}, timeout=at_once)
                err = openai_error(body)
                assert status == 400 and err["param"] == "X-Request-Id" and "A-Z a-z 0-9 . _ -" in err["message"], \
                    (rid, body)
                assert not fake.requests
            status, _, body = await client.get("/v1/requests/a%20b/stream", timeout=at_once)
            assert status == 400 and openai_error(body)["param"] == "id" and "'a b'" in body["error"]["message"]
            for stop, phrase in ((["x" * 2**20], "stop[0] is 1048576 bytes"), (["\u00e9" * 513], "stop[0] is 1026"),
                                 (["a", "b", "c", "d", "e"], "up to 4")):
                status, _, body = await client.post(CHAT, data=chat(stop=stop), timeout=at_once)
                err = openai_error(body)
                assert status == 400 and err["param"] == "stop" and phrase in err["message"], body
            status, _, body = await client.post(CHAT, data=chat(stop=["é" * 512, "b", "c", "d"]), timeout=at_once)
            assert status == 200, body  # 1024 bytes: the cap itself is taken
            fake.gate.clear()
            first = asyncio.create_task(client.post(CHAT, data=chat(stream=True, max_tokens=20),
                                                    headers={"X-Request-Id": "held-1"}))
            deadline = time.monotonic() + 10
            while "held-1" not in fake.requests:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.01)
            for last in ("4294967295", "21"):
                status, _, body = await client.get("/v1/requests/held-1/stream", headers={"Last-Event-ID": last},
                                                   timeout=at_once)
                err = openai_error(body)
                assert status == 400 and "Last-Event-ID" in err["message"] and "its max_tokens is 20" in err["message"]
            # 15 may come (under max_tokens): the resume waits; the answer then ends with fewer (its fixed 8)
            waiting = asyncio.create_task(client.get("/v1/requests/held-1/stream", headers={"Last-Event-ID": "15"}))
            await asyncio.sleep(0.1)
            assert not waiting.done()
            fake.gate.set()
            status, _, body = await asyncio.wait_for(waiting, AT_ONCE)
            assert status == 400 and "Last-Event-ID 15 is more tokens than request 'held-1' has: it finished with " \
                f"{len(fake.answer)}" in openai_error(body)["message"], body
            status, headers, _ = await first
            assert status == 200 and {k.lower(): v for k, v in headers.items()}["x-request-id"] == "held-1", headers
    run(go())
