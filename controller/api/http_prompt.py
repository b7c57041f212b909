"""An HTTP API body's prompt, as the front door's `Prompt`: a chat body's conversation (a tool
loop's turns included), a completions body's prompt or batch of prompts. A refusal is an ApiError
naming the field at fault (controller.http_body's rules)."""
from __future__ import annotations

import json

from logicpipe.controller.api.http_body import MAX_TOOLS, ApiError, shown
from logicpipe.controller.jobs.rules import ROLES, Prompt

MAX_BATCH_PROMPTS = 64   # prompts of one completions request (each counts toward the client's cap)


def chat_prompt(body: dict) -> Prompt:
    """The conversation of a chat body. A tool loop's turns are taken too: an assistant turn's
    `tool_calls` become its text in the tool-call format the tools' system message teaches
    (<tool_call>{"name", "arguments"}</tool_call>), and a `tool` turn (its `tool_call_id`) the
    tool's answer (controller.text renders it for the model's template)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list of {\"role\", \"content\"} objects", param="messages")
    turns = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ApiError(400, f"{where} must be an object with a role and content", param=where)
        role = m.get("role")
        allowed = {"role", "content"} | ({"tool_calls"} if role == "assistant" else set()) | \
            ({"tool_call_id"} if role == "tool" else set())
        for key in m:
            if key not in allowed:
                raise ApiError(400, f"{where}.{shown(key)} is not supported by this server yet; a message is its "
                               "role and content (an assistant's tool_calls, a tool's tool_call_id)",
                               param=f"{where}.{shown(key)}", code="unsupported_parameter")
        if role not in ROLES:  # developer: OpenAI's newer name for system, taken as system
            raise ApiError(400, f"{where}.role must be one of {', '.join(ROLES)}, not "
                           f"{shown(json.dumps(role), 30)}", param=f"{where}.role")
        calls = m.get("tool_calls")
        if calls is not None:
            text = "" if m.get("content") is None else message_text(m.get("content"), f"{where}.content")
            turns.append((role, "\n".join(x for x in (text, *tool_call_texts(calls, f"{where}.tool_calls")) if x)))
            continue
        if role == "tool" and not isinstance(m.get("tool_call_id"), str):
            raise ApiError(400, f"{where}.tool_call_id must name the call this answers", param=f"{where}.tool_call_id")
        turns.append((role, message_text(m.get("content"), f"{where}.content")))
    return Prompt(messages=tuple(turns))


def tool_call_texts(calls, where: str) -> list[str]:
    """An assistant turn's tool_calls as the model wrote them: <tool_call>{"name", "arguments"}</tool_call>."""
    if not isinstance(calls, list) or not calls or len(calls) > MAX_TOOLS:
        raise ApiError(400, f"{where} must be a list of 1 to {MAX_TOOLS} calls", param=where)
    out = []
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not isinstance(fn.get("arguments"), str):
            raise ApiError(400, f"{where}[{j}] must be {{\"id\", \"type\": \"function\", \"function\": {{\"name\", "
                           "\"arguments\": \"<JSON text>\"}}}}", param=f"{where}[{j}]")
        try:
            args = json.loads(fn["arguments"])
        except ValueError:
            raise ApiError(400, f"{where}[{j}].function.arguments is not JSON text", param=f"{where}[{j}]") from None
        out.append("<tool_call>\n" + json.dumps({"name": fn["name"], "arguments": args}, ensure_ascii=False)
                   + "\n</tool_call>")
    return out


def message_text(content, where: str) -> str:
    """A message's content: text, or a list of text parts [{"type": "text", "text": ...}]."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(400, f"{where} must be text (a string or a list of text parts)", param=where)
    parts = []
    for j, p in enumerate(content):
        if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str) \
                or set(p) != {"type", "text"}:
            kind = p.get("type") if isinstance(p, dict) else None
            raise ApiError(400, f"{where}[{j}] must be a text part {{\"type\": \"text\", \"text\": \"...\"}}"
                           + (f"; {shown(str(kind), 30)!r} parts are not supported by this server yet"
                              if isinstance(kind, str) and kind != "text" else ""), param=f"{where}[{j}]")
        parts.append(p["text"])
    return "".join(parts)


def completion_prompts(body: dict) -> list[Prompt]:
    """The prompts of a completions body, each its own choice: a string, a list of token ids, or a
    batch (a list) of either kind, up to MAX_BATCH_PROMPTS."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) > MAX_BATCH_PROMPTS:
            raise ApiError(400, f"prompt: a batch of {len(prompt)} prompts is over the cap of {MAX_BATCH_PROMPTS}; "
                           "send them in several requests", param="prompt")
        return [one_prompt(p, f"prompt[{i}]") for i, p in enumerate(prompt)]
    return [one_prompt(prompt, "prompt")]


def one_prompt(prompt, where: str) -> Prompt:
    """A string, or a list of token ids (`where`: its place, for the error)."""
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return Prompt(token_ids=tuple(prompt))
    if not isinstance(prompt, str) or not prompt:
        raise ApiError(400, f"{where} must be a non-empty string or a list of token ids"
                       + ("" if where != "prompt" else " (or a list of either: a batch)"), param=where)
    return Prompt(text=prompt, raw=True)
