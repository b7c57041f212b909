"""Fuzzing the HTTP API (hypothesis, a fixed budget per target, fixed seed): bodies and headers for
/v1/chat/completions, /v1/completions and /v1/requests/{id}/stream, and bodies for the adapted APIs
(/v1/messages, /v1/responses, /api/chat, /api/generate, /api/show), sent to the API in-process
(tests/service/http_harness.py: the real adapter, front door and tokenizer over a fake scheduler)
with API keys on. Whatever comes in, the answer is never a 500: it is an OpenAI error body
({"error": {"message", "type", "param", "code"}}) with a 4xx status, or a well-formed completion
(whole, or a stream of chunks ending in `data: [DONE]`). Bodies are JSON objects with each
field's plausible values and anything else (NaN, Infinity, lone surrogates, huge integers, nesting),
arbitrary JSON, and raw bytes. Each target's count of inputs tried is printed (`pytest -s`)."""
from __future__ import annotations

import contextlib
import json
import urllib.parse

import aiohttp
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from logicpipe.controller.api.http_auth import ApiKeys, parse
from logicpipe.controller.api.http_body import FIELDS, NOT_YET

from .http_harness import http_api

BUDGET = 300  # inputs per target
FUZZ = settings(max_examples=BUDGET, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large])
TRIED: dict[str, int] = {}
TOKEN = "fuzz-" + "k" * 27
KEYS = ApiKeys(parse(f"fuzzer {TOKEN}\n"))
ERROR_STATUSES = {400, 401, 404, 405, 409, 413, 417, 429}


@pytest.fixture(scope="module")
def api(runner, model_dir):
    """The API with keys, served for the whole module on the module's event loop."""
    stack = contextlib.AsyncExitStack()
    client, _ = runner.run(stack.enter_async_context(http_api(model_dir, keys=KEYS)))
    try:
        yield runner, client
    finally:
        runner.run(stack.aclose())


# ---- strategies ------------------------------------------------------------------------------------
SURROGATES = st.sampled_from(["\ud800", "\udbff", "\udc00", "\udfff"])
TEXT = st.one_of(st.text(max_size=30), st.builds(lambda a, s, b: a + s + b, st.text(max_size=5), SURROGATES,
                                                 st.text(max_size=5)))
NUMBERS = st.one_of(st.integers(-3, 3000), st.integers(), st.sampled_from([10**30, -(10**30), 10**400, 2**63, 2**64]),
                    st.floats(allow_nan=True, allow_infinity=True))
LEAVES = st.one_of(st.none(), st.booleans(), NUMBERS, TEXT)
NAMES = st.sampled_from(sorted(FIELDS["chat"] | FIELDS["completions"] | set(NOT_YET) | {"foo", "", "include_usage"}))
JSON = st.recursive(LEAVES, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(NAMES | TEXT, inner, max_size=4),
                    max_leaves=10)
DEEP = st.integers(20, 3000).map(lambda n: "[" * n + "]" * n)

CLEAN = st.text(alphabet=st.characters(exclude_categories=("Cs",)), min_size=1, max_size=30)  # valid text


def nest(depth: int) -> list:
    value: list = []
    for _ in range(depth - 1):
        value = [value]
    return value


ANYTHING = st.one_of(JSON, NUMBERS, TEXT, st.integers(20, 200).map(nest))  # (deeper: DEEP, as bytes)

MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]),
                                 "content": st.one_of(CLEAN, st.lists(st.fixed_dictionaries(
                                     {"type": st.just("text"), "text": CLEAN}), min_size=1, max_size=3))})
