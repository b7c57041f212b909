"""Controller service in-process over two in-process stage nodes running the default model
(SmolLM2-135M-Instruct, 30 layers, split uniformly): bad Submits and Plan requests get their
status and a message a person can act on, the controller then serves a valid request; no
pipeline and a stage lost mid-request are UNAVAILABLE, never a hang."""
from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import dataclass

import grpc
import pytest

from logicpipe.controller.mesh import pipeline as pipeline_module
from logicpipe.v1 import controller_pb2, stage_pb2

from .conftest import (
    RPC_TIMEOUT_S,
    Controller,
    Node,
    closed_port_address,
    controller,
    expect_status,
    fixed_profile,
    stage_node,
)

SMOL_LAYERS = 30
SMOL_VOCAB = 49152
SMOL_CONTEXT = 8192
CALL_TIMEOUT_S = 60.0  # one Submit; a hang fails as DEADLINE_EXCEEDED
IA = grpc.StatusCode.INVALID_ARGUMENT


def arun(runner, coro, timeout: float = 120.0):
    return runner.run(asyncio.wait_for(coro, timeout))


@dataclass
class Mesh:
    first: Node  # layers [0, 15)
    last: Node   # layers [15, 30)
    ctl: Controller


@contextlib.asynccontextmanager
async def mesh_of_two(model_dir, tag: str, first_options: dict | None = None, **last_options):
    async with stage_node(f"{tag}-first", **(first_options or {})) as first, \
            stage_node(f"{tag}-last", **last_options) as last:
        async with controller(model_dir, [first.address, last.address]) as ctl:
            yield Mesh(first, last, ctl)


@pytest.fixture(scope="module")
def mesh(runner, model_dir):
    """Two stages and a controller for the module's tests, on the module's event loop."""
    stack = contextlib.AsyncExitStack()
    try:
        yield arun(runner, stack.enter_async_context(mesh_of_two(model_dir, "mesh")))
    finally:
        arun(runner, stack.aclose())


async def submit(ctl: Controller, **fields) -> list[controller_pb2.SubmitReply]:
    """Every reply of one Submit, to its end."""
    call = ctl.stub.Submit(controller_pb2.SubmitRequest(**fields), timeout=CALL_TIMEOUT_S)
    return [reply async for reply in call]


async def open_sessions(node: Node) -> int:
    return (await node.stub.Status(stage_pb2.StatusRequest(), timeout=RPC_TIMEOUT_S)).open_sessions


