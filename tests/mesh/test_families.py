"""Mesh tier, every family: three stage processes, and a controller started for each family's tiny
random checkpoint in turn (tests/families.py). Greedy tokens through 3, 2 and 1 stages equal
transformers' generate for a prompt longer than the sliding window, alone and among 8 concurrent
requests, with candidate tokens on (drafted by a small model) and off, and (three of issue 33's families)
after a replay; and each family serves `lpctl submit` and the OpenAI API, `n=3` too. The hybrids of
linear and full attention (Qwen3.5, Qwen3-Next: linear layers on both sides of the first stage boundary)
also serve an outline request whose points fork the outline's and each other's state."""
from __future__ import annotations

import json
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import torch
from transformers import AutoTokenizer

from logicpipe.controller.cli.model_prep import find_default_gguf
from logicpipe.controller.jobs.outline import OutlineRun, ancestors, parse_outline
from logicpipe.v1 import controller_pb2, controller_pb2_grpc
from tests.families import FAMILIES, WINDOW, build, hf_greedy, hf_model
from tests.gguf_files import write_gguf
from tests.localmesh import LocalMesh, free_port

NEW = 6
LONG = 96  # tokens of the generation a killed stage interrupts (replayed on the new plan)
# replayed after a fault: a family of each attention issue 33 added (MLA's latent KV, gpt-oss's sinks and
# sliding layers, GLM's partial RoPE); a replay costs a stage's restart, the suite's time
REPLAYED = ("deepseek_v2", "gpt_oss", "glm4_moe", "qwen3_next")  # + a recurrent state recomputed from the prompt
HYBRIDS = ("qwen3_5", "qwen3_next")
QUESTION = "How does a bicycle work?"
OUTLINE = "1. Wheels.\n2. Chain. [1]\n3. Brakes. [1, 2]"  # a root point, a one- and a two-predecessor point
torch.manual_seed(11)
PROMPTS = [torch.randint(0, 49152, (2 * WINDOW + i,)).tolist() for i in range(8)]  # past the sliding window


@pytest.fixture(scope="module")
def models(model_dir, tmp_path_factory):
    """Every family's model (the default model's tokenizer), under one directory: the stages'
    --model-root."""
    root = tmp_path_factory.mktemp("families")
    return {f: build(f, root / f, model_dir) for f in FAMILIES}


@pytest.fixture(scope="module")
def mesh(models, tmp_path_factory):
    http = f"127.0.0.1:{free_port()}"
    first = next(iter(models.values()))
    # the last stage drafts candidate tokens with a small model of the same vocabulary (the tiny Llama): it
    # proposes some on every step, whatever the text, so every family verifies candidates
    with LocalMesh(3, first, tmp_path_factory.mktemp("families-mesh"), threads=1,
                   controller_args=("--http", http, "--strategy", "uniform", "--settle-s", "0.5"),
                   stage_args=("--draft-model", str(models["llama"]))) as m:
        m.http = http
        yield m


def eventually(check, within: float, what: str) -> None:
    deadline = time.monotonic() + within
    while not check():
        assert time.monotonic() < deadline, f"no {what} within {within} s"
        time.sleep(0.02)


def submit(mesh, ids, speculate: int, timings: list | None = None, new: int = NEW,
           streamed: list | None = None) -> list[int]:
    """Greedy tokens of a Submit (`streamed`: each reply's tokens appended as they come)."""
    replies = []
    with mesh.transport.sync_channel(mesh.controller_address, "controller") as ch:
        for r in controller_pb2_grpc.ControllerStub(ch).Submit(controller_pb2.SubmitRequest(
                prompt_token_ids=ids, max_tokens=new, ignore_eos=True, speculate=speculate), timeout=300):
            replies.append(r)
            if streamed is not None:
                streamed.extend(r.token_ids)
    if timings is not None:
        timings.append(replies[-1].timings)
    return [t for r in replies for t in r.token_ids]


