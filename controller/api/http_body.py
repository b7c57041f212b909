"""An HTTP API request body, from bytes to the front door's types, refusing what it cannot honour.

Every refusal is an `ApiError`, answered as OpenAI's error body {"error": {"message", "type",
"param", "code"}} with `param` naming the field at fault. The rules, so that a client never gets a
result other than the one it asked for:

- the body is a JSON object, nested at most MAX_JSON_DEPTH deep, with no lone UTF-16 surrogate in
  any string (it has no UTF-8 form: the tokenizer cannot take it) and no NaN or Infinity;
- every field is one this API honours, or one of OpenAI's it does not implement yet (NOT_YET)
  carrying the value that asks for nothing (`"echo": false`, `"best_of": 1`);
  anything else is refused by name, never ignored;
- booleans are JSON booleans (`"stream": "yes"` is refused, not taken as true), numbers are finite
  numbers of the field's kind and range.
"""
from __future__ import annotations

import json
import math
import re

from logicpipe.controller.jobs.grammar_check import check_schema
from logicpipe.controller.jobs.rules import OutlineOptions, RequestOptions, check_stops
from logicpipe.controller.jobs.outline import MAX_POINTS as MAX_OUTLINE_POINTS
from logicpipe.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    MeshError,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from logicpipe.sampling import (
    JSON_OBJECT,
    MAX_BIAS,
    MAX_BIASED_TOKENS,
    MAX_PENALTY,
    MAX_TOP_LOGPROBS,
    SamplingParams,
)

DEFAULT_MAX_TOKENS = 256
MAX_JSON_DEPTH = 32  # a chat body is 5 deep; deeper is refused before any field is read

# the fields each endpoint honours: OpenAI's, and the mesh's own (speculate, top_k, ignore_eos, outline, max_points)
COMMON = frozenset({"model", "max_tokens", "temperature", "top_p", "seed", "stop", "n", "stream", "stream_options",
                    "user", "speculate", "top_k", "ignore_eos", "outline", "max_points", "presence_penalty",
                    "frequency_penalty", "logit_bias", "response_format"})
FIELDS = {"chat": COMMON | {"messages", "max_completion_tokens", "logprobs", "top_logprobs", "tools", "tool_choice"},
          "completions": COMMON | {"prompt", "logprobs", "echo"}}

# OpenAI's parameters not implemented yet: accepted only with a value that asks for nothing (null always)
NOT_YET = {
    "functions": ([],),
    "function_call": ("none", "auto"), "parallel_tool_calls": (True, False), "best_of": (1,), "echo": (False,),
    "suffix": ("",), "store": (False,), "metadata": ({},), "service_tier": ("auto", "default"),
    "reasoning_effort": (), "modalities": (["text"],), "audio": (), "prediction": (), "web_search_options": (),
}

_SURROGATE = re.compile("[\ud800-\udfff]")


class ApiError(Exception):
    """A refusal: HTTP `status`, OpenAI's error `kind` and `code`, the field at fault (`param`)."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.kind, self.param, self.code = status, kind, param, code

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}


def mesh_error(err: MeshError) -> ApiError:
    """A front-door refusal as the API answers it: the status its kind maps to, the same message."""
    if isinstance(err, InvalidArgument):
        return ApiError(400, str(err))
    if isinstance(err, NotFound):
        return ApiError(404, str(err), code="request_not_found")
    if isinstance(err, AlreadyExists):
        return ApiError(409, str(err), code="request_exists")
    if isinstance(err, ResourceExhausted):
        return ApiError(429, str(err), "rate_limit_error", code="mesh_full")
    if isinstance(err, (Unavailable, FailedPrecondition)):
        return ApiError(503, str(err), "service_unavailable", code="no_plan")
    return ApiError(500, str(err), "server_error")


def shown(text: str, n: int = 40) -> str:
    """`text` cut to `n` characters, printable whatever it holds (surrogates escaped)."""
    return text[:n].encode("utf-8", "backslashreplace").decode()


def parse(raw: bytes) -> dict:
    """The body as a JSON object, checked for depth, lone surrogates and non-finite numbers."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise ApiError(400, f"the body is nested too deeply (at most {MAX_JSON_DEPTH} levels)",
                       code="invalid_json") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, an integer of over 4300 digits
        raise ApiError(400, f"the body is not JSON: {shown(str(exc), 200)}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object", code="invalid_json")
    walk(body)
    return body


