"""Anthropic's Messages API (`POST /v1/messages`) as a translation to and from the chat path.

In: `system` (a string or text blocks) becomes the system turn; `messages` of user and assistant
turns, their content a string or blocks: text, an assistant's `tool_use` (an OpenAI tool call),
a user's `tool_result` (a tool turn; `is_error` prefixes "Error: "); `max_tokens` (required),
`temperature`, `top_p`, `top_k`, `stop_sequences` (chat's `stop`), `tools` ({name, description,
input_schema}: chat's function tools), `tool_choice` (auto, any: chat's "required", tool: a named
function, none), `metadata.user_id`, `stream`. `cache_control` is taken on any block (the mesh
reuses cached prompt prefixes on its own), `thinking` only as {"type": "disabled"}. Anything else
(images, documents, thinking blocks, server tools, a last assistant turn as prefill, ...) is a 400
naming it, in Anthropic's error shape {"type": "error", "error": {"type", "message"}}.

Out: a `message` whose content is a text block and the answer's tool calls as `tool_use` blocks;
`stop_reason` end_turn, max_tokens, stop_sequence (with `stop_sequence`) or tool_use; `usage`
input_tokens and output_tokens. Streamed: message_start, then for each block content_block_start
/ content_block_delta (text_delta, input_json_delta) / content_block_stop, then message_delta
(the stop reason, output_tokens) and message_stop; an error after the stream began is an `error`
event. With tools the answer is parsed for calls once whole, so its blocks come at its end.
"""
from __future__ import annotations

import json

from logicpipe.controller.api.dialect import Asked, call_arguments, check_model, items, known, obj, sse, text
from logicpipe.controller.api.http_body import ApiError, boolean
from logicpipe.controller.api.http_form import Form
from logicpipe.controller.jobs.door import Completion, Piece

FIELDS = {"model", "max_tokens", "messages", "system", "stop_sequences", "stream", "temperature", "top_p", "top_k",
          "tools", "tool_choice", "metadata", "cache_control"}
NOOP = {"thinking": ({"type": "disabled"},), "service_tier": ("auto", "standard_only")}
RENAMED = {"stop": "stop_sequences", "messages": "=messages", "user": "metadata.user_id"}
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


