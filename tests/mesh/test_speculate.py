"""Mesh tier: candidate tokens and pipelined prefill on the default model, through 1 and 3 stage
processes. Greedy output with prompt-lookup candidates is token-identical to greedy output
without, on input-grounded and open-ended prompts and one of more than 1,000 tokens; a seeded
sampled request gives the same tokens; a long prompt gives the same tokens in small pipelined
chunks as in big ones; lpctl reports the acceptance."""
from __future__ import annotations

import json
import subprocess

import pytest

from logicpipe.v1 import controller_pb2, controller_pb2_grpc, stage_pb2
from tests.localmesh import LocalMesh as Mesh
from tests.localmesh import client_transport

pytestmark = pytest.mark.mesh

TEXT = ("The city council met on Tuesday to discuss the new bicycle lanes on Main Street. Residents said the "
        "lanes made the street safer for children walking to school, but several shop owners worried that "
        "removing forty parking spaces would cost them customers.")
LONG = " ".join(f"Entry {i}: the river station measured {i * 7 % 31} centimetres of rain and a water level "
                f"of {i * 13 % 97} metres." for i in range(45))
GROUNDED = [f"Copy this text, correcting any mistake in it:\n\n{TEXT}",
            f"Rewrite this text in the passive voice, keeping every fact:\n\n{TEXT}"]
PROMPTS = GROUNDED + ["Write a haiku about the sea.", "What are the benefits of regular exercise?",
                      f"Here is a log:\n\n{LONG}\n\nRepeat the last three entries exactly."]
NEW_TOKENS = 32


@pytest.fixture(scope="module", params=[1, 3], ids=lambda n: f"{n}stage")
def mesh(request, model_dir, tmp_path_factory):
    with Mesh(request.param, model_dir, tmp_path_factory.mktemp(f"spec{request.param}"),
              controller_args=("--speculate", "4")) as m:
        yield m


def submit(address: str, prompt: str, **kw) -> tuple[list[int], controller_pb2.Timings]:
    with client_transport().sync_channel(address, "controller") as ch:
        replies = list(controller_pb2_grpc.ControllerStub(ch).Submit(
            controller_pb2.SubmitRequest(prompt=prompt, max_tokens=kw.pop("max_tokens", NEW_TOKENS), **kw),
            timeout=300))
    return [t for r in replies for t in r.token_ids], replies[-1].timings


def test_candidates_give_the_tokens_greedy_gives_without(mesh):
    accepted = {}
    for prompt in PROMPTS:
        with_c, t = submit(mesh.controller_address, prompt)  # the controller's --speculate 4
        without, t0 = submit(mesh.controller_address, prompt, speculate=0)
        assert with_c == without, f"{mesh.n_stages} stages: candidates change the output of {prompt[:40]!r}"
        assert t.speculate == 4 and t0.speculate == 0 and t0.candidates == 0
        assert t.decode_steps == t.new_tokens - t.accepted  # one trip per token, less the accepted candidates
        accepted[prompt] = t.accepted
    assert submit(mesh.controller_address, PROMPTS[-1], max_tokens=1)[1].prompt_tokens > 1000
    # the model copies its input: candidates found there are accepted
    assert all(accepted[p] > 0 for p in GROUNDED), accepted


def test_seeded_sampling_draws_the_same_tokens_with_candidates(mesh):
    sampling = stage_pb2.SamplingParams(temperature=0.7, top_p=0.9, seed=2024)
    with_c, t = submit(mesh.controller_address, GROUNDED[0], sampling=sampling)
    without, _ = submit(mesh.controller_address, GROUNDED[0], sampling=sampling, speculate=0)
    assert with_c == without and t.candidates > 0 and t.accepted > 0


@pytest.mark.parametrize("mesh", [3], indirect=True, ids=["3stage"])  # chunks pipelined over stages
def test_a_long_prompt_in_small_pipelined_chunks_gives_the_same_tokens(mesh):
    small, ts = submit(mesh.controller_address, PROMPTS[-1], prefill_chunk=48, speculate=0, max_tokens=12)
    big, tb = submit(mesh.controller_address, PROMPTS[-1], prefill_chunk=512, speculate=0, max_tokens=12)
    chosen, tc = submit(mesh.controller_address, PROMPTS[-1], speculate=0, max_tokens=12)
    assert small == big == chosen
    assert (ts.prefill_chunk, tb.prefill_chunk) == (48, 512) and tc.prefill_chunk > 0


def test_lpctl_reports_candidates_and_status_counts_them(mesh):
    lpctl = mesh.lpctl()
    out = json.loads(subprocess.run([*lpctl, "submit", GROUNDED[0], "--max-tokens", "24", "--json", "--speculate", "3"],
                                    capture_output=True, text=True, timeout=120, check=True).stdout)
    t = out["timings"]
    assert t["speculate"] == 3 and t["candidates"] > 0 and 0 < t["acceptance_rate"] <= 1
    assert t["tokens_per_step"] == pytest.approx(t["new_tokens"] / t["decode_steps"])
    status = subprocess.run([*lpctl, "status"], capture_output=True, text=True, timeout=60, check=True).stdout
    assert "tokens per pipeline trip" in status and "candidates accepted" in status
    st = mesh.controller_status()
    assert st.candidates >= t["candidates"] and st.candidates_accepted > 0 and st.speculate == 4
    assert st.acceptance_rate == pytest.approx(st.candidates_accepted / st.candidates)
    assert st.tokens_per_step == pytest.approx(st.decode_tokens / st.decode_steps) and st.tokens_per_step > 1
