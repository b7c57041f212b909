"""What the adapters of other APIs (Anthropic Messages, OpenAI Responses, Ollama:
controller.http_adapters) share: the translated request (`Asked`), the refusal of a field none of
them honours, by name, and the small pieces of their answers (an event of a stream, a call's
arguments, a timestamp).

An adapter turns its body into an OpenAI chat (or completions) body and hands it to the chat path
(HttpApi.opened), so every rule of that path holds for it; a refusal there names the chat field,
which `renamed` turns back into the adapter's own name (`stop` -> `stop_sequences`)."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

from logicpipe.controller.api.http_body import ApiError, place, shown


@dataclass(frozen=True)
class Asked:
    """An adapter's request, translated: the OpenAI body the chat path runs, and what the answer needs."""

    body: dict                  # an OpenAI chat body (kind "chat") or completions body (kind "completions")
    stream: bool                # answer as the API's stream
    kind: str = "chat"
    renamed: dict = field(default_factory=dict)  # a chat field (or its prefix) -> the adapter's name, for errors
    echo: dict = field(default_factory=dict)     # request fields the answer repeats (the model's name, tools, ...)
    answer: dict | None = None  # answered without generating (Ollama's load request): this body


def known(body: dict, fields, noop: dict | None = None, where: str = "") -> None:
    """Refuse, naming it, a key of `body` (at `where`) that is not in `fields`, unless it is null
    (which asks for nothing; clients send their unset fields so) or `noop` lists it with a value
    that asks for nothing."""
    noop = noop or {}
    for name, value in body.items():
        if name in fields or value is None:
            continue
        if name in noop and any(type(value) is type(v) and value == v for v in noop[name]):
            continue
        at = place(where, name, True)
        only = f" (or send {json.dumps(noop[name][0])})" if noop.get(name) else ""
        raise ApiError(400, f"{at} is not supported by this server; leave it out{only}. Supported here: "
                       f"{', '.join(sorted(fields))}", param=at, code="unsupported_parameter")


def obj(value, where: str) -> dict:
    if not isinstance(value, dict):
        raise ApiError(400, f"{where} must be an object", param=where)
    return value


def items(value, where: str, empty: bool = False) -> list:
    if not isinstance(value, list) or (not value and not empty):
        raise ApiError(400, f"{where} must be a {'' if empty else 'non-empty '}list", param=where)
    return value


def text(value, where: str) -> str:
    if not isinstance(value, str):
        raise ApiError(400, f"{where} must be a string", param=where)
    return value


def renamed(err: ApiError, names: dict) -> ApiError:
    """A chat-path refusal of the field `err.param` named by the adapter's name for it (the exact
    field, or the part of a path before its first `[` or `.`)."""
    param = err.param or ""
    head = param.split("[")[0].split(".")[0]
    new = names.get(param, names.get(head, ""))
    if not new:
        return err
    if param not in names and not new.startswith("="):  # "=name": the chat body's places in it are not the
        new += param[len(head):]                          # adapter's (its list is ordered otherwise)
    new = new.lstrip("=")
    return ApiError(err.status, f"{new}: {err}", err.kind, new, err.code)


def check_model(given, model_id: str, aliases: tuple[str, ...] = (), required: bool = False) -> None:
    """The model asked for is the one this mesh serves (or one of its `aliases`), else 404."""
    if given is None and not required:
        return
    if not isinstance(given, str):
        raise ApiError(400, "model must be a string (the model's name)", param="model")
    if given != model_id and given not in aliases:
        raise ApiError(404, f"the model {shown(given, 100)!r} does not exist; this mesh serves {model_id!r}",
                       code="model_not_found", param="model")


def call_arguments(call: dict) -> dict:
    """An OpenAI tool call's arguments (JSON text; parsed by controller.tools) as an object."""
    args = json.loads(call["function"]["arguments"])
    return args if isinstance(args, dict) else {"value": args}


def sse(event: str, data: dict) -> bytes:
    """A server-sent event with its name."""
    return f"event: {event}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n".encode()


def iso_now() -> str:
    """Now as Ollama writes a time: RFC 3339, UTC, with nanoseconds' place."""
    t = time.time()
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t % 1 * 1e9):09d}Z"
