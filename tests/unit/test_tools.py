"""controller.tools: the family chosen by the chat template, each family's parser on fixture
answers of models that emit calls (Qwen's <tool_call> tags, Llama 3.1's bare JSON), what is not a
call left as content, and the forced call's schema."""
from __future__ import annotations

import json
from types import SimpleNamespace

import jsonschema

from logicpipe.controller.api.tools import LLAMA3, QWEN, call_schema, family, parse, renders_tools

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
         {"type": "function", "function": {"name": "get_time"}}]
QWEN_TEMPLATE = "{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>{% endif %}<tool_call>"
LLAMA_TEMPLATE = "{% if tools %}Environment: ipython{% endif %}<|python_tag|>{{ messages }}"


def test_family_by_template():
    assert family(SimpleNamespace(chat_template=QWEN_TEMPLATE)) == QWEN
    assert family(SimpleNamespace(chat_template=LLAMA_TEMPLATE)) == LLAMA3
    assert family(SimpleNamespace(chat_template="{{ messages }}")) == QWEN  # (SmolLM2's: the fallback)
    assert renders_tools(SimpleNamespace(chat_template=QWEN_TEMPLATE))
    assert not renders_tools(SimpleNamespace(chat_template="{{ messages }}"))


def test_qwen_calls_parsed():
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
    content, calls = parse(text, QWEN, TOOLS)
    assert content == "Let me check."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert len({c["id"] for c in calls}) == 2
    # cut before its closing tag (max_tokens): the call is still whole
    assert parse('<tool_call>\n{"name": "get_time", "arguments": {}}', QWEN, TOOLS)[1][0]["function"]["name"] == \
        "get_time"


def test_llama3_calls_parsed():
    content, calls = parse('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}', LLAMA3, TOOLS)
    assert content is None and json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo"}
    _, calls = parse('{"name": "get_time", "parameters": {}}; {"name": "get_weather", "parameters": {"city": "a;b"}}',
                     LLAMA3, TOOLS)
    assert [c["function"]["name"] for c in calls] == ["get_time", "get_weather"]


def test_what_is_not_a_call_stays_content():
    for text, fam in (("The weather is sunny.", QWEN), ('{"name": "rm_rf", "arguments": {}}', QWEN),
                      ("<tool_call>not json</tool_call>", QWEN), ('{"city": "Paris"}', LLAMA3)):
        content, calls = parse(text, fam, TOOLS)
        assert calls == [] and content == text


def test_call_schema_accepts_only_calls_to_the_tools():
    one = json.loads(call_schema(TOOLS, "get_weather", QWEN))
    jsonschema.validate({"name": "get_weather", "arguments": {"city": "Paris"}}, one)
    for bad in ({"name": "get_time", "arguments": {}}, {"name": "get_weather", "arguments": {}},
                {"name": "get_weather", "parameters": {"city": "x"}}):
        try:
            jsonschema.validate(bad, one)
        except jsonschema.ValidationError:
            continue
        raise AssertionError(f"{bad} validated")
    both = json.loads(call_schema(TOOLS, None, LLAMA3))
    jsonschema.validate({"name": "get_time", "parameters": {}}, both)
