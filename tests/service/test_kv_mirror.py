"""Service tier, KV mirrors (issue 34): two pipelines of the same split copy each other's full KV
blocks as they fill (SetMirror, PutBlocks); a request moved off its pipeline mid-generation (as a
re-plan after a fault moves it) is replayed on the pipeline that holds its mirror, attaches its
history's blocks there instead of computing them, and gives transformers' greedy tokens. A
PutBlocks without the controller's mirror key, a SetMirror from a caller that does not hold the
stage and one for another plan generation are refused. A target that takes the connection but never
answers (as a SIGSTOPped stage) holds up neither the copies to another target nor a flush past its
deadline. Four in-process stages, pipelines A [0, 2) -> [2, 4) and B the same."""
from __future__ import annotations

import asyncio
import json
import contextlib
import random
import socket
import time

import grpc

from logicpipe.common.modeldir import model_digest
from logicpipe.common.transport import PLAINTEXT
from logicpipe.controller.jobs.job import Job
from logicpipe.controller.jobs.scheduler import Scheduler, SchedulerConfig
from logicpipe.controller.mesh.pipeline import StageAssignment
from logicpipe.controller.mesh.pipelines import PipelineSet
from logicpipe.controller.mesh.state import MeshState, Phase
from logicpipe.sampling import SamplingParams
from logicpipe.stage_node.net import kv_disk as kv_disk_module
from logicpipe.stage_node.net import mirror as mirror_module
from logicpipe.tensor_codec import encode
from logicpipe.v1 import stage_pb2
from tests.service.conftest import (
    RPC_TIMEOUT_S,
    TINY_CONTEXT,
    TINY_LAYERS,
    TINY_VOCAB,
    expect_status,
    hf_greedy,
    stage_node,
)
import torch

NEW = 40
MOVE_AT = 20  # tokens received when the request is moved


async def install(pipelines: PipelineSet, model_path, s0, s1):
    """A new pipeline of `pipelines` over stages s0 (layers [0, 2)) and s1 (the rest), installed."""
    p = pipelines.new()
    await p.install(str(model_path), model_digest(model_path), TINY_LAYERS,
                    [StageAssignment(s0.address, 0, 2), StageAssignment(s1.address, 2, TINY_LAYERS)], micro_batches=1)
    return p


async def until(check, within: float = 30.0, what: str = "") -> None:
    deadline = time.monotonic() + within
    while not check():
        assert time.monotonic() < deadline, f"{what} did not happen within {within:.0f} s"
        await asyncio.sleep(0.02)


