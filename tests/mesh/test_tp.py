"""Mesh tier, tensor-parallel stages (issue 36): a node started with `--tp 2` is one stage of two
processes over gloo on loopback, planned beside a `--tp-max 2` node as a 2-stage pipeline. Greedy tokens
equal transformers' for a dense and a mixture-of-experts family (alone and 4 at once), and a killed
tensor-parallel member takes its stage down: the request in flight finishes, identical, on the re-plan.
The planner keeps the --tp 2 node's width and gives the --tp-max 2 node width 1: on a CPU its ranks share
the cores and gloo's all-reduce on loopback only adds to a token (docs/engine.md measured 0.45x)."""
from __future__ import annotations

import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.families import build, hf_greedy, hf_model
from tests.localmesh import LocalMesh
from tests.mesh.test_faults import stage_status
from tests.mesh.test_families import eventually, submit
from logicpipe.v1 import controller_pb2, controller_pb2_grpc

PROMPTS = [[5, 17, 2000, 9, 31, 77, 4, 1200, 8, 600, 45, 3], [7, 7, 300, 41, 9000, 12, 5], [100, 200, 300, 400, 500],
           [49000, 3, 77, 12000, 6, 8, 1, 2, 3]]
NEW = 8
LONG = 64


@pytest.fixture(scope="module")
def models(model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("tp-models")
    return {f: build(f, root / f, model_dir) for f in ("llama", "qwen3_moe")}


def children(pid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(d))
            except OSError:
                pass
    return out


def plan_devices(mesh: LocalMesh) -> list[list[str]]:
    """The plan in force's stages' devices, as `lpctl plan --json` lists them."""
    with mesh.transport.sync_channel(mesh.controller_address, "controller") as ch:
        reply = controller_pb2_grpc.ControllerStub(ch).Plan(controller_pb2.PlanRequest(), timeout=10)
    return [s["devices"] for p in json.loads(reply.plan_json)["pipelines"] for s in p["stages"]]


def test_a_tensor_parallel_stage_in_a_pipeline(models, tmp_path):
    with LocalMesh(2, models["llama"], tmp_path / "mesh", threads=1, stage_extra={0: ("--tp", "2"), 1: ("--tp-max", "2")},
                   controller_args=("--strategy", "uniform", "--settle-s", "0.5")) as mesh:
        for family in ("qwen3_moe", "llama"):  # the dense one last: the kill below runs on it
            st = mesh.restart_controller(models[family])
            assert [(s.node_id, s.end_layer - s.start_layer) for s in st.stages] == [("stage0", 2), ("stage1", 1)]
            model = hf_model(models[family])
            want = [hf_greedy(model, p, NEW) for p in PROMPTS]
            assert submit(mesh, PROMPTS[0], 0, new=NEW) == want[0], family
            with ThreadPoolExecutor(len(PROMPTS)) as pool:
                assert list(pool.map(lambda p: submit(mesh, p, 0, new=NEW), PROMPTS)) == want, family
        # its profile says it spans 2 devices and gives its measured all-reduce (the planner's cost of it)
        prof = stage_status(mesh.stage_addresses[0]).profile
        assert prof.devices == 2 and prof.allreduce_latency_s > 0 and prof.allreduce_bandwidth > 0, prof
        # the --tp-max 2 node offers 2 devices with the all-reduce its ranks measured at start; the planner
        # gives it width 1 (a CPU), and its measuring group is gone; the --tp 2 node keeps its 2
        flex = stage_status(mesh.stage_addresses[1]).profile
        assert flex.max_devices == 2 and flex.devices <= 1 and flex.allreduce_latency_s > 0, flex
        assert plan_devices(mesh) == [["stage0:0", "stage0:1"], ["stage1"]]
        assert children(mesh.procs["stage1"].pid) == []
        # a member of the tensor-parallel stage killed in the middle of a generation: the stage exits, the
        # mesh re-plans over the other node, and the request finishes as transformers' tokens
        followers = children(mesh.procs["stage0"].pid)
        assert len(followers) == 1, followers
        with ThreadPoolExecutor(1) as pool:
            streamed: list = []
            long = pool.submit(submit, mesh, PROMPTS[1], 0, None, LONG, streamed)
            eventually(lambda: len(streamed) >= 4, 120, "the long generation's first tokens")
            os.kill(followers[0], signal.SIGKILL)
            assert long.result() == hf_greedy(model, PROMPTS[1], LONG)
        deadline = time.monotonic() + 30
        while mesh.procs["stage0"].poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert mesh.procs["stage0"].returncode == 75  # the stage left: a member was lost
        assert [s.node_id for s in mesh.controller_status().stages] == ["stage1"]
        assert plan_devices(mesh) == [["stage1"]]
