"""The dashboard on the HTTP API's port (`logicpipe-controller --http`): a page of plain files
(controller/api/static/, shipped in the package; nothing is built or fetched at run time) and the
mesh's state as JSON snapshots.

    GET /                    the page (no key: it holds no data)
    GET /ui/{file}           its script and style sheet
    GET /dashboard/snapshot  one snapshot (JSON)
    GET /dashboard/events    a snapshot every INTERVAL_S as server-sent events (`data: {...}`), until the
                             client leaves or the controller stops

The two /dashboard/ routes take the API's keys as /v1/* does (`Authorization: Bearer TOKEN`). The
page asks for the key once, keeps it in the browser's localStorage and reads the events with
fetch() and a stream reader (EventSource cannot send a header; a key in the URL would land in
logs). Its chat box uses POST /v1/chat/completions with `stream: true`.

A snapshot reads what the controller holds already — no probe of its own: the stages of the plan
are asked for their Status every second by their pipeline (pipeline._watch_health), every node
every PROBE_S by membership; tokens/s of a stage is the change of its token count between two of
those answers, over the change of its own uptime.
"""
from __future__ import annotations

import asyncio
import json
import time
from collections import deque
from dataclasses import asdict
from pathlib import Path

from aiohttp import web

from logicpipe.controller.app import ControllerApp
from logicpipe.controller.jobs.door import request_timings
from logicpipe.controller.jobs.job import Request, RequestState

STATIC = Path(__file__).parent / "static"
FILES = {"dashboard.js": "text/javascript", "dashboard.css": "text/css"}  # what /ui/ serves
INTERVAL_S = 1.0  # between two events of /dashboard/events
RECENT = 12       # finished requests a snapshot lists
ACTIVE = 64       # requests not ended a snapshot lists at most (the oldest; `requests` counts them all)
# the page may load only its own files and talk only to this server (nothing from a CDN, no framing)
PAGE_HEADERS = {"Cache-Control": "no-cache", "Content-Security-Policy": "default-src 'self'; frame-ancestors 'none'",
                "X-Frame-Options": "DENY", "Referrer-Policy": "no-referrer", "X-Content-Type-Options": "nosniff"}


