"""Service tier, structured output (issue 24): response_format json_schema / json_object on chat
and completions with the official `openai` client, and Submit's json_schema over gRPC, against an
in-process controller over one in-process stage holding the default model (CPU): every answer
parses and validates against its schema (20 prompts, greedy and seeded sampling, candidates
included), ends with finish_reason "stop" when the grammar ends, and a bad schema, one no value
satisfies or an unknown type is a 400 naming response_format with the reason."""
from __future__ import annotations

import asyncio
import contextlib
import json

import jsonschema
import openai
import pytest

from logicpipe.v1 import controller_pb2, stage_pb2

from .test_openai_api import CALL_TIMEOUT_S, served

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "colour": {"enum": ["red", "green", "blue"]},
    "happy": {"type": "boolean"}},
    "required": ["name", "age", "colour", "happy"], "additionalProperties": False}
PROMPTS = ["Describe a person as JSON.", "Who is Ada Lovelace?", "Tell me about a cat.", "Make up a character.",
           "What is your favourite colour?", "Give me a random person.", "A knight from a story.", "A robot friend.",
           "Describe your neighbour.", "Invent a pirate."]
MAX_TOKENS = 80  # the schema's longest answer is 66 characters + the end: even sampled one character a token
#                (sampling picks odd splits of the keys) every answer ends by the grammar, not the limit


@pytest.fixture(scope="module")
def api(runner, model_dir):
    stack = contextlib.AsyncExitStack()
    try:
        yield runner.run(asyncio.wait_for(stack.enter_async_context(served(model_dir)), CALL_TIMEOUT_S))
    finally:
        runner.run(stack.aclose())


def arun(runner, coro):
    return runner.run(asyncio.wait_for(coro, CALL_TIMEOUT_S * 4))


def rf(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}


def test_json_schema_answers_validate_for_20_prompts(runner, api):
    """10 prompts greedy, 10 seeded at temperature 1: each answer parses, validates, and ended with
    the grammar ("stop"), on the chat API; the same request again gives the same answer."""
    async def one(prompt: str, seed: int | None):
        r = await api.client.chat.completions.create(
            model=api.model, messages=[{"role": "user", "content": prompt}], max_tokens=MAX_TOKENS,
            temperature=0 if seed is None else 1.0, seed=seed, response_format=rf(SCHEMA))
        return r.choices[0]

    async def go():
        asks = [(p, None) for p in PROMPTS] + [(p, 100 + i) for i, p in enumerate(PROMPTS)]
        got = await asyncio.gather(*(one(p, s) for p, s in asks))
        for (p, s), c in zip(asks, got):
            answer = json.loads(c.message.content)
            jsonschema.validate(answer, SCHEMA)
            assert c.finish_reason == "stop", (p, s, c.message.content)
        assert len({c.message.content for c in got}) > 1  # the grammar constrains, it does not dictate
        again = await one(*asks[-1])
        assert again.message.content == got[-1].message.content  # seeded: the same tokens every time
    arun(runner, go())


def test_json_object_on_completions_and_grpc_json_schema(runner, api):
    """completions with json_object gives a JSON object; gRPC Submit with json_schema (and
    candidates: a prompt whose answer repeats its own n-grams) gives one that validates."""
    schema = {"type": "object", "properties": {"numbers": {"type": "array", "items": {"type": "integer"},
                                                           "maxItems": 8}},
              "required": ["numbers"], "additionalProperties": False}

    async def go():
        r = await api.client.completions.create(model=api.model, prompt="A JSON object about the sea:",
                                                max_tokens=64, temperature=0,
                                                extra_body={"response_format": {"type": "json_object"}})  # (not in its signature)
        c = r.choices[0]
        if c.finish_reason == "stop":  # (json_object bounds nothing: a long answer may be cut by max_tokens)
            assert isinstance(json.loads(c.text), dict)
        else:
            assert c.text.lstrip().startswith("{")
        before = await api.node.stub.Status(stage_pb2.StatusRequest(), timeout=CALL_TIMEOUT_S)
        replies = [x async for x in api.ctl.stub.Submit(controller_pb2.SubmitRequest(
            prompt="List the numbers 1, 2, 3, 4, 5, 6, 7, 8 as JSON.", max_tokens=64, speculate=4,
            json_schema=json.dumps(schema)), timeout=CALL_TIMEOUT_S)]
        text = "".join(x.text for x in replies)
        jsonschema.validate(json.loads(text), schema)
        assert replies[-1].finish_reason == "stop"
        after = await api.node.stub.Status(stage_pb2.StatusRequest(), timeout=CALL_TIMEOUT_S)
        assert after.candidates_verified > before.candidates_verified  # candidates went through the mask
        assert after.candidates_accepted > before.candidates_accepted
    arun(runner, go())


