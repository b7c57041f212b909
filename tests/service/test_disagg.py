"""Service tier, disaggregated prefill (issue 39 item 1): a request prefilled on one pipeline and
decoded on another whose layer split differs (KV moved stage to stage by layer range) gives
transformers' greedy tokens; its TTFT is reported as prefill / transfer / first decode step; a
handoff that fails falls back to a replay with the same tokens; a chunk with the wrong key is
refused. Four in-process stages, two pipelines: P [0, 1) -> [1, 4), D [0, 3) -> [3, 4)."""
from __future__ import annotations

import asyncio
import random

import grpc
import pytest
import torch

from logicpipe.common.modeldir import model_digest
from logicpipe.common.transport import PLAINTEXT
from logicpipe.controller.jobs import scheduler as scheduler_module
from logicpipe.controller.jobs.door import request_timings
from logicpipe.controller.jobs.handoff import HandoffPolicy, transfers
from logicpipe.controller.jobs.job import Job
from logicpipe.controller.jobs.scheduler import Scheduler, SchedulerConfig
from logicpipe.controller.mesh.pipeline import StageAssignment
from logicpipe.controller.mesh.pipelines import PipelineSet
from logicpipe.controller.mesh.state import MeshState, Phase
from logicpipe.errors import FailedPrecondition, Unavailable
from logicpipe.sampling import SamplingParams
from logicpipe.stage_node.engine.sequence import SeqWork
from logicpipe.tensor_codec import encode
from logicpipe.v1 import stage_pb2
from tests.service.conftest import (
    RPC_TIMEOUT_S,
    TINY_CONTEXT,
    TINY_LAYERS,
    TINY_VOCAB,
    expect_status,
    hf_greedy,
    open_request,
    stage_node,
)

NEW = 6


async def generate(sched: Scheduler, prompt: list[int]):
    async with sched.submit(Job(tuple(prompt), NEW, SamplingParams(), ignore_eos=True)) as handle:
        tokens = [u.token_id async for u in handle]
        return tokens, request_timings(handle.request)


def test_a_request_prefilled_on_one_pipeline_decodes_on_another_split_as_transformers(tiny_model, hf, monkeypatch):
    rng = random.Random(39)
    prompts = [[rng.randrange(TINY_VOCAB) for _ in range(n)] for n in (41, 23)]  # over blocks of 16, and not whole

    async def main():
        async with stage_node("p0") as p0, stage_node("p1") as p1, stage_node("d0") as d0, stage_node("d1") as d1:
            sched = None
            pipelines = PipelineSet(PLAINTEXT, lambda ev: sched.on_event(ev), lambda address, why: None)
            prefill, decode = pipelines.new(), pipelines.new()
            digest, path = model_digest(tiny_model.path), str(tiny_model.path)
            await prefill.install(path, digest, TINY_LAYERS, [StageAssignment(p0.address, 0, 1),
                                                              StageAssignment(p1.address, 1, TINY_LAYERS)],
                                  micro_batches=1)
            await decode.install(path, digest, TINY_LAYERS, [StageAssignment(d0.address, 0, 3),
                                                             StageAssignment(d1.address, 3, TINY_LAYERS)],
                                 micro_batches=1)
            pipelines.replace([prefill, decode])
            assert [(t.source.address, t.target.address, t.start, t.end) for t in
                    transfers(prefill.stages, decode.stages)] == [(p0.address, d0.address, 0, 1),
                                                                  (p1.address, d0.address, 1, 3),
                                                                  (p1.address, d1.address, 3, 4)]
            state = MeshState()
            state.set(Phase.READY)
            policy = HandoffPolicy("on")  # the first pipeline prefills for the second
            sched = Scheduler(pipelines, state, SchedulerConfig(TINY_CONTEXT, frozenset(), TINY_VOCAB, speculate=0),
                              handoffs=policy)
            try:
                for prompt in prompts:
                    tokens, t = await generate(sched, prompt)
                    assert tokens == hf_greedy(hf, prompt, NEW), "greedy tokens differ from transformers'"
                    assert t.disaggregated and min(t.prefill_s, t.transfer_s, t.first_step_s) > 0, t
                    assert t.prefill_s + t.transfer_s + t.first_step_s <= t.first_token_s - t.queue_s
                assert policy.handoffs == 2 and policy.fallbacks == 0
                assert p1.runtime.stats.sampled_steps == 0, "the prefill pipeline sampled"
                # the decode pipeline's first stage computed only each prompt's last token, then decoded
                assert d0.runtime.stats.rows == 2 * NEW

                # a move that fails: the request is replayed without a handoff, with the same tokens
                real = scheduler_module.move_kv

                async def broken(*args):
                    raise Unavailable("the link broke")

                monkeypatch.setattr(scheduler_module, "move_kv", broken)
                tokens, t = await generate(sched, prompts[0])
                assert tokens == hf_greedy(hf, prompts[0], NEW) and not t.disaggregated
                assert policy.fallbacks == 1
                monkeypatch.setattr(scheduler_module, "move_kv", real)

                # a chunk with the wrong key is refused; a step before the KV came is refused
                sid = "import-1"
                await decode.stages[1].stub.OpenSession(open_request(sid, 30, prompt_token_ids=list(range(20)),
                                                       kv_import_length=19, kv_import_key="k" * 32),
                                          timeout=RPC_TIMEOUT_S)
                chunk = stage_pb2.KvChunk(session_id=sid, import_key="x" * 32, layer=3, start_pos=0,
                                          kv=encode(torch.zeros(2, 2, 19, 16)))

                async def one():
                    yield chunk
                await expect_status(d1.stub.ImportKv(one(), timeout=RPC_TIMEOUT_S), grpc.StatusCode.PERMISSION_DENIED,
                                    "wrong import_key")
                with pytest.raises(FailedPrecondition, match="holds 0 positions"):  # no step before the KV came
                    d1.runtime.engine.scheduler._check_step(SeqWork(sid, 19, (19,)))
            finally:
                await sched.shutdown()
                await pipelines.close()

    asyncio.run(asyncio.wait_for(main(), 180))