async def eventually_no_sessions(*nodes: Node, within: float = 10.0) -> None:
    """The controller closes a request's sessions in the background; wait for it."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while True:
        counts = [await open_sessions(n) for n in nodes]
        if not any(counts):
            return
        assert loop.time() < deadline, f"sessions left open on the stages: {counts}"
        await asyncio.sleep(0.05)


def check_finished_stream(replies: list[controller_pb2.SubmitReply], mesh: Mesh, max_tokens: int) -> list[int]:
    """A Submit stream that ran to its end: one token per reply, stages on the first, timings on the last."""
    assert replies, "no reply"
    ids = [t for r in replies for t in r.token_ids]
    assert [len(r.token_ids) for r in replies] == [1] * len(replies)
    assert 1 <= len(ids) <= max_tokens
    assert len({r.request_id for r in replies}) == 1 and replies[0].request_id
    assert [r.finished for r in replies] == [False] * (len(replies) - 1) + [True]
    last = replies[-1]
    assert last.finish_reason == ("length" if len(ids) == max_tokens else "stop")
    assert [(s.address, s.start_layer, s.end_layer) for s in replies[0].stages] == \
           [(mesh.first.address, 0, 15), (mesh.last.address, 15, SMOL_LAYERS)]
    assert not any(r.stages for r in replies[1:])
    t = last.timings
    assert t.new_tokens == len(ids) and t.prompt_tokens > 0
    assert 0 < t.queue_s <= t.first_token_s <= t.total_s
    assert (t.decode_tokens_per_s > 0) == (len(ids) > 1)
    assert "".join(r.text for r in replies) == mesh.ctl.app.tokenizer.decode(ids, skip_special_tokens=True)
    return ids


# ----------------------------------------------------------------------------- bad Submits

BAD_SUBMITS = {
    # id: (SubmitRequest fields, fragments of the message)
    "empty-prompt": (dict(prompt=""), ["prompt is empty"]),
    "blank-prompt": (dict(prompt=" \n\t"), ["prompt is empty"]),
    "beyond-context": (dict(prompt="Hello", max_tokens=100000),
                       ["100000 new tokens", f"{SMOL_CONTEXT}-token context", "--max-tokens"]),
    "token-past-vocab": (dict(prompt_token_ids=[1, SMOL_VOCAB]), [str(SMOL_VOCAB), f"[0, {SMOL_VOCAB})"]),
    "negative-token": (dict(prompt_token_ids=[1, -3]), ["-3", "vocabulary"]),
    "negative-temperature": (dict(prompt="Hello", sampling=stage_pb2.SamplingParams(temperature=-1.0)),
                             ["temperature", "-1.0"]),
    "infinite-temperature": (dict(prompt="Hello", sampling=stage_pb2.SamplingParams(temperature=float("inf"))),
                             ["temperature", "inf"]),
    "vanishing-temperature": (dict(prompt="Hello", sampling=stage_pb2.SamplingParams(temperature=1e-45)),
                              ["temperature", "greedy"]),
    "huge-prompt": (dict(prompt="x" * (2**20 + 1)), [str(2**20 + 1), "over the cap"]),
    "top-p-over-one": (dict(prompt="Hello", sampling=stage_pb2.SamplingParams(temperature=1.0, top_p=1.5)),
                       ["top_p", "(0, 1]", "1.5"]),
}


@pytest.mark.parametrize("case", list(BAD_SUBMITS))
def test_bad_submit_is_invalid_argument_and_the_controller_keeps_serving(case, runner, mesh):
    fields, fragments = BAD_SUBMITS[case]

    async def main():
        await expect_status(submit(mesh.ctl, **fields), IA, *fragments)
        assert not mesh.ctl.app.scheduler.active
        assert await open_sessions(mesh.first) == 0 and await open_sessions(mesh.last) == 0
        replies = await submit(mesh.ctl, prompt="Hi", max_tokens=2)
        check_finished_stream(replies, mesh, 2)
    arun(runner, main())


def test_valid_submit_streams_tokens_and_finishes_with_timings(runner, mesh):
    prompt, max_tokens = "The capital of France is", 8

    async def main():
        done = mesh.ctl.app.scheduler.stats.completed
        replies = await submit(mesh.ctl, prompt=prompt, raw=True, max_tokens=max_tokens)
        ids = check_finished_stream(replies, mesh, max_tokens)
        prompt_ids = mesh.ctl.door.encode_prompt(prompt, raw=True)
        assert replies[-1].timings.prompt_tokens == len(prompt_ids)
        # the same prompt, already tokenized: the same greedy tokens
        again = await submit(mesh.ctl, prompt_token_ids=prompt_ids, max_tokens=max_tokens)
        assert check_finished_stream(again, mesh, max_tokens) == ids
        assert mesh.ctl.app.scheduler.stats.completed == done + 2
        await eventually_no_sessions(mesh.first, mesh.last)
    arun(runner, main())


def test_a_stage_too_slow_to_admit_a_request_delays_it_without_failing_it(runner, mesh, monkeypatch):
    """OpenSession past its deadline (a stage busy or stalled) is a stage's trouble, not the
    request's: it waits and opens again once the stage answers in time (was: failed as an
    internal error, an HTTP 500)."""
    async def main():
        opens = []

        def late(spec):  # the first stage answers every admission after its deadline
            opens.append(spec.session_id)
            time.sleep(0.3)  # (blocks the one event loop: nothing can answer meanwhile)
            return admit(spec)

        admit = mesh.first.runtime.open_session
        monkeypatch.setattr(pipeline_module, "OPEN_TIMEOUT_S", 0.1)
        monkeypatch.setattr(mesh.first.runtime, "open_session", late)
        task = asyncio.ensure_future(submit(mesh.ctl, prompt="Hello", raw=True, max_tokens=3))
        await asyncio.sleep(2.0)
        assert not task.done(), task.exception() if task.done() else None
        assert len(opens) >= 2, opens  # tried again
        monkeypatch.setattr(mesh.first.runtime, "open_session", admit)
        check_finished_stream(await task, mesh, 3)
        await eventually_no_sessions(mesh.first, mesh.last)
    arun(runner, main())


def test_status_lists_the_stages_covering_every_layer(runner, mesh):
    async def main():
        st = await mesh.ctl.stub.Status(controller_pb2.ControllerStatusRequest(), timeout=RPC_TIMEOUT_S)
        assert st.state == "ready" and st.plan_id and st.model_dir == str(mesh.ctl.app.model_dir)
        assert [(s.node_id, s.address) for s in st.stages] == \
               [("mesh-first", mesh.first.address), ("mesh-last", mesh.last.address)]
        bounds = [(s.start_layer, s.end_layer) for s in st.stages]
        assert bounds[0][0] == 0 and bounds[-1][1] == SMOL_LAYERS
        assert all(a[1] == b[0] and a[0] < a[1] for a, b in zip(bounds, bounds[1:] + [(SMOL_LAYERS, None)]))
        assert all(s.parameter_count > 0 and s.device == "cpu" for s in st.stages)
        assert [(n.address, n.reachable, n.status.state, n.status.plan_id) for n in st.nodes] == \
               [(mesh.first.address, True, "ready", st.plan_id), (mesh.last.address, True, "ready", st.plan_id)]
        assert all(n.status.profile.flops == fixed_profile().flops for n in st.nodes)
        plan = json.loads(st.plan_json)
        assert [p["strategy"] for p in plan["pipelines"]] == ["uniform"] and plan["pipelines"][0]["stages"]
    arun(runner, main())


# ----------------------------------------------------------------------------- Plan

BAD_PLANS = {
    # id: (PlanRequest fields, fragments of the message)
    "unknown-strategy": (dict(strategy="bogus"), ["'bogus'", "dp, uniform"]),
    "unknown-objective": (dict(strategy="uniform", objective="fastest"), ["'fastest'", "throughput, latency"]),
    "custom-without-boundaries": (dict(strategy="custom"), ["--boundaries"]),
    "custom-past-the-layers": (dict(strategy="custom", boundaries=[40]), ["custom boundaries", "40"]),
    "custom-too-many-stages": (dict(strategy="custom", boundaries=[10, 20]), ["3 ranges for 2 devices"]),
}


@pytest.mark.parametrize("case", list(BAD_PLANS))
def test_bad_plan_request_is_invalid_argument_and_the_plan_in_force_stays(case, runner, mesh):
    fields, fragments = BAD_PLANS[case]

    async def main():
        in_force = await mesh.ctl.stub.Plan(controller_pb2.PlanRequest(), timeout=RPC_TIMEOUT_S)
        assert in_force.plan_json == mesh.ctl.app.replanner.plan_json and in_force.table
        await expect_status(mesh.ctl.stub.Plan(controller_pb2.PlanRequest(**fields), timeout=RPC_TIMEOUT_S),
                            IA, *fragments)
        preview = await mesh.ctl.stub.Plan(controller_pb2.PlanRequest(strategy="dp", objective="latency"),
                                           timeout=RPC_TIMEOUT_S)
        assert json.loads(preview.plan_json)["objective"] == "latency"
        again = await mesh.ctl.stub.Plan(controller_pb2.PlanRequest(), timeout=RPC_TIMEOUT_S)
        assert again.plan_json == in_force.plan_json  # a preview changes nothing
    arun(runner, main())


def test_a_request_larger_than_a_stage_pool_is_resource_exhausted_at_once(runner, model_dir):
    async def main():
        async with mesh_of_two(model_dir, "small", max_kv_bytes=2 * 2**20) as m:  # ~90 positions on the last stage
            await expect_status(submit(m.ctl, prompt="Hello", max_tokens=200), grpc.StatusCode.RESOURCE_EXHAUSTED,
                                "200 new tokens", "--max-kv-mib")
            assert not m.ctl.app.scheduler.waiting and not m.ctl.app.scheduler.active
            assert await open_sessions(m.first) == 0 and await open_sessions(m.last) == 0
            check_finished_stream(await submit(m.ctl, prompt="Hello", max_tokens=3), m, 3)
    arun(runner, main())


def test_a_preempted_request_is_replayed_to_the_same_tokens(runner, model_dir):
    """Two requests whose sequences cannot both grow in the last stage's pool: it preempts the
    younger, whose owner (the controller) replays it once there is room; both give exactly what
    they give alone, and the stream of the preempted one never notices. The stages have swap space
    (--swap-mib): the preempted sequence's KV waits there (the last stage's as it preempts, the first
    stage's as the controller closes it) and comes back for the replay instead of being computed."""
    block_bytes = 16 * 15 * 3 * 64 * 2 * 4  # 16 positions of the 15 layers a stage holds, fp32 K and V
    prompts = ["Tell me about the history of bread, from the first farmers to modern bakeries.",
               "Tell me about the history of maps, from clay tablets to satellites."]

    async def main():
        swap = dict(swap_bytes=8 * 2**20)
        async with mesh_of_two(model_dir, "tight", swap, max_kv_bytes=14 * block_bytes, **swap) as m:
            alone = [[t for r in await submit(m.ctl, prompt=p, max_tokens=90, ignore_eos=True) for t in r.token_ids]
                     for p in prompts]
            before = (await m.last.stub.Status(stage_pb2.StatusRequest(), timeout=RPC_TIMEOUT_S)).preempted
            together = await asyncio.gather(*(submit(m.ctl, prompt=p, max_tokens=90, ignore_eos=True) for p in prompts))
            assert [[t for r in replies for t in r.token_ids] for replies in together] == alone
            assert all([len(r.token_ids) for r in replies] == [1] * 90 for replies in together)
            st = await m.last.stub.Status(stage_pb2.StatusRequest(), timeout=RPC_TIMEOUT_S)
            assert st.preempted > before and m.ctl.app.scheduler.stats.preemptions >= 1
            s0 = await m.first.stub.Status(stage_pb2.StatusRequest(), timeout=RPC_TIMEOUT_S)
            for s in (s0, st):  # swapped out and back in, not computed again
                assert s.swapped_out_seqs >= 1 and s.swapped_in_seqs >= 1 and s.swapped_in_tokens > 0, s
                assert not s.swap_full
            await eventually_no_sessions(m.first, m.last)
    arun(runner, main(), timeout=300)


