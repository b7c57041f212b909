"""OpenAI's Responses API (`POST /v1/responses`) as a translation to and from the chat path.

In: `instructions` (the system turn); `input`, a string (one user turn) or items: messages
(user, assistant, system, developer; content a string or input_text / output_text parts),
`function_call` items (an assistant's tool calls) and `function_call_output` items (tool turns);
`max_output_tokens`, `temperature`, `top_p`, `tools` (function tools; `strict` taken: a forced
call is sampled under its schema), `tool_choice` (none, auto, required, {"type": "function",
"name"}), `text.format` (text, json_object, json_schema: chat's response_format), `user` /
`safety_identifier`, `stream`. Stateless: `store`, `background`, `previous_response_id`,
`conversation`, `reasoning`, `include`, `top_logprobs`, hosted tools, images and files are refused
by name unless they carry the value that asks for nothing (`store: false`, `include: []`, ...).
Errors are OpenAI's {"error": {"message", "type", "param", "code"}}.

Out: a `response` whose output is a `message` item (one output_text part) and the answer's tool
calls as `function_call` items; status completed, or incomplete (incomplete_details.reason
max_output_tokens) when the answer ran out of tokens; `usage` (input, output, total tokens).
Streamed: response.created, response.in_progress, then per item response.output_item.added /
content_part.added / output_text.delta ... output_text.done / content_part.done /
output_item.done (function_call_arguments.delta / .done for a call), then response.completed
(or response.incomplete; response.failed for an error once the stream began), every event
numbered by sequence_number.
"""
from __future__ import annotations

import time

from logicpipe.controller.api.dialect import Asked, check_model, items, known, obj, sse, text
from logicpipe.controller.api.http_body import ApiError, boolean
from logicpipe.controller.api.http_form import Form
from logicpipe.controller.jobs.door import Completion, Piece

FIELDS = {"model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "stream", "tools",
          "tool_choice", "text", "user", "safety_identifier", "parallel_tool_calls"}
NOOP = {"store": (False,), "metadata": ({},), "truncation": ("disabled",), "background": (False,), "include": ([],),
        "service_tier": ("auto", "default"), "stream_options": ({"include_obfuscation": False},),
        "previous_response_id": (), "conversation": (), "reasoning": (), "top_logprobs": (), "prompt": (),
        "max_tool_calls": (), "prompt_cache_key": ()}
RENAMED = {"max_tokens": "max_output_tokens", "response_format": "text.format", "messages": "=input"}
ROLES = ("user", "assistant", "system", "developer")


def asked(body: dict, model_id: str) -> Asked:
    """The Responses body as a chat body (a refusal names the Responses field)."""
    known(body, FIELDS, NOOP)
    check_model(body.get("model"), model_id)
    chat = {"messages": conversation(body)}
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    for name in ("temperature", "top_p"):
        if body.get(name) is not None:
            chat[name] = body[name]
    for name in ("user", "safety_identifier"):
        if body.get(name) is not None:
            chat["user"] = text(body[name], name)
    if body.get("tools") is not None:
        chat["tools"] = [tool(t, f"tools[{i}]") for i, t in enumerate(items(body["tools"], "tools", empty=True))]
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        known(choice, {"type", "name"}, where="tool_choice")
        if choice.get("type") != "function":
            raise ApiError(400, 'tool_choice must be "none", "auto", "required" or {"type": "function", "name": ...}',
                           param="tool_choice")
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    if choice is not None:
        chat["tool_choice"] = choice
    if body.get("text") is not None:
        fmt = response_format(obj(body["text"], "text"))
        if fmt is not None:
            chat["response_format"] = fmt
    echo = {k: body.get(k) for k in ("instructions", "max_output_tokens", "temperature", "top_p")}
    echo.update(tools=body.get("tools") or [], tool_choice=body.get("tool_choice") or "auto",
                text=body.get("text") or {"format": {"type": "text"}},
                parallel_tool_calls=body.get("parallel_tool_calls", True) is not False)
    return Asked(chat, boolean(body, "stream"), renamed=RENAMED, echo=echo)


