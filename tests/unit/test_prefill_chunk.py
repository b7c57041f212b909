"""Pipelined prefill: the chunk size the cost model picks for a long prompt, and stage 0 cutting a
sequence's prompt into chunks of it."""
from __future__ import annotations

import math

from logicpipe.planner import DeviceProfile, Link, ModelSpec
from logicpipe.planner.prefill import best_chunk, chunk_times_s, prefill_time_s
from logicpipe.sampling import SamplingParams
from logicpipe.stage_node.engine.blocks import KVManager
from logicpipe.stage_node.engine.scheduler import Budget, Scheduler
from logicpipe.stage_node.engine.sequence import SeqSpec, SeqWork

MODEL = ModelSpec.llama(name="m", hidden_size=576, intermediate_size=1536, num_heads=9, num_kv_heads=3,
                        vocab_size=49152, num_layers=30, head_dim=64, tied_embeddings=True)
LINK = Link(latency=0.0007, bandwidth=1e9)


def cpus(n: int, flops: float = 1.5e11) -> list[DeviceProfile]:
    ids = [f"n{i}" for i in range(n)]
    return [DeviceProfile(a, "cpu", 8 * 2**30, flops, 3e10, links={b: LINK for b in ids if b != a}) for a in ids]


def test_the_time_formula_fills_the_pipeline_then_adds_a_bottleneck_step_per_chunk():
    assert prefill_time_s([1.0, 2.0, 1.0], [1.0, 2.0, 1.0], 100, 100) == 4.0     # one chunk: every stage in turn
    assert prefill_time_s([1.0, 2.0, 1.0], [0.5, 1.0, 0.5], 250, 100) == 4.0 + 2.0 + 1.0


def test_three_stages_chunk_a_long_prompt_and_one_stage_does_not():
    three = best_chunk(cpus(3), [10, 10, 10], MODEL, 1500)
    assert 16 <= three < 1500 and three % 16 == 0
    one_chunk_s = prefill_time_s(chunk_times_s(cpus(3), [10, 10, 10], MODEL, 1500, 750),
                                 chunk_times_s(cpus(3), [10, 10, 10], MODEL, 1500, 750), 1500, 1500)
    last = 1500 - (math.ceil(1500 / three) - 1) * three
    chunked_s = prefill_time_s(chunk_times_s(cpus(3), [10, 10, 10], MODEL, three, 750),
                               chunk_times_s(cpus(3), [10, 10, 10], MODEL, last, 750), 1500, three)
    assert chunked_s < 0.6 * one_chunk_s  # what the model expects of pipelining here
    # one stage has nothing to overlap: the biggest chunk its budget allows
    assert best_chunk(cpus(1), [30], MODEL, 1500, max_chunk=512) == 512
    assert best_chunk(cpus(3), [10, 10, 10], MODEL, 10) == 10  # a short prompt goes whole


def test_a_slower_device_or_more_stages_do_not_break_the_choice():
    slow = cpus(3)
    chunks = [best_chunk(slow, [10, 10, 10], MODEL, n) for n in (256, 1024, 4096)]
    assert all(16 <= c <= 512 for c in chunks)
    assert best_chunk(cpus(6), [5] * 6, MODEL, 1500) <= best_chunk(cpus(2), [15, 15], MODEL, 1500)


def test_stage_zero_cuts_a_prompt_into_its_chunks_and_samples_after_the_last():
    sched = Scheduler(KVManager(200, 4), first=True, last=True, node_id="n", budget=Budget(max_tokens=512))
    spec = SeqSpec(session_id="s", capacity=120, sampling=SamplingParams(), max_new_tokens=10,
                   stop_ids=frozenset(), prompt=tuple(range(100)), prefill_chunk=32)
    sched.admit(spec)
    sched.feed(SeqWork("s", 0, tuple(range(100))))
    works = []
    while sched.seqs["s"].pending:
        step, _ = sched.schedule()
        works += [p.work for p in step.seqs]
        sched.complete(step, set())
    assert [(w.start_pos, w.num_tokens, w.sample) for w in works] == [
        (0, 32, False), (32, 32, False), (64, 32, False), (96, 4, True)]