# ----------------------------------------------------------------------------- no pipeline

def test_without_a_usable_node_requests_wait_then_fail_saying_why(runner, model_dir):
    """A controller serves Status while it has no plan, says what it waits for, and a request
    waits (bounded) for nodes, then fails RESOURCE_EXHAUSTED saying why no plan serves."""
    nowhere = closed_port_address()

    async def main():
        async with controller(model_dir, [nowhere], start=False, wait_for_nodes_s=1.0) as ctl:
            await ctl.app.start()
            await asyncio.sleep(1.0)
            st = await ctl.stub.Status(controller_pb2.ControllerStatusRequest(), timeout=RPC_TIMEOUT_S)
            assert st.state == "waiting" and not st.stages and nowhere in st.waiting
            assert [(n.address, n.reachable, n.source) for n in st.nodes] == [(nowhere, False, "static")]
            assert nowhere in st.nodes[0].error and st.nodes[0].down
            await expect_status(submit(ctl, prompt="Hello", max_tokens=2), grpc.StatusCode.RESOURCE_EXHAUSTED,
                                "waited 1 s", nowhere)
            await expect_status(ctl.stub.Plan(controller_pb2.PlanRequest(), timeout=RPC_TIMEOUT_S),
                                grpc.StatusCode.UNAVAILABLE, "no plan")
        # with no node at all, saying so
        async with controller(model_dir, [], start=False) as ctl:
            await ctl.app.start()
            st = await ctl.stub.Status(controller_pb2.ControllerStatusRequest(), timeout=RPC_TIMEOUT_S)
            assert st.state == "waiting" and st.waiting == "no stage nodes yet" and not st.nodes
        # a node started with --no-profile cannot be planned for, and the controller says why
        async with stage_node("unmeasured", profiled=False) as node:
            async with controller(model_dir, [node.address], start=False, wait_for_nodes_s=1.0) as ctl:
                await ctl.app.start()
                await expect_status(submit(ctl, prompt="Hello", max_tokens=2), grpc.StatusCode.RESOURCE_EXHAUSTED,
                                    "unmeasured", "--no-profile")
            assert (await node.stub.Status(stage_pb2.StatusRequest(), timeout=RPC_TIMEOUT_S)).state == "idle"
    arun(runner, main())