VALID = {  # values each field honours (combinations may still be refused: stream_options without stream)
    "messages": st.lists(MESSAGE, min_size=1, max_size=3),
    "prompt": st.one_of(CLEAN, st.lists(st.integers(0, 40_000), min_size=1, max_size=6), st.lists(CLEAN, max_size=1),
                        st.lists(st.lists(st.integers(0, 100), min_size=1, max_size=3), max_size=1)),
    "max_tokens": st.integers(1, 4), "max_completion_tokens": st.integers(1, 4), "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1), "top_k": st.integers(0, 50), "seed": st.integers(0, 2**63 - 1), "n": st.just(1),
    "stop": st.one_of(CLEAN, st.lists(CLEAN, max_size=4)), "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
    "speculate": st.integers(0, 16), "ignore_eos": st.booleans(), "outline": st.booleans(),
    "max_points": st.integers(0, 32), "model": st.just("SmolLM2-135M-Instruct"), "user": CLEAN,
    "logprobs": st.one_of(st.booleans(), st.integers(0, 20)), "top_logprobs": st.integers(0, 20),
    "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2),
    "logit_bias": st.dictionaries(st.integers(0, 40_000).map(str), st.floats(-100, 100), max_size=3),
    "response_format": st.sampled_from([{"type": "text"}, {"type": "json_object"}, {"type": "json_schema", "json_schema": {
        "name": "n", "schema": {"type": "object", "properties": {"n": {"type": "integer"}}}}}]),
    "tools": st.sampled_from([[], [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "integer"}}}}}]]),
    "tool_choice": st.sampled_from(["none", "auto", {"type": "function", "function": {"name": "f"}}]),
}
for _name, _noop in NOT_YET.items():
    _values = list(_noop[a] for a in ("chat", "completions")) if isinstance(_noop, dict) else [_noop]
    VALID[_name] = st.sampled_from([v for vs in _values for v in vs] + [None])
SPOILED = sorted(set(VALID) | {"foo", "", "messages", "prompt"})


def body_of(api: str):
    """A JSON object: `api`'s prompt field and up to 3 of its other fields, each valid; about half
    of them then with one field (any, or a made-up one) set to anything."""
    required = "messages" if api == "chat" else "prompt"
    own = sorted(FIELDS[api] - {required, "max_tokens"})
    head = st.fixed_dictionaries({required: VALID[required], "max_tokens": VALID["max_tokens"]})
    extra = st.lists(st.sampled_from(own), max_size=3, unique=True).flatmap(
        lambda names: st.fixed_dictionaries({n: VALID[n] for n in names}))
    spoil = st.one_of(st.none(), st.tuples(st.sampled_from(SPOILED), ANYTHING))
    return st.builds(lambda h, e, s: {**h, **e, **({s[0]: s[1]} if s else {})}, head, extra, spoil)


def dumps(body) -> bytes:
    """JSON as Python writes it: NaN and Infinity as the extension, lone surrogates escaped."""
    return json.dumps(body).encode()


