"""Service tier, the adapted APIs (issue 38) with their official Python clients — `anthropic`
(Messages), `openai` (Responses), `ollama` — in two parts.

Against the HTTP API of an in-process controller over one in-process stage holding the default
model (CPU), on the module's event loop: each API's greedy answer is the chat completion's for the
same conversation (text, token counts, stop reason), streamed and not; a tool call's result sent
back through each client gives the chat path's answer to the same tool loop; a forced call (the
grammar) comes back as Anthropic's tool_use; a parameter an API does not support is a 400 in that
API's error shape naming it.

Over the fake scheduler (tests/service/http_harness.py), whose answer is a tool call: each client
gets it as its API's call, streamed and not; a forced or named tool reaches the job as its grammar;
the API keys hold for every adapter (Anthropic's X-Api-Key too); each request is a job of the key's
client with its API named (what the journal keeps)."""
from __future__ import annotations

import asyncio
import contextlib
import json

import anthropic
import jsonschema
import ollama
import openai
import pytest

from logicpipe.controller.api.http_auth import ApiKeys, parse

from .conftest import run
from .http_harness import http_api, tokenizer
from .test_openai_api import CALL_TIMEOUT_S, served

SYSTEM = "You answer in one short sentence."
QUESTION = "What is the capital of France?"
TOKENS = 10
GREEDY = {"temperature": 0}  # anthropic's client has no sampling parameters any more: sent as extra body fields
WEATHER = {"name": "get_weather", "description": "The current weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                          "required": ["city"], "additionalProperties": False}}
ASK = "What is the weather like in Paris today?"
RESULT = "18 C and sunny"
TOOL_TOKENS = 40  # a forced call (22 tokens) ends by its grammar before this
CONVERSATION = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
CHAT_TOOL_LOOP = [{"role": "user", "content": ASK},
                  {"role": "assistant", "content": None, "tool_calls": [
                      {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                        "arguments": '{"city": "Paris"}'}}]},
                  {"role": "tool", "tool_call_id": "call_1", "content": RESULT}]


@pytest.fixture(scope="module")
def api(runner, model_dir):
    """The mesh, the three clients on its HTTP API, and the chat path's greedy answers (`ref`:
    CONVERSATION's choice and usage; `loop`: CHAT_TOOL_LOOP's text) to compare with."""
    stack = contextlib.AsyncExitStack()

    async def start():
        s = await stack.enter_async_context(served(model_dir))
        base = str(s.client.base_url).removesuffix("/v1/")
        s.claude = anthropic.AsyncAnthropic(base_url=base, api_key="none", max_retries=0, timeout=CALL_TIMEOUT_S)
        s.llama = ollama.AsyncClient(host=base, timeout=CALL_TIMEOUT_S)
        stack.push_async_callback(s.claude.close)
        r = await s.client.chat.completions.create(model=s.model, messages=CONVERSATION, max_tokens=TOKENS,
                                                   temperature=0)
        s.ref, s.usage = r.choices[0], r.usage
        s.loop = (await s.client.chat.completions.create(model=s.model, messages=CHAT_TOOL_LOOP, max_tokens=TOKENS,
                                                         temperature=0)).choices[0].message.content
        return s
    try:
        yield runner.run(asyncio.wait_for(start(), CALL_TIMEOUT_S * 2))
    finally:
        runner.run(stack.aclose())


def arun(runner, coro):
    return runner.run(asyncio.wait_for(coro, CALL_TIMEOUT_S * 2))


def test_anthropic_messages(runner, api):
    """Text, usage and stop reason equal the chat path's, streamed (the standard events) and not;
    stop_sequences ends the text before the one that matched and names it."""
    async def go():
        ask = dict(model=api.model, system=SYSTEM, messages=[{"role": "user", "content": QUESTION}],
                   max_tokens=TOKENS, extra_body=GREEDY)
        m = await api.claude.messages.create(**ask)
        assert [b.type for b in m.content] == ["text"] and m.content[0].text == api.ref.message.content
        assert (m.usage.input_tokens, m.usage.output_tokens) == (api.usage.prompt_tokens, api.usage.completion_tokens)
        assert m.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[api.ref.finish_reason]
        events = [e async for e in await api.claude.messages.create(**ask, stream=True)]
        kinds = [e.type for e in events]
        assert kinds[:2] == ["message_start", "content_block_start"] and set(kinds[2:-3]) == {"content_block_delta"}
        assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"] and len(kinds) > 6
        assert "".join(e.delta.text for e in events[2:-3]) == api.ref.message.content
        assert events[0].message.usage.input_tokens == api.usage.prompt_tokens
        assert (events[-2].delta.stop_reason, events[-2].usage.output_tokens) == (m.stop_reason, m.usage.output_tokens)
        word = api.ref.message.content.split()[2]  # a word the answer holds
        cut = await api.claude.messages.create(**{**ask, "stop_sequences": [word, "zzz"]})
        assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == word
        assert cut.content[0].text == api.ref.message.content[:api.ref.message.content.index(word)]
    arun(runner, go())


