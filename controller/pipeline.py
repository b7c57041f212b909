"""The pipeline in force: the stage nodes, their layer ranges, and the controller's links to them.

The controller talks to every stage for assignment, sessions and events, and writes prompts to
stage 0. It never sits between two stages.
"""
from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import dataclass, field
from typing import Callable

import grpc

from logicpipe import grpc_options
from logicpipe.errors import MeshError, Unavailable, from_code
from logicpipe.v1 import stage_pb2, stage_pb2_grpc

log = logging.getLogger(__name__)

RPC_TIMEOUT_S = 10.0      # unary calls to a stage (not Assign)
ASSIGN_TIMEOUT_S = 600.0  # loading a shard can take minutes on a slow disk


@dataclass(frozen=True)
class StageAssignment:
    address: str
    start: int  # first layer, inclusive
    end: int    # exclusive


@dataclass
class StageHandle:
    address: str
    channel: grpc.aio.Channel
    stub: stage_pb2_grpc.StageNodeStub
    node_id: str = ""
    start: int = 0
    end: int = 0
    device: str = ""
    parameter_count: int = 0
    status: stage_pb2.StatusReply | None = None
    events_task: asyncio.Task | None = field(default=None, repr=False)


def _mesh_error(exc: grpc.aio.AioRpcError, address: str) -> MeshError:
    return from_code(exc.code(), f"stage {address}: {exc.details()}")


class Pipeline:
    """Stage handles in pipeline order, event fan-in, and the prompt stream to stage 0."""

    def __init__(self, on_event: Callable[[stage_pb2.Event], None], on_stage_lost: Callable[[str, str], None]):
        self._on_event = on_event
        self._on_stage_lost = on_stage_lost
        self.stages: list[StageHandle] = []
        self.plan_id = ""
        self.model_dir = ""
        self._prompt_call = None
        self._prompt_lock = asyncio.Lock()

    # ---- set-up ---------------------------------------------------------------------------
    @staticmethod
    async def probe(address: str) -> stage_pb2.StatusReply:
        """Status of a node, or Unavailable naming it."""
        async with grpc_options.insecure_channel(address) as ch:
            try:
                return await stage_pb2_grpc.StageNodeStub(ch).Status(stage_pb2.StatusRequest(), timeout=RPC_TIMEOUT_S)
            except grpc.aio.AioRpcError as exc:
                raise Unavailable(f"stage node {address} is unreachable: {exc.details()}") from exc

    async def install(self, model_dir: str, digest: str, num_layers: int, assignments: list[StageAssignment],
                      dtype: str = "float32") -> None:
        """Push the assignments (last stage first, so each stage's successor is ready) and
        subscribe to every stage's events."""
        await self.close()
        self.plan_id = uuid.uuid4().hex[:12]
        self.model_dir = model_dir
        handles = []
        for a in assignments:
            ch = grpc_options.insecure_channel(a.address)
            handles.append(StageHandle(a.address, ch, stage_pb2_grpc.StageNodeStub(ch), start=a.start, end=a.end))
        n = len(handles)
        try:
            for i in reversed(range(n)):
                h = handles[i]
                req = stage_pb2.AssignRequest(
                    model_dir=model_dir, model_digest=digest, start_layer=h.start, end_layer=h.end,
                    num_layers=num_layers, stage_index=i, num_stages=n,
                    next_address=handles[i + 1].address if i + 1 < n else "",
                    first_address=handles[0].address if i > 0 else "", dtype=dtype, plan_id=self.plan_id)
                try:
                    reply = await h.stub.Assign(req, timeout=ASSIGN_TIMEOUT_S)
                except grpc.aio.AioRpcError as exc:
                    raise _mesh_error(exc, h.address) from exc
                h.parameter_count = reply.parameter_count
                h.status = await h.stub.Status(stage_pb2.StatusRequest(), timeout=RPC_TIMEOUT_S)
                h.node_id, h.device = h.status.node_id, h.status.device
                log.info("stage %d: %s (%s) layers [%d, %d) loaded in %.1f s", i, h.node_id, h.address,
                         h.start, h.end, reply.load_seconds)
        except BaseException:
            for h in handles:
                await h.channel.close()
            raise
        self.stages = handles
        ready = []
        for h in handles:
            ready.append(asyncio.get_running_loop().create_future())
            h.events_task = asyncio.create_task(self._watch_events(h, ready[-1]))
        await asyncio.gather(*ready)

    async def _watch_events(self, h: StageHandle, ready: asyncio.Future) -> None:
        call = h.stub.Events(stage_pb2.EventsRequest())
        try:
            await call.initial_metadata()
            ready.set_result(None)
            async for batch in call:
                for ev in batch.events:
                    self._on_event(ev)
            reason = "its event stream ended"
        except asyncio.CancelledError:
            call.cancel()
            raise
        except grpc.aio.AioRpcError as exc:
            reason = f"{exc.code().name}: {exc.details()}"
        if not ready.done():
            ready.set_exception(Unavailable(f"stage {h.address} sends no events: {reason}"))
        if h in self.stages:
            log.warning("lost stage %s (%s): %s", h.node_id, h.address, reason)
            self._on_stage_lost(h.address, reason)

    async def close(self) -> None:
        stages, self.stages = self.stages, []
        await self._close_prompt_stream()
        for h in stages:
            if h.events_task:
                h.events_task.cancel()
            await h.channel.close()

    # ---- sessions -------------------------------------------------------------------------
    async def open_session(self, request: stage_pb2.OpenSessionRequest) -> None:
        """Open on every stage; on any failure close those opened and raise the first error."""
        results = await asyncio.gather(*(h.stub.OpenSession(request, timeout=RPC_TIMEOUT_S) for h in self.stages),
                                       return_exceptions=True)
        errors = [(h, r) for h, r in zip(self.stages, results) if isinstance(r, BaseException)]
        if errors:
            await self.close_session(request.session_id, only=[h for h, r in zip(self.stages, results)
                                                                if not isinstance(r, BaseException)])
            h, exc = errors[0]
            if isinstance(exc, grpc.aio.AioRpcError):
                raise _mesh_error(exc, h.address) from exc
            raise exc

    async def close_session(self, session_id: str, only: list[StageHandle] | None = None) -> None:
        req = stage_pb2.CloseSessionRequest(session_id=session_id)
        await asyncio.gather(*(h.stub.CloseSession(req, timeout=RPC_TIMEOUT_S) for h in (only or self.stages)),
                             return_exceptions=True)

    async def send_prompt(self, batch: stage_pb2.StepBatch) -> None:
        """Write a step to stage 0 on the controller's long-lived stream."""
        async with self._prompt_lock:
            if self._prompt_call is None:
                self._prompt_call = self.stages[0].stub.Stream()
                asyncio.create_task(self._read_prompt_replies(self._prompt_call))
            try:
                await self._prompt_call.write(batch)
            except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError) as exc:
                self._prompt_call = None
                raise Unavailable(f"stage 0 at {self.stages[0].address} does not take prompts: {exc}") from exc

    async def _read_prompt_replies(self, call) -> None:
        try:
            async for reply in call:
                log.warning("stage 0 rejected %s: %s", reply.session_id, reply.message)
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.CANCELLED:
                log.warning("prompt stream to stage 0 ended: %s", exc.details())
        finally:
            if self._prompt_call is call:
                self._prompt_call = None

    async def _close_prompt_stream(self) -> None:
        call, self._prompt_call = self._prompt_call, None
        if call is not None:
            call.cancel()
