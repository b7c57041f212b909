"""A stage whose --model-dir holds another model (the tiny 4-layer one, the controller serving the
30-layer default): it pulls the controller's layers instead when it can; when it cannot, it is
left out saying why — not assigned again every time it answers — and a request waits no longer
than --wait-for-nodes-s (issue 24: 298 retries in 10 minutes, and a client that hung)."""
from __future__ import annotations

import asyncio

import grpc

from logicpipe.v1 import controller_pb2

from .conftest import RPC_TIMEOUT_S, controller, expect_status, stage_node
from .test_controller_service import arun, submit


def test_a_node_with_another_model_that_cannot_pull_is_left_out_and_requests_do_not_hang(runner, model_dir,
                                                                                         tiny_model):
    async def main():
        async with stage_node("other-model") as node:
            node.runtime.weights.local_model_dir = str(tiny_model.path)  # --model-dir of another model; no pulls
            async with controller(model_dir, [node.address], start=False, wait_for_nodes_s=3.0) as ctl:
                await ctl.app.start()
                t0 = asyncio.get_running_loop().time()
                await expect_status(submit(ctl, prompt="Hello", max_tokens=2), grpc.StatusCode.RESOURCE_EXHAUSTED,
                                    "waited 3 s")
                assert asyncio.get_running_loop().time() - t0 < 20
                st = await ctl.stub.Status(controller_pb2.ControllerStatusRequest(), timeout=RPC_TIMEOUT_S)
                down = st.nodes[0].down
                assert "has 4 layers, the controller's 30" in down and "without --model-dir" in down, down
                attempts = ctl.app.replanner.replans, down
                await asyncio.sleep(5)  # several probe rounds: the same process is not assigned again
                st = await ctl.stub.Status(controller_pb2.ControllerStatusRequest(), timeout=RPC_TIMEOUT_S)
                assert (ctl.app.replanner.replans, st.nodes[0].down) == attempts and st.state == "waiting"
    arun(runner, main())


def test_a_node_with_another_model_pulls_the_controllers_layers(runner, model_dir, tiny_model, tmp_path):
    async def main():
        async with stage_node("puller") as node:
            node.runtime.weights.local_model_dir = str(tiny_model.path)
            node.runtime.weights.pull_root = tmp_path / "pulled"
            async with controller(model_dir, [node.address], start=False) as ctl:
                ctl.app.options = type(ctl.app.options)(**{**ctl.app.options.__dict__, "address": ctl.address})
                await ctl.app.start()
                assert await ctl.app.wait_ready(120), ctl.app.state.reason
                replies = await submit(ctl, prompt="Hello", max_tokens=4, ignore_eos=True)
                assert sum(len(r.token_ids) for r in replies) == 4
                assert node.runtime.weights.pulled_bytes > 0
    arun(runner, main())
