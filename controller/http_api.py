"""An OpenAI-compatible HTTP API on the controller (`logicpipe-controller --http HOST:PORT`),
served by aiohttp in the controller's own event loop.

    POST /v1/chat/completions   messages (system/user/assistant) through the model's chat template
    POST /v1/completions        a raw prompt
    GET  /v1/models             the one model the mesh serves
    GET  /health                200 while a plan serves, 503 otherwise

Request fields: `model`, `max_tokens` (or `max_completion_tokens`), `temperature`, `top_p`, `seed`,
`stop` (a string or up to 4), `n` (1 only), `stream`; the mesh's own options as extra fields:
`speculate` (candidate tokens per step, 0 = off), `top_k`, `ignore_eos`, `outline` (an outline-DAG
request, with `max_points`; `max_tokens` is then per point). Streams are server-sent
events of the standard chunk objects, ending with `data: [DONE]`. Errors are OpenAI-style JSON
bodies, {"error": {"message", "type", "param", "code"}}: 400 for a bad request, 404 for an unknown
model, 429 when the mesh's queue is full, 503 when no plan serves. A client that goes away
mid-stream cancels its request, which closes its sequences on every stage.
"""
from __future__ import annotations

import json
import logging
import time
import uuid

from aiohttp import web

from logicpipe.common.transport import is_loopback
from logicpipe.errors import FailedPrecondition, InvalidArgument, MeshError, ResourceExhausted, Unavailable
from logicpipe.sampling import SamplingParams

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 4 * 2**20
MAX_STOPS = 4
DEFAULT_MAX_TOKENS = 256


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.kind, self.param, self.code = status, kind, param, code

    def response(self) -> web.Response:
        return web.json_response({"error": {"message": str(self), "type": self.kind, "param": self.param,
                                            "code": self.code}}, status=self.status)


def _mesh_error(err: MeshError) -> ApiError:
    if isinstance(err, InvalidArgument):
        return ApiError(400, str(err))
    if isinstance(err, ResourceExhausted):
        return ApiError(429, str(err), "rate_limit_error", code="mesh_full")
    if isinstance(err, (Unavailable, FailedPrecondition)):
        return ApiError(503, str(err), "service_unavailable", code="no_plan")
    return ApiError(500, str(err), "server_error")


def _number(body: dict, name: str, kind, default, low=None, high=None):
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int):
        raise ApiError(400, f"{name} must be {'a number' if kind is float else 'an integer'}", param=name)
    if (low is not None and value < low) or (high is not None and value > high):
        raise ApiError(400, f"{name} must be in [{low}, {high}], got {value}", param=name)
    return kind(value)


