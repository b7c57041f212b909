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


def test_a_grammar_that_allows_no_token_ends_its_request_as_the_clients_error(book):
    """A schema no text satisfies ({"$ref": "#"}: a value that is itself) reaching a stage all the
    same (the door refuses it: controller.grammar_check) is a DeadEnd, an INVALID_ARGUMENT the
    controller ends the request with, not a fault it replays; the matcher is left where it was."""
    from logicpipe.stage_node.model.grammar import DeadEnd

    b, tok = book
    try:
        c = b.constraint(json.dumps({"$ref": "#"}))
    except InvalidArgument as exc:  # xgrammar >= 0.2.9 refuses it when compiling: the client's error too
        assert "Circular $ref chain" in str(exc)
    else:
        with pytest.raises(DeadEnd, match="json_schema: its grammar allows no token after generated token 0") as info:
            c.mask_rows(torch.zeros(1, 49152), 0, ())
        assert isinstance(info.value, InvalidArgument) and c.accepted == 0
    ok = b.constraint(SCHEMA)  # a schema with values: its rows always allow a token
    assert ok.mask_rows(torch.zeros(1, 49152), 0, ()) == 0


NEVER = {  # schemas the grammar library takes whose grammar admits no JSON value: (schema, why)
    "a $ref to itself": ({"$ref": "#"}, "never ends"),
    "a required property that is the whole schema": (
        {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}, "never ends"),
    "a non-empty array of itself": ({"type": "array", "items": {"$ref": "#"}, "minItems": 1}, "never ends"),
    "a definition that needs itself": ({"$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}},
                                                        "required": ["next"]}}, "$ref": "#/$defs/n"}, "never ends"),
    "anyOf nothing": ({"anyOf": []}, "only the empty text"),
    "oneOf nothing": ({"oneOf": []}, "only the empty text"),
}
SATISFIABLE = [  # recursive ones with a way out, and the usual forms (patterns, formats, bounds, enums)
    {"type": "object", "properties": {"a": {"$ref": "#"}}},
    {"type": "array", "items": {"$ref": "#"}},
    {"anyOf": [{"$ref": "#"}, {"type": "null"}]},
    {"$defs": {"n": {"type": "object", "properties": {"v": {"type": "integer"}, "kids": {
        "type": "array", "items": {"$ref": "#/$defs/n"}}}, "required": ["v", "kids"]}}, "$ref": "#/$defs/n"},
    {"type": "object", "properties": {"name": {"type": "string", "pattern": "^[A-Z][a-z]+$"},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                      "day": {"type": "string", "format": "date"},
                                      "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 1}},
     "required": ["name", "age"]},
    {"type": "string", "minLength": 3, "maxLength": 10}, {"type": "number", "minimum": 1.5}, {"const": "x"}, {},
    {"type": "object", "additionalProperties": {"type": "integer"}}, json.loads(SCHEMA),
]


@pytest.mark.parametrize("case", list(NEVER))
def test_a_schema_no_value_satisfies_is_refused_at_the_door(case):
    from logicpipe.controller.jobs.grammar_check import check_schema

    schema, why = NEVER[case]
    try:
        check_grammar(json.dumps(schema))  # the library itself takes it: only the door's own check refuses it
    except ValueError as exc:  # ... or (xgrammar >= 0.2.9, a schema that is only a $ref to itself) it refuses it
        assert case == "a $ref to itself" and "Circular $ref chain" in str(exc), exc
    with pytest.raises(ValueError, match="can never be satisfied") as info:
        check_schema(json.dumps(schema))
    assert why in str(info.value)


def test_satisfiable_schemas_pass_and_every_printed_form_is_read():
    """The check refuses only what it has shown empty: each schema here passes, and its grammar's
    printed form (and xgrammar's built-in JSON grammar) is read without a form left unknown."""
    import xgrammar as xgr

    from logicpipe.controller.jobs.grammar_check import check_schema, emptiness, read_rules

    for schema in SATISFIABLE:
        text = json.dumps(schema)
        assert check_schema(text) == text
        read_rules(str(xgr.Grammar.from_json_schema(text, any_whitespace=False)))  # raises on an unknown form
    builtin = str(xgr.Grammar.builtin_json_grammar())
    assert read_rules(builtin) and emptiness(builtin) == ""
    assert check_schema(JSON_OBJECT) == JSON_OBJECT
