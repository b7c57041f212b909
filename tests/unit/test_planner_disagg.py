"""planner.disagg: which pipelines prefill for the others, and which prompts are handed over."""
from __future__ import annotations

import pytest

from logicpipe.planner.disagg import PipelineRates, Roles, choose_roles, first_token_s, hand_over

GPU = PipelineRates(prefill_tokens_per_s=10_000, decode_tokens_per_s=100, transfer_s_per_token=1e-5)
CPU = PipelineRates(prefill_tokens_per_s=200, decode_tokens_per_s=20)


def test_roles_by_mode_and_measured_prefill_rates():
    assert choose_roles([CPU, GPU], "auto") == Roles((1,), (0,))        # 50x faster at prefill: it prefills
    assert choose_roles([CPU, CPU], "auto") == Roles((), (0, 1))        # equals: each its own
    assert choose_roles([CPU, PipelineRates()], "auto") == Roles((), (0, 1))  # not measured yet: no roles
    assert choose_roles([CPU, GPU], "off") == Roles((), (0, 1))
    assert choose_roles([GPU], "on") == Roles((), (0,))                 # one pipeline: nothing to hand over to
    assert choose_roles([PipelineRates(), PipelineRates()], "on") == Roles((0,), (1,))  # forced: the first
    with pytest.raises(ValueError, match="disaggregation mode"):
        choose_roles([CPU, GPU], "sometimes")


def test_a_prompt_is_handed_over_when_its_first_token_comes_sooner():
    assert first_token_s(4096, GPU, CPU) == pytest.approx(4095 / 10_000 + 4095 * 1e-5 + 1 / 20)
    assert hand_over(4096, GPU, CPU)                  # 0.5 s there and back vs 20 s here
    assert not hand_over(4, GPU, CPU)                 # a 4-token prompt: the first step there costs more
    assert not hand_over(4096, GPU, CPU, "off")
    assert hand_over(2, GPU, CPU, "on") and not hand_over(1, GPU, CPU, "on")  # at least one position moves
    slow_link = PipelineRates(10_000, 100, transfer_s_per_token=0.01)
    assert not hand_over(4096, slow_link, CPU)        # 41 s of transfer: prefill where it decodes