def test_anthropic_tool_use_and_its_result(runner, api):
    """tool_choice any: a tool_use block (stop_reason tool_use) whose input validates; a
    tool_result sent back gives the chat path's answer to the same tool loop."""
    async def go():
        tool = {"name": WEATHER["name"], "description": WEATHER["description"], "input_schema": WEATHER["parameters"]}
        m = await api.claude.messages.create(model=api.model, messages=[{"role": "user", "content": ASK}], tools=[tool],
                                             tool_choice={"type": "any"}, max_tokens=TOOL_TOKENS, extra_body=GREEDY)
        assert m.stop_reason == "tool_use" and [b.type for b in m.content] == ["tool_use"], m
        assert m.content[0].name == "get_weather" and m.content[0].id.startswith("toolu_")
        jsonschema.validate(m.content[0].input, WEATHER["parameters"])
        back = await api.claude.messages.create(model=api.model, max_tokens=TOKENS, extra_body=GREEDY, messages=[
            {"role": "user", "content": ASK},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                               "input": {"city": "Paris"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": RESULT}]}])
        assert back.content[0].text == api.loop
    arun(runner, go())


def test_anthropic_refuses_by_name(runner, api):
    async def go():
        base = dict(model=api.model, max_tokens=4, messages=[{"role": "user", "content": QUESTION}])
        image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
        for fields, name in (
                (dict(thinking={"type": "enabled", "budget_tokens": 1024}), "thinking"),
                (dict(messages=[{"role": "user", "content": [image]}]), "messages[0].content[0].type"),
                (dict(stop_sequences=["a", "b", "c", "d", "e"]), "stop_sequences"),
                (dict(tools=[{"type": "web_search_20250305", "name": "web_search"}]), "tools[0].type"),
                (dict(messages=[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "The"}]),
                 "messages[1].role"),
                (dict(extra_body={"temperature": 2.5}), "temperature"),
                (dict(extra_body={"top_logprobs": 2}), "top_logprobs")):
            with pytest.raises(anthropic.BadRequestError) as info:
                await api.claude.messages.create(**{**base, **fields})
            assert info.value.body["type"] == "error", info.value.body
            err = info.value.body["error"]
            assert err["type"] == "invalid_request_error" and name in err["message"], (name, err)
        with pytest.raises(anthropic.NotFoundError) as info:
            await api.claude.messages.create(**{**base, "model": "claude-opus-4"})
        assert info.value.body["error"]["type"] == "not_found_error"
    arun(runner, go())


def test_openai_responses(runner, api):
    """Text and usage equal the chat path's, streamed (the standard events, numbered) and not; out
    of tokens is status incomplete; function_call items and their output give the chat path's
    answer to the same tool loop."""
    async def go():
        ask = dict(model=api.model, instructions=SYSTEM, input=QUESTION, max_output_tokens=TOKENS, temperature=0)
        r = await api.client.responses.create(**ask)
        assert r.output_text == api.ref.message.content and [o.type for o in r.output] == ["message"]
        assert (r.usage.input_tokens, r.usage.output_tokens) == (api.usage.prompt_tokens, api.usage.completion_tokens)
        assert r.status == ("incomplete" if api.ref.finish_reason == "length" else "completed")
        events = [e async for e in await api.client.responses.create(**ask, stream=True)]
        kinds = [e.type for e in events]
        assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                             "response.content_part.added"]
        assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                              f"response.{r.status}"]
        assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == api.ref.message.content
        assert [e.sequence_number for e in events] == list(range(len(events)))
        assert events[-1].response.output_text == api.ref.message.content
        back = await api.client.responses.create(model=api.model, max_output_tokens=TOKENS, temperature=0, input=[
            {"role": "user", "content": ASK},
            {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
            {"type": "function_call_output", "call_id": "call_1", "output": RESULT}])
        assert back.output_text == api.loop
    arun(runner, go())


def test_openai_responses_refuses_by_name(runner, api):
    async def go():
        image = {"type": "input_image", "image_url": "http://x/y.png"}
        for fields, name in ((dict(store=True), "store"), (dict(previous_response_id="resp_1"), "previous_response_id"),
                             (dict(tools=[{"type": "web_search"}]), "tools[0].type"),
                             (dict(reasoning={"effort": "low"}), "reasoning"),
                             (dict(input=[{"role": "user", "content": [{"type": "input_text", "text": "What is this?"},
                                                                       image]}]), "input[0].content[1].type"),
                             (dict(max_output_tokens=0), "max_output_tokens"),
                             (dict(text={"format": {"type": "json_schema", "name": "x",
                                                    "schema": {"type": "nothing"}}}), "text.format")):
            with pytest.raises(openai.BadRequestError) as info:
                await api.client.responses.create(**{"model": api.model, "input": QUESTION, **fields})
            assert info.value.body["param"] == name and name in info.value.body["message"], (name, info.value.body)
    arun(runner, go())


def test_ollama(runner, api):
    """/api/chat and /api/generate give the chat path's text and counts, streamed (NDJSON) and not;
    raw generate the completions path's; format a JSON schema; a tool turn the chat path's answer
    to the same loop; tags, show, version; refusals name the field."""
    async def go():
        opts = {"num_predict": TOKENS, "temperature": 0}
        r = await api.llama.chat(model=api.model, messages=CONVERSATION, options=opts)
        assert r.message.content == api.ref.message.content and r.done and r.done_reason == api.ref.finish_reason
        assert (r.prompt_eval_count, r.eval_count) == (api.usage.prompt_tokens, api.usage.completion_tokens)
        assert r.total_duration > r.eval_duration > 0
        parts = [p async for p in await api.llama.chat(model=api.model + ":latest", messages=CONVERSATION,
                                                       options=opts, stream=True)]
        assert "".join(p.message.content for p in parts) == api.ref.message.content and len(parts) > 2
        assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True]
        assert parts[-1].eval_count == api.usage.completion_tokens
        g = await api.llama.generate(model=api.model, system=SYSTEM, prompt=QUESTION, options=opts)
        assert g.response == api.ref.message.content and g.eval_count == api.usage.completion_tokens
        raw = await api.client.completions.create(model=api.model, prompt="The capital of France is", max_tokens=4,
                                                  temperature=0)
        streamed = [p async for p in await api.llama.generate(model=api.model, prompt="The capital of France is",
                                                              raw=True, options={"num_predict": 4, "temperature": 0},
                                                              stream=True)]
        assert "".join(p.response for p in streamed) == raw.choices[0].text and streamed[-1].done_reason == "length"
        assert (await api.llama.generate(model=api.model)).done_reason == "load"
        city = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"]}
        shaped = await api.llama.chat(model=api.model, messages=[{"role": "user", "content": ASK}], format=city,
                                      options={"num_predict": 12, "temperature": 0})
        jsonschema.validate(json.loads(shaped.message.content), city)
        back = await api.llama.chat(model=api.model, options=opts, messages=[
            {"role": "user", "content": ASK},
            {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "get_weather",
                                                                             "arguments": {"city": "Paris"}}}]},
            {"role": "tool", "content": RESULT, "tool_name": "get_weather"}])
        assert back.message.content == api.loop
        tags = await api.llama.list()
        assert [m.model for m in tags.models] == [api.model] and tags.models[0].details.family == "llama"
        assert tags.models[0].details.parameter_size == "135M" and tags.models[0].size > 0
        show = await api.llama.show(api.model)
        assert show.modelinfo["llama.block_count"] == 30 and "tools" in show.capabilities and show.template
        assert (await api.llama._client.get("/api/version")).json()["version"]
        for fields, name in ((dict(options={"num_ctx": 4096}), "options.num_ctx"),
                             (dict(options={"num_predict": -1}), "options.num_predict"),
                             (dict(options={"temperature": 3}), "options.temperature"),
                             (dict(think=True), "think"),
                             (dict(messages=[{"role": "user", "content": "What is this?", "images": ["AAAA"]}]),
                              "messages[0].images"),
                             (dict(options={"mirostat": 1}), "options.mirostat")):
            with pytest.raises(ollama.ResponseError) as info:
                await api.llama.chat(**{"model": api.model, "messages": [{"role": "user", "content": QUESTION}],
                                        **fields})
            assert info.value.status_code == 400 and name in info.value.error, (name, info.value.error)
        with pytest.raises(ollama.ResponseError) as info:
            await api.llama.chat(model="llama3.2", messages=[{"role": "user", "content": QUESTION}])
        assert info.value.status_code == 404 and "llama3.2" in info.value.error
    arun(runner, go())