def lpctl(mesh, *args: str) -> str:
    out = subprocess.run([*mesh.lpctl(), *args], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return out.stdout


def check_outline(mesh, path, model, tmp) -> None:
    """An outline request with a given outline through the mesh: each point's text is that of
    transformers' greedy tokens of the point's sequence, rebuilt here as the controller builds it
    (the outline, its ancestors' segments, its own request)."""
    (tmp / "outline.txt").write_text(OUTLINE)
    doc = json.loads(lpctl(mesh, "submit", QUESTION, "--outline-text", str(tmp / "outline.txt"), "--max-points", "8",
                           "--max-tokens", str(NEW), "--json"))
    got = {p["id"]: p for p in doc["dag"]["points"]}
    run = OutlineRun(None, AutoTokenizer.from_pretrained(path), QUESTION, outline_text=OUTLINE, max_points=8)
    outline_ids = run.prefix_ids()[:-len(run.encode("1."))] + run.encode(OUTLINE)
    points, _ = parse_outline(OUTLINE, 8)
    assert [got[p.id]["shared"] for p in points] == ["outline", "point 1", "point 2"]
    for p in points:
        ids = list(outline_ids)
        for a in ancestors(points, p):
            ids += run.header_ids(points[a - 1]) + points[a - 1].tokens
        want = hf_greedy(model, ids + run.header_ids(p), NEW)
        stop = next((i for i, t in enumerate(want) if t in run.stop_ids), len(want))
        p.tokens = want[:stop]
        assert got[p.id]["text"] == run.tokenizer.decode(p.tokens, skip_special_tokens=True).strip(), p


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_family_through_3_2_and_1_stages(family, models, mesh, tmp_path):
    st = mesh.restart_controller(models[family])
    assert [s.end_layer - s.start_layer for s in st.stages] == [1, 1, 1]
    model = hf_model(models[family])
    prompts = PROMPTS
    want = [hf_greedy(model, p, NEW) for p in prompts]
    # 3 stages: alone with and without candidates, then all 8 at once
    t: list = []
    assert submit(mesh, prompts[0], 4, t) == want[0] and submit(mesh, prompts[0], 0) == want[0]
    assert t[0].candidates > 0  # drafted, verified
    if family in HYBRIDS:  # some rejected: the linear layers' states rolled back to an accepted position
        assert t[0].accepted < t[0].candidates
        check_outline(mesh, models[family], model, tmp_path)
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        assert list(pool.map(lambda p: submit(mesh, p, 4), prompts)) == want
    # lpctl and the OpenAI API serve it (text through the chat template)
    text = json.loads(lpctl(mesh, "submit", "Hello there", "--max-tokens", "5", "--json"))
    client = openai.OpenAI(base_url=f"http://{mesh.http}/v1", api_key="none", max_retries=0, timeout=120)
    chat = client.chat.completions.create(model=models[family].name, max_tokens=5, temperature=0, n=3,
                                          messages=[{"role": "user", "content": "Hello there"}])
    assert [c.message.content for c in chat.choices] == [text["text"]] * 3  # n=3 greedy: three times the same
    assert chat.usage.completion_tokens == 3 * len(text["token_ids"])
    # 2 stages, then 1. The families of issue 33 get there by a fault: the third stage is killed in the
    # middle of a long generation, which replays on the 2-stage plan, and comes back for the next family
    # (the others by drains, a replay costing a stage's restart: the suite's time)
    killed = family in REPLAYED
    if killed:
        with ThreadPoolExecutor(1) as pool:
            streamed: list = []
            long = pool.submit(submit, mesh, prompts[2], 0, None, LONG, streamed)
            eventually(lambda: len(streamed) >= 4, 120, "the long generation's first tokens")
            replays = mesh.controller_status().replays
            mesh.kill("stage2")
            assert long.result() == hf_greedy(model, prompts[2], LONG)
        assert mesh.controller_status().replays > replays, "the generation was not replayed"
    try:
        for node, stages in (("stage2", 2), ("stage1", 1)):
            if not (killed and node == "stage2"):
                assert "drained" in lpctl(mesh, "drain", node)
            assert len(mesh.wait_plan(stages=stages).stages) == stages
            assert submit(mesh, prompts[1], 4) == want[1] and submit(mesh, prompts[0], 4) == want[0]
    finally:
        if killed:
            mesh.start_stage(2, mesh.stage_addresses[2])


def test_a_gguf_file_is_converted_and_served(models, mesh, tmp_path):
    """`--model FILE.gguf`: the controller converts the file into its cache (stages outside it pull
    their layers), and the mesh serves transformers' tokens of the checkpoint the file was written from."""
    gguf = write_gguf("qwen3_moe", models["qwen3_moe"], tmp_path / "tiny-qwen3-moe.gguf", find_default_gguf())
    st = mesh.restart_controller(gguf, "--gguf-dtype", "float32", env={"LOGICPIPE_CACHE": str(tmp_path / "cache")})
    assert st.model_dir == str(tmp_path / "cache" / "models" / "tiny-qwen3-moe-float32")
    assert [s.end_layer - s.start_layer for s in st.stages] == [1, 1, 1]
    model = hf_model(models["qwen3_moe"])
    with ThreadPoolExecutor(4) as pool:
        assert list(pool.map(lambda p: submit(mesh, p, 4), PROMPTS[:4])) == [hf_greedy(model, p, NEW) for p in PROMPTS[:4]]