def walk(body: dict) -> None:
    """Refuse (naming the place) a value nested over MAX_JSON_DEPTH, a string or key with a lone
    surrogate, a NaN or an infinity; iterative, so no depth can overflow the stack, and quick over
    the long lists of numbers a prompt of token ids is (a place is named only for a container)."""
    stack = [(body, "", 1)]
    while stack:
        value, path, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise ApiError(400, f"{path} is nested too deeply (at most {MAX_JSON_DEPTH} levels)", param=path)
        keyed = isinstance(value, dict)
        for k, v in value.items() if keyed else enumerate(value):
            if keyed and _SURROGATE.search(k):
                where = place(path, k, keyed)
                raise ApiError(400, f"the key {where} holds a lone UTF-16 surrogate: send valid Unicode", param=where)
            kind = type(v)
            if kind is int or kind is bool or v is None:
                continue
            if kind is str:
                if _SURROGATE.search(v):
                    where = place(path, k, keyed)
                    raise ApiError(400, f"{where} holds a lone UTF-16 surrogate (\\ud800 to \\udfff without its "
                                   "pair), which is not text: send valid Unicode", param=where)
            elif kind is float:
                if not math.isfinite(v):
                    where = place(path, k, keyed)
                    raise ApiError(400, f"{where} is {v}: numbers must be finite (JSON has no NaN or Infinity)",
                                   param=where)
            else:  # a dict or a list
                stack.append((v, place(path, k, keyed), depth + 1))


def place(path: str, key, keyed: bool) -> str:
    """Where body[...path][key] is, as a param: `messages[0].content`."""
    if not keyed:
        return f"{path}[{key}]"
    return f"{path}.{shown(key)}" if path else shown(key)


def check_fields(body: dict, api: str) -> None:
    """Refuse a field `api` ("chat", "completions") does not honour, naming it."""
    for name, value in body.items():
        if name == "user" and value is not None and not isinstance(value, str):
            raise ApiError(400, "user must be a string (an id of the end user; not used by this server)", param="user")
        if name in FIELDS[api]:
            continue
        if name in NOT_YET:
            noop = NOT_YET[name]
            noop = noop[api] if isinstance(noop, dict) else noop
            if value is None or any(type(value) is type(v) and value == v for v in noop):
                continue
            raise ApiError(400, f"{name} is not supported by this server yet; leave it out"
                           + (f" (or send {json.dumps(noop[0])})" if noop else ""), param=name,
                           code="unsupported_parameter")
        other = "chat/completions" if api == "completions" else "completions"
        hint = f" ({name} belongs to /v1/{other})" if name in FIELDS["chat" if api == "completions" else "completions"] \
            else ""
        raise ApiError(400, f"unknown parameter {shown(name)!r}{hint}; this endpoint takes "
                       f"{', '.join(sorted(FIELDS[api]))}", param=shown(name), code="unknown_parameter")


def boolean(body: dict, name: str, default: bool = False, where: str = "") -> bool:
    """body[name], a JSON boolean (`where`: its place, for the error; default: `name`)."""
    value, where = body.get(name), where or name
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ApiError(400, f"{where} must be true or false (a JSON boolean), not {shown(json.dumps(value))}",
                       param=where)
    return value


def number(body: dict, name: str, kind, default, low=None, high=None):
    """body[name] as `kind` (int or float) within [low, high], or `default` when absent or null."""
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int):
        raise ApiError(400, f"{name} must be {'a number' if kind is float else 'an integer'}", param=name)
    if (low is not None and value < low) or (high is not None and value > high):
        got = str(value) if len(str(value)) <= 24 else f"{str(value)[:12]}... ({len(str(value))} characters)"
        want = f"at least {low}" if high is None else f"at most {high}" if low is None else f"in [{low}, {high}]"
        raise ApiError(400, f"{name} must be {want}, got {got}", param=name)
    try:
        return kind(value)
    except OverflowError:  # an integer too large for a float
        raise ApiError(400, f"{name} is too large", param=name) from None


