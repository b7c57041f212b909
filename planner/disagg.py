"""Disaggregated prefill: which pipelines prefill for the others, and whether a prompt is worth
handing over, from the pipelines' measured prefill and decode rates (pure; the controller measures,
controller.jobs.handoff applies).

Prefill is compute-bound and decode memory-bound, so on a mesh of mixed boxes one pipeline (a GPU
box) may prefill many times faster than another (boards, CPU boxes) that decodes nearly as well. A
prompt prefilled there and its KV handed to the decoding pipeline reaches its first token sooner
when

    n / prefill(P) + n * transfer_per_token(P) + 1 / decode(D)  <  n / prefill(D)

and the prefill pipeline, busy with everyone's prompts, decodes nobody's.
"""
from __future__ import annotations

from dataclasses import dataclass

MODES = ("auto", "off", "on")
PREFILL_GAIN = 4.0   # auto: a pipeline prefills for the others only when this many times faster at it than each
                     # (a GPU box against boards or CPU boxes is 20-100x; replicas of one kind measure within
                     # 2x of each other under load, where a prompt's wait in the stage's queue counts too)
HANDOFF_GAIN = 1.2   # auto: a prompt is handed over only when its predicted first token comes this many times sooner
MIN_PROMPT = 2       # tokens: a handoff moves the KV of all but the last (computed on the decode pipeline)


@dataclass(frozen=True)
class PipelineRates:
    """A pipeline's measured speeds (0: not measured yet)."""

    prefill_tokens_per_s: float = 0.0   # prompt tokens computed per second (0 until measured enough)
    decode_tokens_per_s: float = 0.0    # new tokens per second of one request
    transfer_s_per_token: float = 0.0   # seconds a handed-over prompt's KV takes per token to leave it


@dataclass(frozen=True)
class Roles:
    """Pipeline indexes: those that prefill for the others (and decode none), those that decode."""

    prefill: tuple[int, ...] = ()
    decode: tuple[int, ...] = ()


def choose_roles(rates: list[PipelineRates], mode: str = "auto") -> Roles:
    """`off` (or one pipeline): every pipeline decodes and prefills its own. `on`: the fastest
    prefiller (the first when none was measured) prefills for the others. `auto`: it does only once
    every pipeline's prefill rate is measured and it is PREFILL_GAIN times faster than each other."""
    if mode not in MODES:
        raise ValueError(f"disaggregation mode {mode!r}: expected one of {', '.join(MODES)}")
    everyone = tuple(range(len(rates)))
    if mode == "off" or len(rates) < 2:
        return Roles((), everyone)
    p = max(everyone, key=lambda i: (rates[i].prefill_tokens_per_s, -i))
    others = tuple(i for i in everyone if i != p)
    if mode == "auto":
        if not all(r.prefill_tokens_per_s > 0 for r in rates):
            return Roles((), everyone)
        if rates[p].prefill_tokens_per_s < PREFILL_GAIN * max(rates[i].prefill_tokens_per_s for i in others):
            return Roles((), everyone)
    return Roles((p,), others)


def first_token_s(prompt_tokens: int, prefill: PipelineRates, decode: PipelineRates) -> float:
    """Predicted seconds to the first token of a prompt prefilled on `prefill` and decoded on
    `decode` (the same pipeline: no transfer, its own prefill)."""
    if prefill is decode:
        return prompt_tokens / prefill.prefill_tokens_per_s
    step = 1 / decode.decode_tokens_per_s if decode.decode_tokens_per_s > 0 else 0.0
    n = prompt_tokens - 1
    return n / prefill.prefill_tokens_per_s + n * prefill.transfer_s_per_token + step


def hand_over(prompt_tokens: int, prefill: PipelineRates, decode: PipelineRates, mode: str = "auto") -> bool:
    """Whether a prompt of `prompt_tokens` routed to `decode` is prefilled on `prefill` (a pipeline
    of Roles.prefill): `on`, every prompt of MIN_PROMPT tokens or more; `auto`, those whose first
    token the measured rates say comes HANDOFF_GAIN times sooner."""
    if mode == "off" or prompt_tokens < MIN_PROMPT:
        return False
    if mode == "on":
        return True
    if prefill.prefill_tokens_per_s <= 0 or decode.prefill_tokens_per_s <= 0:
        return False
    return first_token_s(prompt_tokens, prefill, decode) * HANDOFF_GAIN < first_token_s(prompt_tokens, decode, decode)