def test_a_huge_prompt_is_refused_before_any_work_while_others_are_served(runner, mesh, monkeypatch):
    """30 MiB of prompt used to be tokenized inside the handler (~0.5 s per MiB), freezing every
    other user; now it is refused before it is tokenized, and a request beside it runs as usual."""
    door = mesh.ctl.door
    seen: list[int] = []
    real = door.encode_prompt
    monkeypatch.setattr(door, "encode_prompt", lambda prompt, raw: seen.append(len(prompt)) or real(prompt, raw))

    async def main():
        small = asyncio.ensure_future(submit(mesh.ctl, prompt="Hi", max_tokens=6))
        await expect_status(submit(mesh.ctl, prompt="x" * (30 * 2**20)), IA, "over the cap")
        check_finished_stream(await small, mesh, 6)
        assert seen == [2], f"the huge prompt was tokenized: {seen}"
    arun(runner, main())


# ----------------------------------------------------------------------------- a stage lost

def test_a_stage_lost_mid_request_moves_it_to_a_plan_over_the_survivor(runner, model_dir):
    """The last stage goes away mid-generation: the controller re-plans over the survivor (which
    can hold the whole model) and replays the request there; the client sees the same tokens as a
    run without the loss, and no error."""
    prompt = "Once upon a time, in a land far away,"

    async def main():
        async with mesh_of_two(model_dir, "loss") as m:
            alone = [t for r in await submit(m.ctl, prompt=prompt, raw=True, max_tokens=40, ignore_eos=True)
                     for t in r.token_ids]
            call = m.ctl.stub.Submit(controller_pb2.SubmitRequest(
                prompt=prompt, raw=True, max_tokens=40, ignore_eos=True), timeout=CALL_TIMEOUT_S)
            got = list((await call.read()).token_ids)
            generation = m.ctl.app.pipelines.generation
            await m.last.server.stop(None)  # the last stage goes away mid-generation
            while (reply := await call.read()) is not grpc.aio.EOF:
                got += reply.token_ids
            assert got == alone
            st = await m.ctl.stub.Status(controller_pb2.ControllerStatusRequest(), timeout=RPC_TIMEOUT_S)
            assert st.state == "ready" and st.plan_generation > generation
            assert [(s.address, s.start_layer, s.end_layer) for s in st.stages] == [(m.first.address, 0, SMOL_LAYERS)]
            assert "lost" in st.last_replan and m.last.address in st.last_replan
            down = {n.address: n.down for n in st.nodes}
            assert down[m.first.address] == "" and down[m.last.address]
    arun(runner, main())