GARBAGE = st.one_of(ANYTHING.map(dumps), DEEP.map(str.encode), st.binary(max_size=64),
                    body_of("chat").map(dumps).map(lambda b: b[: len(b) // 2]))
HEADER_TEXT = st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=70)
KEY = {"Authorization": f"Bearer {TOKEN}"}
HEADERS = st.fixed_dictionaries(  # the key mostly right, sometimes not
    {"Authorization": st.one_of(*[st.just(f"Bearer {TOKEN}")] * 3, st.just(f"bearer {TOKEN}"), HEADER_TEXT, st.none())},
    optional={"X-Request-Id": HEADER_TEXT, "Last-Event-ID": HEADER_TEXT,
              "Content-Type": st.sampled_from(["application/json", "text/plain", "x/y"]),
              "Expect": st.sampled_from(["100-continue", "100-continue", "100-continue", "nothing"])})


# ---- the check ---------------------------------------------------------------------------------------
def check(status: int, content_type: str, text: str, *, stream_ok: bool) -> None:
    """A well-formed answer: an OpenAI error with a 4xx status, or a completion."""
    assert status != 500 and (status == 200 or status in ERROR_STATUSES), (status, text[:500])
    if status != 200:
        body = json.loads(text)
        assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
        err = body["error"]
        assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str), body
        assert err["param"] is None or isinstance(err["param"], str), body
        return
    if content_type == "text/event-stream":
        assert stream_ok and text.endswith("data: [DONE]\n\n"), text[-300:]
        chunks = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
        assert chunks and all(isinstance(c["choices"], list) for c in chunks)
        return
    body = json.loads(text)
    assert body["object"] in ("chat.completion", "text_completion") and len(body["choices"]) == 1, body
    assert body["usage"]["completion_tokens"] >= 0


async def send(client, method: str, path: str, headers: dict, data: bytes | None) -> tuple[int, str, str]:
    headers = {k: v for k, v in headers.items() if v is not None}
    async with client.session.request(method, client.base + path, headers=headers, data=data,
                                      skip_auto_headers=("Content-Type",)) as r:
        return r.status, r.content_type, await r.text(errors="replace")


def one(api_fixture, target: str, method: str, path: str, headers: dict, data: bytes | None, *, stream_ok=True):
    runner, client = api_fixture
    try:
        status, content_type, text = runner.run(send(client, method, path, headers, data))
    except (ValueError, aiohttp.InvalidURL):  # the client refused to send it (not the server's doing)
        assume(False)
    TRIED[target] = TRIED.get(target, 0) + 1
    check(status, content_type, text, stream_ok=stream_ok)


@FUZZ
@given(body=body_of("chat"), rid=st.one_of(st.none(), HEADER_TEXT))
def test_chat_completions(api, body, rid):
    one(api, "POST /v1/chat/completions", "POST", "/v1/chat/completions", {**KEY, "X-Request-Id": rid}, dumps(body))


@FUZZ
@given(body=body_of("completions"), rid=st.one_of(st.none(), HEADER_TEXT))
def test_completions(api, body, rid):
    one(api, "POST /v1/completions", "POST", "/v1/completions", {**KEY, "X-Request-Id": rid}, dumps(body))


@FUZZ
@given(raw=st.one_of(GARBAGE, body_of("completions").map(dumps)), headers=HEADERS,
       path=st.sampled_from(["/v1/chat/completions", "/v1/completions"]))
def test_garbage_and_headers(api, raw, headers, path):
    """Bytes, any JSON, deep nests, cut bodies; any Authorization, Expect, X-Request-Id."""
    one(api, "POST garbage, any headers", "POST", path, headers, raw)


@FUZZ
@given(rid=st.one_of(TEXT, HEADER_TEXT), after=st.one_of(st.none(), HEADER_TEXT), headers=HEADERS)
def test_resume_stream(api, rid, after, headers):
    path = f"/v1/requests/{urllib.parse.quote(rid.encode('utf-8', 'surrogatepass'), safe='')}/stream"
    if after is not None:
        path += f"?after={urllib.parse.quote(after, safe='')}"
    one(api, "GET /v1/requests/{id}/stream", "GET", path, headers, None)


# ---- the adapted APIs (Anthropic Messages, OpenAI Responses, Ollama) ------------------------------------
MODEL = "SmolLM2-135M-Instruct"
TURN = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", "tool", "developer"]),
                              "content": st.one_of(CLEAN, st.lists(st.one_of(ANYTHING, st.fixed_dictionaries(
                                  {"type": st.sampled_from(["text", "tool_use", "tool_result", "image", "input_text",
                                                            "output_text", "function_call"])},
                                  optional={"text": CLEAN, "id": CLEAN, "name": CLEAN, "input": ANYTHING,
                                            "tool_use_id": CLEAN, "content": ANYTHING, "is_error": ANYTHING,
                                            "cache_control": ANYTHING})), max_size=3))},
                             optional={"tool_calls": ANYTHING, "tool_name": ANYTHING, "images": ANYTHING})
