"""Streamed text, token by token, is exactly the decoded text of all the tokens; stop strings cut it
exactly where the whole text would be cut, holding back only the tail a stop may have begun in."""
from __future__ import annotations

import random

import pytest

from logicpipe.controller.jobs.rules import MAX_STOP_BYTES
from logicpipe.controller.jobs.text import StopScan, TextStream

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


def released(stops: tuple[str, ...], pieces: list[str]) -> tuple[str, bool, int]:
    """(all the text a StopScan releases for `pieces`, whether it stopped, the most it held back)."""
    scan, out, most = StopScan(stops), [], 0
    for i, p in enumerate(pieces):
        out.append(scan.push(p, final=i == len(pieces) - 1))
        most = max(most, len(scan.pending))
        if scan.stopped:
            break
    return "".join(out), scan.stopped, most


@pytest.mark.parametrize("seed", range(20))
def test_stop_strings_cut_where_the_whole_text_is_cut_in_any_split(seed):
    rng = random.Random(seed)
    text = "".join(rng.choice("abc\n") for _ in range(rng.randint(0, 60)))
    stops = tuple("".join(rng.choice("abc") for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 4)))
    cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(1, 8))))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    first = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
    out, stopped, most = released(stops, pieces)
    assert (out, stopped) == ((text[:first], True) if first >= 0 else (text, False)), (text, stops, pieces)
    assert most <= max(map(len, stops)) - 1  # only the tail a stop may have begun in is kept between pushes


def test_a_long_answer_under_a_capped_stop_keeps_only_the_stops_length():
    """4000 pieces under the longest stop there may be: what is held and searched each push stays
    the stop's length (no rescan of the whole answer), and the text released is all of it."""
    stop = "z" * MAX_STOP_BYTES
    pieces = ["word "] * 4000
    out, stopped, most = released((stop,), pieces)
    assert out == "".join(pieces) and not stopped and most == MAX_STOP_BYTES - 1
