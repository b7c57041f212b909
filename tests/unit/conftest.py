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
    seqs = [encode_prompt(tok, prompt) for prompt in PROMPTS]
    n_prompt = [len(ids) for ids in seqs]
    # every prompt in one step, then one decode row each a step: a row's result is its own whatever
    # shares its step (test_shard, test_families), and the weights are read once a step, not once a prompt
    cache = PagedCache(full, num_blocks=16 * len(seqs))
    rows = [(str(i), 0, ids) for i, ids in enumerate(seqs)]
    for _ in range(TOKENS):
        h = cache.forward(full.embed(torch.tensor([t for _, _, ids in rows for t in ids])), rows,
                          {sid: n for (sid, _, _), n in zip(rows, n_prompt)})
        ends = torch.tensor([len(ids) for _, _, ids in rows]).cumsum(0) - 1
        nxt = full.logits(h[ends]).argmax(-1).tolist()
        for i, t in enumerate(nxt):
            seqs[i].append(int(t))
        rows = [(str(i), len(ids) - 1, ids[-1:]) for i, ids in enumerate(seqs)]
    return list(zip(n_prompt, seqs))
