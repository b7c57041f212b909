"""Streamed text, token by token, is exactly the decoded text of all the tokens."""
from __future__ import annotations

import pytest

from logicpipe.controller.jobs.text import TextStream

TEXTS = ["Hello, world! Ünïcödé 你好世界 🚀🚀 done.\n  indented   spaces", "The capital of France is Paris."]


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_text_equals_full_decode(model_dir, text):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = tok(text)["input_ids"] + [tok.eos_token_id]
    stream = TextStream(tok)
    pieces = [stream.push([t], final=i == len(ids) - 1) for i, t in enumerate(ids)]
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=True)
    assert all("\ufffd" not in p for p in pieces)  # no half characters on the wire


def test_no_tokenizer_streams_no_text():
    assert TextStream(None).push([1, 2, 3], final=True) == ""
