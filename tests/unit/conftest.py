"""Fixtures shared by unit-test modules (computed once per session)."""
from __future__ import annotations

import pytest
import torch

from logicpipe.stage_node.model.shard import Shard

from .paged import PagedCache
from .test_quant import PROMPTS, TOKENS


@pytest.fixture(scope="session")
def reference(model_dir):
    """The float32 model's greedy tokens for test_quant's prompts (its own top-1, fed back): what the
    quantized models of test_quant and test_cpu_kernels are teacher-forced on, computed once."""
    from transformers import AutoTokenizer

    from logicpipe.controller.jobs.text import encode_prompt

    tok = AutoTokenizer.from_pretrained(model_dir)
    full = Shard.load(model_dir, 0, 30, first=True, last=True)
    out = []
    for prompt in PROMPTS:
        ids = encode_prompt(tok, prompt)
        cache = PagedCache(full, num_blocks=16)
        h = cache.forward(full.embed(torch.tensor(ids)), [("s", 0, ids)], {"s": len(ids)})
        for _ in range(TOKENS):
            ids.append(int(full.logits(h[-1:]).argmax()))
            h = cache.forward(full.embed(torch.tensor(ids[-1:])), [("s", len(ids) - 1, ids[-1:])])
        out.append((len(ids) - TOKENS, ids))
    return out
