"""Sampling parameters of a request: one type, its validation and its protobuf form, for lpctl,
the controller and the stages alike (the arithmetic of sampling lives in stage_node.sampling)."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace

from logicpipe.v1 import stage_pb2

MIN_TEMPERATURE = 1e-3  # below this a softmax overflows float32 for ordinary logits; use 0 (greedy)
MAX_TEMPERATURE = 100.0
MAX_TOP_K = 1 << 20
MAX_TOP_LOGPROBS = 20   # most likely tokens reported with each token at most (OpenAI's cap)
MAX_PENALTY = 2.0       # |presence_penalty|, |frequency_penalty| at most (OpenAI's range)
MAX_BIAS = 100.0        # |logit_bias| of a token at most (OpenAI's range)
MAX_BIASED_TOKENS = 1024  # tokens one request may bias
MAX_GRAMMAR_CHARS = 64 * 1024  # a structured-output grammar (a JSON schema's text) at most
JSON_OBJECT = "json_object"    # the grammar of OpenAI's response_format json_object: any JSON object
_WHERE = re.compile(r"\[[\d:]+\]\s+\S+:\d+:\s*(Check failed: .*? is false:\s*)?")  # xgrammar's source location


def grammar_error(exc: Exception) -> str:
    """The grammar library's reason, without its source-file location."""
    return _WHERE.sub("", str(exc)).strip().splitlines()[0][:500] if str(exc).strip() else type(exc).__name__


def check_grammar(text: str) -> str:
    """`text` (JSON_OBJECT or a JSON schema's text) if the grammar library accepts it, else
    ValueError with the library's reason: checked where a request comes in, so a bad schema is the
    client's 400, not a stage's failure (compiling it against the vocabulary is the last stage's)."""
    if text == JSON_OBJECT:
        return text
    if len(text) > MAX_GRAMMAR_CHARS:
        raise ValueError(f"the JSON schema has {len(text)} characters, over the cap of {MAX_GRAMMAR_CHARS}")
    try:
        if not isinstance(json.loads(text), dict):
            raise ValueError("a JSON schema is a JSON object")
    except json.JSONDecodeError as exc:
        raise ValueError(f"the JSON schema is not JSON: {exc}") from exc
    import xgrammar as xgr  # only when a grammar is asked: its import takes a second
    try:
        xgr.Grammar.from_json_schema(text, any_whitespace=False)
    except RuntimeError as exc:
        raise ValueError(f"the JSON schema is not supported: {grammar_error(exc)}") from exc
    return text


@dataclass(frozen=True)
class SamplingParams:
    """How one sequence picks its next token."""

    temperature: float = 0.0  # softmax temperature (dimensionless); 0 means greedy argmax
    top_k: int = 0  # keep only the k most likely tokens (count); 0 keeps all
    top_p: float = 1.0  # keep the smallest set of top tokens whose probability reaches top_p (0, 1]
    seed: int | None = None  # seed of the sequence's draws; None: one is drawn when the request starts
    presence_penalty: float = 0.0  # subtracted from the logit of each token the sequence generated (-2..2)
    frequency_penalty: float = 0.0  # ... times how often it generated it (-2..2)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit: -100..100), sorted by id

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """The logits are changed before the choice (penalties or a bias)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias)

    def validate(self) -> "SamplingParams":
        """Itself, or ValueError with a message a person can act on if a field is out of range."""
        t = self.temperature
        if not (t == 0.0 or MIN_TEMPERATURE <= t <= MAX_TEMPERATURE):  # also catches NaN and inf
            raise ValueError(f"temperature must be 0 (greedy) or in [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}], "
                             f"got {t}")
        if not 0 <= self.top_k <= MAX_TOP_K:
            raise ValueError(f"top_k must be in [0, {MAX_TOP_K}] (0 disables it), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:  # also catches NaN
            raise ValueError(f"top_p must be in (0, 1] (1 disables it), got {self.top_p}")
        if self.seed is not None and not 0 <= self.seed < 2**64:
            raise ValueError(f"seed must be in [0, 2^64), got {self.seed}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not -MAX_PENALTY <= v <= MAX_PENALTY:  # also catches NaN
                raise ValueError(f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}] (0 disables it), got {v}")
        if len(self.logit_bias) > MAX_BIASED_TOKENS:
            raise ValueError(f"logit_bias biases {len(self.logit_bias)} tokens, over the cap of {MAX_BIASED_TOKENS}")
        for t, b in self.logit_bias:
            if t < 0 or not -MAX_BIAS <= b <= MAX_BIAS:
                raise ValueError(f"logit_bias: token {t} must be a token id with a bias in [-{MAX_BIAS:g}, "
                                 f"{MAX_BIAS:g}], got {b}")
        return self

    def with_seed(self, seed: int) -> "SamplingParams":
        return replace(self, seed=seed)

    def to_proto(self) -> stage_pb2.SamplingParams:
        p = stage_pb2.SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                                     presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                                     logit_bias=dict(self.logit_bias))
        if self.seed is not None:
            p.seed = self.seed
        return p

    @classmethod
    def from_proto(cls, p: stage_pb2.SamplingParams) -> "SamplingParams":
        """The message's parameters (top_p 0, the proto default, means off), not yet validated."""
        return cls(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p or 1.0,
                   seed=p.seed if p.HasField("seed") else None, presence_penalty=p.presence_penalty,
                   frequency_penalty=p.frequency_penalty, logit_bias=tuple(sorted(p.logit_bias.items())))


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability under the model's distribution at its position (log-softmax of
    the logits that chose it, before temperature, top-k and top-p), and the most likely tokens
    there, most likely first: what the last stage reports when a session asks for logprobs."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, log-probability)

    def to_proto(self) -> stage_pb2.TokenLogprob:
        return stage_pb2.TokenLogprob(logprob=self.logprob, top_token_ids=[t for t, _ in self.top],
                                      top_logprobs=[lp for _, lp in self.top])

    @classmethod
    def from_proto(cls, p: stage_pb2.TokenLogprob) -> "TokenLogprob":
        return cls(p.logprob, tuple(zip(p.top_token_ids, p.top_logprobs)))
