"""Service tier: one servicer in-process on an ephemeral loopback port, real gRPC calls.

pytest-asyncio is not a dependency: a test is a plain function that runs its coroutine with
`run(...)` (a fresh event loop, with an overall timeout so a bug fails instead of hanging), or
with the module's `runner` (one event loop shared by a module's tests, for servers that are
expensive to start). Every server a helper starts is stopped when its `async with` ends, also on
failure or timeout.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import uuid
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Awaitable, Sequence

import grpc
import pytest

from logicpipe.common.health import add_health, set_serving
from logicpipe.common.transport import PLAINTEXT
from logicpipe.controller.app import ControllerApp, ControllerOptions
from logicpipe.controller.jobs.door import FrontDoor
from logicpipe.controller.api.service import ControllerServicer
from logicpipe.v1 import controller_pb2_grpc, stage_pb2, stage_pb2_grpc

RPC_TIMEOUT_S = 20.0   # any single call in these tests; generous for a loaded 2-core machine
TEST_TIMEOUT_S = 90.0  # one test's coroutine
ABORT_WAIT_S = 5.0     # a stream the server must abort on a bad message

STAGE_SERVICE = "logicpipe.v1.StageNode"

# The tiny random Llama model: 4 layers, 64-wide, 128-token vocabulary, 256-token context.
TINY_LAYERS = 4
TINY_HIDDEN = 64
TINY_VOCAB = 128
TINY_CONTEXT = 256
# KV bytes per token of the whole tiny model in float32: layers x kv_heads x head_dim x (k, v) x 4.
TINY_KV_BYTES_PER_TOKEN = TINY_LAYERS * 2 * (TINY_HIDDEN // 4) * 2 * 4

PROMPT = (3, 14, 15, 92, 65)  # token ids of the valid request
NEW_TOKENS = 4


# ----------------------------------------------------------------------------- event loops

def run(coro: Awaitable, timeout: float = TEST_TIMEOUT_S):
    """Run one test's coroutine on a fresh event loop; a hang fails as TimeoutError."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


@pytest.fixture(scope="module")
def runner():
    """One event loop for a whole module: `runner.run(coro)`; servers started by one call keep
    living (idle) until a later call stops them."""
    with asyncio.Runner() as r:
        yield r


# ----------------------------------------------------------------------------- models

@dataclass(frozen=True)
class TinyModel:
    path: Path
    greedy: tuple[int, ...]  # transformers' greedy continuation of PROMPT, NEW_TOKENS long


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> TinyModel:
    """A random 4-layer Llama saved as safetensors, and its greedy continuation of PROMPT
    (tokens 6, 92, 39, 13, each ahead of the runner-up by > 0.7 logits)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=TINY_VOCAB, hidden_size=TINY_HIDDEN, intermediate_size=128,
                         num_hidden_layers=TINY_LAYERS, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=TINY_CONTEXT, tie_word_embeddings=True,
                         # wide init: greedy picks varied tokens by clear margins (with the default
                         # 0.02 a random model just repeats the last prompt token)
                         initializer_range=0.5)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    path = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(path)
    ids = torch.tensor([PROMPT])
    with torch.no_grad():  # plain argmax loop: no EOS handling, like a stage opened without stop ids
        for _ in range(NEW_TOKENS):
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return TinyModel(path, tuple(int(t) for t in ids[0, len(PROMPT):]))


@pytest.fixture(scope="session")
def bert_model_dir(tmp_path_factory) -> Path:
    """A model directory of another architecture (config.json says bert)."""
    path = tmp_path_factory.mktemp("bert")
    (path / "config.json").write_text(json.dumps({
        "model_type": "bert", "architectures": ["BertModel"], "num_hidden_layers": TINY_LAYERS,
        "hidden_size": TINY_HIDDEN, "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": TINY_VOCAB}))
    return path


@pytest.fixture(scope="module")
def hf(tiny_model):
    """transformers' own model of the tiny Llama (the reference for greedy tokens)."""
    import torch
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(tiny_model.path, dtype=torch.float32).eval()