def conversation(body: dict) -> list[dict]:
    """instructions and input as chat messages: consecutive function_call items (and the message
    before them, when the assistant's) are one assistant turn."""
    messages = [] if body.get("instructions") is None else [{"role": "system",
                                                              "content": text(body["instructions"], "instructions")}]
    given = body.get("input")
    if isinstance(given, str):
        return messages + [{"role": "user", "content": given}]
    for i, item in enumerate(items(given, "input")):
        w = f"input[{i}]"
        kind = obj(item, w).get("type", "message")
        if kind == "message":
            known(item, {"type", "role", "content", "id", "status", "phase"}, where=w)
            role = item.get("role")
            if role not in ROLES:
                raise ApiError(400, f"{w}.role must be one of {', '.join(ROLES)}", param=f"{w}.role")
            messages.append({"role": role, "content": parts_text(item.get("content"), f"{w}.content")})
        elif kind == "function_call":
            known(item, {"type", "call_id", "name", "arguments", "id", "status"}, where=w)
            fn = {"name": text(item.get("name"), f"{w}.name"),
                  "arguments": text(item.get("arguments"), f"{w}.arguments")}
            call = {"id": text(item.get("call_id"), f"{w}.call_id"), "type": "function", "function": fn}
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
                messages[-1]["content"] = messages[-1]["content"] or None
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            known(item, {"type", "call_id", "output", "id", "status"}, where=w)
            messages.append({"role": "tool", "tool_call_id": text(item.get("call_id"), f"{w}.call_id"),
                             "content": parts_text(item.get("output"), f"{w}.output")})
        else:
            raise ApiError(400, f"{w}.type {str(kind)[:40]!r}: this server takes message, function_call and "
                           "function_call_output items", param=f"{w}.type")
    return messages


def parts_text(content, where: str) -> str:
    """A string, or input_text / output_text parts, as one text."""
    if isinstance(content, str):
        return content
    out = []
    for j, p in enumerate(items(content, where)):
        w = f"{where}[{j}]"
        if obj(p, w).get("type") not in ("input_text", "output_text"):
            raise ApiError(400, f"{w}.type {str(p.get('type'))[:40]!r} is not supported by this server: text parts "
                           "(input_text, output_text) only", param=f"{w}.type")
        known(p, {"type", "text", "annotations", "logprobs"}, where=w)
        out.append(text(p.get("text"), f"{w}.text"))
    return "".join(out)


def tool(t, where: str) -> dict:
    if obj(t, where).get("type") != "function":
        raise ApiError(400, f"{where}.type {str(t.get('type'))[:40]!r}: hosted tools are not supported by this server; "
                       "function tools only", param=f"{where}.type")
    known(t, {"type", "name", "description", "parameters", "strict"}, where=where)
    fn = {"name": t.get("name"), "parameters": t.get("parameters") or {"type": "object", "properties": {}}}
    if t.get("description") is not None:
        fn["description"] = text(t["description"], f"{where}.description")
    return {"type": "function", "function": fn}


def response_format(given: dict) -> dict | None:
    """`text` ({"format": ...}) as chat's response_format (None: plain text)."""
    known(given, {"format"}, {"verbosity": ("medium",)}, "text")
    fmt = given.get("format")
    if fmt is None:
        return None
    kind = obj(fmt, "text.format").get("type")
    if kind == "text":
        known(fmt, {"type"}, where="text.format")
        return None
    if kind == "json_object":
        known(fmt, {"type"}, where="text.format")
        return {"type": "json_object"}
    if kind != "json_schema":
        raise ApiError(400, 'text.format.type must be "text", "json_object" or "json_schema"', param="text.format.type")
    known(fmt, {"type", "name", "schema", "strict", "description"}, where="text.format")
    return {"type": "json_schema", "json_schema": {"name": fmt.get("name") or "answer", "schema": fmt.get("schema")}}