def test_drain_undrain_register_and_leave(runner, model_dir):
    """Drain moves a running request to a plan without the node (same tokens); draining the last
    usable node, or an unknown one, is refused; undrain plans on it again; a second node claiming
    a taken id is refused; a node outside the plan leaves at once."""
    prompt = "Name three rivers and a fact about each."

    async def main():
        async with mesh_of_two(model_dir, "drain") as m:
            stub = m.ctl.stub
            alone = [t for r in await submit(m.ctl, prompt=prompt, max_tokens=30, ignore_eos=True) for t in r.token_ids]
            call = stub.Submit(controller_pb2.SubmitRequest(prompt=prompt, max_tokens=30, ignore_eos=True),
                               timeout=CALL_TIMEOUT_S)
            got = list((await call.read()).token_ids)
            reply = await stub.Drain(controller_pb2.DrainRequest(node="drain-last"), timeout=RPC_TIMEOUT_S)
            assert "drain-last drained" in reply.message and reply.plan_generation == m.ctl.app.pipelines.generation
            while (r := await call.read()) is not grpc.aio.EOF:
                got += r.token_ids
            assert got == alone
            st = await stub.Status(controller_pb2.ControllerStatusRequest(), timeout=RPC_TIMEOUT_S)
            assert [(s.node_id, s.start_layer, s.end_layer) for s in st.stages] == [("drain-first", 0, SMOL_LAYERS)]
            assert {n.node_id: (n.drained, n.in_plan) for n in st.nodes} == {
                "drain-first": (False, True), "drain-last": (True, False)}
            await expect_status(stub.Drain(controller_pb2.DrainRequest(node="drain-first"), timeout=RPC_TIMEOUT_S),
                                grpc.StatusCode.FAILED_PRECONDITION, "no plan fits without node drain-first")
            await expect_status(stub.Drain(controller_pb2.DrainRequest(node="nobody"), timeout=RPC_TIMEOUT_S),
                                grpc.StatusCode.NOT_FOUND, "nobody")
            await stub.Drain(controller_pb2.DrainRequest(node=m.last.address, undrain=True), timeout=RPC_TIMEOUT_S)
            st = await stub.Status(controller_pb2.ControllerStatusRequest(), timeout=RPC_TIMEOUT_S)
            assert [s.node_id for s in st.stages] == ["drain-first", "drain-last"]
            # another process calling itself drain-first is refused; the first keeps serving
            dup = await stub.Register(controller_pb2.RegisterRequest(address="127.0.0.1:9", node_id="drain-first"),
                                      timeout=RPC_TIMEOUT_S)
            assert not dup.admitted and "already taken" in dup.message
            assert "127.0.0.1:9" not in m.ctl.app.members.by_address
            async with stage_node("drain-spare") as spare:  # registers (by port: the caller's host is filled in)
                ok = await stub.Register(controller_pb2.RegisterRequest(
                    address=f":{spare.address.rpartition(':')[2]}", node_id="drain-spare"), timeout=RPC_TIMEOUT_S)
                assert ok.admitted and m.ctl.app.members.by_address[spare.address].source == "registered"
                for _ in range(100):  # joined: planned on (uniform over 3 beats 2)
                    if len(m.ctl.app.pipelines.stages) == 3:
                        break
                    await asyncio.sleep(0.1)
                assert [h.node_id for h in m.ctl.app.pipelines.stages] == ["drain-first", "drain-last", "drain-spare"]
                spare.runtime.stopping = True  # as a node leaving on SIGTERM says it is (else a probe that sees
                # it answering as usual takes it back, and the next plan is on it again)
                left = await stub.Leave(controller_pb2.LeaveRequest(node_id="drain-spare"), timeout=RPC_TIMEOUT_S)
                assert left.moved and "moved" in left.message
                assert [h.node_id for h in m.ctl.app.pipelines.stages] == ["drain-first", "drain-last"]
    arun(runner, main())