def test_a_request_moved_off_its_pipeline_replays_from_its_mirrored_kv_as_transformers(tiny_model, hf, monkeypatch,
                                                                                      tmp_path):
    """(Also: a stage's --step-log, a JSON line per computed step.)"""
    monkeypatch.setattr(mirror_module, "MIRROR_S", 0.05)
    monkeypatch.setattr(mirror_module, "PUT_TIMEOUT_S", 120.0)  # (a call to the silent target below waits this long)
    step_log = tmp_path / "a1-steps.jsonl"
    prompt = [random.Random(34).randrange(TINY_VOCAB) for _ in range(37)]
    want = hf_greedy(hf, prompt, NEW)

    async def main():
        async with stage_node("a0", min_step_s=0.01) as a0, \
                stage_node("a1", min_step_s=0.08, step_log=str(step_log)) as a1, \
                stage_node("b0", min_step_s=0.01) as b0, stage_node("b1", min_step_s=0.01) as b1:
            sched = None
            pipelines = PipelineSet(PLAINTEXT, lambda ev: sched.on_event(ev), lambda address, why: None)
            digest = model_digest(tiny_model.path)
            pa, pb = await install(pipelines, tiny_model.path, a0, a1), await install(pipelines, tiny_model.path, b0, b1)
            pipelines.replace([pa, pb])
            await pipelines._mirror_task
            assert pipelines.mirror_of(pa) is pb and pipelines.mirror_of(pb) is pa
            assert [t.address for t in a1.runtime.mirror.targets] == [b1.address]  # stage by stage
            async def no_rounds() -> None:
                return None
            a1.runtime.mirror.round = no_rounds  # a1's copies come only from its flush, below
            # each of A's stages copies to a target that never answers first, then to B's: the copies to B
            # must not wait for it (a round a task, the targets at the same time)
            silent = socket.create_server(("127.0.0.1", 0), backlog=16)  # (takes connections, answers nothing)
            stuck = f"127.0.0.1:{silent.getsockname()[1]}"
            for s, b in ((a0, b0), (a1, b1)):
                assert s.runtime.mirror.set([stuck, b.address], pipelines.identity.mirror_key, pa.generation) == 2
            state = MeshState()
            state.set(Phase.READY)
            sched = Scheduler(pipelines, state, SchedulerConfig(TINY_CONTEXT, frozenset(), TINY_VOCAB, speculate=0))
            try:
                tokens = []
                async with sched.submit(Job(tuple(prompt), NEW, SamplingParams(), ignore_eos=True)) as handle:
                    async for u in handle:
                        tokens.append(u.token_id)
                        if len(tokens) == MOVE_AT:
                            assert sched.opened[handle.request.session_id] is pa
                            # B's stages hold the request's first 3 blocks (positions [0, 48)): b0 by the
                            # rounds, b1 by a flush (what a stage that leaves on SIGTERM does first) ...
                            await until(lambda: b0.runtime.stats.mirrored_in_blocks >= 3, what="b0 taking a0's blocks")
                            assert b1.runtime.stats.mirrored_in_blocks == 0
                            # (its deadline bounds the silent target's call: 0.5 s, while a1's steps of 0.08 s
                            # leave the request 1.6 s more to run); a catch-up to b1 under way (a round's, that
                            # sends nothing) is waited for, then the flush sends what b1 lacks
                            to_b1 = a1.runtime.mirror.targets[1]
                            to_b1.task = asyncio.ensure_future(asyncio.sleep(0.2, 0))
                            assert await asyncio.wait_for(a1.runtime.mirror.flush(0.5), 2) > 0
                            assert b1.runtime.stats.mirrored_in_blocks >= 3
                            pa.retired = True  # ... when a re-plan moves it off A
                            sessions = sched.detach([pa])
                            await pa.close_session_many(sessions, pa.stages)
                assert tokens == want, "greedy tokens differ from transformers'"
                st = sched.stats
                assert st.replays == 1 and st.replay_cached_tokens >= 48, (st.replays, st.replay_cached_tokens)
                assert a0.runtime.stats.mirrored_out_blocks >= 3 and a0.runtime.stats.mirror_errors == 0
                steps = [json.loads(line) for line in step_log.read_text().splitlines()]
                assert steps and all(s["node"] == "a1" and s["s"] >= 0.01 and s["rows"] >= 1 for s in steps), steps[:3]
                assert steps[0]["rows"] == 37 and steps[0]["positions"] == 37 * 38 // 2  # the prompt, then decode rows
                assert any(s["decodes"] and s["rows"] == 1 for s in steps) and all(s["model_s"] > 0 for s in steps)

                # refusals: the wrong key, a caller that does not hold the stage, a stale generation
                bad = stage_pb2.PutBlocksRequest(key="x" * 32, model_digest=digest, start_layer=0, end_layer=2,
                                                 block_size=16, blocks=[stage_pb2.MirrorBlock(hash=1, first=True,
                                                                                              tokens=[0] * 16)],
                                                 kv=encode(torch.zeros(4, 2, 16, 16)))
                await expect_status(b0.stub.PutBlocks(bad, timeout=RPC_TIMEOUT_S), grpc.StatusCode.PERMISSION_DENIED,
                                    "mirror key")
                bad.key = pipelines.identity.mirror_key
                await expect_status(b0.stub.PutBlocks(bad, timeout=RPC_TIMEOUT_S), grpc.StatusCode.INVALID_ARGUMENT,
                                    "hash")
                await expect_status(b0.stub.SetMirror(stage_pb2.SetMirrorRequest(
                    targets=[a0.address], key="k" * 32, generation=pb.generation), timeout=RPC_TIMEOUT_S),
                    grpc.StatusCode.PERMISSION_DENIED)
                await expect_status(pb.stages[0].stub.SetMirror(stage_pb2.SetMirrorRequest(
                    targets=[a0.address], key="k" * 32, generation=pb.generation + 1), timeout=RPC_TIMEOUT_S),
                    grpc.StatusCode.FAILED_PRECONDITION, "stale")
            finally:
                silent.close()
                await sched.shutdown()
                await pipelines.close()

    asyncio.run(asyncio.wait_for(main(), 180))


