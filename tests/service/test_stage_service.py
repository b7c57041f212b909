"""StageNode service in-process: every class of bad input gets its gRPC status and a message a
person can act on, and the same node then serves a valid request (to greedy tokens equal to
transformers' own)."""
from __future__ import annotations

import math

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from logicpipe.common.health import set_serving
from logicpipe.limits import MAX_MESSAGE_BYTES
from logicpipe.stage_node.net import links
from logicpipe.stage_node.net.service import MAX_ECHO_BYTES
from logicpipe.stage_node.net.wire import MAX_STEP_ROWS
from logicpipe.v1 import stage_pb2, stage_pb2_grpc, tensor_pb2

from .conftest import (
    NEW_TOKENS,
    PROMPT,
    RPC_TIMEOUT_S,
    STAGE_SERVICE,
    TINY_CONTEXT,
    TINY_HIDDEN,
    TINY_KV_BYTES_PER_TOKEN,
    TINY_LAYERS,
    TINY_VOCAB,
    Events,
    assign,
    assign_request,
    closed_port_address,
    expect_status,
    expect_stream_abort,
    new_session_id,
    open_request,
    prompt_step,
    run,
    serve_valid_request,
    single_stage,
    stage_node,
    two_stages,
)

IA = grpc.StatusCode.INVALID_ARGUMENT
FP = grpc.StatusCode.FAILED_PRECONDITION


async def status(node) -> stage_pb2.StatusReply:
    return await node.stub.Status(stage_pb2.StatusRequest(), timeout=RPC_TIMEOUT_S)


async def close(node, session_id: str) -> int:
    reply = await node.stub.CloseSession(stage_pb2.CloseSessionRequest(session_id=session_id), timeout=RPC_TIMEOUT_S)
    return reply.tokens_held


def hidden_tensor(rows: int, width: int = TINY_HIDDEN, *, dtype: str = "float32", itemsize: int = 4,
                  shape=None, data: bytes | None = None) -> tensor_pb2.Tensor:
    shape = [rows, width] if shape is None else shape
    if data is None:
        data = bytes(math.prod(shape) * itemsize)
    return tensor_pb2.Tensor(dtype=dtype, shape=shape, data=data)


def hidden_step(session_id: str, num_tokens: int, hidden: tensor_pb2.Tensor | None) -> stage_pb2.StepBatch:
    batch = stage_pb2.StepBatch(seqs=[stage_pb2.SeqStep(session_id=session_id, start_pos=0, num_tokens=num_tokens,
                                                        token_ids=[1] * num_tokens)])
    if hidden is not None:
        batch.hidden.CopyFrom(hidden)
    return batch


# ----------------------------------------------------------------------------- health, no assignment

def test_health_reports_serving_and_a_valid_request_is_served(tiny_model):
    async def main():
        async with stage_node("healthy", serving=False) as node:
            health = health_pb2_grpc.HealthStub(node.channel)
            for service in ("", STAGE_SERVICE):  # registered, not yet declared ready
                reply = await health.Check(health_pb2.HealthCheckRequest(service=service), timeout=RPC_TIMEOUT_S)
                assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING, service
            await set_serving(node.health, True, STAGE_SERVICE)  # as stage_node.main does once started
            for service in ("", STAGE_SERVICE):
                reply = await health.Check(health_pb2.HealthCheckRequest(service=service), timeout=RPC_TIMEOUT_S)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING, service
            await expect_status(health.Check(health_pb2.HealthCheckRequest(service="no.such.Service"),
                                             timeout=RPC_TIMEOUT_S), grpc.StatusCode.NOT_FOUND)
            st = await status(node)
            assert (st.node_id, st.state, st.device) == ("healthy", "idle", "cpu")
            reply = await assign(node, tiny_model.path)
            assert reply.parameter_count > 0
            st = await status(node)
            assert (st.state, st.start_layer, st.end_layer, st.num_layers) == ("ready", 0, TINY_LAYERS, TINY_LAYERS)
            await serve_valid_request(node, expect=tiny_model.greedy)
            assert (await status(node)).open_sessions == 0
    run(main())


