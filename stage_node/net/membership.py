"""How a stage node makes itself known and says goodbye: an mDNS record (found by any
controller browsing the LAN), registration with a named controller (`--controller`, for
networks without multicast; repeated so a restarted controller re-adopts the node), and, on
SIGTERM, a Leave call so the controller moves the node's sequences to a plan without it before
the node exits."""
from __future__ import annotations

import asyncio
import logging

import grpc

from logicpipe.common.discovery import Advertiser
from logicpipe.common.transport import Transport
from logicpipe.stage_node.net.mirror import FLUSH_S
from logicpipe.v1 import controller_pb2, controller_pb2_grpc

log = logging.getLogger(__name__)

REGISTER_INTERVAL_S = 5.0   # a registered node registers again this often (idempotent)
REGISTER_TIMEOUT_S = 3.0
LEAVE_TIMEOUT_S = 20.0      # a stopping node waits this long for its sequences to move


class StageMembership:
    def __init__(self, runtime, address: str, transport: Transport, *, controller: str | None, mdns: bool,
                 mdns_interface: str | None, profile_digest: str, mesh: str = "default"):
        self.runtime = runtime
        self.transport = transport
        self.address = address            # host:port we serve on (a wildcard host: the controller fills it)
        self.controller = controller      # --controller HOST:PORT
        self.mdns = mdns
        self.mdns_interface = mdns_interface
        self.mesh = mesh
        self.profile_digest = profile_digest
        self._advertiser = None
        self._register_task: asyncio.Task | None = None
        self._registered = asyncio.Event()

    async def start(self) -> str:
        """Advertise and register; returns a status line for systemd once the node is known (or
        its first registration attempt is over: a controller that is down must not hold the start)."""
        said = []
        if self.mdns:
            port = int(self.address.rpartition(":")[2])
            host = self.address.rpartition(":")[0]
            self._advertiser = Advertiser(self.runtime.node_id, port, profile_digest=self.profile_digest,
                                          interface=self.mdns_interface, host=host, mesh=self.mesh)
            await self._advertiser.start()  # raises DuplicateNode: refuse to run under a taken id
            said.append(f"advertised by mDNS{' on ' + self.mdns_interface if self.mdns_interface else ''}")
        if self.controller:
            self._register_task = asyncio.create_task(self._register_loop(), name="register")
            try:
                await asyncio.wait_for(self._registered.wait(), REGISTER_TIMEOUT_S + 1)
                said.append(f"registered with {self.controller}")
            except asyncio.TimeoutError:
                said.append(f"registering with {self.controller} (no answer yet)")
        return f"node {self.runtime.node_id}: " + (", ".join(said) or "waiting to be assigned (--nodes)")

    async def _register_loop(self) -> None:
        warned = False
        async with self.transport.channel(self.controller, "controller") as ch:
            stub = controller_pb2_grpc.ControllerStub(ch)
            while True:
                try:
                    reply = await stub.Register(controller_pb2.RegisterRequest(
                        address=self.address, node_id=self.runtime.node_id), timeout=REGISTER_TIMEOUT_S)
                    if not reply.admitted:
                        log.error("controller %s refused this node: %s", self.controller, reply.message)
                    elif not self._registered.is_set() or warned:
                        log.info("registered with controller %s", self.controller)
                    warned = False
                    self._registered.set()
                except grpc.aio.AioRpcError as exc:
                    if not warned:
                        log.warning("cannot register with controller %s: %s; retrying every %.0f s",
                                    self.controller, exc.details() or exc.code().name, REGISTER_INTERVAL_S)
                        warned = True
                await asyncio.sleep(REGISTER_INTERVAL_S)

    async def leave(self) -> None:
        """SIGTERM: withdraw the mDNS record, then ask the controller to move our sequences away
        (it answers once they run elsewhere, or at once if we serve no plan). First the KV mirrors get
        what they lack (net.mirror), for FLUSH_S at most: the sequences replay there from those copies.
        The node's disk stores its last blocks (read back if it serves again) meanwhile and while the
        sequences move, for FLUSH_S at most: their replays wait for nothing but the mirrors (in a 1.5 s
        storm the disk's 1 s was a second more of every moved request's pause)."""
        disk = asyncio.ensure_future(self._flush_disk())
        try:
            await self._flush_mirrors()
            await self._leave()
        finally:
            await disk

    async def _leave(self) -> None:
        self.runtime.stopping = True
        if self._register_task is not None:
            self._register_task.cancel()
        if self._advertiser is not None:
            await self._advertiser.close()
            self._advertiser = None
        eng = self.runtime.engine
        target = self.controller or (eng.assignment.controller_address if eng is not None else "")
        if not target:
            return
        async with self.transport.channel(target, "controller") as ch:
            try:
                reply = await controller_pb2_grpc.ControllerStub(ch).Leave(
                    controller_pb2.LeaveRequest(node_id=self.runtime.node_id, timeout_s=LEAVE_TIMEOUT_S),
                    timeout=LEAVE_TIMEOUT_S + 2)
                log.info("left the mesh: %s", reply.message or ("sequences moved" if reply.moved else "not moved"))
            except grpc.aio.AioRpcError as exc:
                log.warning("controller %s did not take our leave: %s", target, exc.details() or exc.code().name)

    async def _flush_mirrors(self) -> None:
        try:  # (its own deadline bounds its calls; a wait for the step lock is not: a storm saw 3.6 s before that)
            await asyncio.wait_for(self.runtime.mirror.flush(FLUSH_S), FLUSH_S + 0.25)
        except asyncio.TimeoutError:
            log.info("the KV mirrors did not get all they lack within %.1f s of the stop: leaving without it", FLUSH_S)
        except Exception:  # noqa: BLE001 — a mirror not flushed only costs the replays their speed
            log.exception("could not send the KV mirrors what they lack before leaving")

    async def _flush_disk(self) -> None:
        """The node's own disk gets the blocks of the last round (net.kv_disk), read back when it restarts."""
        try:
            await asyncio.wait_for(self.runtime.kv_disk.round(), FLUSH_S)
        except asyncio.TimeoutError:
            log.info("the last KV blocks were not all on disk within %.1f s of the stop: leaving without them",
                     FLUSH_S)
        except Exception:  # noqa: BLE001 — the same: only the replays' speed
            log.exception("could not write the last KV blocks to disk before leaving")

    async def close(self) -> None:
        if self._register_task is not None:
            self._register_task.cancel()
        if self._advertiser is not None:
            await self._advertiser.close()
            self._advertiser = None
