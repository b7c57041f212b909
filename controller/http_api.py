"""The OpenAI-compatible HTTP adapter (`logicpipe-controller --http HOST:PORT`), served by aiohttp
in the controller's own event loop. Every request goes through the front door
(controller.requests), exactly as one from gRPC Submit does: the same caps, tokenizing, chat
template, stop strings and outline requests.

    POST /v1/chat/completions   messages (system/user/assistant) through the model's chat template
    POST /v1/completions        a raw prompt (a string, or a list of token ids)
    GET  /v1/models             the one model the mesh serves
    GET  /health                200 while a plan serves, 503 otherwise
    GET  /metrics               Prometheus (controller.metrics)
    GET  /v1/requests/{id}/stream   a stream again, after the tokens the client holds (Last-Event-ID)

Resuming a stream. Every response names its request in the header X-Request-Id (a client may
choose the id by sending that header itself), and every server-sent event of a stream carries
`id: N`, N the tokens the client has with it. A client whose stream broke (the controller
restarted, or a standby took over: give clients both addresses) asks GET /v1/requests/{id}/stream
with the header Last-Event-ID: N (the last id it got; 0 or none: from the start) and receives the
rest, the same chunks the first stream would have carried. 404: the request ended or is unknown.

Request fields: `model`, `max_tokens` (or `max_completion_tokens`), `temperature`, `top_p`, `seed`,
`stop` (a string or up to 4), `n` (1 only), `stream`; the mesh's own options as extra fields:
`speculate` (candidate tokens per step, 0 = off), `top_k`, `ignore_eos`, `outline` (an outline-DAG
request, with `max_points`; `max_tokens` is then per point). Streams are server-sent events of the
standard chunk objects, ending with `data: [DONE]`. Errors are OpenAI-style JSON bodies,
{"error": {"message", "type", "param", "code"}}: 400 for a bad request, 404 for an unknown model,
413 for a body over MAX_BODY_BYTES, 429 when the mesh's queue or the client's cap is full, 503
when no plan serves. A client that goes away mid-stream cancels its request, which closes its
sequences on every stage.
"""
from __future__ import annotations

import json
import logging
import time
from dataclasses import replace

from aiohttp import web

from logicpipe.common.transport import is_loopback
from logicpipe.controller.app import ControllerApp
from logicpipe.controller.metrics import Metrics
from logicpipe.controller.requests import Completion, FrontDoor, OutlineOptions, Prompt, RequestOptions, host_client
from logicpipe.controller.state import Phase
from logicpipe.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    MeshError,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from logicpipe.sampling import SamplingParams

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 8 * 2**20  # a request body, bytes: room for the front door's prompt cap, JSON-escaped
DEFAULT_MAX_TOKENS = 256
MAX_OUTLINE_POINTS = 32


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.kind, self.param, self.code = status, kind, param, code

    def response(self) -> web.Response:
        return web.json_response({"error": {"message": str(self), "type": self.kind, "param": self.param,
                                            "code": self.code}}, status=self.status)


def mesh_error(err: MeshError) -> ApiError:
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


def number(body: dict, name: str, kind, default, low=None, high=None):
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int):
        raise ApiError(400, f"{name} must be {'a number' if kind is float else 'an integer'}", param=name)
    if (low is not None and value < low) or (high is not None and value > high):
        raise ApiError(400, f"{name} must be in [{low}, {high}], got {value}", param=name)
    return kind(value)


def request_options(body: dict) -> RequestOptions:
    """The body's generation fields as the front door's options."""
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    max_tokens = number({"max_tokens": max_tokens}, "max_tokens", int, DEFAULT_MAX_TOKENS, 1, None)
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else (stop or [])
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise ApiError(400, "stop must be a string or a list of up to 4 non-empty strings", param="stop")
    sampling = SamplingParams(number(body, "temperature", float, 1.0, 0.0, 2.0), number(body, "top_k", int, 0, 0, None),
                              number(body, "top_p", float, 1.0, 0.0, 1.0), number(body, "seed", int, None, 0, 2**63 - 1))
    try:
        sampling.validate()
    except ValueError as exc:
        raise ApiError(400, str(exc)) from None
    speculate = body.get("speculate")
    if speculate is not None:
        speculate = number(body, "speculate", int, None, 0, None)
    outline = None
    if body.get("outline"):
        outline = OutlineOptions(max_points=number(body, "max_points", int, 0, 0, MAX_OUTLINE_POINTS))
    return RequestOptions(max_tokens=max_tokens, sampling=sampling, ignore_eos=bool(body.get("ignore_eos", False)),
                          speculate=speculate, stop=tuple(stops), outline=outline)