def test_unassigned_node_refuses_work_with_failed_precondition(tiny_model):
    async def main():
        async with stage_node("fresh") as node:
            await expect_status(node.stub.OpenSession(open_request("s1"), timeout=RPC_TIMEOUT_S), FP,
                                "fresh", "no layer assignment", "idle")
            await expect_stream_abort(node, prompt_step("s1"), FP, "fresh", "no layer assignment")
            await expect_status(node.stub.Events(stage_pb2.EventsRequest(), timeout=0.5).read(),
                                grpc.StatusCode.DEADLINE_EXCEEDED)  # subscribing is fine; nothing comes
            assert (await status(node)).state == "idle"
            await assign(node, tiny_model.path)
            await serve_valid_request(node, expect=tiny_model.greedy)
    run(main())


def test_close_session_on_unassigned_node_is_failed_precondition(tiny_model):
    async def main():
        async with stage_node("fresh") as node:
            try:
                await expect_status(node.stub.CloseSession(stage_pb2.CloseSessionRequest(session_id="s1"),
                                                           timeout=RPC_TIMEOUT_S), FP, "fresh", "no layer assignment")
            finally:  # the node keeps serving either way
                await assign(node, tiny_model.path)
                await serve_valid_request(node, expect=tiny_model.greedy)
    run(main())


# ----------------------------------------------------------------------------- Assign

ASSIGN_CASES = {
    # id: (model, AssignRequest fields, code, fragments of the message)
    "end-past-num-layers": ("tiny", dict(start=0, end=5), IA, ["[0, 5)", f"[0, {TINY_LAYERS})"]),
    "empty-range": ("tiny", dict(start=2, end=2), IA, ["[2, 2)"]),
    "start-after-end": ("tiny", dict(start=3, end=1), IA, ["[3, 1)"]),
    "num-layers-not-the-models": ("tiny", dict(start=0, end=3, num_layers=3), FP,
                                  [f"has {TINY_LAYERS} layers, the controller's 3", "copy the controller's model"]),
    "bad-dtype": ("tiny", dict(dtype="float64"), IA, ["'float64'", "float32", "bfloat16"]),
    "bad-weight-format": ("tiny", dict(weight_format="q4_k"), IA, ["'q4_k'", "nf4"]),
    "bad-wire-dtype": ("tiny", dict(wire_dtype="int8"), IA, ["wire dtype 'int8'", "bfloat16"]),
    "format-not-offered": ("tiny", dict(weight_format="int8"), IA, ["runs its layers in fp32", "asked for int8"]),
    "format-not-its-dtype": ("tiny", dict(weight_format="bf16"), IA, ["fp32 for dtype float32", "asked for bf16"]),
    "stage-index-out-of-range": ("tiny", dict(stage_index=1, num_stages=1), IA, ["stage index 1", "1 stages"]),
    "no-next-address": ("tiny", dict(start=0, end=2, num_stages=2), IA, ["next_address", "layer 2"]),
    "no-first-address": ("tiny", dict(start=2, end=4, stage_index=1, num_stages=2), IA, ["first_address"]),
    "missing-model-dir": ("missing", {}, FP, ["{model}", "does not exist"]),
    "not-llama": ("bert", {}, FP, ["{model}", "'bert'", "llama"]),
    "no-weights": ("noweights", {}, FP, ["{model}", "safetensors"]),
    "digest-differs": ("tiny", dict(model_digest="0123456789abcdef"), FP, ["0123456789abcdef", "copy the same model"]),
    "truncated-weights": ("truncated", {}, FP, ["could not load", "keeps its previous assignment"]),
    "path-component-too-long": ("longname", {}, FP, ["cannot read the model directory", "too long"]),
    "model-dir-too-long": ("hugepath", {}, IA, ["model_dir", "4096 characters"]),
}