class Dashboard:
    """The snapshots of one controller (`app`), and the routes that serve them and the page."""

    def __init__(self, app: ControllerApp):
        self.app = app
        self.recent: deque[dict] = deque(maxlen=RECENT)  # finished requests, newest last
        self._rates: dict[str, tuple[float, int, float, float]] = {}  # address -> (uptime, tokens, compute_s, rate)
        self._busy: dict[str, float] = {}                             # address -> busy share over the last interval
        self._generated: tuple[float, int, float] = (time.monotonic(), 0, 0.0)  # (when, tokens out, rate)
        self.closing = asyncio.Event()  # set as the server stops: every event stream ends
        app.scheduler.observers.append(self._finished)

    def routes(self) -> dict:
        return {"/": self.page, "/ui/{file}": self.asset, "/dashboard/snapshot": self.one,
                "/dashboard/events": self.events}

    # ---- routes ----------------------------------------------------------------------------------
    async def page(self, request):
        return web.FileResponse(STATIC / "index.html", headers=PAGE_HEADERS)

    async def asset(self, request):
        name = request.match_info["file"]
        if name not in FILES:
            raise web.HTTPNotFound()
        return web.FileResponse(STATIC / name, headers={**PAGE_HEADERS, "Content-Type": FILES[name]})

    async def one(self, request):
        return web.json_response(self.snapshot())

    async def events(self, request):
        """Server-sent events, one snapshot each, every INTERVAL_S."""
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                               "X-Accel-Buffering": "no"})
        await response.prepare(request)
        while not self.closing.is_set():
            await response.write(b"data: " + json.dumps(self.snapshot(), separators=(",", ":")).encode() + b"\n\n")
            try:
                await asyncio.wait_for(self.closing.wait(), INTERVAL_S)
            except asyncio.TimeoutError:
                pass
        return response

    async def on_shutdown(self, _app) -> None:
        self.closing.set()

    # ---- the snapshot ------------------------------------------------------------------------------
    def snapshot(self) -> dict:
        """The mesh now, as the page draws it (docs/dashboard.md lists the fields)."""
        app = self.app
        snap = app.snapshot()
        st = snap.stats
        now = time.monotonic()
        when, out, rate = self._generated
        if now - when >= INTERVAL_S / 2:
            rate = (st.generated_tokens - out) / (now - when)
            self._generated = (now, st.generated_tokens, rate)
        return {
            "time": time.time(), "model": app.model_dir.name, "layers": app.num_layers,
            "state": snap.phase.value, "reason": snap.reason, "generation": snap.plan_generation,
            "replans": snap.replans, "role": snap.role,
            "requests": {"running": snap.running, "queued": snap.queued, "open": len(app.scheduler.requests),
                         "completed": st.completed, "failed": st.failed, "cancelled": st.cancelled,
                         "prompt_tokens": st.prompt_tokens,
                         "generated_tokens": st.generated_tokens, "replays": st.replays,
                         "preemptions": st.preemptions, "tokens_per_s": round(rate, 2)},
            "nodes": self._nodes(),
            "pipelines": self._pipelines(snap),
            "active": [self._active(r, now) for r in list(app.scheduler.requests.values())[:ACTIVE] if not r.ended],
            "recent": list(reversed(self.recent)),
            "history": [{**asdict(h), "pipelines": [[{"node": n, "start": s, "end": e} for n, s, e in p]
                                                    for p in h.pipelines]}
                        for h in reversed(app.replanner.history)],
        }

    def _nodes(self) -> list[dict]:
        """Every node membership knows, from its last probe."""
        in_plan = {h.address: p.index for p in self.app.pipelines.all for h in (*p.stages, *p.members)}
        out = []
        for m in sorted(self.app.members.by_address.values(), key=lambda m: (m.node_id or "~", m.address)):
            s, why = m.status, m.why_not()
            p = s.profile if s is not None else None
            state = ("in plan" if m.address in in_plan and not why else "drained" if m.drained
                     else "leaving" if m.leaving else "down" if why else "spare")
            out.append({
                "address": m.address, "node_id": m.node_id or (s.node_id if s else ""), "source": m.source,
                "state": state, "why_out": why or ("" if m.address in in_plan else
                                                   "spare: the plan in force does not need it"),
                "pipeline": in_plan.get(m.address), "stage_state": s.state if s else "",
                "device": s.device if s else "", "device_name": p.device_name if p else "",
                "memory_bytes": p.memory_bytes if p else 0, "flops": p.flops if p else 0.0,
                "mem_bandwidth": p.mem_bandwidth if p else 0.0,
                "weight_formats": list(p.weight_formats) if p else [],
            })
        return out

    def _pipelines(self, snap) -> list[dict]:
        """The plan in force: per pipeline its stages, each with its layers and its last probe's
        figures (tokens/s, busy share, KV blocks)."""
        views = {v.index: v for v in snap.pipelines}
        out = []
        for p in self.app.pipelines.all:
            v = views.get(p.index)
            stages = []
            for h in p.stages:
                s = h.status
                stages.append({
                    "node_id": h.node_id, "address": h.address, "start": h.start, "end": h.end, "device": h.device,
                    "down": h.down_reason or self.app.why_down(h.address), "tokens_per_s": self._rate(h.address, s),
                    "busy": self._busy.get(h.address, 0.0),
                    "weight_format": s.weight_format if s else "", "sessions": s.open_sessions if s else 0,
                    "kv_blocks_used": s.kv_blocks_used if s else 0, "kv_blocks_total": s.kv_blocks_total if s else 0,
                    "kv_blocks_cached": s.kv_blocks_cached if s else 0,
                })
            out.append({"index": p.index, "generation": p.generation, "serving": bool(v and v.serving),
                        "running": v.running if v else 0, "micro_batches": p.micro_batches,
                        "predicted_tokens_per_s": v.predicted_tokens_per_s if v else 0.0, "stages": stages})
        return out

    def _rate(self, address: str, s) -> float:
        """Token rows/s the stage at `address` computed between its last two probe answers."""
        if s is None:
            return 0.0
        last = self._rates.get(address)
        if last is None or s.uptime_s < last[0]:  # first seen, or the process restarted
            self._rates[address] = (s.uptime_s, s.tokens, s.compute_s, 0.0)
            return 0.0
        uptime, tokens, compute, rate = last
        if s.uptime_s - uptime >= 0.5:  # a newer answer
            dt = s.uptime_s - uptime
            rate = (s.tokens - tokens) / dt
            self._busy[address] = min(1.0, max(0.0, (s.compute_s - compute) / dt))
            self._rates[address] = (s.uptime_s, s.tokens, s.compute_s, rate)
        return round(rate, 2)

    @staticmethod
    def _active(r: Request, now: float) -> dict:
        t = r.times
        n = len(r.tokens)
        decode = now - t.first_token if t.first_token else 0.0
        return {"id": r.id, "state": r.state.value, "api": r.job.api or "grpc", "client": r.job.client,
                "pipeline": r.pipeline.index if r.pipeline is not None and r.state is RequestState.RUNNING else None,
                "prompt_tokens": len(r.prompt_ids), "tokens": n, "max_tokens": r.max_tokens,
                "age_s": round(now - t.submitted, 2), "replays": r.replays,
                "tokens_per_s": round((n - 1) / decode, 2) if decode > 0 and n > 1 else 0.0}

    def _finished(self, r: Request) -> None:
        """A request ended (the scheduler's observer): kept for the page's recent list."""
        t = request_timings(r)
        outcome = ("completed" if r.state is RequestState.FINISHED
                   else "cancelled" if r.error is None and not r.reader_failed else "failed")
        self.recent.append({"id": r.id, "api": r.job.api or "grpc", "outcome": outcome,
                            "finish_reason": r.finish_reason, "prompt_tokens": len(r.prompt_ids),
                            "tokens": len(r.tokens), "first_token_s": round(max(0.0, t.first_token_s), 3),
                            "total_s": round(max(0.0, t.total_s), 3),
                            "tokens_per_s": round(t.decode_tokens_per_s, 2), "replays": r.replays})
