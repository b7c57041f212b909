"""Who may steer a stage, in plaintext (the default on loopback), replayed from a security probe
(issue 23): while a victim's request runs, another local party — which knows the controller's
owner id, as any stage learns it from Register — tries to reassign a stage (hijack), read its
events (eavesdrop), close, open, feed and measure. Each is refused with its status; the victim
gets the same tokens as alone. A session lost under its owner is replayed at once, and a stage
that serves another plan makes the controller re-plan instead of staying ready."""
from __future__ import annotations

import asyncio

import grpc

from logicpipe.v1 import controller_pb2, stage_pb2

from .conftest import RPC_TIMEOUT_S, closed_port_address, expect_status, stage_node
from .test_controller_service import CALL_TIMEOUT_S, SMOL_LAYERS, arun, mesh_of_two

PD, FP = grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.FAILED_PRECONDITION
PROMPT = "Once upon a time, in a land far away,"


async def tokens_of(call) -> list[int]:
    """The tokens of a Submit's replies still to come (read, not iterated: a test may have read one)."""
    out = []
    while (reply := await call.read()) is not grpc.aio.EOF:
        out += reply.token_ids
    return out


def victim(m, max_tokens: int = 48):
    return m.ctl.stub.Submit(controller_pb2.SubmitRequest(prompt=PROMPT, raw=True, max_tokens=max_tokens,
                                                          ignore_eos=True), timeout=CALL_TIMEOUT_S)


async def running_session(m) -> str:
    """The victim's session id, once it runs (the attacker would read it off the wire or guess)."""
    for _ in range(400):
        if m.ctl.app.scheduler.active:
            return next(iter(m.ctl.app.scheduler.active))
        await asyncio.sleep(0.01)
    raise AssertionError("the victim's request never ran")


def test_in_plaintext_another_party_cannot_hijack_eavesdrop_close_or_feed(runner, model_dir):
    async def main():
        async with mesh_of_two(model_dir, "plain") as m, stage_node("fake") as fake:
            want = await tokens_of(victim(m))
            call = victim(m)
            first = asyncio.ensure_future(call.read())
            sid = await running_session(m)
            owner = m.ctl.app.pipelines.owner  # no secret: Register hands it to any stage
            generation = m.ctl.app.pipelines.generation
            # hijack: stage 0 sends its hidden states to a fake stage (a newer epoch claimed)
            hijack = stage_pb2.AssignRequest(model_dir=str(model_dir), start_layer=0, end_layer=SMOL_LAYERS // 2,
                                             num_layers=SMOL_LAYERS, stage_index=0, num_stages=2,
                                             next_address=fake.address, generation=generation + 1,
                                             controller_epoch=2**63, controller_id=owner)
            await expect_status(m.first.stub.Assign(hijack, timeout=RPC_TIMEOUT_S), FP, "FENCED", "lease runs")
            # eavesdrop: the controller's events, by its owner id
            events = m.last.stub.Events(stage_pb2.EventsRequest(owner=owner), timeout=RPC_TIMEOUT_S)
            await expect_status(events.read(), PD, "only from the controller that holds it")
            for stage in (m.first, m.last):
                await expect_status(stage.stub.CloseSession(stage_pb2.CloseSessionRequest(session_id=sid),
                                                            timeout=RPC_TIMEOUT_S), PD, "CloseSession")
                await expect_status(stage.stub.OpenSession(stage_pb2.OpenSessionRequest(
                    session_id="intruder", capacity=16, owner=owner), timeout=RPC_TIMEOUT_S), PD, "sessions")
                await expect_status(stage.stub.MeasureLink(stage_pb2.MeasureLinkRequest(  # no dialing for others
                    target_address=closed_port_address(), controller_epoch=2**63, controller_id=owner),
                    timeout=RPC_TIMEOUT_S), PD, "MeasureLink only from the controller that holds it")
                await expect_status(stage.stub.Revoked(stage_pb2.RevokedRequest(names=["stage"]),
                                                       timeout=RPC_TIMEOUT_S), PD)
            # a feed into the victim's session on stage 0, a step into stage 1: neither holder nor plan
            for stage in (m.first, m.last):
                feed = stage.stub.Stream(timeout=RPC_TIMEOUT_S)

                async def intrude(feed=feed):  # the refusal may end the call while the write is still on its way
                    await feed.write(stage_pb2.StepBatch(seqs=[stage_pb2.SeqStep(session_id=sid, start_pos=0,
                                                                                 num_tokens=1, token_ids=[1])]))
                    await feed.read()
                await expect_status(intrude(), PD, "stages of its plan")
            got = list((await first).token_ids) + await tokens_of(call)
            assert got == want
            assert m.ctl.app.state.phase.value == "ready" and m.ctl.app.pipelines.generation == generation
            st = await m.first.stub.Status(stage_pb2.StatusRequest(), timeout=RPC_TIMEOUT_S)
            assert st.controller_id == owner and st.generation == generation
    arun(runner, main(), timeout=300)


def test_a_session_lost_under_its_owner_is_replayed_at_once(runner, model_dir):
    """Stage 1 drops the victim's session (what an anonymous CloseSession did before): the next
    step stage 0 sends for it is refused, stage 0 (which holds the session, and knows its owner)
    tells the controller, and the request replays to the same tokens long before its deadline."""
    async def main():
        async with mesh_of_two(model_dir, "lost") as m:
            want = await tokens_of(victim(m))
            call = victim(m)
            got = list((await call.read()).token_ids)
            sid = await running_session(m)
            m.last.runtime.engine.scheduler.close(sid)
            t0 = asyncio.get_running_loop().time()
            got += await tokens_of(call)
            assert got == want
            assert asyncio.get_running_loop().time() - t0 < 60  # replayed, not left to a 120 s deadline
            assert m.ctl.app.scheduler.stats.completed >= 2
    arun(runner, main(), timeout=300)


def test_a_stage_serving_another_plan_makes_the_controller_replan(runner, model_dir):
    """Stage 1 is re-assigned behind the controller's back (by hand here; a stage that restarted
    and was assigned again looks the same): its Status shows another generation, and the steps
    stage 0 sends it are refused as stale. The controller re-plans, and serves again."""
    from dataclasses import replace

    async def main():
        async with mesh_of_two(model_dir, "stale") as m:
            want = await tokens_of(victim(m, 8))
            generation = m.ctl.app.pipelines.generation
            eng = m.last.runtime.engine
            await m.last.runtime.assign(replace(eng.assignment, generation=generation + 7))
            for _ in range(200):
                if m.ctl.app.pipelines.generation != generation and m.ctl.app.state.phase.value == "ready":
                    break
                await asyncio.sleep(0.05)
            assert m.ctl.app.pipelines.generation != generation, m.ctl.app.state.reason
            assert "generation" in m.ctl.app.replanner.last_replan
            assert await tokens_of(victim(m, 8)) == want
    arun(runner, main(), timeout=300)