@pytest.mark.parametrize("case", list(ASSIGN_CASES))
def test_bad_assign_is_refused_and_the_node_keeps_its_assignment(case, tiny_model, bert_model_dir, tmp_path):
    which, fields, code, fragments = ASSIGN_CASES[case]
    no_weights = tmp_path / "no-weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text((tiny_model.path / "config.json").read_text())
    truncated = tmp_path / "truncated"
    truncated.mkdir()
    (truncated / "config.json").write_text((tiny_model.path / "config.json").read_text())
    weights = (tiny_model.path / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    model = {"tiny": tiny_model.path, "missing": tmp_path / "no-such-model", "bert": bert_model_dir,
             "noweights": no_weights, "truncated": truncated, "longname": tmp_path / ("x" * 300),
             "hugepath": "/" + "y" * 100_000}[which]
    fields = dict(fields)
    start, end = fields.pop("start", 0), fields.pop("end", TINY_LAYERS)

    async def main():
        async with single_stage(tiny_model.path, "assigned") as node:
            before = await status(node)
            err = await expect_status(node.stub.Assign(assign_request(model, start, end, **fields),
                                                       timeout=RPC_TIMEOUT_S),
                                      code, *[f.format(model=model) for f in fragments])
            assert "\n" not in err.details() and len(err.details()) < 1000
            after = await status(node)
            assert (after.state, after.start_layer, after.end_layer, after.plan_id) == \
                   (before.state, before.start_layer, before.end_layer, before.plan_id)
            await serve_valid_request(node, expect=tiny_model.greedy)
    run(main())


# ----------------------------------------------------------------------------- malformed tensors

TENSOR_CASES = {
    # id: (num_tokens, hidden tensor or None, fragments of the message)
    "dtype-not-allowed": (5, hidden_tensor(5, dtype="float64", itemsize=8), ["'float64'", "not allowed"]),
    "dtype-not-a-float": (5, hidden_tensor(5, dtype="int64", itemsize=8), ["int64", "not accepted", "float32"]),
    "data-length-not-shape": (5, hidden_tensor(5, data=bytes(5 * TINY_HIDDEN * 4 - 4)),
                              [f"{5 * TINY_HIDDEN * 4 - 4} bytes", f"needs {5 * TINY_HIDDEN * 4}"]),
    "wrong-hidden-size": (5, hidden_tensor(5, 32), ["[5, 32]", f"expected [5, {TINY_HIDDEN}]"]),
    "wrong-rank": (5, hidden_tensor(5, shape=[1, 5, TINY_HIDDEN]), ["rank 3", "rank 2"]),
    "rows-not-num-tokens": (5, hidden_tensor(4), [f"[4, {TINY_HIDDEN}]", f"expected [5, {TINY_HIDDEN}]"]),
    "negative-dimension": (5, hidden_tensor(5, shape=[-5, TINY_HIDDEN], data=b""), ["negative dimension"]),
    "over-the-tensor-cap": (5, hidden_tensor(5, shape=[2**20, 2**10], data=b""), ["byte cap"]),
    "no-hidden": (5, None, ["stage 1", "needs hidden states"]),
}


@pytest.mark.parametrize("case", list(TENSOR_CASES))
def test_malformed_hidden_states_abort_the_stream_and_the_stage_keeps_serving(case, tiny_model):
    num_tokens, hidden, fragments = TENSOR_CASES[case]

    async def main():
        async with two_stages(tiny_model.path) as (first, last):
            sid = new_session_id("victim")
            await last.stub.OpenSession(open_request(sid), timeout=RPC_TIMEOUT_S)
            await expect_stream_abort(last, hidden_step(sid, num_tokens, hidden), IA, "hidden states", *fragments)
            assert await close(last, sid) == 0  # nothing of the bad step reached the KV
            assert (await status(last)).state == "ready"
            await serve_valid_request(first, last, expect=tiny_model.greedy)
    run(main())


# ----------------------------------------------------------------------------- bad steps into stage 0

STEP_CASES = {
    # id: (seqs of the step, fragments of the message)
    "token-past-vocab": ([dict(num_tokens=2, token_ids=[5, TINY_VOCAB])],
                         [f"token id {TINY_VOCAB}", f"[0, {TINY_VOCAB})"]),
    "negative-token": ([dict(num_tokens=1, token_ids=[-1])], ["token id -1", "vocabulary"]),
    "zero-tokens": ([dict(num_tokens=0, token_ids=[])], ["num_tokens must be >= 1"]),
    "ids-not-num-tokens": ([dict(num_tokens=3, token_ids=list(PROMPT))], [f"{len(PROMPT)} token ids for num_tokens=3"]),
    "no-sequences": ([], ["no sequences"]),
    "over-the-row-cap": ([dict(num_tokens=MAX_STEP_ROWS + 1, token_ids=[1] * (MAX_STEP_ROWS + 1))],
                         [str(MAX_STEP_ROWS + 1), f"{MAX_STEP_ROWS}-row cap", "smaller chunks"]),
}


@pytest.mark.parametrize("case", list(STEP_CASES))
def test_bad_prompt_step_is_invalid_argument_and_the_stage_keeps_serving(case, tiny_model):
    seqs, fragments = STEP_CASES[case]

    async def main():
        async with single_stage(tiny_model.path) as node:
            sid = new_session_id("victim")
            await node.stub.OpenSession(open_request(sid), timeout=RPC_TIMEOUT_S)
            batch = stage_pb2.StepBatch(seqs=[stage_pb2.SeqStep(session_id=sid, **s) for s in seqs])
            await expect_stream_abort(node, batch, IA, *fragments)
            assert await close(node, sid) == 0
            await serve_valid_request(node, expect=tiny_model.greedy)
    run(main())


def test_session_twice_in_one_step_is_invalid_argument(tiny_model):
    async def main():
        async with single_stage(tiny_model.path, "solo") as node:
            sid = new_session_id("twice")
            await node.stub.OpenSession(open_request(sid, 40), timeout=RPC_TIMEOUT_S)
            batch = prompt_step(sid, PROMPT[:3])
            batch.seqs.extend(prompt_step(sid, PROMPT[3:]).seqs)  # same session, start_pos 0 again
            try:
                await expect_stream_abort(node, batch, IA, sid, "twice")
                assert await close(node, sid) == 0
            finally:
                await serve_valid_request(node, expect=tiny_model.greedy)
    run(main())


# ----------------------------------------------------------------------------- unknown sessions

def test_unknown_session_is_not_found_and_the_stream_stays_usable(tiny_model):
    nf = grpc.StatusCode.NOT_FOUND

    async def main():
        async with single_stage(tiny_model.path, "solo") as node:
            await expect_status(node.stub.CloseSession(stage_pb2.CloseSessionRequest(session_id="ghost-1"),
                                                       timeout=RPC_TIMEOUT_S), nf, "ghost-1", "solo")
            call = node.stub.Stream(timeout=60)
            try:
                async with Events(node) as events:
                    # a step for an unknown session: a per-sequence rejection, not a dead stream
                    await call.write(prompt_step("ghost-2"))
                    reply = await call.read()
                    assert (reply.session_id, reply.code) == ("ghost-2", nf.value[0])
                    assert "ghost-2" in reply.message and "solo" in reply.message
                    err = await events.error("ghost-2")
                    assert (err.code, err.node_id) == (nf.value[0], "solo") and "ghost-2" in err.message

                    # one step, an unknown and a known session: only the unknown one is rejected
                    sid = new_session_id("known")
                    await node.stub.OpenSession(open_request(sid), timeout=RPC_TIMEOUT_S)
                    mixed = prompt_step("ghost-3", (7, 8))
                    mixed.seqs.extend(prompt_step(sid).seqs)
                    await call.write(mixed)
                    reply = await call.read()
                    assert (reply.session_id, reply.code) == ("ghost-3", nf.value[0])
                    tokens = await events.tokens(sid)
                    assert [t.token_id for t in tokens] == list(tiny_model.greedy)
                    assert await close(node, sid) == len(PROMPT) + NEW_TOKENS - 1
                # and the same stream then carries a valid request
                await serve_valid_request(node, call=call, expect=tiny_model.greedy)
            finally:
                call.cancel()
    run(main())


# ----------------------------------------------------------------------------- wrong state per step

def test_step_at_the_wrong_position_or_past_capacity_fails_that_session_only(tiny_model):
    async def main():
        async with single_stage(tiny_model.path, "solo") as node:
            call = node.stub.Stream(timeout=60)
            try:
                async with Events(node) as events:
                    skip, small = new_session_id("skip"), new_session_id("small")
                    await node.stub.OpenSession(open_request(skip), timeout=RPC_TIMEOUT_S)
                    await node.stub.OpenSession(open_request(small, capacity=3), timeout=RPC_TIMEOUT_S)
                    await call.write(prompt_step(skip, start_pos=3))
                    err = await events.error(skip)
                    assert err.code == FP.value[0] and "position 3" in err.message and "holds 0" in err.message
                    await call.write(prompt_step(small))
                    err = await events.error(small)
                    assert err.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
                    assert small in err.message and "3-token capacity" in err.message
                    assert await close(node, skip) == 0 and await close(node, small) == 0
                await serve_valid_request(node, call=call, expect=tiny_model.greedy)
            finally:
                call.cancel()
    run(main())


# ----------------------------------------------------------------------------- oversize messages

def test_oversize_messages_are_resource_exhausted_and_the_node_keeps_serving(tiny_model):
    cap = MAX_MESSAGE_BYTES

    async def main():
        async with single_stage(tiny_model.path) as node:
            # a client that would send anything: the server's own limit must refuse it
            async with grpc.aio.insecure_channel(node.address, options=[("grpc.max_send_message_length", -1)]) as ch:
                greedy_client = stage_pb2_grpc.StageNodeStub(ch)
                await expect_status(greedy_client.Echo(stage_pb2.EchoRequest(payload=bytes(cap + 1)),
                                                       timeout=RPC_TIMEOUT_S),
                                    grpc.StatusCode.RESOURCE_EXHAUSTED, str(cap))
                big = stage_pb2.StepBatch(seqs=prompt_step("big").seqs)
                big.hidden.CopyFrom(tensor_pb2.Tensor(dtype="float32", shape=[cap // 4 + 1], data=bytes(cap + 4)))
                call = greedy_client.Stream(timeout=RPC_TIMEOUT_S)
                try:
                    async def write_read():
                        await call.write(big)
                        return await call.read()
                    await expect_status(write_read(), grpc.StatusCode.RESOURCE_EXHAUSTED, str(cap))
                finally:
                    call.cancel()
            await expect_status(node.stub.Echo(stage_pb2.EchoRequest(reply_bytes=MAX_ECHO_BYTES + 1),
                                               timeout=RPC_TIMEOUT_S), IA, str(MAX_ECHO_BYTES + 1), str(MAX_ECHO_BYTES))
            reply = await node.stub.Echo(stage_pb2.EchoRequest(payload=b"x" * 1000, reply_bytes=4096),
                                         timeout=RPC_TIMEOUT_S)
            assert len(reply.payload) == 4096
            await serve_valid_request(node, expect=tiny_model.greedy)
    run(main())


# ----------------------------------------------------------------------------- OpenSession

def test_open_session_rejections_and_the_node_keeps_serving(tiny_model):
    block = 16  # positions per KV block
    budget = 6 * block * TINY_KV_BYTES_PER_TOKEN + 100  # a pool of 6 blocks

    async def main():
        async with single_stage(tiny_model.path, "small", max_kv_bytes=budget) as node:
            async def refused(request, code, *fragments):
                await expect_status(node.stub.OpenSession(request, timeout=RPC_TIMEOUT_S), code, *fragments)

            def prompt(sid, n, token=1):
                return open_request(sid, n + NEW_TOKENS, prompt_token_ids=[token] * n)

            await refused(open_request("long", TINY_CONTEXT + 1), IA, str(TINY_CONTEXT + 1), str(TINY_CONTEXT), "context")
            await refused(open_request("none", 0), IA, "capacity 0")
            await refused(open_request("hot", sampling=stage_pb2.SamplingParams(temperature=-0.5)), IA,
                          "temperature", "-0.5")
            await refused(open_request("wide", sampling=stage_pb2.SamplingParams(temperature=1, top_p=1.5)), IA,
                          "top_p", "1.5")
            await refused(open_request(""), IA, "session_id")
            await refused(open_request("x" * 300), IA, "session_id", "300 characters")
            await refused(open_request("stops", stop_token_ids=list(range(5000))), IA, "5000 stop token ids")
            await refused(open_request("past", 4, prompt_token_ids=[1] * 5), IA, "5 prompt tokens", "capacity of 4")
            # fits the model's context but never this node's pool: capacity, and what to change
            await refused(open_request("big", 6 * block + 1), grpc.StatusCode.RESOURCE_EXHAUSTED,
                          "small", f"{6 * block + 1} positions", "--max-kv-mib")
            # admission by free blocks: a prompt's blocks are taken at once
            await node.stub.OpenSession(prompt("p1", 40), timeout=RPC_TIMEOUT_S)  # 3 blocks
            st = await status(node)
            assert (st.open_sessions, st.kv_blocks_used, st.kv_blocks_total) == (1, 3, 6)
            assert st.kv_bytes == 3 * block * TINY_KV_BYTES_PER_TOKEN
            # 3 free, one kept for p1's growth: a 3-block prompt misses one block, and says so
            await refused(prompt("p2", 40, 2), grpc.StatusCode.RESOURCE_EXHAUSTED, "small", "1 missing", "retry")
            await node.stub.OpenSession(prompt("p3", 20, 3), timeout=RPC_TIMEOUT_S)  # 2 blocks
            await refused(prompt("p3", 20, 3), FP, "p3", "already open", "small")
            assert await close(node, "p1") == 0
            assert (await status(node)).kv_blocks_used == 2
            # a refused id is not held: it opens once the request is sound
            await node.stub.OpenSession(open_request("hot", sampling=stage_pb2.SamplingParams(temperature=0.5, seed=1)),
                                        timeout=RPC_TIMEOUT_S)
            assert await close(node, "hot") == 0
            await node.stub.OpenSession(prompt("p2", 40, 2), timeout=RPC_TIMEOUT_S)  # now it fits
            assert await close(node, "p2") == 0 and await close(node, "p3") == 0
            st = await status(node)
            assert (st.open_sessions, st.kv_blocks_used, st.kv_bytes) == (0, 0, 0)
            await serve_valid_request(node, expect=tiny_model.greedy)
    run(main())


# ----------------------------------------------------------------------------- dead neighbours

def test_dead_next_stage_is_unavailable_naming_it_and_a_reassign_recovers(tiny_model, monkeypatch):
    monkeypatch.setattr(links, "CONNECT_TIMEOUT_S", 1.0)  # no need to wait the full 5 s for a closed port
    dead = closed_port_address()

    async def main():
        async with stage_node("first") as first:
            await assign(first, tiny_model.path, 0, 2, stage_index=0, num_stages=2, next_address=dead)
            sid = new_session_id("orphan")
            await first.stub.OpenSession(open_request(sid), timeout=RPC_TIMEOUT_S)
            async with Events(first) as events:
                call = first.stub.Stream(timeout=RPC_TIMEOUT_S)
                try:
                    await call.write(prompt_step(sid))
                    err = await events.error(sid)
                finally:
                    call.cancel()
            assert err.code == grpc.StatusCode.UNAVAILABLE.value[0], err
            assert dead in err.message and "stage 1" in err.message and err.node_id == "first"
            assert (await status(first)).state == "ready"
            await close(first, sid)
            async with stage_node("last") as last:
                await assign(last, tiny_model.path, 2, TINY_LAYERS, stage_index=1, num_stages=2,
                             first_address=first.address)
                await assign(first, tiny_model.path, 0, 2, stage_index=0, num_stages=2, next_address=last.address)
                await serve_valid_request(first, last, expect=tiny_model.greedy)
    run(main())


def test_dead_first_stage_is_unavailable_naming_it(tiny_model, monkeypatch):
    monkeypatch.setattr(links, "CONNECT_TIMEOUT_S", 1.0)
    dead = closed_port_address()

    async def main():
        async with stage_node("last") as last:
            await assign(last, tiny_model.path, 2, TINY_LAYERS, stage_index=1, num_stages=2, first_address=dead)
            sid = new_session_id("orphan")
            await last.stub.OpenSession(open_request(sid), timeout=RPC_TIMEOUT_S)
            async with Events(last) as events:
                call = last.stub.Stream(timeout=RPC_TIMEOUT_S)
                try:
                    await call.write(hidden_step(sid, 2, hidden_tensor(2)))
                    first_token = await events.next(sid)  # sampled, then it cannot go back to stage 0
                    assert first_token.HasField("token") and first_token.token.index == 0
                    err = await events.error(sid)
                finally:
                    call.cancel()
            assert err.code == grpc.StatusCode.UNAVAILABLE.value[0], err
            assert dead in err.message and "stage 0" in err.message
            assert await close(last, sid) == 2
            assert (await status(last)).state == "ready"
    run(main())


def test_a_model_outside_the_model_root_is_refused_unopened(tiny_model, tmp_path):
    """--model-root: an assignment naming a directory elsewhere is refused before the node opens
    it, with the same answer whether it exists or not (no probing the node's disk)."""
    async def main():
        async with stage_node("rooted", model_root=str(tmp_path / "root")) as node:
            for where in (tiny_model.path, tmp_path / "no-such-dir", "/etc"):
                await expect_status(node.stub.Assign(assign_request(where), timeout=RPC_TIMEOUT_S), IA,
                                    "only from under its --model-root", str(tmp_path / "root"))
            root = tmp_path / "root" / "m"
            root.parent.mkdir()
            root.symlink_to(tiny_model.path)  # a link inside the root to a model outside: resolved, refused
            await expect_status(node.stub.Assign(assign_request(root), timeout=RPC_TIMEOUT_S), IA, "--model-root")
    run(main())


def test_a_model_under_the_model_root_loads(tiny_model, tmp_path):
    async def main():
        async with stage_node("rooted-ok", model_root=str(tiny_model.path.parent)) as node:
            await assign(node, tiny_model.path)
            await serve_valid_request(node, expect=tiny_model.greedy)
    run(main())
