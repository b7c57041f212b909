"""Candidate drafting on the last stage: prompt lookup's proposals, and how many candidates a
sequence's acceptance record makes worth sending."""
from __future__ import annotations

import pytest

from logicpipe.stage_node.engine.drafter import (
    FREE_ROWS,
    MAX_PAUSE,
    MISSES_TO_PAUSE,
    QUANTIZED_CPU_COST,
    STEP_COST,
    Drafter,
    PromptLookup,
    allocate,
    best_k,
    expected_tokens,
    step_cost,
    step_cost_for,
)


def test_lookup_proposes_what_followed_the_latest_earlier_occurrence():
    # "5 6" occurred twice before; the latest occurrence was followed by 9 1 2
    lookup = PromptLookup([5, 6, 7, 8, 0, 5, 6, 9, 1, 2, 3, 5, 6])
    assert lookup.propose(3) == [9, 1, 2]
    assert lookup.propose(1) == [9]
    assert lookup.propose(0) == []


def test_lookup_prefers_the_longest_recurring_suffix():
    # the 1-gram "3" was last followed by 4, but the 3-gram "1 2 3" by 7
    lookup = PromptLookup([1, 2, 3, 7, 8, 0, 3, 4, 1, 2, 3])
    assert lookup.propose(2) == [7, 8]


def test_lookup_drafts_nothing_when_nothing_recurs():
    assert PromptLookup([1, 2, 3, 4]).propose(4) == []
    assert PromptLookup([]).propose(4) == []


def test_a_repeating_pattern_continues_past_the_present():
    lookup = PromptLookup([1, 2, 1, 2])
    assert lookup.propose(5) == [1, 2, 1, 2, 1]


def test_the_index_grows_with_the_sequence_as_a_fresh_one_would():
    tokens = [(i * 7) % 11 for i in range(60)]
    grown = PromptLookup(tokens[:10])
    for a in range(10, 60, 7):
        grown.extend(tokens[a:a + 7])
        fresh = PromptLookup(tokens[:a + 7])
        assert grown.propose(4) == fresh.propose(4)


def test_more_candidates_pay_only_while_they_are_accepted():
    assert expected_tokens(0.0, 5) == 1.0 and expected_tokens(1.0, 5) == 6.0
    assert step_cost(FREE_ROWS - 1) == 1.0 < step_cost(FREE_ROWS + 3)
    assert best_k(0.0, 8) == 0                  # nothing is ever accepted: draft nothing
    assert best_k(0.05, 8) == FREE_ROWS - 1     # rows that cost nothing are always worth a try
    assert best_k(1.0, 8) == 8                  # everything accepted: as many as allowed
    assert best_k(0.95, 2) == 2
    assert FREE_ROWS - 1 < best_k(0.95, 8) < 8  # rows past the free ones must earn their cost
    ks = [best_k(a / 10, 8) for a in range(10)]
    assert ks == sorted(ks)                     # more acceptance, never fewer candidates


def test_a_quantized_cpu_stage_pays_for_its_first_candidate():
    """A float CPU stage pads a lone row to 4, so 3 candidates are free there; a quantized one
    computes each row on its own: a lone sequence on open-ended text (candidates rarely accepted)
    gets none, one that copies its prompt still gets several."""
    assert step_cost_for("cpu", "float32") is STEP_COST and step_cost_for("cuda", "int4") is STEP_COST
    for fmt in ("int4", "int8", "nf4", "fp4"):
        assert step_cost_for("cpu", fmt) is QUANTIZED_CPU_COST
    assert QUANTIZED_CPU_COST(1) == 1.0 < QUANTIZED_CPU_COST(2)
    assert allocate([0.1], [8]) == [FREE_ROWS - 1]
    assert allocate([0.1], [8], QUANTIZED_CPU_COST) == [0]
    assert allocate([0.9], [8], QUANTIZED_CPU_COST)[0] >= 3
    assert allocate([0.5] * 8, [8] * 8, QUANTIZED_CPU_COST) == [0] * 8


def test_sequences_sharing_a_step_share_its_rows():
    """Alone, a sequence whose candidates are mostly accepted gets several; eight sharing a step
    at the same acceptance get none (each extra row would cost more than its expected token
    brings); the likeliest get them first when only some pay."""
    assert allocate([0.7], [8]) == [best_k(0.7, 8)] and best_k(0.7, 8) >= FREE_ROWS - 1
    assert allocate([0.7] * 8, [8] * 8) == [0] * 8
    mixed = allocate([0.99, 0.2, 0.99], [6, 6, 6])
    assert mixed[1] == 0 and mixed[0] > 0 and mixed[2] > 0
    assert allocate([0.9, 0.9], [1, 0]) == [1, 0]  # never more than a sequence has to offer
    assert allocate([], []) == []


def test_k_grows_with_acceptance_and_falls_without():
    d = Drafter([1, 2, 3], k_max=8)
    start = d.k()
    for _ in range(6):
        d.observe(d.k(), d.k(), [5])
    high = d.k()
    assert high == 8 and high >= start
    for _ in range(4):
        d.observe(4, 0, [6])
    assert d.k() < high


def test_repeated_misses_pause_drafting_then_it_resumes():
    context = [1, 2, 3, 1, 2]  # "1 2" recurs: there is always something to propose
    d = Drafter(context, k_max=4)
    for _ in range(MISSES_TO_PAUSE):
        assert d.propose(4)
        d.observe(4, 0, [])
    assert d.propose(4) == []          # paused for one step
    assert d.propose(4)                # then drafting again
    for _ in range(MISSES_TO_PAUSE):
        d.observe(4, 0, [])
    assert d.propose(4) == [] and d.propose(4) == []  # the next pause is twice as long
    assert d.propose(4)
    d.observe(4, 2, [])                # an acceptance resets the backoff
    assert d.pauses == 0 and d.verified == 4 * (2 * MISSES_TO_PAUSE + 1) and d.accepted == 2


def test_pauses_are_bounded():
    d = Drafter([1, 1], k_max=4)
    for _ in range(MISSES_TO_PAUSE * 20):
        d.paused = 0
        d.observe(4, 0, [])
    assert d.paused <= MAX_PAUSE


@pytest.mark.parametrize("limit", [0, 1, 3])
def test_a_proposal_respects_the_limit(limit):
    d = Drafter([1, 2, 3, 4, 1, 2, 3, 4, 1], k_max=8)
    assert len(d.propose(limit)) == min(limit, d.k())