@pytest.mark.parametrize("order", ["bf16-then-fp32", "fp32-then-bf16"])
def test_each_stage_computes_in_the_dtype_its_plan_stage_says(order, runner, model_dir):
    """--dtype bfloat16 over a node that offers bf16 and one that offers only fp32: the plan gives
    the second fp32 (an upcast), and the assignment says so, stage by stage (one global dtype would
    make it compute in a dtype it does not offer); hidden states cross in the narrower dtype of the
    two (an fp32 sender converts to bf16 before sending), are converted on receipt, and the mixed
    pipeline answers."""
    formats = [("fp32", "bf16"), ("fp32",)] if order == "bf16-then-fp32" else [("fp32",), ("fp32", "bf16")]
    dtypes = ["bfloat16", "float32"] if order == "bf16-then-fp32" else ["float32", "bfloat16"]

    async def main():
        async with stage_node(f"{order}-a", weight_formats=formats[0]) as first, \
                stage_node(f"{order}-b", weight_formats=formats[1]) as last:
            async with controller(model_dir, [first.address, last.address], dtype="bfloat16") as ctl:
                plan = json.loads(ctl.app.replanner.plan_json)
                assert [s["weight_format"] for s in plan["pipelines"][0]["stages"]] == [d.replace("float32", "fp32").replace(
                    "bfloat16", "bf16") for d in dtypes]
                got = [(await n.stub.Status(stage_pb2.StatusRequest(), timeout=RPC_TIMEOUT_S)).dtype
                       for n in (first, last)]
                assert got == dtypes
                assert first.runtime.engine.assignment.wire_dtype == "bfloat16"  # the narrower, either way
                replies = await submit(ctl, prompt="Hello", max_tokens=4)
                assert replies[-1].finished and sum(len(r.token_ids) for r in replies) == 4
    arun(runner, main())


