"""Two stage nodes as one tensor-parallel stage over gloo on TCP (issue 36, the controller's --tp-group):
rank 0's Assign waits for its member, whose Assign starts its follower (Status "member", naming rank 0);
together they serve transformers' tokens; when rank 0 ends the group, or the member's follower dies, the
member is idle again; the group forms again at the same port. A member
that does not come fails rank 0's assignment naming it; an assignment whose members do not name the node
at its rank, or that asks a node of several devices of its own (--tp-max) to join, is refused by name."""
from __future__ import annotations

import asyncio
import time
from datetime import timedelta

import grpc

from logicpipe.stage_node.engine import tp_group
from logicpipe.v1 import stage_pb2
from tests.localmesh import free_port

from .conftest import RPC_TIMEOUT_S, assign, expect_status, open_request, run, serve_valid_request, stage_node


async def state_of(node) -> stage_pb2.StatusReply:
    return await node.stub.Status(stage_pb2.StatusRequest(), timeout=RPC_TIMEOUT_S)


async def until_idle(node, timeout: float = 20.0) -> stage_pb2.StatusReply:
    deadline = time.monotonic() + timeout
    while (st := await state_of(node)).state != "idle" and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    return st


def test_two_nodes_are_one_stage_and_the_member_is_idle_again_when_it_ends(tiny_model, monkeypatch):
    monkeypatch.setattr(tp_group, "_STORES", {})  # (the store rank 0 serves here ends with the test)
    join_timeout = tp_group.JOIN_TIMEOUT

    async def main():
        port = free_port()
        async with stage_node("lead", tp_port=port, tp_threads=1) as lead, stage_node("mem", tp_threads=1) as mem:
            assert (await state_of(lead)).tp_port == port
            group = dict(tp_world=2, tp_init=f"tcp://127.0.0.1:{port}", tp_members=["lead", "mem"], generation=7)
            await expect_status(assign(mem, tiny_model.path, **{**group, "tp_rank": 1, "tp_members": ["lead", "x"]}),
                                grpc.StatusCode.INVALID_ARGUMENT, "tp_members names x at rank 1, not node mem")
            await expect_status(assign(mem, tiny_model.path, **{**group, "tp_rank": 1, "tp_members": ["lead"]}),
                                grpc.StatusCode.INVALID_ARGUMENT, "tp_members must name 2 nodes")
            async with stage_node("flex", tp_max=2) as flex:  # a node of several devices of its own: not in a group
                await expect_status(assign(flex, tiny_model.path, **{**group, "tp_rank": 1, "tp_members": ["lead", "flex"]}),
                                    grpc.StatusCode.FAILED_PRECONDITION, "tp_world 2: node flex cannot join")
            # a member that never comes: rank 0's assignment fails naming it, and rank 0 stays as it was
            monkeypatch.setattr(tp_group, "JOIN_TIMEOUT", timedelta(seconds=1))
            await expect_status(assign(lead, tiny_model.path, **group), grpc.StatusCode.FAILED_PRECONDITION,
                                "member mem did not join", f"tcp://127.0.0.1:{port}")
            assert lead.runtime.options.tp is None and (await state_of(lead)).state == "idle"
            # (the member's follower, a process of its own, takes a while to start)
            monkeypatch.setattr(tp_group, "JOIN_TIMEOUT", join_timeout)
            for generation in (7, 8):  # formed, ended; formed again at the same port, ended
                group["generation"] = generation
                await asyncio.gather(assign(lead, tiny_model.path, **group),
                                     assign(mem, tiny_model.path, tp_rank=1, **group))
                st = await state_of(mem)
                assert (st.state, st.tp_leader) == ("member", "lead"), st
                assert lead.runtime.options.tp.remote.members == ("lead", "mem")
                await expect_status(mem.stub.OpenSession(open_request("s1"), timeout=RPC_TIMEOUT_S),
                                    grpc.StatusCode.FAILED_PRECONDITION, "member of lead's tensor-parallel stage")
                await serve_valid_request(lead, expect=tiny_model.greedy)  # 4 heads over 2 KV heads, split in two
                follower = mem.runtime.member.proc
                if generation == 7:  # the member's follower dies: the member is idle, rank 0 still ends its group
                    follower.kill()
                    assert (await until_idle(mem)).state == "idle"
                # rank 0 ends the group (a stage of its own now): the member's follower ends, the member is idle
                await assign(lead, tiny_model.path, generation=generation)
                assert lead.runtime.options.tp is None
                assert (await until_idle(mem)).state == "idle" and follower.poll() is not None
                await serve_valid_request(lead, expect=tiny_model.greedy)
    run(main())
