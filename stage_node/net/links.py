"""A long-lived outgoing activation stream to one peer stage (StageNode.Stream).

`send` only queues: a sender task writes the messages in order, so the step loop never waits on
the network. The stream opens lazily on the first message and re-opens after a failure, so a
restarted peer is picked up without re-assigning. A message that cannot be written is reported
through `on_down(session ids, reason)`; a rejection the peer sends back (a session it does not
hold, a stale generation) goes to `on_rejected(session id, code, message)`: the peer cannot tell
the owner of a session it does not know, this side can. Messages are built by the wire adapter (stage_node.wire).
"""
from __future__ import annotations

import asyncio
import logging
from typing import Callable

import grpc

from logicpipe.common.transport import Transport
from logicpipe.stage_node.net import wire
from logicpipe.stage_node.engine.sequence import SeqWork
from logicpipe.tensor_codec import RawTensor
from logicpipe.v1 import stage_pb2, stage_pb2_grpc

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 5.0  # a peer not reachable within this is reported down
RETRY_AFTER_S = 1.0      # after a failure, sends fail at once for this long instead of waiting again


class LinkDown(Exception):
    """The peer cannot be written to; the message names it and says why."""


class PeerLink:
    def __init__(self, address: str, transport: Transport, on_down: Callable[[list[str], str], None], *,
                 name: str = "peer", metadata: tuple[tuple[str, str], ...] = (),
                 on_rejected: Callable[[str, int, str], None] = lambda sid, code, message: None):
        self.address = address
        self.transport = transport
        self.name = name
        self.metadata = metadata  # sent with the Stream call (the plan's stream key)
        self._on_down = on_down
        self._on_rejected = on_rejected
        self._channel: grpc.aio.Channel | None = None
        self._call = None
        self._reader: asyncio.Task | None = None
        self._queue: asyncio.Queue[stage_pb2.StepBatch] = asyncio.Queue()
        self._sender = asyncio.create_task(self._send_loop(), name=f"link-{name}")
        self._down_until = 0.0
        self._down_reason = ""

    def send(self, works: list[SeqWork], generation: int, hidden: RawTensor | None = None) -> None:
        """Queue a step (with its hidden states) or a feed (without) for the peer, in order."""
        self._queue.put_nowait(wire.step_batch(works, generation, hidden))

    async def _send_loop(self) -> None:
        while True:
            batch = await self._queue.get()
            try:
                await self._write(batch)
            except LinkDown as exc:
                log.warning("%s", exc)
                self._on_down([s.session_id for s in batch.seqs], str(exc))

    async def _open(self):
        if self._channel is None:
            self._channel = self.transport.channel(self.address, "stage")
        try:
            await asyncio.wait_for(self._channel.channel_ready(), CONNECT_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise LinkDown(f"{self.name} at {self.address} is unreachable (no connection in {CONNECT_TIMEOUT_S:.0f} s)") from None
        call = stage_pb2_grpc.StageNodeStub(self._channel).Stream(metadata=self.metadata)
        self._reader = asyncio.create_task(self._read_replies(call))
        return call

    async def _read_replies(self, call) -> None:
        try:
            while True:
                reply = await call.read()
                if reply is grpc.aio.EOF:
                    break
                log.debug("%s rejected session %s: %s", self.name, reply.session_id, reply.message)
                self._on_rejected(reply.session_id, reply.code, reply.message)
        except asyncio.CancelledError:
            raise
        except grpc.aio.AioRpcError as exc:
            log.warning("%s stream to %s ended: %s %s", self.name, self.address, exc.code().name, exc.details())
        finally:
            if self._call is call:
                self._call = None

    async def _write(self, batch: stage_pb2.StepBatch) -> None:
        loop = asyncio.get_running_loop()
        if self._call is None:
            if loop.time() < self._down_until:
                raise LinkDown(self._down_reason)
            try:
                self._call = await self._open()
            except LinkDown as exc:
                self._down_until, self._down_reason = loop.time() + RETRY_AFTER_S, str(exc)
                raise
        try:
            await self._call.write(batch)
        except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError) as exc:
            self._call = None
            detail = exc.details() if isinstance(exc, grpc.aio.AioRpcError) else str(exc) or type(exc).__name__
            raise LinkDown(f"{self.name} at {self.address} failed: {detail}") from exc

    async def close(self) -> None:
        self._sender.cancel()
        call, self._call = self._call, None
        if call is not None:
            try:
                await call.done_writing()
            except Exception:  # noqa: BLE001 — the peer may already be gone
                pass
        if self._reader is not None:
            self._reader.cancel()
        if self._channel is not None:
            await self._channel.close()
            self._channel = None
