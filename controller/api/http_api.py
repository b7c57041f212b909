"""The OpenAI-compatible HTTP adapter (`logicpipe-controller --http HOST:PORT`), served by aiohttp
in the controller's own event loop. Every request goes through the front door
(controller.requests), exactly as one from gRPC Submit does: the same caps, tokenizing, chat
template, stop strings and outline requests.

    POST /v1/chat/completions   messages (system/developer/user/assistant) through the model's chat template
    POST /v1/completions        a raw prompt (a string, or a list of token ids), or a batch of them:
                                each prompt is its own choice (`index`), computed as its own request
    (both: `n` choices of each prompt, the prompt computed once and forked: FrontDoor.open_n;
     logprobs, penalties, logit_bias; completions' echo: controller.http_body, controller.http_form;
     the prompts: controller.http_prompt)
    GET  /v1/models             the one model the mesh serves
    GET  /v1/models/{id}        that model (404 model_not_found for any other id)
    GET  /v1/requests/{id}/stream   a stream again, after the tokens the client holds (Last-Event-ID)
    GET  /health                200 while a plan serves and the journal can be written, 503 otherwise (no key)
    GET  /metrics               Prometheus (controller.metrics; no key needed)
    GET  /                      the dashboard's page, and GET /ui/{file} its script and style (no key)
    GET  /dashboard/events      the dashboard's snapshots as server-sent events, one a second; GET
                                /dashboard/snapshot one (controller.dashboard; the key as /v1/*)
    POST /v1/messages, /v1/responses, /api/chat, /api/generate, /api/show; GET /api/tags, /api/version
                                Anthropic Messages, OpenAI Responses, Ollama: adapters over the chat path
                                (controller.http_adapters; errors in each API's own shape)

Keys. With `--http-token-file` (controller.http_auth) every /v1/*, /api/* and /dashboard/* call
needs `Authorization: Bearer TOKEN` (or Anthropic's `X-Api-Key: TOKEN`) of one of the file's keys (else
401), and the client the front door counts is the key (`key NAME`); without one, the caller's
host. Off loopback a token file is required unless `--insecure`.

In order, before any work: the key (401); the body's size from its Content-Length (413); the
client's place under `--max-requests-per-client` (429) — all three before the body is read, and a
client that sent `Expect: 100-continue` is refused without being asked for the body; then the body
(controller.http_body: 400 naming the field at fault; 413 once a chunked body passes the cap).
A refused request whose body was not read is answered at once and its connection then closed.

Resuming a stream. Every response names its request in the header X-Request-Id (a client may
choose the id by sending that header itself), and every server-sent event of a stream carries
`id: N`, N the tokens the client has with it. A client whose stream broke (the controller
restarted, or a standby took over: give clients both addresses) asks GET /v1/requests/{id}/stream
with the header Last-Event-ID: N (the last id it got; 0 or none: from the start) and receives the
rest, the same chunks the first stream would have carried. 404: the request ended, is unknown, or
is another client's.

Streams are server-sent events of the standard chunk objects, ending with `data: [DONE]`
(`stream_options: {"include_usage": true}` adds a last chunk with the usage). Errors are
OpenAI-style JSON bodies, {"error": {"message", "type", "param", "code"}}: 400 for a bad request,
401 without a valid key, 404 for an unknown model, 413 for a body over MAX_BODY_BYTES, 429 when the
mesh's queue or the client's cap is full, 503 when no plan serves. A client that goes away
mid-stream cancels its request, which closes its sequences on every stage.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
from dataclasses import replace

from aiohttp import web
from aiohttp.http import HttpVersion11

from logicpipe.common.transport import is_loopback
from logicpipe.controller.app import ControllerApp
from logicpipe.controller.api.dashboard import Dashboard
from logicpipe.controller.api.http_adapters import ADAPTED, Adapters, error_body
from logicpipe.controller.api.http_auth import ApiKeys
from logicpipe.controller.api.http_body import (
    ApiError,
    check_fields,
    mesh_error,
    echoed,
    number,
    parse,
    request_options,
    shown,
    stream_options,
    tool_options,
)
from logicpipe.controller.api.http_prompt import chat_prompt, completion_prompts
from logicpipe.controller.api.http_form import Form, close_stream, merged, open_stream
from logicpipe.controller.api.logprobs import TokenText
from logicpipe.controller.api.metrics import Metrics
from logicpipe.controller.jobs.door import Completion, FrontDoor, host_client
from logicpipe.controller.jobs.rules import MAX_CHOICES
from logicpipe.controller.mesh.state import Phase
from logicpipe.controller.api.tools import call_schema
from logicpipe.controller.api.tools import family as tool_family
from logicpipe.errors import InvalidArgument, MeshError
from logicpipe.limits import check_request_id

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 8 * 2**20  # a request body, bytes: room for the front door's prompt cap, JSON-escaped
LINGER_S = 2.0              # a refused body still arriving is read and dropped this long, then the connection closes
MAX_EVENT_ID_DIGITS = 12    # Last-Event-ID: a token count
PARSE_INLINE_BYTES = 2**20  # a larger body is parsed and checked off the event loop (4M token ids: ~0.2 s)
KEYED = ("/v1/", "/api/", "/dashboard/")  # the paths that need a key (when there are keys)
ROUTES = [("GET", "/health"), ("GET", "/metrics"), ("GET", "/v1/models"), ("GET", "/v1/models/{id}"),
          ("GET", "/"), ("GET", "/ui/{file}"), ("GET", "/dashboard/snapshot"), ("GET", "/dashboard/events"),
          ("POST", "/v1/chat/completions"),
          ("POST", "/v1/completions"), ("GET", "/v1/requests/{id}/stream"), *ADAPTED]


def answer(request: web.BaseRequest, err: ApiError) -> web.Response:
    """The error's response, in the shape of the API its path belongs to; a body left unread means
    the connection closes after it (the client may still be sending: it must not take what follows
    for its next request)."""
    headers = {"WWW-Authenticate": 'Bearer realm="logicpipe"'} if err.status == 401 else None
    response = web.json_response(error_body(request.path, err), status=err.status, headers=headers)
    if request.can_read_body:
        response.force_close()
    return response


async def _inline(fn, *args):
    return fn(*args)


class HttpApi:
    """The routes over the front door (`keys`: the API keys /v1/* needs; None: none)."""

    def __init__(self, app: ControllerApp, door: FrontDoor, keys: ApiKeys | None = None):
        self.app = app
        self.door = door
        self.keys = keys
        self.model_id = app.model_dir.name
        self.created = int(time.time())
        self.metrics = Metrics(app)
        self.token_text = TokenText(door.tokenizer)  # tokens' text and bytes, for logprobs
        self.adapters = Adapters(self)  # Anthropic Messages, OpenAI Responses, Ollama
        self.dashboard = Dashboard(app)  # the page at / and its snapshots

    def web_app(self) -> web.Application:
        w = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[self._errors])
        handlers = {"/health": self.health, "/metrics": self.scrape, "/v1/models": self.models,
                    "/v1/models/{id}": self.model,
                    "/v1/chat/completions": self.chat, "/v1/completions": self.completions,
                    "/v1/requests/{id}/stream": self.resume, **self.adapters.handlers(),
                    **self.dashboard.routes()}
        w.on_shutdown.append(self.dashboard.on_shutdown)  # its event streams end, or the stop would wait for them
        w.add_routes([(web.post if method == "POST" else web.get)(path, handlers[path], expect_handler=self._expect)
                      for method, path in ROUTES])
        # last, every other path: answered here (an OpenAI body, the key checked first) rather than by aiohttp
        w.add_routes([web.route("*", "/{tail:.*}", self.no_route, expect_handler=self._expect)])
        return w

    def runner(self) -> web.AppRunner:
        return web.AppRunner(self.web_app(), access_log=None, handler_cancellation=True, lingering_time=LINGER_S)

    # ---- before the body: the key, the size ------------------------------------------------------
    def admit(self, request: web.BaseRequest) -> str:
        """The key (for /v1/*) and the declared size; returns the client the front door counts
        (checked again by a handler that needs it: nothing is kept on the request)."""
        client = host_client(request.remote or "")
        if self.keys is not None and request.path.startswith(KEYED):
            given = request.headers.get("Authorization", "")
            if not given and request.headers.get("X-Api-Key"):  # how Anthropic's clients may send it
                given = "Bearer " + request.headers["X-Api-Key"]
            name = self.keys.check(given)
            if name is None:
                log.debug("HTTP %s %s from %s: %s API key", request.method, request.path, client,
                          "a wrong" if given else "no")
                raise ApiError(401, ("the API key is not valid" if given else "an API key is needed")
                               + ": send the header `Authorization: Bearer TOKEN` with a token of the controller's "
                                 "--http-token-file", "authentication_error", code="invalid_api_key")
            client = f"key {name}"
        size = request.content_length
        if size is not None and size > MAX_BODY_BYTES:
            raise ApiError(413, f"the body is {size} bytes, over the {MAX_BODY_BYTES}-byte cap",
                           code="body_too_large")
        return client

    async def _expect(self, request: web.Request):
        """`Expect: 100-continue`: refused without reading the body when the key or the size is
        wrong; otherwise the body is asked for once the client has its place (`_body`)."""
        if request.version != HttpVersion11 or request.headers.get("Expect", "").lower() != "100-continue":
            return answer(request, ApiError(417, f"Expect: {shown(request.headers.get('Expect', ''))} is not "
                                                 "supported (only 100-continue)"))
        try:
            self.admit(request)
        except ApiError as err:
            return answer(request, err)
        return None  # no 100 yet: `_body` sends it

    @web.middleware
    async def _errors(self, request, handler):
        try:
            self.admit(request)
            return await handler(request)
        except ApiError as err:
            return answer(request, err)
        except MeshError as err:
            return answer(request, mesh_error(err))
        except web.HTTPException as exc:  # unknown route, wrong method
            return answer(request, ApiError(exc.status, exc.reason or "bad request"))
        except Exception:  # noqa: BLE001 — never a stack trace to the client
            log.exception("HTTP %s %s failed", request.method, request.path)
            return answer(request, ApiError(500, "internal error (see the controller's log)", "server_error"))

    async def no_route(self, request):
        allowed = sorted({m for m, path in ROUTES if re.fullmatch(re.sub(r"\{\w+\}", "[^{}/]+", path), request.path)})
        if allowed:
            raise ApiError(405, f"{shown(request.method)} is not allowed on {shown(request.path, 80)}: "
                                f"{', '.join(allowed)}", code="method_not_allowed")
        raise ApiError(404, f"no route {shown(request.path, 80)}; this API serves "
                            f"{', '.join(sorted({p for _, p in ROUTES}))}", code="not_found")

    # ---- open routes -----------------------------------------------------------------------------
    async def health(self, request):
        """200 while a plan serves and the journal can hold new requests; the journal's state and
        any damage found at start besides."""
        journal = self.app.journal
        ready = self.app.state.admitting and journal.failure is None
        status = "ok" if ready else self.app.state.phase.value if not self.app.state.admitting else "journal_failing"
        return web.json_response({"status": status,
                                  "waiting": self.app.state.reason if self.app.state.phase is Phase.WAITING else "",
                                  "journal": journal.state(), "journal_damage": journal.damage},
                                 status=200 if ready else 503)

    async def scrape(self, request):
        body, content_type = await self.metrics.scrape()
        return web.Response(body=body, headers={"Content-Type": content_type})

    def _model(self) -> dict:
        return {"id": self.model_id, "object": "model", "created": self.created, "owned_by": "logicpipe"}

    async def models(self, request):
        return web.json_response({"object": "list", "data": [self._model()]})

    async def model(self, request):
        """GET /v1/models/{id}: the model, or OpenAI's 404 for any other id."""
        model_id = request.match_info["id"]
        if model_id != self.model_id:
            raise ApiError(404, f"the model {shown(model_id, 100)!r} does not exist; this mesh serves "
                                f"{self.model_id!r}", code="model_not_found", param="model")
        return web.json_response(self._model())

    # ---- requests ----------------------------------------------------------------------------------
    async def _body(self, request, api: str) -> dict:
        """The body, read once the client has its place (the size was checked from its header)."""
        body = await self.read_body(request)
        check_fields(body, api)
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise ApiError(400, "model must be a string", param="model")
        if model not in (None, self.model_id):
            raise ApiError(404, f"the model {shown(model, 100)!r} does not exist; this mesh serves {self.model_id!r}",
                           code="model_not_found", param="model")
        return body

    async def read_body(self, request) -> dict:
        """The body as a JSON object, its fields not checked yet (`_body`; an adapter's own checks)."""
        if request.headers.get("Expect"):  # (past `_expect`: 100-continue) the client waits for this to send it
            await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            request.writer.output_size = 0
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:  # a chunked body past the cap
            raise ApiError(413, f"the body is over the {MAX_BODY_BYTES}-byte cap", code="body_too_large") from None
        return parse(raw) if len(raw) <= PARSE_INLINE_BYTES else await asyncio.to_thread(parse, raw)

    async def chat(self, request):
        return await self._complete(request, "chat")

    async def completions(self, request):
        return await self._complete(request, "completions")

    async def _complete(self, request, api: str):
        client = self.admit(request)
        async with self.door.admit(client):  # before the body: a client's uploads count toward its cap
            body = await self._body(request, api)
            prompts = [chat_prompt(body)] if api == "chat" else completion_prompts(body)
            stream, usage = stream_options(body)
            prompts, options, tooled = await self._options(request, body, api, api, prompts)
            rid = options.request_id
            n = number(body, "n", int, 1, 1, MAX_CHOICES)
            if len(prompts) * n > 1:
                for name, given in (("X-Request-Id", rid), ("outline", options.outline is not None),
                                    ("echo", n > 1 and echoed(body, api))):
                    if given:
                        raise ApiError(400, f"{name} is for one choice: send each prompt of a batch, or each of "
                                            "n choices, as its own request", param=name)
            async with contextlib.AsyncExitStack() as held:
                for _ in range(len(prompts) * n - 1):  # each further choice counts toward the client's cap
                    await held.enter_async_context(self.door.admit(client))
                completions = []  # choice i * n + j: prompt i's j-th (OpenAI's order)
                for p in prompts:
                    if n == 1:
                        completions.append(await held.enter_async_context(self.door.open(p, options, client,
                                                                                          admitted=True)))
                    else:
                        completions += await held.enter_async_context(self.door.open_n(p, options, client, n,
                                                                                        admitted=True))
                echo = [p.text or self._decoded(p.token_ids) for p in prompts] if echoed(body, api) else None
                form = Form(self.model_id, api == "chat", completions, self.token_text, echo)
                form.tools = tooled
                if options.outline is not None:
                    return await self._outline(request, completions[0], form, stream, usage)
                if not stream:
                    async for _ in merged(completions):
                        pass
                    return web.json_response(form.whole(), headers={"X-Request-Id": completions[0].id})
                return await self._stream(request, completions, form, usage)

    async def _options(self, request, body: dict, kind: str, api: str, prompts: list):
        """`body`'s options for the front door (`kind`: "chat" or "completions"; `api`: the door it
        came by, journaled) and, chat, its tools: (prompts, options, tooled: (family, tools) when
        the answer may call a tool, parsed into tool_calls; else None)."""
        rid = request.headers.get("X-Request-Id", "")
        if rid:
            try:
                check_request_id("X-Request-Id", rid)
            except InvalidArgument as exc:
                raise ApiError(400, str(exc), param="X-Request-Id") from None
        parse_options = asyncio.to_thread if body.get("response_format") is not None else _inline  # (a schema is
        # compiled: off the event loop)
        options = replace(await parse_options(request_options, body, kind), request_id=rid, api=api)
        if kind != "chat":
            return prompts, options, None
        tools = asyncio.to_thread if body.get("tools") else _inline  # their schemas are compiled: off the loop
        return await tools(self._tools, body, prompts[0], options)

    @contextlib.asynccontextmanager
    async def opened(self, request, client: str, body: dict, kind: str, api: str):
        """One completion of `body`, the OpenAI body of `kind` ("chat", "completions") that an
        adapter of another API built (controller.http_adapters), for `client`, whose place it holds
        already: (the Completion, its Form)."""
        prompts = [chat_prompt(body)] if kind == "chat" else completion_prompts(body)
        prompts, options, tooled = await self._options(request, body, kind, api, prompts)
        async with self.door.open(prompts[0], options, client, admitted=True) as completion:
            form = Form(self.model_id, kind == "chat", [completion], self.token_text)
            form.tools = tooled
            yield completion, form

    def _tools(self, body: dict, prompt, options):
        """chat's tools: in the prompt (through the template, or a system message), and with
        tool_choice "required" or a named function, the answer constrained to a call object."""
        tools, choice = tool_options(body)
        if choice is None:  # "none" (or no tools): the tools stay out of the prompt, nothing is parsed
            return [prompt], options, None
        if options.outline is not None:
            raise ApiError(400, "tools are for plain requests: not with an outline", param="tools")
        fam = tool_family(self.door.tokenizer)
        if choice:
            if options.json_schema:
                raise ApiError(400, "response_format and a forced tool call are two grammars for one answer: send "
                               "one of them", param="tool_choice")
            options = replace(options, json_schema=call_schema(tools, None if choice == "*" else choice, fam))
        return [replace(prompt, tools=json.dumps(tools))], options, (fam, tools)

    def _decoded(self, token_ids) -> str:
        """A prompt of token ids as text, for `echo`."""
        return self.door.tokenizer.decode(list(token_ids)) if self.door.tokenizer is not None else ""

    async def _outline(self, request, completion: Completion, form: Form, stream: bool, usage: bool):
        """An outline request's answer, in one piece at the end: points do not map onto one delta stream."""
        async for _ in completion:
            pass
        if not stream:
            return web.json_response(form.whole(outline=True))
        response = await open_stream(request)
        await response.write(form.chunk(completion.text, None))
        await response.write(form.chunk("", "stop", outline=True))
        if usage:
            await response.write(form.usage_chunk())
        return await close_stream(response)

    async def _stream(self, request, completions: list[Completion], form: Form, usage: bool = False):
        """The completions' pieces as server-sent events; one completion's each carry its client's
        token count as their id (what a resume starts from; a batch is not resumable: no ids)."""
        one = len(completions) == 1
        if form.tools is not None:  # calls are parsed from the whole answer: it goes out as one chunk
            async for _ in merged(completions):
                pass
            response = await open_stream(request, completions[0].id)
            for i in range(len(completions)):
                await response.write(form.whole_chunk(i))
            if usage:
                await response.write(form.usage_chunk())
            return await close_stream(response)
        response = None  # opened with the first token: an error before it still gets its status
        echoed: set[int] = set()  # choices whose prompt (with `echo`) is out
        async for i, piece in merged(completions):
            response = response or await open_stream(request, completions[0].id)
            c = completions[i]
            if form.echo is not None and i not in echoed:  # (the prompt's logprobs came with the first token)
                echoed.add(i)
                await response.write(form.echo_chunk(i))
            if piece.text or piece.token_ids:
                await response.write(form.chunk(piece.text, None, index=i, piece=piece,
                                                event_id=len(c.tokens) if one else None))
            if piece.finished and not one:
                await response.write(form.chunk("", c.finish_reason or "length", index=i))
        response = response or await open_stream(request, completions[0].id)
        if one:
            c = completions[0]
            await response.write(form.chunk("", c.finish_reason or "length", event_id=len(c.tokens)))
        if usage:
            await response.write(form.usage_chunk())
        return await close_stream(response)

    async def resume(self, request):
        rid = request.match_info["id"]
        try:
            check_request_id("the request id in the path", rid)
        except InvalidArgument as exc:
            raise ApiError(400, str(exc), param="id") from None
        last = request.headers.get("Last-Event-ID", request.query.get("after", "0")) or "0"
        if not (last.isascii() and last.isdigit() and len(last) <= MAX_EVENT_ID_DIGITS):
            raise ApiError(400, f"Last-Event-ID must be the id of the last event received (a number), not "
                                f"{shown(last, 20)!r}", param="Last-Event-ID")
        async with self.door.resume(rid, int(last), self.admit(request), have_name="Last-Event-ID") as completion:
            form = Form(self.model_id, completion.api != "completions", [completion], self.token_text)
            return await self._stream(request, [completion], form)


async def start_http(app: ControllerApp, door: FrontDoor, address: str, keys: ApiKeys | None = None) -> web.AppRunner:
    """Serve the API on `address` ("HOST:PORT") in the running loop; returns the runner (cleanup()).
    `keys`: the API keys /v1/* needs (None: none; off loopback the caller has checked --insecure)."""
    host, _, port = address.rpartition(":")
    runner = HttpApi(app, door, keys).runner()
    await runner.setup()
    site = web.TCPSite(runner, host or "127.0.0.1", int(port))
    try:
        await site.start()
    except BaseException:  # the port is taken (the caller says so in one line): let go of the runner
        await runner.cleanup()
        raise
    log.info("OpenAI-compatible HTTP API on http://%s:%s/v1 (%s)", host or "127.0.0.1", port,
             f"{len(keys.keys)} API keys of {keys.path}" if keys else "no API keys")
    if keys is None and not is_loopback(host or "127.0.0.1"):
        log.warning("INSECURE: the HTTP API on %s takes requests without an API key (--insecure): anyone who "
                    "reaches it can submit requests and read their answers; give --http-token-file", address)
    return runner
