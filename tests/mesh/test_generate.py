"""Mesh tier: a controller and 1 or 3 stage processes on 127.0.0.1 with the default model (2: the kill test).

Greedy output through the mesh is token-identical to transformers' generate (fp32, CPU); every
stage holds only its shard; lpctl prints the documented JSON.
"""
from __future__ import annotations

import json
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from logicpipe.controller.jobs.text import encode_prompt
from logicpipe.v1 import controller_pb2, controller_pb2_grpc, stage_pb2, stage_pb2_grpc
from tests.localmesh import LocalMesh as Mesh
from tests.localmesh import client_transport

pytestmark = pytest.mark.mesh

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three uses of a paperclip.",
    "Explain recursion to a child in two sentences.",
    "Translate 'good morning' into Spanish and German.",
]
NEW_TOKENS = 48


@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return tok, model


@pytest.fixture(scope="module")
def reference(hf_model):
    """transformers' greedy generate: prompt ids and new token ids (EOS included, as the mesh does)."""
    tok, model = hf_model
    out = {}
    for prompt in PROMPTS:
        ids = encode_prompt(tok, prompt)
        with torch.inference_mode():
            gen = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)
        out[prompt] = gen[0, len(ids):].tolist()
    return out


@pytest.fixture(scope="module", params=[1, 3], ids=lambda n: f"{n}stage")  # (2 stages: the kill test below)
def mesh(request, model_dir, tmp_path_factory):
    with Mesh(request.param, model_dir, tmp_path_factory.mktemp(f"mesh{request.param}")) as m:
        yield m


def submit(address: str, prompt: str, max_tokens: int = NEW_TOKENS, **kw) -> tuple[list[int], str, list]:
    with client_transport().sync_channel(address, "controller") as ch:
        replies = list(controller_pb2_grpc.ControllerStub(ch).Submit(
            controller_pb2.SubmitRequest(prompt=prompt, max_tokens=max_tokens, **kw), timeout=300))
    ids = [t for r in replies for t in r.token_ids]
    return ids, "".join(r.text for r in replies), replies


def test_greedy_matches_transformers(mesh, reference):
    """Every prompt's tokens equal transformers' greedy ones; the prompts go at once, sharing the
    pipeline's steps (a sequence's tokens do not depend on what shares its steps)."""
    first = mesh.stage_addresses[[stage_status(a).stage_index for a in mesh.stage_addresses].index(0)]
    before = stage_status(first)
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        answers = list(pool.map(lambda p: submit(mesh.controller_address, p), PROMPTS))
    after = stage_status(first)
    for prompt, (ids, text, replies) in zip(PROMPTS, answers):
        assert ids == reference[prompt], f"{mesh.n_stages} stages diverge on {prompt!r}\n{mesh.logs()}"
        assert replies[-1].finished and replies[-1].finish_reason in ("stop", "length")
        assert text.strip()
    assert after.seq_rows - before.seq_rows > (after.steps - before.steps) * 1.5  # steps of several sequences


def test_each_stage_holds_only_its_shard(mesh, hf_model):
    _, model = hf_model
    statuses = []
    for addr in mesh.stage_addresses:
        with client_transport().sync_channel(addr, "stage") as ch:
            statuses.append(stage_pb2_grpc.StageNodeStub(ch).Status(stage_pb2.StatusRequest(), timeout=10))
    ranges = sorted((s.start_layer, s.end_layer) for s in statuses)
    assert ranges[0][0] == 0 and ranges[-1][1] == model.config.num_hidden_layers
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:])), f"gaps or overlaps: {ranges}"
    assert sum(s.parameter_count for s in statuses) == model.num_parameters()
    # The tied LM head is a copy only where the last stage is not also the first.
    assert sum(1 for s in statuses if s.tied_copy_count) == (1 if mesh.n_stages > 1 else 0)


def stage_status(address: str) -> stage_pb2.StatusReply:
    with client_transport().sync_channel(address, "stage") as ch:
        return stage_pb2_grpc.StageNodeStub(ch).Status(stage_pb2.StatusRequest(), timeout=10)


def test_lpctl_json_and_stream(mesh, model_dir):
    from logicpipe.common.modeldir import ModelConfig

    num_layers = ModelConfig.from_dir(model_dir).num_layers
    lpctl = mesh.lpctl()
    out = subprocess.run([*lpctl, "submit", PROMPTS[0], "--max-tokens", "12", "--json"],
                         capture_output=True, text=True, timeout=120, check=True)
    doc = json.loads(out.stdout)
    assert set(doc) >= {"text", "token_ids", "stages", "timings"}
    assert len(doc["token_ids"]) <= 12 and doc["text"]
    layers = [s["layers"] for s in doc["stages"]]
    assert len(layers) == mesh.n_stages and layers[0][0] == 0 and layers[-1][1] == num_layers
    assert doc["timings"]["new_tokens"] == len(doc["token_ids"])
    streamed = subprocess.run([*lpctl, "submit", PROMPTS[0], "--max-tokens", "12"],
                              capture_output=True, text=True, timeout=120, check=True)
    assert streamed.stdout.strip() == doc["text"].strip()
    status = subprocess.run([*lpctl, "status"], capture_output=True, text=True, timeout=60, check=True)
    assert f"stage{mesh.n_stages - 1}" in status.stdout and f"{layers[-1][0]}-{num_layers - 1}" in status.stdout


@pytest.mark.parametrize("mesh", [3], indirect=True, ids=["3stage"])
def test_an_outline_request_end_to_end(mesh):
    """The model writes an outline, its points decode in parallel through 3 stages, and lpctl
    prints the DAG: at least 2 points, each with text, dependencies only on earlier points."""
    out = subprocess.run([*mesh.lpctl(),
                          "submit", "Explain how a bicycle works.", "--outline", "--max-points", "4",
                          "--max-tokens", "24", "--json"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    points = doc["dag"]["points"]
    assert len(points) >= 2, doc
    assert all(p["tokens"] > 0 and p["text"] for p in points)
    assert all(d < p["id"] for p in points for d in p["deps"])
    assert points[0]["shared"] == "outline"
    starts = sorted(p["timings"]["start_s"] for p in points)
    ends = sorted(p["timings"]["end_s"] for p in points)
    assert starts[1] < ends[0], "no two points decoded at the same time"
    assert doc["text"].startswith("1. ")


def test_node_killed_mid_generation_finishes_on_the_survivor(model_dir, tmp_path):
    """SIGKILL of the last of 2 stages mid-generation: the survivor can hold the whole model, so
    the controller re-plans onto it alone and the (seeded, sampled) request finishes with the
    tokens it gives without the kill."""
    with Mesh(2, model_dir, tmp_path) as mesh:
        with client_transport().sync_channel(mesh.controller_address, "controller") as ch:
            stub = controller_pb2_grpc.ControllerStub(ch)
            request = controller_pb2.SubmitRequest(prompt=PROMPTS[1], max_tokens=60, ignore_eos=True,
                                                   sampling=stage_pb2.SamplingParams(temperature=0.8, seed=1))
            alone = [t for reply in stub.Submit(request, timeout=120) for t in reply.token_ids]
            got: list[int] = []
            for reply in stub.Submit(request, timeout=120):
                got += reply.token_ids
                if len(got) == 3:
                    mesh.kill("stage1")
            assert got == alone
            status = stub.Status(controller_pb2.ControllerStatusRequest(), timeout=30)
            assert status.state == "ready" and [s.node_id for s in status.stages] == ["stage0"]
            assert {n.node_id: n.reachable for n in status.nodes} == {"stage0": True, "stage1": False}