def request_options(body: dict, api: str = "chat") -> RequestOptions:
    """The body's generation fields as the front door's options (`api`: "chat" or "completions")."""
    tokens = {"max_tokens": body.get("max_completion_tokens", body.get("max_tokens"))}
    if None not in (body.get("max_tokens"), body.get("max_completion_tokens")) and \
            body["max_tokens"] != body["max_completion_tokens"]:  # (one of them would be dropped)
        raise ApiError(400, "max_tokens and max_completion_tokens differ: send one of them", param="max_tokens")
    echo = echoed(body, api)
    max_tokens = number(tokens, "max_tokens", int, DEFAULT_MAX_TOKENS, 0 if echo else 1, None)  # 0: the prompt only
    stop = body.get("stop")
    stops = [] if stop is None else [stop] if isinstance(stop, str) else stop
    try:
        check_stops(stops if isinstance(stops, list) else [None])  # (not a list: refused as no string)
    except InvalidArgument as exc:
        raise ApiError(400, str(exc), param="stop") from None
    sampling = SamplingParams(number(body, "temperature", float, 1.0, 0.0, 2.0), number(body, "top_k", int, 0, 0, None),
                              number(body, "top_p", float, 1.0, 0.0, 1.0), number(body, "seed", int, None, 0, 2**63 - 1),
                              number(body, "presence_penalty", float, 0.0, -MAX_PENALTY, MAX_PENALTY),
                              number(body, "frequency_penalty", float, 0.0, -MAX_PENALTY, MAX_PENALTY),
                              logit_bias(body))
    try:
        sampling.validate()
    except ValueError as exc:
        raise ApiError(400, str(exc), param=str(exc).split()[0]) from None
    speculate = number(body, "speculate", int, None, 0, None)
    outline = None
    if boolean(body, "outline"):
        outline = OutlineOptions(max_points=number(body, "max_points", int, 0, 0, MAX_OUTLINE_POINTS))
    elif body.get("max_points") is not None:
        raise ApiError(400, "max_points is for an outline request: send it with \"outline\": true", param="max_points")
    top_logprobs = logprobs(body, api)
    if outline is not None and top_logprobs is not None:
        raise ApiError(400, "logprobs are not available for an outline request (its answer is several sequences)",
                       param="logprobs")
    if echo and outline is not None:
        raise ApiError(400, "echo is not available for an outline request", param="echo")
    prompt_logprobs = None
    if echo and (top_logprobs is not None or not max_tokens):  # (max_tokens 0 computes the prompt: its logprobs)
        prompt_logprobs = top_logprobs or 0
    grammar = response_format(body)
    if grammar and outline is not None:
        raise ApiError(400, "response_format is for plain requests: an outline's answer is several sequences",
                       param="response_format")
    return RequestOptions(max_tokens=max_tokens, sampling=sampling, ignore_eos=boolean(body, "ignore_eos"),
                          speculate=speculate, stop=tuple(stops), outline=outline, top_logprobs=top_logprobs,
                          prompt_logprobs=prompt_logprobs, json_schema=grammar)


def response_format(body: dict) -> str:
    """OpenAI's response_format as the grammar the last stage samples under: "" (text), JSON_OBJECT,
    or the schema's text; an unknown type, a schema the grammar library refuses or one that admits
    no JSON value is a 400 with its reason (checked here, so it never reaches a stage; compiling it
    takes milliseconds: the API calls this off the event loop for a body that has one)."""
    rf = body.get("response_format")
    if rf is None:
        return ""
    kind = rf.get("type") if isinstance(rf, dict) else None
    if kind == "text":
        return ""
    if kind == "json_object":
        return JSON_OBJECT
    if kind != "json_schema":
        raise ApiError(400, 'response_format must be {"type": "text"}, {"type": "json_object"} or {"type": '
                       '"json_schema", "json_schema": {"name": ..., "schema": {...}}}, got type '
                       f"{shown(str(kind))}", param="response_format")
    spec = rf.get("json_schema")
    schema = spec.get("schema") if isinstance(spec, dict) else None
    if not isinstance(schema, dict):
        raise ApiError(400, 'response_format json_schema needs "json_schema": {"name": ..., "schema": {a JSON '
                       "schema object}}", param="response_format")
    try:
        return check_schema(json.dumps(schema))
    except ValueError as exc:
        raise ApiError(400, f"response_format: {exc}", param="response_format") from None


def echoed(body: dict, api: str) -> bool:
    """completions' `echo`: the answer starts with the prompt (and its logprobs, when asked)."""
    return api == "completions" and boolean(body, "echo")