# ---- over the fake scheduler: its answer is a tool call -------------------------------------------

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TOKEN = "t" * 32
KEYS = ApiKeys(parse(f"alice {TOKEN}\n"))


def test_each_client_gets_the_call_as_its_apis_call(model_dir):
    """The model's call comes back as a tool_use block (the client's stream accumulates its
    input_json_delta), a function_call item (arguments .delta / .done events), Ollama's tool_calls
    (arguments an object); a named tool is the job's grammar; keys are asked for by every adapter,
    and each job carries its API and the key's client."""
    tool = {"name": "get_weather", "description": WEATHER["description"], "input_schema": WEATHER["parameters"]}
    user = [{"role": "user", "content": ASK}]

    async def go():
        async with http_api(model_dir, keys=KEYS) as (client, fake):
            fake.answer = tokenizer(model_dir)(CALL, add_special_tokens=False)["input_ids"]
            jobs = []
            submit = fake.submit
            fake.submit = lambda job: (jobs.append(job), submit(job))[1]
            claude = anthropic.AsyncAnthropic(base_url=client.base, api_key=TOKEN, max_retries=0)
            oa = openai.AsyncOpenAI(base_url=client.base + "/v1", api_key=TOKEN, max_retries=0)
            llama = ollama.AsyncClient(host=client.base, headers={"Authorization": f"Bearer {TOKEN}"})
            try:
                m = await claude.messages.create(model=model_dir.name, max_tokens=64, messages=user, tools=[tool])
                assert m.stop_reason == "tool_use" and [(b.type, b.name, b.input) for b in m.content] == \
                    [("tool_use", "get_weather", {"city": "Paris"})]
                async with claude.messages.stream(model=model_dir.name, max_tokens=64, messages=user, tools=[tool],
                                                  tool_choice={"type": "tool", "name": "get_weather"}) as s:
                    final = await s.get_final_message()
                assert final.content[0].input == {"city": "Paris"} and final.stop_reason == "tool_use"
                assert json.loads(jobs[-1].grammar)["properties"]["name"] == {"const": "get_weather"}
                result = {"type": "tool_result", "tool_use_id": final.content[0].id, "content": RESULT}
                again = await claude.messages.create(model=model_dir.name, max_tokens=64, tools=[tool], messages=[
                    *user, {"role": "assistant", "content": final.content}, {"role": "user", "content": [result]}])
                assert again.content[0].type == "tool_use"  # (the fake answers the call again) the loop is taken
                fn = {"type": "function", **WEATHER, "strict": True}
                r = await oa.responses.create(model=model_dir.name, input=ASK, tools=[fn], max_output_tokens=64)
                assert [(o.type, o.name, json.loads(o.arguments)) for o in r.output] == \
                    [("function_call", "get_weather", {"city": "Paris"})] and r.status == "completed"
                events = [e async for e in await oa.responses.create(
                    model=model_dir.name, input=ASK, tools=[fn], max_output_tokens=64, stream=True,
                    tool_choice={"type": "function", "name": "get_weather"})]
                assert [e.type for e in events][2:] == [
                    "response.output_item.added", "response.function_call_arguments.delta",
                    "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
                assert json.loads(events[-2].item.arguments) == {"city": "Paris"} and jobs[-1].grammar
                result = {"type": "function_call_output", "call_id": r.output[0].call_id, "output": RESULT}
                again = await oa.responses.create(model=model_dir.name, tools=[fn], max_output_tokens=64,
                                                  input=[*user, *r.output, result])
                assert again.output[0].type == "function_call"  # (the fake answers the call again) the loop is taken
                functions = [{"type": "function", "function": WEATHER}]
                c = await llama.chat(model=model_dir.name, messages=user, tools=functions, options={"num_predict": 64})
                assert [(t.function.name, t.function.arguments) for t in c.message.tool_calls] == \
                    [("get_weather", {"city": "Paris"})] and not c.message.content
                parts = [p async for p in await llama.chat(model=model_dir.name, messages=user, stream=True,
                                                           tools=functions)]
                assert [t.function.arguments for p in parts for t in p.message.tool_calls or ()] == [{"city": "Paris"}]
                lp = await llama.chat(model=model_dir.name, messages=user, logprobs=True, top_logprobs=2,
                                      options={"num_predict": 3})
                assert len(lp.logprobs) == lp.eval_count == 3 and [len(x.top_logprobs) for x in lp.logprobs] == [2] * 3
                assert "".join(x.token for x in lp.logprobs) == lp.message.content
            finally:
                await claude.close()
                await oa.close()
            assert [(j.api, j.client) for j in jobs] == [("messages", "key alice")] * 3 + \
                [("responses", "key alice")] * 3 + [("ollama", "key alice")] * 3
            status, _, body = await client.post("/v1/messages", json={"model": model_dir.name, "max_tokens": 4,
                                                                      "messages": user})
            assert status == 401 and body["type"] == "error" and body["error"]["type"] == "authentication_error"
            status, _, body = await client.post("/v1/messages", headers={"X-Api-Key": TOKEN},
                                                json={"model": model_dir.name, "max_tokens": 4, "messages": user})
            assert status == 200 and body["content"]
            for method, path in (("GET", "/api/version"), ("GET", "/api/tags"), ("POST", "/api/chat")):
                status, _, body = await client.request(method, path)
                assert status == 401 and set(body) == {"error"}, (path, body)
            status, _, body = await client.post("/v1/responses", json={"input": "hi"})
            assert status == 401 and body["error"]["code"] == "invalid_api_key"
    run(go())