def chat_prompt(body: dict) -> Prompt:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list", param="messages")
    turns = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(400, f"messages[{i}]: an object with a role and content", param="messages")
        content = m.get("content")
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
        if not isinstance(content, str):
            raise ApiError(400, f"messages[{i}]: content must be text", param="messages")
        turns.append((m["role"], content))
    return Prompt(messages=tuple(turns))


def completion_prompt(body: dict) -> Prompt:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return Prompt(token_ids=tuple(prompt))
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise ApiError(400, "prompt must be a non-empty string (or a list of token ids)", param="prompt")
    return Prompt(text=prompt, raw=True)


class HttpApi:
    """The routes over the front door."""

    def __init__(self, app: ControllerApp, door: FrontDoor):
        self.app = app
        self.door = door
        self.model_id = app.model_dir.name
        self.created = int(time.time())
        self.metrics = Metrics(app)

    def web_app(self) -> web.Application:
        w = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[self._errors])
        w.add_routes([web.get("/health", self.health), web.get("/v1/models", self.models),
                      web.post("/v1/chat/completions", self.chat), web.post("/v1/completions", self.completions),
                      web.get("/metrics", self.scrape), web.get("/v1/requests/{id}/stream", self.resume)])
        return w

    @web.middleware
    async def _errors(self, request, handler):
        try:
            return await handler(request)
        except ApiError as err:
            return err.response()
        except MeshError as err:
            return mesh_error(err).response()
        except web.HTTPException as exc:  # unknown route, wrong method, body too large
            return ApiError(exc.status, exc.reason or "bad request", "invalid_request_error").response()
        except Exception:  # noqa: BLE001 — never a stack trace to the client
            log.exception("HTTP %s %s failed", request.method, request.path)
            return ApiError(500, "internal error (see the controller's log)", "server_error").response()

    async def health(self, request):
        ready = self.app.state.admitting
        return web.json_response({"status": "ok" if ready else self.app.state.phase.value,
                                  "waiting": self.app.state.reason if self.app.state.phase is Phase.WAITING else ""},
                                 status=200 if ready else 503)

    async def scrape(self, request):
        body, content_type = await self.metrics.scrape()
        return web.Response(body=body, headers={"Content-Type": content_type})

    async def models(self, request):
        return web.json_response({"object": "list", "data": [
            {"id": self.model_id, "object": "model", "created": self.created, "owned_by": "logicpipe"}]})

    # ---- requests -----------------------------------------------------------------------------
    async def _body(self, request) -> dict:
        if request.content_length is not None and request.content_length > MAX_BODY_BYTES:
            raise ApiError(413, f"the body is {request.content_length} bytes, over the {MAX_BODY_BYTES}-byte cap")
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError, ValueError) as exc:
            raise ApiError(400, f"the body is not JSON: {exc}") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the body must be a JSON object")
        model = body.get("model")
        if model not in (None, self.model_id):
            raise ApiError(404, f"the model {str(model)[:100]!r} does not exist; this mesh serves {self.model_id!r}",
                           code="model_not_found", param="model")
        if number(body, "n", int, 1, 1, 1) != 1:
            raise ApiError(400, "n must be 1", param="n")
        return body

    async def chat(self, request):
        body = await self._body(request)
        return await self._complete(request, body, chat_prompt(body), chat=True)

    async def completions(self, request):
        body = await self._body(request)
        return await self._complete(request, body, completion_prompt(body), chat=False)

    async def _complete(self, request, body: dict, prompt: Prompt, *, chat: bool):
        options = replace(request_options(body), request_id=request.headers.get("X-Request-Id", ""),
                          api="chat" if chat else "completions")
        stream = bool(body.get("stream", False))
        async with self.door.open(prompt, options, host_client(request.remote or "")) as completion:
            form = Form(self.model_id, chat, completion)
            if options.outline is not None:  # one piece at the end: points do not map onto one delta stream
                async for _ in completion:
                    pass
                if not stream:
                    return web.json_response(form.whole(outline=True))
                response = await open_stream(request)
                await response.write(form.chunk(completion.text, None))
                await response.write(form.chunk("", "stop", outline=True))
                return await close_stream(response)
            if not stream:
                async for _ in completion:
                    pass
                return web.json_response(form.whole(), headers={"X-Request-Id": completion.id})
            return await self._stream(request, completion, form)

    async def _stream(self, request, completion: Completion, form: "Form"):
        """The completion's pieces as server-sent events, each with the client's token count as its id."""
        response = None  # opened with the first token: an error before it still gets its status
        async for piece in completion:
            response = response or await open_stream(request, completion.id)
            if piece.text or piece.token_ids:
                await response.write(form.chunk(piece.text, None, event_id=len(completion.tokens)))
        response = response or await open_stream(request, completion.id)
        await response.write(form.chunk("", completion.finish_reason or "length", event_id=len(completion.tokens)))
        return await close_stream(response)

    async def resume(self, request):
        rid = request.match_info["id"]
        last = request.headers.get("Last-Event-ID", request.query.get("after", "0")) or "0"
        if not last.isdigit():
            raise ApiError(400, f"Last-Event-ID must be the id of the last event received (a number), not {last[:20]!r}",
                           param="Last-Event-ID")
        async with self.door.resume(rid, int(last), host_client(request.remote or "")) as completion:
            return await self._stream(request, completion, Form(self.model_id, completion.api != "completions",
                                                                completion))


