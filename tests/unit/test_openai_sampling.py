"""Unit tier, the last stage's arithmetic behind the OpenAI parameters: penalties and logit_bias
as OpenAI defines them (each verification row also counting the candidates before it), each
token's logprob and its top ones, the proto round trip, and token bytes for logprobs."""
from __future__ import annotations

from collections import Counter

import pytest
import torch

from logicpipe.controller.api.logprobs import TokenText, byte_decoder
from logicpipe.sampling import SamplingParams, TokenLogprob
from logicpipe.stage_node.model.sampling import penalize, token_logprobs


def test_penalize_is_openais_formula_and_counts_the_candidates_before_each_row():
    logits = torch.zeros(3, 6)
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, logit_bias=((1, 3.0), (5, -100.0)))
    out = penalize(logits, params, Counter({2: 2, 4: 1}), candidates=(4, 0))
    # row 0: generated {2: 2, 4: 1}; row 1: + candidate 4; row 2: + candidate 0
    assert out[0].tolist() == [0, 3, -1.0, 0, -0.75, -100]
    assert out[1].tolist() == [0, 3, -1.0, 0, -1.0, -100]
    assert out[2].tolist() == [-0.75, 3, -1.0, 0, -1.0, -100]
    assert logits.abs().sum() == 0  # a copy: the raw logits stay (logprobs are of them)


def test_penalties_validate_their_ranges():
    for bad in (SamplingParams(presence_penalty=2.5), SamplingParams(frequency_penalty=float("nan")),
                SamplingParams(logit_bias=((3, 101.0),)), SamplingParams(logit_bias=((-1, 1.0),))):
        with pytest.raises(ValueError):
            bad.validate()
    p = SamplingParams(temperature=0.5, seed=3, presence_penalty=-1.5, frequency_penalty=0.5,
                       logit_bias=((7, -100.0), (9, 2.5)))
    assert SamplingParams.from_proto(p.validate().to_proto()) == p and p.penalized
    assert not SamplingParams().penalized


def test_token_logprobs_are_the_log_softmax_with_the_top_most_likely_first():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [0.0, 0.0, 5.0, 1.0]])
    got = token_logprobs(logits, [0, 2], top=2)
    want = torch.log_softmax(logits, -1)
    assert got[0].logprob == pytest.approx(float(want[0, 0]))
    assert [t for t, _ in got[0].top] == [1, 2] and [t for t, _ in got[1].top] == [2, 3]
    assert got[1].top[0][1] == pytest.approx(float(want[1, 2])) == pytest.approx(got[1].logprob)
    assert token_logprobs(logits, [0, 2], top=0)[0].top == ()
    lp = TokenLogprob(-0.5, ((3, -0.5), (1, -2.0)))
    assert TokenLogprob.from_proto(lp.to_proto()) == lp


class ByteLevel:
    """A byte-level BPE tokenizer's two tokens: 'Ġhi' (b' hi') and half of 'é' (0xC3)."""

    def convert_ids_to_tokens(self, i):
        return {0: "Ġhi", 1: "Ã"}[i]


def test_token_bytes_are_exact_for_byte_level_tokens():
    assert len(byte_decoder()) == 256 and set(byte_decoder().values()) == set(range(256))
    text = TokenText(ByteLevel())
    assert text.bytes(0) == b" hi" and text.bytes(1) == b"\xc3" and text.text(1) == "\ufffd"
    entry = text.completions([0, 1], [TokenLogprob(-1.0, ((0, -1.0),)), None], offset=5)
    assert entry == {"tokens": [" hi", "\ufffd"], "token_logprobs": [-1.0, None],
                     "top_logprobs": [{" hi": -1.0}, {}], "text_offset": [5, 8]}