def hf_greedy(hf, prompt, n: int) -> list[int]:
    """n greedy tokens after `prompt`, by a plain argmax loop over the whole sequence."""
    import torch

    ids = torch.tensor([list(prompt)])
    with torch.no_grad():
        for _ in range(n):
            ids = torch.cat([ids, hf(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[0, len(prompt):].tolist()


# ----------------------------------------------------------------------------- stage nodes

def closed_port_address() -> str:
    """host:port of a loopback port nobody listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


@dataclass
class Node:
    node_id: str
    runtime: object  # stage_node.runtime.StageRuntime
    server: grpc.aio.Server
    health: object   # grpc_health.v1.health.aio.HealthServicer
    address: str
    channel: grpc.aio.Channel
    stub: stage_pb2_grpc.StageNodeStub


def fixed_profile(weight_formats: tuple[str, ...] = ("fp32",)):
    """A fixed resource profile (what `logicpipe-stage` measures at start; fixed here so the
    controller's plan does not depend on this machine's speed or load)."""
    from logicpipe.stage_node.profile import HostProfile

    return HostProfile(device_kind="cpu", device_name="service-test cpu", memory_bytes=8 * 2**30, flops=5e10,
                       mem_bandwidth=1e10, weight_formats=weight_formats)


@contextlib.asynccontextmanager
async def stage_node(node_id: str = "stage", *, max_kv_bytes: int = 2**30, serving: bool = True,
                     profiled: bool = True, weight_formats: tuple[str, ...] = ("fp32",), **options):
    """A StageNode server (+ grpc.health.v1) on 127.0.0.1:<ephemeral>, wired like stage_node.main;
    health says SERVING once started unless `serving` is False; `profiled=False` is a node started
    with --no-profile; `options`: more StageOptions fields (session_ttl_s, block_size, budget)."""
    from logicpipe.stage_node.config import StageOptions
    from logicpipe.stage_node.runtime import StageRuntime
    from logicpipe.stage_node.net.service import StageNodeServicer

    if options.get("quantize", "none") != "none":  # a quantized node offers its one format
        weight_formats = (options["quantize"],)
    runtime = StageRuntime(node_id, "cpu", transport=PLAINTEXT, options=StageOptions(max_kv_bytes=max_kv_bytes, **options))
    server = PLAINTEXT.server()
    servicer = StageNodeServicer(runtime, PLAINTEXT, fixed_profile(weight_formats) if profiled else None, f"cpu@{node_id}")
    stage_pb2_grpc.add_StageNodeServicer_to_server(servicer, server)
    health = await add_health(server, STAGE_SERVICE)
    port = server.add_insecure_port("127.0.0.1:0")
    assert port, "could not bind an ephemeral loopback port"
    address = f"127.0.0.1:{port}"
    runtime.start()
    channel = None
    try:
        await server.start()
        if serving:
            await set_serving(health, True, STAGE_SERVICE)
        channel = PLAINTEXT.channel(address, "stage")
        yield Node(node_id, runtime, server, health, address, channel, stage_pb2_grpc.StageNodeStub(channel))
    finally:
        if channel is not None:
            await channel.close()
        await server.stop(None)
        await runtime.stop()


def assign_request(model_dir, start: int = 0, end: int = TINY_LAYERS, *, num_layers: int = TINY_LAYERS,
                   stage_index: int = 0, num_stages: int = 1, **fields) -> stage_pb2.AssignRequest:
    return stage_pb2.AssignRequest(model_dir=str(model_dir), start_layer=start, end_layer=end,
                                   num_layers=num_layers, stage_index=stage_index, num_stages=num_stages,
                                   **fields)


async def assign(node: Node, model_dir, start: int = 0, end: int = TINY_LAYERS, **fields) -> stage_pb2.AssignReply:
    return await node.stub.Assign(assign_request(model_dir, start, end, **fields), timeout=RPC_TIMEOUT_S)


async def assign_pipeline(first: Node, last: Node, model_dir, split: int = 2) -> None:
    """[0, split) on `first`, [split, TINY_LAYERS) on `last` (last stage first, as the controller does)."""
    await assign(last, model_dir, split, TINY_LAYERS, stage_index=1, num_stages=2, first_address=first.address)
    await assign(first, model_dir, 0, split, stage_index=0, num_stages=2, next_address=last.address)


@contextlib.asynccontextmanager
async def single_stage(model_dir, node_id: str = "solo", **kw):
    """One node holding the whole tiny model: first and last stage at once."""
    async with stage_node(node_id, **kw) as node:
        await assign(node, model_dir)
        yield node


@contextlib.asynccontextmanager
async def two_stages(model_dir):
    """Two nodes, [0, 2) -> [2, 4), in this event loop."""
    async with stage_node("first") as first, stage_node("last") as last:
        await assign_pipeline(first, last, model_dir)
        yield first, last


@contextlib.asynccontextmanager
async def three_stages(model_dir):
    """Three nodes, [0, 1) -> [1, 3) -> [3, 4), in this event loop."""
    async with stage_node("first") as first, stage_node("middle") as middle, stage_node("last") as last:
        await assign(last, model_dir, 3, TINY_LAYERS, stage_index=2, num_stages=3, first_address=first.address)
        await assign(middle, model_dir, 1, 3, stage_index=1, num_stages=3, next_address=last.address,
                     first_address=first.address)
        await assign(first, model_dir, 0, 1, stage_index=0, num_stages=3, next_address=middle.address)
        yield first, middle, last


# ----------------------------------------------------------------------------- expectations

async def expect_status(awaitable: Awaitable, code: grpc.StatusCode, *fragments: str) -> grpc.aio.AioRpcError:
    """Await a call that must fail with `code` and a details message containing every fragment."""
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await awaitable
    err = info.value
    assert err.code() == code, f"expected {code.name}, got {err.code().name}: {err.details()}"
    for fragment in fragments:
        assert str(fragment) in err.details(), f"{fragment!r} not in the message {err.details()!r}"
    return err


async def stream_once(node: Node, *batches: stage_pb2.StepBatch, timeout: float = RPC_TIMEOUT_S):
    """Write batches on a new Stream call, then read its first reply (raises if the stream aborted)."""
    call = node.stub.Stream(timeout=timeout)
    try:
        for batch in batches:
            await call.write(batch)
        return await call.read()
    finally:
        call.cancel()


async def expect_stream_abort(node: Node, batch: stage_pb2.StepBatch, code: grpc.StatusCode,
                              *fragments: str) -> grpc.aio.AioRpcError:
    """Write one step on a new Stream; the node must end the stream with `code` (at once: a stream
    that stays open fails as DEADLINE_EXCEEDED after ABORT_WAIT_S)."""
    return await expect_status(stream_once(node, batch, timeout=ABORT_WAIT_S), code, *fragments)


def prompt_step(session_id: str, token_ids: Sequence[int] = PROMPT, start_pos: int = 0,
                num_candidates: int = 0) -> stage_pb2.StepBatch:
    return stage_pb2.StepBatch(seqs=[stage_pb2.SeqStep(session_id=session_id, start_pos=start_pos,
                                                       num_tokens=len(token_ids), token_ids=list(token_ids),
                                                       num_candidates=num_candidates)])


def open_request(session_id: str, capacity: int = len(PROMPT) + NEW_TOKENS, *,
                 max_new_tokens: int = NEW_TOKENS, **fields) -> stage_pb2.OpenSessionRequest:
    return stage_pb2.OpenSessionRequest(session_id=session_id, capacity=capacity, max_new_tokens=max_new_tokens,
                                        **fields)


def new_session_id(tag: str = "s") -> str:
    return f"{tag}-{uuid.uuid4().hex[:8]}"


@dataclass(frozen=True)
class Token:
    """One generated token, from a TokenEvent (which may carry several)."""

    token_id: int
    index: int
    finished: bool
    finish_reason: str


class Events:
    """A subscription to a node's Events stream (of `owner`'s sessions); `async with` waits until
    it is subscribed."""

    def __init__(self, node: Node, owner: str = ""):
        self.node = node
        self.call = node.stub.Events(stage_pb2.EventsRequest(owner=owner))
        self.buffer: deque[stage_pb2.Event] = deque()

    async def __aenter__(self) -> "Events":
        await asyncio.wait_for(self.call.initial_metadata(), RPC_TIMEOUT_S)
        return self

    async def __aexit__(self, *exc) -> None:
        self.call.cancel()

    async def next(self, session_id: str, timeout: float = RPC_TIMEOUT_S) -> stage_pb2.Event:
        """The next event of `session_id` (events of other sessions stay buffered)."""
        async def find():
            while True:
                for ev in self.buffer:
                    if ev.session_id == session_id:
                        self.buffer.remove(ev)
                        return ev
                batch = await self.call.read()
                assert batch is not grpc.aio.EOF, f"the Events stream of {self.node.address} ended"
                self.buffer.extend(batch.events)
        return await asyncio.wait_for(find(), timeout)

    async def error(self, session_id: str) -> stage_pb2.SessionError:
        ev = await self.next(session_id)
        assert ev.HasField("error"), f"expected a SessionError for {session_id}, got {ev}"
        return ev.error

    async def token_event(self, session_id: str) -> stage_pb2.TokenEvent:
        ev = await self.next(session_id)
        assert ev.HasField("token"), f"session {session_id} failed: {ev.error}"
        return ev.token

    async def tokens(self, session_id: str) -> list[Token]:
        """Tokens of a session up to the finished one; a SessionError fails the test."""
        out: list[Token] = []
        while not out or not out[-1].finished:
            t = await self.token_event(session_id)
            n = len(t.token_ids)
            out.extend(Token(tok, t.index + i, t.finished and i == n - 1, t.finish_reason if i == n - 1 else "")
                       for i, tok in enumerate(t.token_ids))
        return out


async def serve_valid_request(first: Node, last: Node | None = None, *, call=None,
                              expect: Sequence[int] | None = None) -> list[int]:
    """The node(s) still serve: open a session on every stage, stream PROMPT into `first` (on `call`
    when given, else a new Stream), read NEW_TOKENS token events from `last` to finished ("length"),
    close the session everywhere. Returns the generated token ids (checked against `expect`)."""
    last = last or first
    nodes = [first] if last is first else [first, last]
    sid = new_session_id("valid")
    async with Events(last) as events:
        for node in nodes:
            await node.stub.OpenSession(open_request(sid), timeout=RPC_TIMEOUT_S)
        own_call = call is None
        if own_call:
            call = first.stub.Stream(timeout=RPC_TIMEOUT_S)
        try:
            await call.write(prompt_step(sid))
            tokens = await events.tokens(sid)
        finally:
            if own_call:
                call.cancel()
    assert [t.index for t in tokens] == list(range(NEW_TOKENS))
    assert tokens[-1].finish_reason == "length"
    assert all(0 <= t.token_id < TINY_VOCAB for t in tokens)
    for node in nodes:
        reply = await node.stub.CloseSession(stage_pb2.CloseSessionRequest(session_id=sid), timeout=RPC_TIMEOUT_S)
        # the prompt plus every generated token but the last went through every stage's KV
        assert reply.tokens_held == len(PROMPT) + NEW_TOKENS - 1
    ids = [t.token_id for t in tokens]
    if expect is not None:
        assert ids == list(expect), "greedy tokens differ from transformers' generate"
    return ids


# ----------------------------------------------------------------------------- the controller

@dataclass
class Controller:
    app: object  # controller.app.ControllerApp
    door: object  # controller.requests.FrontDoor
    server: grpc.aio.Server
    address: str
    channel: grpc.aio.Channel
    stub: object  # controller_pb2_grpc.ControllerStub


@contextlib.asynccontextmanager
async def controller(model_dir, nodes: Sequence[str], *, start: bool = True, strategy: str = "uniform",
                     dtype: str = "float32", requests_per_client: int = 64, wait_for_nodes_s: float = 60.0):
    """ControllerApp + ControllerServicer on 127.0.0.1:<ephemeral>; `start` profiles `nodes`, plans
    and installs the pipeline as logicpipe-controller does (strategy "uniform": every node gets a
    stage, in the given order, whatever the planner would prefer)."""
    options = ControllerOptions(strategy=strategy, settle_s=0.5, dtype=dtype, wait_for_nodes_s=wait_for_nodes_s)
    app = ControllerApp(model_dir, list(nodes), transport=PLAINTEXT, options=options)
    door = FrontDoor(app.scheduler, app.tokenizer, model_dir=app.model_dir, requests_per_client=requests_per_client)
    server = PLAINTEXT.server()
    controller_pb2_grpc.add_ControllerServicer_to_server(ControllerServicer(app, door, PLAINTEXT), server)
    port = server.add_insecure_port("127.0.0.1:0")
    assert port, "could not bind an ephemeral loopback port"
    address = f"127.0.0.1:{port}"
    channel = None
    try:
        await server.start()
        if start:
            await app.start()
            assert await app.wait_ready(120), f"no plan: {app.state.reason}"
        channel = PLAINTEXT.channel(address, "controller")
        yield Controller(app, door, server, address, channel, controller_pb2_grpc.ControllerStub(channel))
    finally:
        if channel is not None:
            await channel.close()
        await server.stop(None)
        await app.close()