@pytest.mark.parametrize("fmt", ["int8", "nf4"])
def test_a_pipeline_with_a_quantized_stage_answers(fmt, runner, model_dir):
    """One node in float32, the other quantized (--quantize, so it offers only that format): the
    plan gives the quantized node its format and, since its layers take a fraction of the bytes,
    at least half the layers; the request is answered; the quantized stage says its format and
    holds a fraction of the float weights."""
    async def main():
        async with mesh_of_two(model_dir, f"q{fmt}", quantize=fmt) as m:
            replies = await submit(m.ctl, prompt="What is the capital of France?", max_tokens=12)
            text = "".join(r.text for r in replies)
            first, last = [await n.stub.Status(stage_pb2.StatusRequest(), timeout=RPC_TIMEOUT_S) for n in (m.first, m.last)]
        assert replies[-1].finished and 1 <= sum(len(r.token_ids) for r in replies) <= 12 and text.strip()
        assert (first.weight_format, last.weight_format) == ("float32", fmt)
        assert last.end_layer - last.start_layer >= first.end_layer - first.start_layer
        # the last stage also holds the LM head (the tied embedding matrix, kept in float32)
        assert last.weight_bytes < first.weight_bytes
    arun(runner, main())


def test_requests_per_client_are_capped(runner, model_dir):
    """--max-requests-per-client 1: a second request of the same client while its first runs gets
    RESOURCE_EXHAUSTED saying so; the first finishes, and the client may then submit again."""
    async def main():
        async with stage_node("cap-a") as a, stage_node("cap-b") as b:
            async with controller(model_dir, [a.address, b.address], requests_per_client=1) as ctl:
                first = ctl.stub.Submit(controller_pb2.SubmitRequest(prompt="Count to fifty.", max_tokens=40,
                                                                     ignore_eos=True), timeout=CALL_TIMEOUT_S)
                got = [await first.read()]  # running now
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await submit(ctl, prompt="Hello", max_tokens=2)
                assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert "the cap per client" in info.value.details()
                while not got[-1].finished:
                    got.append(await first.read())
                assert got[-1].finished and sum(len(r.token_ids) for r in got) == 40
                replies = await submit(ctl, prompt="Hello", max_tokens=2)
                assert replies[-1].finished
    arun(runner, main())
