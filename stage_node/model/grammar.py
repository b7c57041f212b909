"""Grammar-constrained sampling on the last stage (xgrammar): a session that asks for structured
output ("json_object", or a JSON schema's text) gets a matcher that masks every row its token is
chosen from, cuts the candidates the grammar rejects, and advances with each token it accepts.

Why xgrammar: measured by bench/grammar_bench.py (figures in docs/http-api.md) it compiles a
typical schema against the default model's 49152-token vocabulary in milliseconds and masks a
token in ~0.2 ms on CPU with no multi-second first mask; its matcher rolls back, which the
candidates' probing needs.

The tokenizer is read from the stage's model directory only when a session first asks for a
grammar (stages that never see one never load it); compiled grammars are cached by text, a
bounded number of them. The matcher state is a function of the tokens generated so far only: a
replay re-advances over its generated tokens, so it masks exactly as the first run did.
"""
from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from importlib.metadata import version
from pathlib import Path
from typing import Sequence

import torch

from logicpipe.errors import FailedPrecondition, InvalidArgument
from logicpipe.sampling import JSON_OBJECT, grammar_error

log = logging.getLogger(__name__)

CACHED_GRAMMARS = 64  # compiled grammars kept per stage (least recently used dropped first)
ROLLBACK_TOKENS = 64  # xgrammar < 0.2 keeps this many tokens to roll back (0.2 on: unlimited); > MAX_CANDIDATES


def _matcher(compiled):
    """A matcher that can roll back (probing candidates; a step computed again), on either API."""

    import xgrammar as xgr
    major, minor = (int(x) for x in version("xgrammar").split(".")[:2])
    if (major, minor) < (0, 2):
        return xgr.GrammarMatcher(compiled, max_rollback_tokens=ROLLBACK_TOKENS)  # (deprecated from 0.2)
    return xgr.GrammarMatcher(compiled)


class GrammarBook:
    """Compiles grammars against one model's vocabulary (`vocab_size`: its logits' width)."""

    def __init__(self, model_dir: str, vocab_size: int):
        self.model_dir = model_dir
        self.vocab_size = vocab_size
        self._compiler = None
        self._cache: OrderedDict[str, object] = OrderedDict()
        self._lock = threading.Lock()  # opened from the event loop; the cache is small and local

    def _get_compiler(self):
        if self._compiler is None:
            import xgrammar as xgr
            from transformers import AutoTokenizer
            if not any((Path(self.model_dir) / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
                raise FailedPrecondition(
                    f"structured output needs the model's tokenizer on the last stage, and {self.model_dir} has "
                    "none (a model pulled before the tokenizer was pulled with it: remove that directory and the "
                    "node pulls it again, or start the node with --model-dir pointing at a copy of the model)")
            tok = AutoTokenizer.from_pretrained(self.model_dir)
            info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=self.vocab_size)
            self._compiler = xgr.GrammarCompiler(info, cache_enabled=False)  # we cache, bounded
        return self._compiler

    def compile(self, text: str):
        with self._lock:
            hit = self._cache.get(text)
            if hit is not None:
                self._cache.move_to_end(text)
                return hit
            compiler = self._get_compiler()
            try:
                if text == JSON_OBJECT:
                    compiled = compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
                else:
                    compiled = compiler.compile_json_schema(text, any_whitespace=False)
            except RuntimeError as exc:
                raise InvalidArgument(f"grammar: {grammar_error(exc)}") from exc
            self._cache[text] = compiled
            if len(self._cache) > CACHED_GRAMMARS:
                self._cache.popitem(last=False)
            return compiled

    def constraint(self, text: str, generated: Sequence[int] = ()) -> "Constraint":
        """A fresh matcher for one sequence, advanced over the tokens it generated before (a replay's)."""
        c = Constraint(_matcher(self.compile(text)), self.vocab_size)
        if not c.advance(0, list(generated)):
            raise InvalidArgument(f"the replayed tokens break the session's grammar at generated token {c.accepted}")
        return c


class DeadEnd(InvalidArgument):
    """The grammar allows no next token (and has not ended): no text goes on from here, so the
    request can never finish. The request's own error, not a stage fault: the controller ends it
    (INVALID_ARGUMENT) rather than replay it."""


class Constraint:
    """One sequence's matcher. `accepted`: generated tokens it has advanced over; `terminated`:
    the grammar reached its end (the sequence finishes there)."""

    def __init__(self, matcher, vocab_size: int):
        import xgrammar as xgr
        self.matcher = matcher
        self.accepted = 0
        self.bitmask = xgr.allocate_token_bitmask(1, vocab_size)

    @property
    def terminated(self) -> bool:
        return self.matcher.is_terminated()

    def _mask(self, row: torch.Tensor) -> bool:
        """Disallowed tokens of `row` (a [1, vocab] view of float logits) to -inf, in place; False
        when that leaves no token (every logit is finite before: the model's, penalized, biased)."""
        import xgrammar as xgr
        self.matcher.fill_next_token_bitmask(self.bitmask)
        xgr.apply_token_bitmask_inplace(row, self.bitmask.to(row.device))
        return bool(torch.isfinite(row).any())

    def mask_rows(self, logits: torch.Tensor, index: int, candidates: Sequence[int]) -> int:
        """Mask the rows of one sequence's step in place (logits: [k + 1, vocab], the row before
        each candidate and the last; `index`: its generated tokens before them) -> how many leading
        candidates the grammar allows; the rows after those are not to be used (the first rejected
        candidate and everything after it are cut). DeadEnd when the grammar allows no token at a
        row (nothing is sampled for the sequence then)."""
        self.sync(index)
        ok = 0
        for i in range(len(candidates) + 1):
            if not self._mask(logits[i: i + 1]):
                if ok:
                    self.matcher.rollback(ok)
                raise DeadEnd(f"json_schema: its grammar allows no token after generated token {index + i} and has "
                              "not ended: no JSON value goes on from there (the schema cannot be completed)")
            if i == len(candidates) or not self.matcher.accept_token(candidates[i]):
                break
            if self.matcher.is_terminated():  # the row that ends it samples the end itself
                self.matcher.rollback(1)
                break
            ok += 1
        if ok:
            self.matcher.rollback(ok)  # probing only: the chosen tokens advance it (`advance`)
        return ok

    def sync(self, index: int) -> None:
        """Back to the state after `index` generated tokens (a step computed again at a position)."""
        if index < self.accepted:
            self.matcher.rollback(self.accepted - index)
            self.accepted = index

    def advance(self, index: int, tokens: Sequence[int]) -> bool:
        """Advance over the tokens chosen at generated index `index` on; False if one is rejected."""
        self.sync(index)
        for t in tokens:
            if self.matcher.is_terminated():
                break
            if not self.matcher.accept_token(int(t)):
                return False
            self.accepted += 1
        return True