class HttpApi:
    """The routes over a ControllerApp."""

    def __init__(self, app):
        self.app = app
        self.model_id = app.model_dir.name
        self.created = int(time.time())
        self.metrics = Metrics(app)

    def web_app(self) -> web.Application:
        w = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[self._errors])
        w.add_routes([web.get("/health", self.health), web.get("/v1/models", self.models),
                      web.post("/v1/chat/completions", self.chat), web.post("/v1/completions", self.completions),
                      web.get("/metrics", self.scrape)])
        return w

    @web.middleware
    async def _errors(self, request, handler):
        try:
            return await handler(request)
        except ApiError as err:
            return err.response()
        except MeshError as err:
            return _mesh_error(err).response()
        except web.HTTPException as exc:  # unknown route, wrong method, body too large
            return ApiError(exc.status, exc.reason or "bad request", "invalid_request_error").response()
        except Exception:  # noqa: BLE001 — never a stack trace to the client
            log.exception("HTTP %s %s failed", request.method, request.path)
            return ApiError(500, "internal error (see the controller's log)", "server_error").response()

    async def health(self, request):
        ready = self.app.state == "ready"
        return web.json_response({"status": "ok" if ready else self.app.state, "waiting": self.app.waiting},
                                 status=200 if ready else 503)

    async def scrape(self, request):
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        await self.metrics.refresh()
        return web.Response(body=generate_latest(self.metrics.registry),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def models(self, request):
        return web.json_response({"object": "list", "data": [
            {"id": self.model_id, "object": "model", "created": self.created, "owned_by": "logicpipe"}]})

    # ---- requests -----------------------------------------------------------------------------
    async def _body(self, request) -> dict:
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
        if _number(body, "n", int, 1, 1, 1) != 1:
            raise ApiError(400, "n must be 1", param="n")
        return body

    def _options(self, body: dict) -> dict:
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        max_tokens = _number({"max_tokens": max_tokens}, "max_tokens", int, DEFAULT_MAX_TOKENS, 1, None)
        stop = body.get("stop")
        stops = [stop] if isinstance(stop, str) else (stop or [])
        if not isinstance(stops, list) or len(stops) > MAX_STOPS or not all(isinstance(s, str) and s for s in stops):
            raise ApiError(400, f"stop must be a string or a list of up to {MAX_STOPS} non-empty strings", param="stop")
        sampling = SamplingParams(_number(body, "temperature", float, 1.0, 0.0, 2.0),
                                  _number(body, "top_k", int, 0, 0, None), _number(body, "top_p", float, 1.0, 0.0, 1.0),
                                  _number(body, "seed", int, None, 0, 2**63 - 1))
        try:
            sampling.validate()
        except ValueError as exc:
            raise ApiError(400, str(exc)) from None
        speculate = body.get("speculate")
        if speculate is not None:
            speculate = _number(body, "speculate", int, None, 0, None)
        return {"max_tokens": max_tokens, "stops": stops, "sampling": sampling, "speculate": speculate,
                "ignore_eos": bool(body.get("ignore_eos", False)), "stream": bool(body.get("stream", False))}

    def _chat_ids(self, body: dict) -> list[int]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ApiError(400, "messages must be a non-empty list", param="messages")
        clean = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise ApiError(400, f"messages[{i}]: an object with a role and content", param="messages")
            content = m.get("content")
            if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
            if not isinstance(content, str):
                raise ApiError(400, f"messages[{i}]: content must be text", param="messages")
            clean.append((m["role"], content))
        return self.app.encode_chat(clean)

    def _prompt_ids(self, body: dict) -> list[int]:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str) or not prompt:
            raise ApiError(400, "prompt must be a non-empty string (or a list of token ids)", param="prompt")
        return self.app.encode_prompt(prompt, raw=True)

    async def chat(self, request):
        body = await self._body(request)
        if body.get("outline"):
            users = [m for m in body.get("messages") or [] if isinstance(m, dict) and m.get("role") == "user"]
            question = users[-1].get("content") if users else None
            return await self._outline(request, body, question, chat=True)
        return await self._run(request, self._chat_ids(body), self._options(body), chat=True)

    async def completions(self, request):
        body = await self._body(request)
        if body.get("outline"):
            return await self._outline(request, body, body.get("prompt"), chat=False)
        return await self._run(request, self._prompt_ids(body), self._options(body), chat=False)

    async def _outline(self, request, body: dict, question, *, chat: bool):
        """`outline: true` (and `max_points`): an outline-DAG request (README "Outline requests"):
        the answer is its points in order, "N. Title" then the point's text; the response also
        carries them as `outline` [{"id", "title", "deps", "text"}]. Streamed, it comes as one
        chunk once every point is done."""
        from logicpipe.controller.outline import OutlineRun

        if not isinstance(question, str) or not question.strip():
            raise ApiError(400, "an outline request needs a question (the last user message, or the prompt)")
        if self.app.tokenizer is None:
            raise ApiError(400, "this model has no tokenizer: outline requests need one")
        o = self._options(body)
        run = OutlineRun(self.app.scheduler, self.app.tokenizer, question,
                         max_points=_number(body, "max_points", int, 0, 0, 32), point_tokens=o["max_tokens"],
                         sampling=o["sampling"], speculate=o["speculate"])
        n = 0
        async for _pid, _token, _finished in run.events():
            n += 1
        text = "\n\n".join(f"{p.id}. {p.title}\n{p.text.strip()}" for p in run.points)
        points = [{"id": p.id, "title": p.title, "deps": list(p.deps), "text": p.text} for p in run.points]
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        kind, created = ("chat.completion" if chat else "text_completion"), int(time.time())
        usage = {"prompt_tokens": len(self.app.encode_prompt(question, raw=not chat)), "completion_tokens": n}
        usage["total_tokens"] = usage["prompt_tokens"] + n
        if o["stream"]:
            response = await _open_stream(request)
            for delta, finish in ((text, None), ("", "stop")):
                choice = ({"index": 0, "delta": {"role": "assistant", "content": delta} if delta else {},
                           "finish_reason": finish} if chat else
                          {"index": 0, "text": delta, "finish_reason": finish, "logprobs": None})
                obj = {"id": rid, "object": kind + ".chunk" if chat else kind, "created": created,
                       "model": self.model_id, "choices": [choice]}
                if finish:
                    obj["outline"] = points
                await response.write(f"data: {json.dumps(obj)}\n\n".encode())
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
            return response
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"} if chat
                  else {"index": 0, "text": text, "finish_reason": "stop", "logprobs": None})
        return web.json_response({"id": rid, "object": kind, "created": created, "model": self.model_id,
                                  "choices": [choice], "usage": usage, "outline": points})

    async def _run(self, request, prompt_ids: list[int], o: dict, *, chat: bool):
        from logicpipe.controller.service import TextStream

        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        kind = "chat.completion" if chat else "text_completion"
        text = TextStream(self.app.tokenizer)
        opened = []
        updates = self.app.scheduler.generate(prompt_ids, o["max_tokens"], o["sampling"], o["ignore_eos"],
                                              speculate=o["speculate"], on_open=opened.append)
        out, n, reason = "", 0, None
        held = max((len(s) for s in o["stops"]), default=1) - 1  # text held back: a stop may be starting
        sent = 0
        response = None

        def chunk(delta: str, finish: str | None) -> bytes:
            if chat:
                choice = {"index": 0, "delta": ({"role": "assistant", "content": delta} if not sent and delta
                                                else {"content": delta} if delta else {}), "finish_reason": finish}
            else:
                choice = {"index": 0, "text": delta, "finish_reason": finish, "logprobs": None}
            obj = {"id": rid, "object": kind + ".chunk" if chat else kind, "created": created,
                   "model": self.model_id, "choices": [choice]}
            return f"data: {json.dumps(obj)}\n\n".encode()

        try:
            async for u in updates:
                n += 1
                scan = max(0, len(out) - held)  # a stop can only end in the new text
                out += text.push([u.token_id], u.finished)
                cut = min((i for i in (out.find(s, scan) for s in o["stops"]) if i >= 0), default=-1)
                if cut >= 0:
                    out, reason = out[:cut], "stop"
                    self.app.scheduler.stop_early(opened[0])
                elif u.finished:
                    reason = "stop" if u.finish_reason == "stop" else "length"
                if o["stream"]:
                    if response is None:
                        response = await _open_stream(request)
                    upto = len(out) if reason else max(sent, len(out) - held)
                    if upto > sent:
                        await response.write(chunk(out[sent:upto], None))
                        sent = upto
                if reason:
                    break
        finally:
            await updates.aclose()  # a stop string or a gone client: the request's sequences close now
        usage = {"prompt_tokens": len(prompt_ids), "completion_tokens": n, "total_tokens": len(prompt_ids) + n}
        if o["stream"]:
            if response is None:
                response = await _open_stream(request)
            await response.write(chunk("", reason or "length"))
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
            return response
        choice = ({"index": 0, "message": {"role": "assistant", "content": out}, "finish_reason": reason or "length"}
                  if chat else {"index": 0, "text": out, "finish_reason": reason or "length", "logprobs": None})
        return web.json_response({"id": rid, "object": kind, "created": created, "model": self.model_id,
                                  "choices": [choice], "usage": usage})


