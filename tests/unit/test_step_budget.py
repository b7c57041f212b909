"""The step-time bar (engine.step_budget): stage 0 sizes a long prompt's chunks so that every step
(a decoding request's row and a prefill chunk) stays under the bar by the stage's cost model,
counted in rows, attended and held key positions (not wall time); the model follows measured steps."""
from __future__ import annotations

from logicpipe.sampling import SamplingParams
from logicpipe.stage_node.engine.blocks import KVManager
from logicpipe.stage_node.engine.scheduler import Budget, Scheduler
from logicpipe.stage_node.engine.sequence import SeqSpec, SeqWork
from logicpipe.stage_node.engine.step_budget import MIN_CHUNK, StepClock, attended, shape_of

# a CPU stage of 3 SmolLM2-135M-shaped layers (576 wide, 9 heads of 64, 3 KV heads), float32 KV
SHAPE = shape_of(params=3 * 3_540_000, attention_layers=3, num_heads=9, head_dim=64, kv_bytes=3 * 2 * 3 * 64 * 4)
PROMPT = 12_000


def spec(sid: str, prompt: tuple[int, ...], new: int) -> SeqSpec:
    return SeqSpec(session_id=sid, capacity=len(prompt) + new + 1, sampling=SamplingParams(), max_new_tokens=new,
                   stop_ids=frozenset(), prompt=prompt)


def run_beside_decode(clock: StepClock | None) -> list[tuple[int, int, int, int, bool]]:
    """A 12,000-token prompt prefilled while another sequence decodes, on stage 0 of a one-stage
    pipeline (its token fed back after every step): (rows, attended, held, chunk, decode row in
    it) of every step until the prompt is in."""
    sched = Scheduler(KVManager(2000, 16), first=True, last=True, node_id="n", budget=Budget(max_tokens=512))
    sched.clock = clock
    sched.admit(spec("d", (1, 2, 3), 5000))
    sched.feed(SeqWork("d", 0, (1, 2, 3)))
    step, _ = sched.schedule()
    sched.complete(step, set())
    sched.feed(SeqWork("d", 3, (7,)))  # its first token, back from the last stage
    sched.admit(spec("p", tuple(range(PROMPT)), 1))
    sched.feed(SeqWork("p", 0, tuple(range(PROMPT))))
    out, pos = [], 4
    while sched.seqs["p"].pending:
        step, failures = sched.schedule()
        assert not failures
        sched.complete(step, set())
        chunk = sum(p.work.num_tokens for p in step.seqs if p.seq.id == "p")
        has_decode = any(p.seq.id == "d" for p in step.seqs)
        out.append((step.rows, step.positions(), step.held(clock or StepClock(SHAPE)), chunk, has_decode))
        if has_decode:  # the last stage's token comes back: the next step decodes it
            sched.feed(SeqWork("d", pos, (7,)))
            pos += 1
    return out


def test_chunks_shrink_with_the_context_so_that_every_step_stays_under_the_bar():
    clock = StepClock(SHAPE, "cpu", bar_s=0.1)
    steps = run_beside_decode(clock)
    assert sum(s[3] for s in steps) == PROMPT
    for rows, positions, held, chunk, _ in steps:
        # counted, not timed: the model's cost of what the step holds
        assert clock.seconds(rows, positions, held) <= 0.1 or chunk == MIN_CHUNK
    chunks = [s[3] for s in steps]
    assert chunks[0] == clock.chunk(1, 4, 4, 0, 511) > 150  # what the bar leaves at first,
    assert chunks[-2] < chunks[0] / 4                          # far fewer rows at 12k
    assert chunks == sorted(chunks, reverse=True) or chunks[-1] < chunks[-2]  # (the last chunk is the rest)
    assert all(s[4] for s in steps)  # the decoding sequence is in every step: never starved by the prompt
    # without the bar: 511-row chunks to the end, the last steps many times over it
    plain = run_beside_decode(None)
    assert {s[3] for s in plain[:-1]} == {511}
    rows, positions, held, _, _ = plain[-2]
    assert clock.seconds(rows, positions, held) > 3 * 0.1


def test_where_the_decode_rows_alone_pass_the_bar_a_chunk_costs_at_most_half_of_it():
    clock = StepClock(SHAPE, "cpu", bar_s=0.01)
    base = clock.seconds(1, 30_001, 30_001)  # one decode row at 30k
    assert base > 0.01
    n = clock.chunk(1, 30_001, 30_001, 30_000, 512)
    assert n >= MIN_CHUNK
    grown = clock.seconds(1 + n, 30_001 + attended(30_000, n), 30_001 + 30_000 + n)
    assert grown - base <= 0.005 or n == MIN_CHUNK


def test_the_model_follows_the_steps_it_measures():
    clock = StepClock(SHAPE, "cpu", bar_s=0.1)
    truth = (0.003, 2e-4, 3e-8, 2e-6)  # what this "device" really costs

    def took(r: int, a: int, h: int) -> float:
        return truth[0] + r * truth[1] + a * truth[2] + h * truth[3]

    for r, start in [(1, 100), (512, 0), (64, 4000), (1, 8000), (200, 2000), (16, 11000), (1, 300), (300, 500)] * 4:
        a, h = attended(start, r), start + r
        clock.observe(r, a, h, took(r, a, h))
    for r, start in [(128, 6000), (1, 20000), (512, 100)]:
        a, h = attended(start, r), start + r
        assert abs(clock.seconds(r, a, h) - took(r, a, h)) < 0.15 * took(r, a, h)
    assert "steps measured" in clock.describe()


def test_a_prompt_with_nothing_decoding_beside_it_flows_in_whole_chunks():
    """Nobody waits on its steps: the bar does not shrink them (its first token comes no later)."""
    sched = Scheduler(KVManager(2000, 16), first=True, last=True, node_id="n", budget=Budget(max_tokens=512))
    sched.clock = StepClock(SHAPE, "cpu", bar_s=0.1)
    sched.admit(spec("p", tuple(range(PROMPT)), 1))
    sched.feed(SeqWork("p", 0, tuple(range(PROMPT))))
    chunks = []
    while sched.seqs["p"].pending:
        step, _ = sched.schedule()
        sched.complete(step, set())
        chunks.append(step.rows)
    assert sum(chunks) == PROMPT and set(chunks[:-1]) == {512}


def test_rows_that_read_the_pool_in_place_cost_no_gather():
    """A decode row that reads its keys in place (lp_attend, CUDA's paged kernels) holds no gathered
    positions; a chunk of more rows than in_place_rows still gathers its sequence's."""
    shape = shape_of(params=3 * 3_540_000, attention_layers=3, num_heads=9, head_dim=64,
                     kv_bytes=3 * 2 * 3 * 64 * 4, in_place_rows=8)
    clock, gathering = StepClock(shape, "cpu", bar_s=0.1), StepClock(SHAPE, "cpu", bar_s=0.1)
    assert clock.held(30_000, 1) == 0 and clock.held(30_000, 8) == 0 and clock.held(30_000, 9) == 30_009
    assert gathering.held(30_000, 1) == 30_001
    # beside a decode row at 30k: the in-place model leaves the chunk more of the bar
    assert clock.chunk(1, 30_001, 0, 10_000, 511) > gathering.chunk(1, 30_001, 30_001, 10_000, 511)