class Reply:
    """The answer to one Responses request, whole or as its stream's events."""

    content_type = "text/event-stream"

    def __init__(self, model_id: str, completion: Completion, form: Form, asked: Asked):
        self.model_id, self.c, self.form, self.echo = model_id, completion, form, asked.echo
        self.id = "resp_" + completion.id[:24]
        self.message_id = "msg_" + completion.id[:24]
        self.created = int(time.time())
        self.seq = 0
        self.text_open = False  # a stream's message item has started
        self.sent = ""          # its text so far

    def _output(self) -> tuple[list[dict], str]:
        """(the output items, the status)."""
        message, reason = self.form.message(0)
        calls = message.get("tool_calls", ())
        status = "incomplete" if reason == "length" and not calls else "completed"
        said = message["content"] or ""
        out = [self._message(said, status)] if said or not calls else []
        return out + [self._call(call, "completed") for call in calls], status

    def _message(self, said: str, status: str) -> dict:
        done = status != "in_progress"
        content = [{"type": "output_text", "text": said, "annotations": [], "logprobs": []}] if done else []
        return {"type": "message", "id": self.message_id, "status": status, "role": "assistant", "content": content}

    @staticmethod
    def _call(call: dict, status: str) -> dict:
        return {"type": "function_call", "id": "fc_" + call["id"].removeprefix("call_"), "call_id": call["id"],
                "name": call["function"]["name"], "arguments": call["function"]["arguments"] if status != "in_progress"
                else "", "status": status}

    def _response(self, status: str, output: list, usage: bool = True) -> dict:
        n, p = len(self.c.tokens), self.c.prompt_tokens
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "model": self.model_id, "output": output, "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                **self.echo, "truncation": "disabled", "metadata": {}, "store": False,
                "usage": {"input_tokens": p, "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                          "output_tokens": n, "output_tokens_details": {"reasoning_tokens": 0},
                          "total_tokens": p + n} if usage else None}

    def whole(self) -> dict:
        output, status = self._output()
        return self._response(status, output)

    def _event(self, kind: str, **fields) -> bytes:
        self.seq += 1
        return sse(kind, {"type": kind, "sequence_number": self.seq - 1, **fields})

    def head(self) -> bytes:
        started = self._response("in_progress", [], usage=False)
        return self._event("response.created", response=started) + self._event("response.in_progress",
                                                                                response=started)

    def delta(self, piece: Piece) -> bytes:
        if not piece.text:
            return b""
        out = b"" if self.text_open else self._open_message()
        self.sent += piece.text
        return out + self._event("response.output_text.delta", item_id=self.message_id, output_index=0,
                                 content_index=0, delta=piece.text, logprobs=[])

    def _open_message(self) -> bytes:
        self.text_open = True
        return self._event("response.output_item.added", output_index=0, item=self._message("", "in_progress")) + \
            self._event("response.content_part.added", item_id=self.message_id, output_index=0, content_index=0,
                        part={"type": "output_text", "text": "", "annotations": []})

    def tail(self) -> bytes:
        """The items still to send (with tools: all of them), then response.completed or .incomplete."""
        output, status = self._output()
        out = b""
        for i, item in enumerate(output):
            if item["type"] == "message":
                if not self.text_open:
                    out += self._open_message()
                if not self.sent and item["content"][0]["text"]:  # (with tools: the whole text at the end)
                    self.sent = item["content"][0]["text"]
                    out += self._event("response.output_text.delta", item_id=self.message_id, output_index=i,
                                       content_index=0, delta=self.sent, logprobs=[])
                ids = {"item_id": self.message_id, "output_index": i, "content_index": 0}
                out += self._event("response.output_text.done", **ids, text=self.sent, logprobs=[])
                out += self._event("response.content_part.done", **ids, part=item["content"][0])
            else:
                out += self._event("response.output_item.added", output_index=i,
                                   item={**item, "arguments": "", "status": "in_progress"})
                ids = {"item_id": item["id"], "output_index": i}
                out += self._event("response.function_call_arguments.delta", **ids, delta=item["arguments"])
                out += self._event("response.function_call_arguments.done", **ids, arguments=item["arguments"],
                                   name=item["name"])
            out += self._event("response.output_item.done", output_index=i, item=item)
        return out + self._event(f"response.{status}", response=self._response(status, output))

    def failed(self, err: ApiError) -> bytes:
        failed = {**self._response("failed", []), "error": {"code": err.code or "server_error", "message": str(err)}}
        return self._event("response.failed", response=failed)