def test_a_stage_started_again_reads_its_prefix_cache_from_disk_and_the_replay_attaches_it(tiny_model, hf, monkeypatch,
                                                                                           tmp_path):
    monkeypatch.setattr(kv_disk_module, "WRITE_S", 0.05)
    prompt = [random.Random(35).randrange(TINY_VOCAB) for _ in range(37)]
    want = hf_greedy(hf, prompt, NEW)
    disk = {name: dict(kv_disk_bytes=2**26, kv_disk_dir=str(tmp_path / f"kv-{name}"), min_step_s=0.01)
            for name in ("s0", "s1")}

    async def main():
        async with contextlib.AsyncExitStack() as again, contextlib.AsyncExitStack() as first:
            a0 = await first.enter_async_context(stage_node("s0", **disk["s0"]))
            a1 = await first.enter_async_context(stage_node("s1", **disk["s1"]))
            sched = None
            pipelines = PipelineSet(PLAINTEXT, lambda ev: sched.on_event(ev), lambda address, why: None)
            pa = await install(pipelines, tiny_model.path, a0, a1)
            pipelines.replace([pa])
            state = MeshState()
            state.set(Phase.READY)
            sched = Scheduler(pipelines, state, SchedulerConfig(TINY_CONTEXT, frozenset(), TINY_VOCAB, speculate=0))
            try:
                tokens = []
                async with sched.submit(Job(tuple(prompt), NEW, SamplingParams(), ignore_eos=True)) as handle:
                    async for u in handle:
                        tokens.append(u.token_id)
                        if len(tokens) != MOVE_AT:
                            continue
                        # both stages wrote the request's first 3 blocks (positions [0, 48)) to their disks
                        await until(lambda: min(a0.runtime.stats.kv_disk_written_blocks,
                                                a1.runtime.stats.kv_disk_written_blocks) >= 3, what="the disk writes")
                        await first.aclose()  # A's stages gone, with no flush (as a SIGKILL)
                        seg = sorted((tmp_path / "kv-s0").glob("seg-*.kv"))[-1]
                        seg.write_bytes(seg.read_bytes() + b"LPKB" + b"\1" * 20)  # ... and a torn record at the tail
                        b0 = await again.enter_async_context(stage_node("s0", **disk["s0"]))
                        b1 = await again.enter_async_context(stage_node("s1", **disk["s1"]))
                        pb = await install(pipelines, tiny_model.path, b0, b1)  # started again: the blocks are read back before they serve
                        assert b0.runtime.stats.kv_disk_restored_blocks >= 3
                        assert b1.runtime.stats.kv_disk_restored_blocks >= 3
                        pipelines.replace([pb])
                        pa.retired = True
                        sched.detach([pa])
                st = await b0.stub.Status(stage_pb2.StatusRequest(), timeout=RPC_TIMEOUT_S)
                assert st.kv_disk_restored_blocks >= 3 and st.kv_disk_bytes > 0 and st.kv_disk_errors == 0
                assert tokens == want, "greedy tokens differ from transformers'"
                assert sched.stats.replays == 1 and sched.stats.replay_cached_tokens >= 48, \
                    (sched.stats.replays, sched.stats.replay_cached_tokens)
            finally:
                await sched.shutdown()
                await pipelines.close()

    asyncio.run(asyncio.wait_for(main(), 180))
