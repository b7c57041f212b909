"""The last stage's grammar constraint (stage_node.grammar) with the default model's tokenizer: a
masked row allows only what the grammar allows, candidates the grammar rejects are cut (the first
rejected one and everything after it), probing leaves the matcher where it was, a replay's matcher
masks as the original does, the grammar's end finishes the sequence, and bad grammars are refused
with the library's reason."""
from __future__ import annotations

import json

import pytest
import torch

from logicpipe.errors import InvalidArgument
from logicpipe.sampling import JSON_OBJECT, check_grammar
from logicpipe.stage_node.model.grammar import GrammarBook
from logicpipe.stage_node.model.sampling import verify

SCHEMA = json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                     "additionalProperties": False})  # exactly {"ok": true} or {"ok": false}


@pytest.fixture(scope="module")
def book(model_dir):
    from transformers import AutoTokenizer
    return GrammarBook(str(model_dir), 49152), AutoTokenizer.from_pretrained(str(model_dir))


def ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def test_candidates_the_grammar_rejects_are_cut(book):
    b, tok = book
    c = b.constraint(SCHEMA)
    good = ids(tok, '{"ok"')
    bad = ids(tok, "hello")[0]
    cands = [*good, bad, *good]
    logits = torch.zeros(len(cands) + 1, 49152)
    allowed = c.mask_rows(logits, 0, cands)
    assert allowed == len(good)  # the rejected candidate and everything after it are cut
    assert c.accepted == 0 and c.matcher.accept_token(good[0])  # probing left the matcher at the start
    c.matcher.rollback(1)
    for i, t in enumerate(good):  # each verification row allows its candidate, and not the rejected token
        assert logits[i, t] == 0 and logits[i, bad] == float("-inf")
    assert logits[len(good), bad] == float("-inf")
    # greedy verification over the rows kept accepts the allowed candidates and picks a grammatical next token
    raw = torch.randn(len(cands) + 1, 49152)
    raw[torch.arange(len(cands)), torch.tensor(cands)] += 100.0  # unmasked, the model would accept all of them
    masked = raw.clone()
    n = c.mask_rows(masked, 0, cands)
    out = verify(masked[:n + 1], cands[:n], type("P", (), {"greedy": True})(), [None] * (n + 1))
    assert out[:n] == good and out[n] != bad
    assert c.advance(0, out)
    assert tok.decode(out).startswith('{"ok"')


def test_replay_masks_as_the_first_run_and_the_end_finishes(book):
    b, tok = book
    answer = ids(tok, '{"ok": true}')
    first = b.constraint(SCHEMA)
    assert first.advance(0, answer[:3])
    replay = b.constraint(SCHEMA, answer[:3])  # a replay's generated tokens: the tail of its prompt
    a, r = torch.zeros(1, 49152), torch.zeros(1, 49152)
    first.mask_rows(a, 3, ())
    replay.mask_rows(r, 3, ())
    assert torch.equal(torch.isinf(a), torch.isinf(r)) and int(torch.isfinite(a).sum()) < 49152
    assert first.advance(3, answer[3:]) and not first.terminated
    end = torch.zeros(1, 49152)
    first.mask_rows(end, len(answer), ())
    allowed = torch.isfinite(end[0]).nonzero().flatten().tolist()
    assert allowed and all(t in first.matcher.stop_token_ids for t in allowed)  # only the end may follow
    assert first.advance(len(answer), allowed[:1]) and first.terminated
    # a step computed again at an earlier position rolls the matcher back first
    assert first.advance(2, answer[2:]) and first.accepted == len(answer) and not first.terminated


def test_bad_grammars_are_refused_with_the_library_reason(book):
    b, _ = book
    with pytest.raises(InvalidArgument, match='Unsupported type "nope"'):
        b.compile(json.dumps({"type": "nope"}))
    with pytest.raises(ValueError, match='Unsupported type "nope"'):
        check_grammar(json.dumps({"type": "nope"}))
    with pytest.raises(ValueError, match="not JSON"):
        check_grammar("{bad")
    assert check_grammar(JSON_OBJECT) == JSON_OBJECT
    assert b.compile(SCHEMA) is b.compile(SCHEMA)  # cached by text