async def _open_stream(request) -> web.StreamResponse:
    """A server-sent-events response, headers sent."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    return response


async def start_http(app, address: str):
    """Serve the API on `address` ("HOST:PORT") in the running loop; returns the runner (cleanup())."""
    host, _, port = address.rpartition(":")
    runner = web.AppRunner(HttpApi(app).web_app(), access_log=None, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, host or "127.0.0.1", int(port))
    await site.start()
    log.info("OpenAI-compatible HTTP API on http://%s:%s/v1", host or "127.0.0.1", port)
    if not is_loopback(host or "127.0.0.1"):
        log.warning("the HTTP API on %s has no authentication: anyone who reaches it can submit requests "
                    "(put an authenticating reverse proxy in front, or bind it to 127.0.0.1)", address)
    return runner


class Metrics:
    """`GET /metrics` in Prometheus' format (prometheus_client): counters and gauges read from the
    controller at scrape time, per-stage figures from a Status probe of each stage, and latency
    histograms observed as each request ends."""

    BUCKETS_TTFT = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60)
    BUCKETS_ITL = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2)

    def __init__(self, app):
        from prometheus_client import CollectorRegistry, Histogram

        self.app = app
        self.registry = CollectorRegistry()
        self.ttft = Histogram("logicpipe_time_to_first_token_seconds", "Submission to first token",
                              buckets=self.BUCKETS_TTFT, registry=self.registry)
        self.itl = Histogram("logicpipe_inter_token_latency_seconds", "Mean time between a request's tokens",
                             buckets=self.BUCKETS_ITL, registry=self.registry)
        self._stages: list = []  # (node id, StatusReply) of the last probe
        app.scheduler.observers.append(self._observe)
        self.registry.register(self)

    def _observe(self, req) -> None:
        if req.first_token:
            self.ttft.observe(req.first_token - req.submitted)
        if len(req.tokens) > 1 and req.last_token > req.first_token:
            self.itl.observe((req.last_token - req.first_token) / (len(req.tokens) - 1))

    async def refresh(self) -> None:
        """Probe the plan's stages (their KV blocks, step times) before a scrape."""
        import asyncio

        stages = list(self.app.pipeline.stages)
        probes = await asyncio.gather(*(self.app.pipeline.probe(h.address, timeout=2.0) for h in stages), return_exceptions=True)
        self._stages = [(h.node_id or h.address, p) for h, p in zip(stages, probes) if not isinstance(p, BaseException)]

    def describe(self):
        return []

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        app, sched = self.app, self.app.scheduler
        requests = CounterMetricFamily("logicpipe_requests", "Requests by outcome", labels=["outcome"])
        requests.add_metric(["completed"], sched.completed)
        requests.add_metric(["failed"], sched.failed)
        yield requests
        tokens = CounterMetricFamily("logicpipe_tokens", "Tokens in (prompts) and out (generated)", labels=["direction"])
        tokens.add_metric(["in"], sched.prompt_tokens)
        tokens.add_metric(["out"], sched.generated_tokens)
        yield tokens
        yield GaugeMetricFamily("logicpipe_active_sequences", "Requests running on the stages", value=sched.running)
        yield GaugeMetricFamily("logicpipe_queued_sequences", "Requests waiting for the mesh", value=len(sched.waiting))
        yield CounterMetricFamily("logicpipe_replans", "Plans installed", value=app.replans)
        yield CounterMetricFamily("logicpipe_replays", "Requests moved to another pipeline and replayed",
                                  value=sched.replays)
        yield CounterMetricFamily("logicpipe_preemptions", "Requests preempted for KV blocks", value=sched.preemptions)
        rate = sched.candidates_accepted / sched.candidates if sched.candidates else 0.0
        yield GaugeMetricFamily("logicpipe_candidate_acceptance_ratio", "Candidate tokens accepted / verified",
                                value=rate)
        blocks = GaugeMetricFamily("logicpipe_stage_kv_blocks_used", "KV blocks in use per stage", labels=["node"])
        step = GaugeMetricFamily("logicpipe_stage_step_seconds", "Mean compute time per step per stage",
                                 labels=["node"])
        for node, st in self._stages:
            blocks.add_metric([node], st.kv_blocks_used)
            step.add_metric([node], st.compute_s / st.steps if st.steps else 0.0)
        yield blocks
        yield step
        hop = GaugeMetricFamily("logicpipe_link_latency_seconds", "Measured one-way latency between nodes",
                                labels=["src", "dst"])
        for src, links in app.links.items():
            for dst, link in links.items():
                hop.add_metric([src, dst], link.latency)
        yield hop
