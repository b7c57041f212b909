"""The stage scheduler without torch: micro-batches, round robin past the sequence budget, prompt
chunks under the token budget, preemption of the youngest, input positions."""
from __future__ import annotations

import pytest

from logicpipe.errors import FailedPrecondition, ResourceExhausted
from logicpipe.sampling import SamplingParams
from logicpipe.stage_node.engine.blocks import KVManager
from logicpipe.stage_node.engine.inbox import StepMsg
from logicpipe.stage_node.engine.scheduler import Budget, Scheduler
from logicpipe.stage_node.engine.sequence import SeqSpec, SeqWork
from logicpipe.stage_node.engine.step_budget import StepClock, shape_of
from logicpipe.tensor_codec import RawTensor


def spec(sid: str, prompt=(1, 2, 3), capacity: int = 48, priority: int = 0, prefill_rank: int = 0) -> SeqSpec:
    return SeqSpec(session_id=sid, capacity=capacity, sampling=SamplingParams(), max_new_tokens=100,
                   stop_ids=frozenset(), prompt=tuple(prompt), priority=priority, prefill_rank=prefill_rank)


def first_stage(blocks: int = 200, budget: Budget = Budget(), micro_batches: int = 1) -> Scheduler:
    return Scheduler(KVManager(blocks, 4), first=True, last=True, node_id="n", budget=budget,
                     micro_batches=micro_batches)


def run_step(sched: Scheduler, token: int = 7) -> list[str]:
    """Schedule one step, 'compute' it, and feed each sampled sequence its next token (as the
    last stage does). Returns the ids in the step."""
    step, failures = sched.schedule()
    assert not failures
    if step is None:
        return []
    for p in sched.complete(step, set()):
        if p.work.sample:
            sched.feed(SeqWork(p.seq.id, p.work.stop, (token,)))
    return [p.seq.id for p in step.seqs]


def admit_and_prefill(sched: Scheduler, ids: list[str]) -> None:
    for sid in ids:
        sched.admit(spec(sid))
        sched.feed(SeqWork(sid, 0, (1, 2, 3)))
    while any(s.is_prefill_ready() for s in sched.seqs.values()):
        run_step(sched)


def test_one_micro_batch_steps_every_sequence_together():
    sched = first_stage()
    admit_and_prefill(sched, ["a", "b", "c", "d"])
    assert sorted(run_step(sched)) == ["a", "b", "c", "d"]


def test_micro_batches_split_the_sequences_and_cap_steps_in_flight():
    sched = first_stage(micro_batches=3)
    admit_and_prefill(sched, list("abcdefg"))  # prompts that arrive together are prefilled together
    sizes = []
    while True:  # nothing comes back: every sampled step stays in flight
        step, _ = sched.schedule()
        if step is None:
            break
        sched.complete(step, set())
        sizes.append(len(step.seqs))
    assert sched.steps_in_flight() == 3
    assert sum(sizes) == 7 and max(sizes) == 3  # 7 sequences in groups of ceil(7 / 3)


def test_past_the_sequence_budget_every_sequence_keeps_moving():
    sched = first_stage(budget=Budget(max_tokens=512, max_seqs=2))
    admit_and_prefill(sched, ["a", "b", "c", "d", "e"])
    seen: list[str] = []
    for _ in range(3):
        seen += run_step(sched)
    assert set(seen) == {"a", "b", "c", "d", "e"}, seen  # nobody waits while others go twice


def test_prompt_chunks_fill_the_token_budget_after_decode_rows():
    sched = first_stage(budget=Budget(max_tokens=8, max_seqs=8))
    admit_and_prefill(sched, ["a"])
    sched.admit(spec("long", prompt=range(20), capacity=24))
    sched.feed(SeqWork("long", 0, tuple(range(20))))
    step, _ = sched.schedule()
    works = {p.seq.id: p.work for p in step.seqs}
    assert works["a"].num_tokens == 1 and works["long"].num_tokens == 7  # 8 rows: a decode row, then a chunk
    assert not works["long"].sample  # a chunk before the last samples nothing
    sched.complete(step, set())
    chunks = []
    while sched.seqs["long"].pending:
        step, _ = sched.schedule()
        chunks.append(next(p.work for p in step.seqs if p.seq.id == "long"))
        sched.complete(step, set())
    assert [w.start_pos for w in chunks] == [7, 15] and chunks[-1].sample


