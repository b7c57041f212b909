"""Service tier, the dashboard's routes (controller.dashboard) on the HTTP API of an in-process
controller over two in-process stages holding the tiny random model, with API keys: the page and
its files need no key, the snapshots do (401 without one, or with a wrong one); a snapshot has the
plan's stages and layers, the nodes, the re-plan history and a finished request; the events come
as `data: {...}` server-sent events, and end when the server stops (it does not wait for them)."""
from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass

import aiohttp
import pytest
from aiohttp import web

from logicpipe.controller.api.http_api import HttpApi
from logicpipe.controller.api.http_auth import ApiKeys, parse
from logicpipe.v1 import controller_pb2

from .conftest import PROMPT, TINY_LAYERS, Controller, controller, stage_node

TOKEN = "d" * 32
KEYS = ApiKeys(parse(f"viewer {TOKEN}\n"))
AUTH = {"Authorization": f"Bearer {TOKEN}"}
CALL_TIMEOUT_S = 60.0


@dataclass
class Served:
    ctl: Controller
    base: str
    session: aiohttp.ClientSession
    runner: web.AppRunner


@contextlib.asynccontextmanager
async def serve(ctl: Controller):
    """ctl's HTTP API (with KEYS) on 127.0.0.1:<ephemeral>, and a client session."""
    runner = HttpApi(ctl.app, ctl.door, keys=KEYS).runner()
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        async with aiohttp.ClientSession() as session:
            yield Served(ctl, f"http://127.0.0.1:{runner.addresses[0][1]}", session, runner)
    finally:
        await runner.cleanup()


@contextlib.asynccontextmanager
async def mesh(model_dir):
    async with stage_node("dash-first") as first, stage_node("dash-last") as last, \
            controller(model_dir, [first.address, last.address]) as ctl, serve(ctl) as served:
        yield served


@pytest.fixture(scope="module")
def api(runner, tiny_model):
    stack = contextlib.AsyncExitStack()
    try:
        yield arun(runner, stack.enter_async_context(mesh(tiny_model.path)))
    finally:
        arun(runner, stack.aclose())


def arun(runner, coro):
    return runner.run(asyncio.wait_for(coro, CALL_TIMEOUT_S))


async def get(api: Served, path: str, headers=None, *, policy: bool = False):
    """(status, content type, text), and with `policy` the Content-Security-Policy header."""
    async with api.session.get(api.base + path, headers=headers or {}) as r:
        got = r.status, r.content_type, await r.text()
        return (*got, r.headers.get("Content-Security-Policy", "")) if policy else got


async def first_events(api: Served, n: int) -> list[dict]:
    """The first `n` snapshots of /dashboard/events."""
    events = []
    async with api.session.get(api.base + "/dashboard/events", headers=AUTH) as r:
        assert r.status == 200 and r.content_type == "text/event-stream"
        async for line in r.content:
            if line.startswith(b"data: "):
                events.append(json.loads(line[6:]))
                if len(events) == n:
                    return events
    raise AssertionError(f"the stream ended after {len(events)} events")


def test_the_page_needs_no_key_the_snapshots_do(runner, api):
    async def go():
        status, kind, text, policy = await get(api, "/", policy=True)
        assert status == 200 and kind == "text/html" and "/ui/dashboard.js" in text
        assert "default-src 'self'" in policy  # its own files only: nothing from elsewhere
        for name, want in (("dashboard.js", "text/javascript"), ("dashboard.css", "text/css")):
            status, kind, _ = await get(api, f"/ui/{name}")
            assert (status, kind) == (200, want), name
        assert (await get(api, "/ui/../http_api.py"))[0] == 404
        assert (await get(api, "/ui/secret.txt"))[0] == 404
        for path in ("/dashboard/snapshot", "/dashboard/events"):
            for headers in ({}, {"Authorization": "Bearer " + "x" * 32}):
                status, kind, text = await get(api, path, headers)
                assert status == 401 and kind == "application/json", (path, headers)
                assert json.loads(text)["error"]["code"] == "invalid_api_key"
    arun(runner, go())


def test_a_snapshot_has_the_plan_the_nodes_and_the_history(runner, api):
    async def go():
        reply = [r async for r in api.ctl.stub.Submit(controller_pb2.SubmitRequest(
            prompt_token_ids=list(PROMPT), max_tokens=4, ignore_eos=True), timeout=CALL_TIMEOUT_S)]
        rid = reply[0].request_id
        status, kind, text = await get(api, "/dashboard/snapshot", AUTH)
        assert status == 200 and kind == "application/json"
        snap = json.loads(text)
        assert {"time", "model", "layers", "state", "reason", "generation", "replans", "requests", "nodes", "pipelines",
                "active", "recent", "history"} <= set(snap)
        assert snap["state"] == "ready" and snap["layers"] == TINY_LAYERS
        stages = snap["pipelines"][0]["stages"]
        assert [(s["node_id"], s["start"], s["end"]) for s in stages] == \
            [(s.node_id, s.start, s.end) for s in api.ctl.app.stage_views()]
        assert stages[0]["start"] == 0 and stages[-1]["end"] == TINY_LAYERS
        assert all(stages[i]["end"] == stages[i + 1]["start"] for i in range(len(stages) - 1))
        for s in stages:
            assert {"tokens_per_s", "busy", "kv_blocks_used", "kv_blocks_total", "sessions", "down"} <= set(s)
            assert s["kv_blocks_total"] > 0 and not s["down"]
        nodes = {n["node_id"]: n for n in snap["nodes"]}
        assert set(nodes) == {"dash-first", "dash-last"}
        for n in nodes.values():
            assert n["state"] == "in plan" and n["why_out"] == "" and n["pipeline"] == 0
            assert n["device"] == "cpu" and n["memory_bytes"] > 0 and n["flops"] > 0
        [entry] = snap["history"]
        assert entry["generation"] == snap["generation"] and entry["why"]
        assert entry["pipelines"] == [[{"node": s["node_id"], "start": s["start"], "end": s["end"]} for s in stages]]
        assert snap["requests"]["completed"] >= 1 and snap["requests"]["queued"] == snap["requests"]["open"] == 0
        done = next(r for r in snap["recent"] if r["id"] == rid)
        assert done["outcome"] == "completed" and done["tokens"] == 4 and done["api"] == "grpc"
    arun(runner, go())


def test_events_are_snapshots_a_second_apart(runner, api):
    async def go():
        a, b = await first_events(api, 2)
        assert a["generation"] == b["generation"] and b["time"] > a["time"]
        assert [s["node_id"] for s in b["pipelines"][0]["stages"]] == ["dash-first", "dash-last"]
    arun(runner, go())


def test_a_stopping_server_ends_the_event_streams(runner, api):
    async def go():
        runner = HttpApi(api.ctl.app, api.ctl.door, keys=KEYS).runner()
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        try:
            url = f"http://127.0.0.1:{runner.addresses[0][1]}/dashboard/events"
            async with api.session.get(url, headers=AUTH) as r:
                assert (await r.content.readline()).startswith(b"data: ")
                await asyncio.wait_for(runner.cleanup(), 5.0)  # not aiohttp's 60 s wait for open handlers
                rest = await asyncio.wait_for(r.content.read(), 5.0)
                assert rest.count(b"data: ") <= 1
        finally:
            if runner.server is not None:
                await runner.cleanup()
    arun(runner, go())
