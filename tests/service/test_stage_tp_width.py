"""A --tp-max node takes the tensor-parallel width each assignment asks (issue 36, the planner's width):
the follower group formed at 2 serves transformers' tokens, stopped at 1 (its follower exits) the node
serves alone; a width above its --tp-max is refused by name, before anything changes."""
from __future__ import annotations

import grpc

from logicpipe.v1 import stage_pb2

from .conftest import RPC_TIMEOUT_S, assign, assign_request, expect_status, run, serve_valid_request, stage_node


def test_a_tp_max_node_forms_and_stops_its_group_at_each_assignment_s_width(tiny_model):
    async def main():
        async with stage_node("flex", tp_max=2, tp_threads=1) as node:
            await expect_status(node.stub.Assign(assign_request(tiny_model.path, tp_width=3)),
                                grpc.StatusCode.INVALID_ARGUMENT, "tp_width 3", "offers 1 to 2 devices (--tp-max 2)")
            assert node.runtime.options.tp is None and (await node.stub.Status(stage_pb2.StatusRequest(), timeout=RPC_TIMEOUT_S)).state == "idle"
            await assign(node, tiny_model.path, tp_width=2)
            leader = node.runtime.options.tp
            assert leader is not None and leader.world == 2 and [p.poll() for p in leader.procs] == [None]
            await serve_valid_request(node, expect=tiny_model.greedy)  # 4 heads over 2 KV heads, split in two
            await assign(node, tiny_model.path, tp_width=1)
            assert node.runtime.options.tp is None and [p.wait(10) for p in leader.procs] == [0]
            await serve_valid_request(node, expect=tiny_model.greedy)
    run(main())