HI = [{"role": "user", "content": "hi"}]
ADAPTED_BASE = {  # path -> a valid body (the fake answers at once)
    "/v1/messages": st.fixed_dictionaries({"model": st.just(MODEL), "max_tokens": st.integers(1, 4),
                                           "messages": st.just(HI), "stream": st.booleans()}),
    "/v1/responses": st.fixed_dictionaries({"input": CLEAN, "max_output_tokens": st.integers(1, 4),
                                            "stream": st.booleans()}),
    "/api/chat": st.fixed_dictionaries({"model": st.just(MODEL), "messages": st.just(HI), "stream": st.booleans(),
                                        "options": st.just({"num_predict": 3})}),
    "/api/generate": st.fixed_dictionaries({"model": st.just(MODEL), "prompt": CLEAN, "stream": st.booleans(),
                                            "raw": st.booleans(), "options": st.just({"num_predict": 3})}),
    "/api/show": st.just({"model": MODEL}),
}
ADAPTED_NAMES = st.sampled_from(["messages", "input", "system", "instructions", "tools", "tool_choice",
                                 "stop_sequences", "temperature", "top_k", "options", "format", "text", "metadata",
                                 "thinking", "store", "max_tokens", "max_output_tokens", "model", "stream", "prompt",
                                 "raw", "think", "logprobs", "top_logprobs", "keep_alive", "images", "foo"])
ADAPTED_VALUES = st.one_of(ANYTHING, st.lists(TURN, min_size=1, max_size=3), st.sampled_from([
    [{"name": "f", "input_schema": {"type": "object"}}], [{"type": "function", "name": "f", "parameters": {}}],
    [{"type": "function", "function": {"name": "f"}}], {"type": "any"}, {"type": "tool", "name": "f"}, "required",
    {"format": {"type": "json_object"}}, "json", {"type": "object"}, {"num_predict": -1}, {"temperature": 0.5},
    {"type": "enabled", "budget_tokens": 1024}]))


def adapted_check(path: str, status: int, content_type: str, text: str) -> None:
    """The API's own error shape with a 4xx status, or its answer (JSON, server-sent events, NDJSON)."""
    assert status != 500 and (status == 200 or status in ERROR_STATUSES), (path, status, text[:500])
    if status != 200:
        body = json.loads(text)
        if path == "/v1/messages":
            assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
        elif path.startswith("/api/"):
            assert set(body) == {"error"} and isinstance(body["error"], str) and body["error"], body
        else:
            assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
        return
    if content_type == "text/event-stream":
        events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ")]
        assert events and events[-1]["type"] in ("message_stop", "response.completed", "response.incomplete"), text
    elif content_type == "application/x-ndjson":
        lines = [json.loads(line) for line in text.splitlines()]
        assert lines and lines[-1]["done"] is True, text
    else:
        assert isinstance(json.loads(text), dict)


@FUZZ
@given(path=st.sampled_from(sorted(ADAPTED_BASE)), data=st.data(), spoil=st.one_of(st.none(), st.tuples(
    ADAPTED_NAMES, ADAPTED_VALUES)))
def test_adapted_apis(api, path, data, spoil):
    """Each adapted API's body, valid, then mostly with one field set to anything (or to a shape
    another API uses): its own error shape or its answer, never a 500."""
    body = {**data.draw(ADAPTED_BASE[path]), **({spoil[0]: spoil[1]} if spoil else {})}
    runner, client = api
    try:
        status, content_type, text = runner.run(send(client, "POST", path, KEY, dumps(body)))
    except (ValueError, aiohttp.InvalidURL):
        assume(False)
    TRIED["POST adapted APIs"] = TRIED.get("POST adapted APIs", 0) + 1
    adapted_check(path, status, content_type, text)


def test_zz_report_budget():
    """Runs last in this module: every target tried its budget (the count is the CI figure)."""
    for target, n in sorted(TRIED.items()):
        print(f"http fuzz: {target}: {n} inputs")
    assert len(TRIED) == 5 and all(n >= BUDGET // 2 for n in TRIED.values()), TRIED