class Form:
    """OpenAI's response objects for one completion: chat or text, whole or in chunks."""

    def __init__(self, model_id: str, chat: bool, completion: Completion):
        self.model_id, self.chat, self.c = model_id, chat, completion
        self.id = ("chatcmpl-" if chat else "cmpl-") + completion.id[:24]
        self.created = int(time.time())
        self.kind = "chat.completion" if chat else "text_completion"
        self.started = False  # the first chat delta carries the role

    def outline(self) -> list[dict]:
        return [{"id": p.id, "title": p.title, "deps": list(p.deps), "text": p.text} for p in self.c.points]

    def chunk(self, delta: str, finish: str | None, *, outline: bool = False, event_id: int | None = None) -> bytes:
        if self.chat:
            content = ({"role": "assistant", "content": delta} if not self.started else {"content": delta}) if delta \
                else {}
            choice = {"index": 0, "delta": content, "finish_reason": finish}
            self.started = self.started or bool(delta)
        else:
            choice = {"index": 0, "text": delta, "finish_reason": finish, "logprobs": None}
        obj = {"id": self.id, "object": self.kind + ".chunk" if self.chat else self.kind, "created": self.created,
               "model": self.model_id, "choices": [choice]}
        if outline:
            obj["outline"] = self.outline()
        head = f"id: {event_id}\n" if event_id is not None else ""
        return f"{head}data: {json.dumps(obj)}\n\n".encode()

    def whole(self, *, outline: bool = False) -> dict:
        c, reason = self.c, self.c.finish_reason or "length"
        choice = ({"index": 0, "message": {"role": "assistant", "content": c.text}, "finish_reason": reason}
                  if self.chat else {"index": 0, "text": c.text, "finish_reason": reason, "logprobs": None})
        n = len(c.tokens)
        obj = {"id": self.id, "object": self.kind, "created": self.created, "model": self.model_id,
               "choices": [choice],
               "usage": {"prompt_tokens": c.prompt_tokens, "completion_tokens": n, "total_tokens": c.prompt_tokens + n}}
        if outline:
            obj["outline"] = self.outline()
        return obj


async def open_stream(request, request_id: str = "") -> web.StreamResponse:
    """A server-sent-events response, headers sent."""
    headers = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    if request_id:
        headers["X-Request-Id"] = request_id
    response = web.StreamResponse(headers=headers)
    await response.prepare(request)
    return response


async def close_stream(response: web.StreamResponse) -> web.StreamResponse:
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


async def start_http(app: ControllerApp, door: FrontDoor, address: str) -> web.AppRunner:
    """Serve the API on `address` ("HOST:PORT") in the running loop; returns the runner (cleanup())."""
    host, _, port = address.rpartition(":")
    runner = web.AppRunner(HttpApi(app, door).web_app(), access_log=None, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, host or "127.0.0.1", int(port))
    await site.start()
    log.info("OpenAI-compatible HTTP API on http://%s:%s/v1", host or "127.0.0.1", port)
    if not is_loopback(host or "127.0.0.1"):
        log.warning("the HTTP API on %s has no authentication: anyone who reaches it can submit requests "
                    "(put an authenticating reverse proxy in front, or bind it to 127.0.0.1)", address)
    return runner