def test_ranked_replays_are_prefilled_first_the_lowest_rank_first():
    """OpenSessionRequest.prefill_rank (a replay after a move, by when it last had a token): prompts
    with a rank before those without, the lowest first, whatever their priority (arrival)."""
    sched = first_stage(budget=Budget(max_tokens=8))  # one prompt of 8 rows a step
    for sid, prio, rank in (("old", 1, 0), ("late", 3, 200), ("early", 4, 100), ("new", 2, 0)):
        sched.admit(spec(sid, prompt=range(8), priority=prio, prefill_rank=rank))
        sched.feed(SeqWork(sid, 0, tuple(range(8))))
    order = []
    for _ in range(4):
        step, _ = sched.schedule()
        order += [p.seq.id for p in step.seqs]
        sched.complete(step, set())
    assert order == ["early", "late", "old", "new"]


def test_a_ranked_replay_is_the_only_prompt_of_its_step():
    """A replay after a move (a prefill rank) is prefilled alone among the prompts, whole, beside the
    decode rows, so that its first token needs only its own rows: with room for all four prompts,
    one replay a step, then the unranked prompts together as before."""
    sched = first_stage(budget=Budget(max_tokens=64))
    sched.admit(spec("dec", prompt=range(4)))
    sched.feed(SeqWork("dec", 0, tuple(range(4))))
    run_step(sched)  # "dec" decodes from now on, a row a step
    for sid, rank in (("r2", 200), ("new", 0), ("r1", 100), ("new2", 0)):
        sched.admit(spec(sid, prompt=range(8), prefill_rank=rank))
        sched.feed(SeqWork(sid, 0, tuple(range(8))))
    prompts, decoding = [], []
    for _ in range(3):
        step, _ = sched.schedule()
        prompts.append(sorted(p.seq.id for p in step.seqs if p.work.num_tokens == 8))
        decoding.append("dec" in {p.seq.id for p in step.seqs})
        for p in sched.complete(step, set()):
            if p.work.sample:
                sched.feed(SeqWork(p.seq.id, p.work.stop, (7,)))
    assert prompts == [["r1"], ["r2"], ["new", "new2"]] and all(decoding)


def test_the_youngest_is_preempted_when_blocks_run_out():
    sched = first_stage(blocks=6)  # 24 positions
    for sid, prio in (("old", 1), ("young", 2)):  # (a prefill rank, a replay's, does not protect it)
        sched.admit(spec(sid, prompt=range(8), capacity=24, priority=prio, prefill_rank=5 if sid == "young" else 0))
        sched.feed(SeqWork(sid, 0, tuple(range(8))))
    run_step(sched)
    failures = []
    for _ in range(12):  # both grow; the pool runs out
        step, f = sched.schedule()
        failures += f
        if step is None:
            break
        for p in sched.complete(step, set()):
            sched.feed(SeqWork(p.seq.id, p.work.stop, (5,)))
    assert [f.session_id for f in failures] == ["young"] and failures[0].closed
    assert isinstance(failures[0].error, ResourceExhausted) and "preempted" in str(failures[0].error)
    assert "young" not in sched.seqs and sched.preempted == 1 and "old" in sched.seqs


def test_admission_by_free_blocks_says_what_is_missing():
    sched = first_stage(blocks=5)
    sched.admit(spec("a", prompt=range(12), capacity=20))  # 3 blocks
    with pytest.raises(ResourceExhausted, match="missing"):
        sched.admit(spec("b", prompt=range(8), capacity=20))  # 2 blocks + 1 kept for a's growth > 2 free
    assert "b" not in sched.seqs and sched.kv.used == 3