def logprobs(body: dict, api: str) -> int | None:
    """How many most likely tokens to report with each token's logprob (None: no logprobs). Chat:
    `logprobs: true` and `top_logprobs` (0 to 20); completions: `logprobs: N` (0 to 20; OpenAI
    caps it at 5, we at 20)."""
    if api == "chat":
        asked = boolean(body, "logprobs")
        top = number(body, "top_logprobs", int, None, 0, MAX_TOP_LOGPROBS)
        if top is not None and not asked:
            raise ApiError(400, "top_logprobs needs \"logprobs\": true", param="top_logprobs")
        return (top or 0) if asked else None
    return number(body, "logprobs", int, None, 0, MAX_TOP_LOGPROBS)


def logit_bias(body: dict) -> tuple[tuple[int, float], ...]:
    """logit_bias: {"token id": bias in [-100, 100]} (JSON keys are strings) -> sorted pairs."""
    bias = body.get("logit_bias")
    if bias is None:
        return ()
    if not isinstance(bias, dict):
        raise ApiError(400, "logit_bias must be an object {\"token id\": bias from -100 to 100}", param="logit_bias")
    if len(bias) > MAX_BIASED_TOKENS:
        raise ApiError(400, f"logit_bias biases {len(bias)} tokens, over the cap of {MAX_BIASED_TOKENS}",
                       param="logit_bias")
    out = []
    for key, value in bias.items():
        where = f"logit_bias.{shown(key)}"
        if not (key.isascii() and key.isdigit() and len(key) <= 9):
            raise ApiError(400, f"{where}: a key of logit_bias is a token id (a number), not {shown(key)!r}",
                           param=where)
        out.append((int(key), number({where: value}, where, float, 0.0, -MAX_BIAS, MAX_BIAS)))
    return tuple(sorted(out))


def stream_options(body: dict) -> tuple[bool, bool]:
    """(stream, include_usage: a last chunk carries the usage)."""
    stream = boolean(body, "stream")
    opts = body.get("stream_options")
    if opts is None:
        return stream, False
    if not stream:
        raise ApiError(400, "stream_options is only for a stream: send it with \"stream\": true",
                       param="stream_options")
    if not isinstance(opts, dict):
        raise ApiError(400, "stream_options must be an object, e.g. {\"include_usage\": true}", param="stream_options")
    for key in opts:
        if key != "include_usage":
            raise ApiError(400, f"stream_options.{shown(key)} is not supported; this server takes include_usage",
                           param=f"stream_options.{shown(key)}", code="unknown_parameter")
    return stream, boolean(opts, "include_usage", where="stream_options.include_usage")


TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
MAX_TOOLS = 128


def tool_options(body: dict) -> tuple[list[dict], str | None]:
    """chat's `tools` and `tool_choice` -> (the tools, each {"type": "function", "function": {...}};
    the choice: None for "none" or no tools, "" for "auto", "*" for "required", else the function
    named). A tool's parameters must be a JSON schema the grammar library takes (a forced call is
    sampled under it)."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is None:
        tools = []
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise ApiError(400, f"tools must be a list of up to {MAX_TOOLS} {{\"type\": \"function\", \"function\": "
                       "{\"name\", \"description\", \"parameters\"}} objects", param="tools")
    names = set()
    for i, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        name = f.get("name") if isinstance(f, dict) else None
        if not isinstance(name, str) or not TOOL_NAME.fullmatch(name) or name in names:
            raise ApiError(400, f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}} "
                           "with a unique name of 1-64 letters, digits, _ or -", param=f"tools[{i}]")
        names.add(name)
        params = f.get("parameters")
        if params is not None:
            try:
                check_schema(json.dumps(params) if isinstance(params, dict) else "[]")
            except ValueError as exc:
                raise ApiError(400, f"tools[{i}].function.parameters: {exc}", param=f"tools[{i}]") from None
    if choice is None:
        choice = "auto"
    if isinstance(choice, dict):
        f = choice.get("function") if choice.get("type") == "function" else None
        name = f.get("name") if isinstance(f, dict) else None
        if name not in names:
            raise ApiError(400, f"tool_choice names function {shown(json.dumps(name), 30)}, which is not one of "
                           "tools", param="tool_choice")
        return tools, name
    if choice not in ("none", "auto", "required"):
        raise ApiError(400, 'tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
                       '{"name": ...}}', param="tool_choice")
    if choice == "required" and not tools:
        raise ApiError(400, 'tool_choice "required" needs tools', param="tool_choice")
    if choice == "none" or not tools:
        return tools, None
    return tools, "*" if choice == "required" else ""