def error_body(err: ApiError) -> dict:
    kind = ERROR_TYPES.get(err.status, "api_error" if err.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": str(err)}}


def asked(body: dict, model_id: str) -> Asked:
    """The Messages body as a chat body (a refusal names the Messages field)."""
    known(body, FIELDS, NOOP)
    check_model(body.get("model"), model_id, required=True)
    cache_control(body, "")
    if body.get("max_tokens") is None:
        raise ApiError(400, "max_tokens is required: the most tokens to generate", param="max_tokens")
    messages = [] if body.get("system") is None else [{"role": "system", "content": blocks_text(body["system"],
                                                                                                  "system")}]
    turns = items(body.get("messages"), "messages")
    for i, m in enumerate(turns):
        messages += turn(m, f"messages[{i}]")
    if obj(turns[-1], f"messages[{len(turns) - 1}]").get("role") == "assistant":
        raise ApiError(400, f"messages[{len(turns) - 1}].role: a last assistant turn (prefill) is not supported by "
                       "this server: end with a user turn", param=f"messages[{len(turns) - 1}].role")
    chat = {"messages": messages, "max_tokens": body["max_tokens"]}
    for name in ("temperature", "top_p", "top_k"):
        if body.get(name) is not None:
            chat[name] = body[name]
    if body.get("stop_sequences") is not None:
        chat["stop"] = body["stop_sequences"]
    if body.get("metadata") is not None:
        known(obj(body["metadata"], "metadata"), {"user_id"}, where="metadata")
        if body["metadata"].get("user_id") is not None:
            chat["user"] = text(body["metadata"]["user_id"], "metadata.user_id")
    if body.get("tools") is not None:
        chat["tools"] = [tool(t, f"tools[{i}]") for i, t in enumerate(items(body["tools"], "tools", empty=True))]
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = tool_choice(obj(body["tool_choice"], "tool_choice"))
    return Asked(chat, boolean(body, "stream"), renamed=RENAMED)


def cache_control(block: dict, where: str) -> None:
    """`cache_control` ({"type": "ephemeral", "ttl"?}): taken, the mesh caches prompt prefixes itself."""
    cc, at = block.get("cache_control"), f"{where}.cache_control" if where else "cache_control"
    if cc is not None and not (isinstance(cc, dict) and cc.get("type") == "ephemeral" and set(cc) <= {"type", "ttl"}):
        raise ApiError(400, f'{at} must be {{"type": "ephemeral"}}', param=at)


def blocks_text(content, where: str) -> str:
    """A string, or text blocks, as one text."""
    if isinstance(content, str):
        return content
    out = []
    for j, b in enumerate(items(content, where, empty=True)):
        w = f"{where}[{j}]"
        if obj(b, w).get("type") != "text":
            raise ApiError(400, f"{w}.type {json.dumps(b.get('type'))[:40]}: not supported here, text blocks only",
                           param=f"{w}.type")
        out.append(text_block(b, w))
    return "".join(out)


def text_block(b: dict, where: str) -> str:
    known(b, {"type", "text", "cache_control", "citations"}, {"citations": ([],)}, where)
    cache_control(b, where)
    return text(b.get("text"), f"{where}.text")


def turn(m, where: str) -> list[dict]:
    """One Messages turn as chat messages: an assistant's tool_use blocks become its tool_calls, a
    user's tool_result blocks tool turns (before the user's own text)."""
    known(obj(m, where), {"role", "content"}, where=where)
    role = m.get("role")
    if role not in ("user", "assistant"):
        raise ApiError(400, f'{where}.role must be "user" or "assistant" (the system prompt is `system`)',
                       param=f"{where}.role")
    content = m.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    said, calls, results = [], [], []
    for j, b in enumerate(items(content, f"{where}.content")):
        w = f"{where}.content[{j}]"
        kind = obj(b, w).get("type")
        if kind == "text":
            said.append(text_block(b, w))
        elif kind == "tool_use" and role == "assistant":
            known(b, {"type", "id", "name", "input", "cache_control"}, where=w)
            cache_control(b, w)
            calls.append({"id": text(b.get("id"), f"{w}.id"), "type": "function", "function": {
                "name": text(b.get("name"), f"{w}.name"), "arguments": json.dumps(obj(b.get("input"), f"{w}.input"))}})
        elif kind == "tool_result" and role == "user":
            known(b, {"type", "tool_use_id", "content", "is_error", "cache_control"}, where=w)
            cache_control(b, w)
            answer = blocks_text(b.get("content", ""), f"{w}.content")
            results.append({"role": "tool", "tool_call_id": text(b.get("tool_use_id"), f"{w}.tool_use_id"),
                            "content": ("Error: " if boolean(b, "is_error", where=f"{w}.is_error") else "") + answer})
        else:
            raise ApiError(400, f"{w}.type {json.dumps(kind)[:40]}: not supported by this server in a {role} turn "
                           "(it takes text; tool_use from the assistant, tool_result from the user)",
                           param=f"{w}.type")
    if role == "assistant":
        return [{"role": "assistant", "content": "".join(said) or (None if calls else ""),
                 **({"tool_calls": calls} if calls else {})}]
    return results + ([{"role": "user", "content": "".join(said)}] if said or not results else [])


def tool(t, where: str) -> dict:
    """A client tool {name, description, input_schema} as chat's function tool."""
    if obj(t, where).get("type") not in (None, "custom"):
        raise ApiError(400, f"{where}.type {json.dumps(t['type'])[:60]}: server tools are not supported by this "
                       "server; a tool is {name, description, input_schema}", param=f"{where}.type")
    known(t, {"type", "name", "description", "input_schema", "cache_control", "strict"}, where=where)
    cache_control(t, where)
    fn = {"name": t.get("name"), "parameters": obj(t.get("input_schema"), f"{where}.input_schema")}
    if t.get("description") is not None:
        fn["description"] = text(t["description"], f"{where}.description")
    return {"type": "function", "function": fn}


def tool_choice(tc: dict) -> str | dict:
    known(tc, {"type", "name", "disable_parallel_tool_use"}, where="tool_choice")
    kind = tc.get("type")
    single = boolean(tc, "disable_parallel_tool_use", where="tool_choice.disable_parallel_tool_use")
    if kind == "tool":
        return {"type": "function", "function": {"name": tc.get("name")}}
    if kind not in ("auto", "any", "none"):
        raise ApiError(400, 'tool_choice.type must be "auto", "any", "tool" or "none"', param="tool_choice.type")
    if single and kind == "auto":  # a forced call (any, tool) is one call; auto may hold several
        raise ApiError(400, "tool_choice.disable_parallel_tool_use is not supported with auto by this server (it "
                       "holds for any and tool: one call)", param="tool_choice.disable_parallel_tool_use")
    return {"auto": "auto", "any": "required", "none": "none"}[kind]


class Reply:
    """The answer to one Messages request, whole or as its stream's events."""

    content_type = "text/event-stream"

    def __init__(self, model_id: str, completion: Completion, form: Form, asked: Asked):
        self.model_id, self.c, self.form = model_id, completion, form
        self.id = "msg_" + completion.id[:24]
        self.text_open = False  # a stream's text block has started

    def _parts(self) -> tuple[str, list[dict], str]:
        """(the text, the tool_use blocks, the stop reason)."""
        message, reason = self.form.message(0)
        calls = [{"type": "tool_use", "id": "toolu_" + call["id"].removeprefix("call_"),
                  "name": call["function"]["name"], "input": call_arguments(call)}
                 for call in message.get("tool_calls", ())]
        stop = "tool_use" if calls else "max_tokens" if reason == "length" else \
            "stop_sequence" if self.c.stop_string else "end_turn"
        return message["content"] or "", calls, stop

    def _message(self, content: list, stop: str | None, output_tokens: int) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model_id, "content": content,
                "stop_reason": stop, "stop_sequence": (self.c.stop_string or None) if stop else None,
                "usage": {"input_tokens": self.c.prompt_tokens, "output_tokens": output_tokens}}

    def whole(self) -> dict:
        said, calls, stop = self._parts()
        return self._message(([{"type": "text", "text": said}] if said else []) + calls, stop, len(self.c.tokens))

    def head(self) -> bytes:
        return sse("message_start", {"type": "message_start", "message": self._message([], None, 0)})

    def delta(self, piece: Piece) -> bytes:
        if not piece.text:
            return b""
        out = b"" if self.text_open else self._start(0, {"type": "text", "text": ""})
        self.text_open = True
        return out + self._delta(0, {"type": "text_delta", "text": piece.text})

    def tail(self) -> bytes:
        """The blocks still to send (with tools: all of them), then the stop reason and the end."""
        said, calls, stop = self._parts()
        out, index = b"", 0
        if self.form.tools is not None and said:
            out += self._start(0, {"type": "text", "text": ""}) + self._delta(0, {"type": "text_delta", "text": said})
            self.text_open = True
        if self.text_open:
            out += sse("content_block_stop", {"type": "content_block_stop", "index": 0})
            index = 1
        for i, call in enumerate(calls, index):
            out += self._start(i, {**call, "input": {}})
            out += self._delta(i, {"type": "input_json_delta", "partial_json": json.dumps(call["input"])})
            out += sse("content_block_stop", {"type": "content_block_stop", "index": i})
        out += sse("message_delta", {"type": "message_delta", "delta": {
            "stop_reason": stop, "stop_sequence": self.c.stop_string or None},
            "usage": {"output_tokens": len(self.c.tokens)}})
        return out + sse("message_stop", {"type": "message_stop"})

    def failed(self, err: ApiError) -> bytes:
        return sse("error", error_body(err))

    @staticmethod
    def _start(index: int, block: dict) -> bytes:
        return sse("content_block_start", {"type": "content_block_start", "index": index, "content_block": block})

    @staticmethod
    def _delta(index: int, delta: dict) -> bytes:
        return sse("content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta})
