"""Disaggregated prefill, the controller's half: a request's prompt prefilled on one pipeline and
decoded on another (the stages' half: stage_node.engine.handoff).

The scheduler opens the request twice: on the decode pipeline D with `kv_import_length` L (all
of the input but its last token; no step yet), and on the prefill pipeline P with the first L
tokens, `prefill_only`. P's last stage reports "prefilled" once its KV holds them; then every
stage of P sends each stage of D the layers the two share (`transfers`: whatever the two splits,
layer range by layer range, stage to stage, all at once), and once every destination holds every
layer, P's sequence closes and D is fed the last input token: its first step samples the first
new token. Meanwhile P prefills the next prompt. The request is journaled as any other; a fault on
either side before D's first token puts it back in the queue, to be replayed without a handoff
(prefilled again where it lands): nothing is lost.

`HandoffPolicy` keeps each pipeline's measured prefill, decode and transfer rates and asks the
planner (planner.disagg) which pipelines prefill for the others and which prompts to hand over.
"""
from __future__ import annotations

import asyncio
import secrets
import weakref
from dataclasses import dataclass, field

import grpc

from logicpipe.controller.mesh.pipeline import Pipeline, StageHandle
from logicpipe.errors import from_code
from logicpipe.planner.disagg import PipelineRates, Roles, choose_roles, hand_over
from logicpipe.v1 import stage_pb2

PREFILLED = "prefilled"  # the finish reason of a prefill_only sequence whose KV is held (stage_node.engine.last_stage)
SEND_TIMEOUT_S = 600.0  # one source stage's SendKv (it answers once its destination took every chunk)
EWMA = 0.3              # weight of the newest measurement in a pipeline's rates
MIN_SAMPLES = 4         # prefill measurements of a pipeline before its rate counts


@dataclass(frozen=True)
class Transfer:
    """Layers [start, end) go from a stage of the prefill pipeline to one of the decode pipeline."""

    source: StageHandle
    target: StageHandle
    start: int
    end: int


def transfers(sources: list[StageHandle], targets: list[StageHandle]) -> list[Transfer]:
    """Every (source stage, target stage) pair whose layer ranges overlap, with the overlap."""
    return [Transfer(s, t, max(s.start, t.start), min(s.end, t.end))
            for s in sources for t in targets if max(s.start, t.start) < min(s.end, t.end)]


@dataclass
class Handoff:
    """A request whose prompt is prefilled on `prefill` for its sequence on the decode pipeline."""

    prefill: Pipeline
    session: str                 # its sequence on the prefill pipeline
    length: int                  # positions handed over: the input but its last token
    key: str = field(default_factory=lambda: secrets.token_hex(16))  # the decode sequence's kv_import_key
    computed: int = 0            # prompt tokens the prefill pipeline computed (the rest its prefix cache held)
    opened: float = 0.0          # monotonic: opened on both pipelines
    prefilled: float = 0.0       # ... the prefill pipeline's KV held the prompt
    transferred: float = 0.0     # ... every decode stage held it
    first_step: float = 0.0      # ... the decode pipeline's first token came
    bytes: int = 0               # KV bytes moved
    task: asyncio.Task | None = None


async def move_kv(h: Handoff, decode: Pipeline, decode_session: str) -> int:
    """Every stage of the prefill pipeline sends its share of the KV to the decode pipeline's
    stages (all pairs at once). Returns the bytes moved; raises a MeshError on any failure."""
    pairs = transfers(h.prefill.stages, decode.stages)
    if not pairs or {layer for p in pairs for layer in range(p.start, p.end)} != set(
            range(min(t.start for t in decode.stages), max(t.end for t in decode.stages))):
        raise from_code(grpc.StatusCode.FAILED_PRECONDITION, "the two pipelines do not hold the same layers")

    async def send(p: Transfer) -> int:
        req = stage_pb2.SendKvRequest(
            session_id=h.session, length=h.length, start_layer=p.start, end_layer=p.end,
            target_address=p.target.address, target_session_id=decode_session, import_key=h.key,
            controller_epoch=h.prefill.epoch, controller_id=h.prefill.owner)
        try:
            reply = await p.source.stub.SendKv(req, timeout=SEND_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            raise from_code(exc.code(), f"stage {p.source.address} -> {p.target.address}: {exc.details()}") from exc
        return reply.bytes

    return sum(await asyncio.gather(*(send(p) for p in pairs)))


@dataclass
class Measured:
    """A pipeline's rates, measured (EWMA) from the requests it served."""

    prefill_tokens_per_s: float = 0.0
    decode_tokens_per_s: float = 0.0
    transfer_s_per_token: float = 0.0
    prefills: int = 0  # prefill measurements so far

    def rates(self) -> PipelineRates:
        prefill = self.prefill_tokens_per_s if self.prefills >= MIN_SAMPLES else 0.0
        return PipelineRates(prefill, self.decode_tokens_per_s, self.transfer_s_per_token)


def _ewma(old: float, new: float) -> float:
    return new if old <= 0 else (1 - EWMA) * old + EWMA * new


class HandoffPolicy:
    """The controller's --disaggregate mode over the pipelines' measured rates."""

    def __init__(self, mode: str = "auto"):
        self.mode = mode
        self._measured: weakref.WeakKeyDictionary[Pipeline, Measured] = weakref.WeakKeyDictionary()
        self.handoffs = 0          # requests handed over, since start
        self.fallbacks = 0         # ... that fell back to a replay (a fault before their first token)

    def measured(self, p: Pipeline) -> Measured:
        """`p`'s rates (forgotten with it)."""
        return self._measured.setdefault(p, Measured())

    # ---- measurements ---------------------------------------------------------------------------
    def observe_prefill(self, p: Pipeline, tokens: int, seconds: float) -> None:
        if tokens >= 16 and seconds > 0:  # (a few tokens measure the step's overhead, not the rate)
            m = self.measured(p)
            m.prefill_tokens_per_s = _ewma(m.prefill_tokens_per_s, tokens / seconds)
            m.prefills += 1

    def observe_decode(self, p: Pipeline, tokens: int, seconds: float) -> None:
        if tokens >= 2 and seconds > 0:
            m = self.measured(p)
            m.decode_tokens_per_s = _ewma(m.decode_tokens_per_s, tokens / seconds)

    def observe_transfer(self, p: Pipeline, tokens: int, seconds: float) -> None:
        if tokens >= 1 and seconds > 0:
            m = self.measured(p)
            m.transfer_s_per_token = _ewma(m.transfer_s_per_token, seconds / tokens)

    # ---- decisions ------------------------------------------------------------------------------
    def roles(self, pipelines: list[Pipeline]) -> Roles:
        return choose_roles([self.measured(p).rates() for p in pipelines], self.mode)

    def prefill_only(self, pipelines: list[Pipeline]) -> frozenset[int]:
        """ids of the pipelines that prefill for the others (the router sends them no request)."""
        return frozenset(id(pipelines[i]) for i in self.roles(pipelines).prefill)

    def prefill_for(self, prompt_tokens: int, decode: Pipeline, pipelines: list[Pipeline]) -> Pipeline | None:
        """The pipeline to prefill a prompt routed to `decode` on (None: `decode` prefills it)."""
        roles = self.roles(pipelines)
        for i in roles.prefill:
            p = pipelines[i]
            if p is not decode and hand_over(prompt_tokens, self.measured(p).rates(), self.measured(decode).rates(),
                                             self.mode):
                return p
        return None