def test_input_at_the_wrong_position_is_refused_for_that_sequence():
    sched = first_stage()
    admit_and_prefill(sched, ["a"])
    with pytest.raises(FailedPrecondition, match="position 9"):
        sched.feed(SeqWork("a", 9, (1,)))


def test_a_prompt_fed_in_parts_is_sampled_after_its_last_part_only():
    sched = first_stage()
    sched.admit(spec("p", prompt=range(10), capacity=24))
    sched.feed(SeqWork("p", 0, tuple(range(6)), sample=False))  # more of the prompt follows
    step, _ = sched.schedule()
    (first,) = step.seqs
    assert first.work.num_tokens == 6 and not first.work.sample
    sched.complete(step, set())
    assert sched.schedule()[0] is None  # nothing to do until the rest arrives: no decode of a half prompt
    sched.feed(SeqWork("p", 6, tuple(range(6, 10))))
    step, _ = sched.schedule()
    (last,) = step.seqs
    assert (last.work.start_pos, last.work.num_tokens, last.work.sample) == (6, 4, True)


def test_a_chunk_before_the_candidates_leaves_the_row_that_samples_the_first():
    sched = first_stage(budget=Budget(max_tokens=4, max_seqs=8))
    sched.admit(spec("c", prompt=range(8), capacity=24))
    sched.feed(SeqWork("c", 0, tuple(range(6)), num_candidates=2))  # 4 real tokens + 2 candidates
    works = []
    while sched.seqs["c"].pending:
        step, _ = sched.schedule()
        works += [p.work for p in step.seqs]
        sched.complete(step, set())
    # the budget would allow 4 rows, but the last real token must travel with the candidates
    assert [(w.num_tokens, w.num_candidates, w.sample) for w in works] == [(3, 0, False), (3, 2, True)]


def test_a_finished_sequence_left_open_frees_its_step_slot():
    """The last stage tells stage 0 a sequence finished: kept open (a parent of later forks), it
    must not hold a micro-batch slot, or every other sequence waits for the stale timeout."""
    sched = first_stage(micro_batches=1)
    sched.admit(spec("parent"))
    sched.feed(SeqWork("parent", 0, (1, 2, 3)))
    step, _ = sched.schedule()
    sched.complete(step, set())
    assert sched.steps_in_flight() == 1
    sched.feed(SeqWork("parent", 3, (9,), finished=True))  # its last token: nothing follows
    assert sched.steps_in_flight() == 0 and sched.seqs["parent"].status.value == "finished"
    sched.admit(spec("other"))
    sched.feed(SeqWork("other", 0, (4, 5, 6)))
    step, _ = sched.schedule()
    assert [p.seq.id for p in step.seqs] == ["other"]  # the slot is free, and the parent is not stepped


def test_candidates_give_way_to_the_step_budget():
    """A token and 4 candidates under a 4-row budget: the last candidate is dropped (a stalled
    sequence would wait forever), the rest go."""
    sched = first_stage(budget=Budget(max_tokens=4, max_seqs=8))
    sched.admit(spec("c", prompt=(1, 2, 3), capacity=24))
    sched.feed(SeqWork("c", 0, (1, 2, 3)))
    step, _ = sched.schedule()
    sched.complete(step, set())
    sched.feed(SeqWork("c", 3, (7, 8, 9, 10, 11), num_candidates=4))
    step, _ = sched.schedule()
    (p,) = step.seqs
    assert (p.work.start_pos, p.work.token_ids, p.work.num_candidates) == (3, (7, 8, 9, 10), 3)
    assert sched.seqs["c"].pending == [] and sched.seqs["c"].next_pos == 7