@pytest.mark.parametrize("fmt, reason", [
    ({"type": "xml"}, "got type xml"),
    (rf({"type": "nope"}), 'Unsupported type "nope"'),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "needs"),
    (rf({"$ref": "#"}), "can never be satisfied"),  # issue 34: was 16 replays, then a 503 "no_plan" after 12 s
    (rf({"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}), "never ends"),
])
def test_bad_response_format_is_a_400_naming_it(runner, api, fmt, reason):
    """Refused at the door, well before a 5 s deadline (a timeout is no 400)."""
    async def go():
        with pytest.raises(openai.BadRequestError) as info:
            await api.client.chat.completions.create(model=api.model, messages=[{"role": "user", "content": "hi"}],
                                                     max_tokens=4, response_format=fmt, timeout=5.0)
        assert info.value.body["param"] == "response_format"
        assert reason in info.value.body["message"]
    arun(runner, go())


def test_a_grammar_that_dead_ends_on_a_stage_ends_its_request_as_invalid_argument(runner, api, monkeypatch):
    """The door refuses a schema no value satisfies; one that reaches a stage all the same (the
    door's check taken away here) ends its request with INVALID_ARGUMENT naming json_schema, well
    before a 10 s deadline and replayed 0 times (was: 16 replays, then UNAVAILABLE / 503 no_plan
    after 12 s); the mesh then serves a good schema."""
    import grpc

    from logicpipe.controller.jobs import rules

    monkeypatch.setattr(rules, "check_schema", lambda text: text)  # no check at the door: it reaches the stage

    async def go():
        replays = api.ctl.app.scheduler.stats.replays
        call = api.ctl.stub.Submit(controller_pb2.SubmitRequest(prompt="Hi", max_tokens=8,
                                                                json_schema='{"$ref": "#"}'), timeout=10.0)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in call:
                pass
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
        # the stage's matcher allows no first token, or (xgrammar >= 0.2.9) its compiler refuses the schema
        assert "json_schema: its grammar allows no token" in info.value.details() or \
            "Circular $ref chain" in info.value.details(), info.value.details()
        assert api.ctl.app.scheduler.stats.replays == replays
        replies = [x async for x in api.ctl.stub.Submit(controller_pb2.SubmitRequest(
            prompt="Is water wet? Answer as JSON.", max_tokens=16, json_schema=json.dumps(SCHEMA)),
            timeout=CALL_TIMEOUT_S)]
        assert replies[-1].finished
    arun(runner, go())


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The current time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 20}},
                   "required": ["zone"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


def test_tool_choice_required_gives_a_valid_call(runner, api):
    """The default model (whose template does not render tools: they go in a system message) with
    tool_choice "required", greedy and seeded, and a named function: the answer is a call to one
    of the tools whose arguments validate against its parameters, finish_reason "tool_calls";
    streamed, the call comes as one delta."""
    async def go():
        schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
        for choice, seed in (("required", None), ("required", 7), ({"type": "function", "function": {"name": "get_time"}},
                                                                    None)):
            r = await api.client.chat.completions.create(
                model=api.model, messages=ASK, tools=[WEATHER, TIME], tool_choice=choice, max_tokens=MAX_TOKENS,
                temperature=0 if seed is None else 1.0, seed=seed)
            c = r.choices[0]
            assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1, c
            call = c.message.tool_calls[0]
            assert call.type == "function" and call.id.startswith("call_")
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
            if isinstance(choice, dict):
                assert call.function.name == "get_time"
        stream = await api.client.chat.completions.create(model=api.model, messages=ASK, tools=[WEATHER],
                                                          tool_choice="required", max_tokens=MAX_TOKENS, temperature=0,
                                                          stream=True)
        chunks = [ch async for ch in stream]
        calls = [tc for ch in chunks for tc in (ch.choices[0].delta.tool_calls or ())]
        assert [tc.function.name for tc in calls] == ["get_weather"]
        jsonschema.validate(json.loads(calls[0].function.arguments), schemas["get_weather"])
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
    arun(runner, go())


def test_tool_choice_none_gives_no_call_and_bad_tools_are_400(runner, api):
    async def go():
        r = await api.client.chat.completions.create(model=api.model, messages=ASK, tools=[WEATHER],
                                                     tool_choice="none", max_tokens=16, temperature=0)
        c = r.choices[0]
        assert not c.message.tool_calls and c.finish_reason in ("stop", "length") and c.message.content
        plain = await api.client.chat.completions.create(model=api.model, messages=ASK, max_tokens=16, temperature=0)
        assert c.message.content == plain.choices[0].message.content  # "none": the tools stay out of the prompt
        for fields, param in ((dict(tools=[{"type": "function", "function": {"name": "bad name!"}}]), "tools[0]"),
                              (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "x"}}),
                               "tool_choice"),
                              (dict(tool_choice="required"), "tool_choice"),
                              (dict(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"}),
                               "tool_choice")):
            with pytest.raises(openai.BadRequestError) as info:
                await api.client.chat.completions.create(model=api.model, messages=ASK, max_tokens=4, **fields)
            assert info.value.body["param"] == param, (fields, info.value.body)
    arun(runner, go())


def test_lpctl_submit_json_schema_file(runner, api, tmp_path, capsys):
    """`lpctl submit --json-schema FILE --json`: the text validates against the schema in FILE; a
    missing file is one line naming the fix, exit 2."""
    from logicpipe.controller.cli import lpctl

    path = tmp_path / "person.json"
    path.write_text(json.dumps(SCHEMA))

    def run(*argv) -> int:
        try:
            lpctl.main(["--controller", api.ctl.address, "submit", "Describe a person.", "--max-tokens",
                        str(MAX_TOKENS), *argv])
        except SystemExit as exc:
            return exc.code or 0
        return 0

    async def go():
        return await asyncio.to_thread(run, "--json-schema", str(path), "--json")
    assert arun(runner, go()) == 0
    out = json.loads(capsys.readouterr().out)
    jsonschema.validate(json.loads(out["text"]), SCHEMA)
    assert run("--json-schema", str(tmp_path / "nope.json")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--json-schema" in err[0] and "json_object" in err[0]