def test_candidates_never_evict_another_sequence():
    """The pool is full: a step with candidates would need a new block, which only preempting the
    younger sequence could give. Stage 0 sends the token without its candidates instead."""
    sched = first_stage(blocks=3, micro_batches=4)  # blocks of 4 positions
    sched.admit(spec("old", prompt=(1, 2, 3), capacity=8))
    sched.admit(spec("young", prompt=(4, 5, 6), capacity=8))
    for sid in ("old", "young"):
        sched.feed(SeqWork(sid, 0, (1, 2, 3)))
    for feed in (None, SeqWork("young", 3, (9,)), SeqWork("young", 4, (9,))):  # young takes the last block
        if feed:
            sched.feed(feed)
        step, _ = sched.schedule()
        sched.complete(step, set())
    assert sched.kv.available == 0
    sched.feed(SeqWork("old", 3, (7, 8, 9), num_candidates=2))  # positions 3..5: a second block
    step, failures = sched.schedule()
    assert not failures and set(sched.seqs) == {"old", "young"} and sched.preempted == 0
    (p,) = step.seqs
    assert p.work.session_id == "old"
    assert (p.work.token_ids, p.work.num_candidates) == ((7,), 0)
    assert sched.seqs["old"].next_pos == 4


def later_stage(bar_s: float) -> Scheduler:
    sched = Scheduler(KVManager(200, 4), first=False, last=False, node_id="n", budget=Budget())
    sched.clock = StepClock(shape_of(params=1_000_000, attention_layers=2, num_heads=4, head_dim=16, kv_bytes=512),
                            "cpu", bar_s=bar_s)
    return sched


def rows(n: int) -> RawTensor:
    return RawTensor("float32", (n, 4), bytes(16 * n))


def queued_behind_chunks(sched: Scheduler) -> list[list[tuple[str, int, int]]]:
    """A decoding sequence d whose next row came in the same message as a prompt's third chunk, two
    chunks of that prompt queued before it: each step's (sequence, start, row in its part)."""
    sched.admit(spec("d", capacity=48))
    sched.admit(spec("p", prompt=tuple(range(40)), capacity=64))
    sched.enqueue(StepMsg((SeqWork("d", 0, (1, 2, 3), sample=True),), rows(3)))
    step, _ = sched.schedule()
    sched.complete(step, set())
    sched.enqueue(StepMsg((SeqWork("p", 0, tuple(range(8))),), rows(8)))
    sched.enqueue(StepMsg((SeqWork("p", 8, tuple(range(8, 16))),), rows(8)))
    third = StepMsg((SeqWork("d", 3, (9,), sample=True), SeqWork("p", 16, tuple(range(16, 24)))), rows(9))
    sched.enqueue(third)
    out = []
    while sched.inbox:
        step, failures = sched.schedule()
        assert not failures
        out.append([(p.seq.id, p.work.start_pos, p.row) for p in step.seqs])
        assert all(step.parts[p.part] is third.hidden for p in step.seqs if p.work.start_pos in (3, 16))
        sched.complete(step, set())
    return out


def test_a_decode_row_queued_behind_prompt_chunks_goes_first_under_the_bar():
    """Later stages, under the step-time bar: a decoding sequence's row jumps the prompt chunks queued
    before it (its own slices stay in order); the chunk left behind reads its rows where they are."""
    steps = queued_behind_chunks(later_stage(0.1))
    assert steps[0][0] == ("d", 3, 0)
    assert [s for step in steps for s in step if s[0] == "p"] == [("p", 0, 0), ("p", 8, 0), ("p", 16, 1)]
    # without a bar, the inbox's order
    assert queued_behind_chunks(later_stage(0.0))[-1] == [("d", 3, 0), ("p", 16, 1)]


def test_a_decode_row_never_passes_an_earlier_slice_of_its_own_sequence():
    sched = later_stage(0.1)
    sched.admit(spec("d", capacity=48))
    sched.enqueue(StepMsg((SeqWork("d", 0, (1, 2, 3)),), rows(3)))
    sched.enqueue(StepMsg((SeqWork("d", 3, (4,), sample=True),), rows(1)))
    step, _ = sched.schedule()
    assert [(p.seq.id, p.work.start_pos) for p in step.seqs] == [("d", 0)]
