"""The nodes the controller knows of, however it learnt of them (`--nodes`, mDNS, a node's own
Register call), and which of them can take part in a plan now.

Every member is probed (StageNode.Status) every PROBE_S (one down or stopping every DOWN_PROBE_S): the probe learns its id and profile,
notices a node that stopped answering, and brings back one that answers again (a node restarted
after a crash, on the same address, is re-admitted without anyone doing anything). What changes
the set of usable nodes is reported through `on_change(why)`; the app re-plans on it.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Awaitable, Callable

from logicpipe.errors import MeshError
from logicpipe.v1 import stage_pb2

log = logging.getLogger(__name__)

PROBE_S = 2.0               # every member's Status is asked this often
DOWN_PROBE_S = 0.5          # ... and a member that is down or stopping this often (a restarted node is back sooner)
PROBE_TIMEOUT_S = 1.5
DOWN_AFTER_MISSES = 2       # unanswered probes in a row before a node counts as down; one that does not
STALL_GRACE_S = 5.0         # answer in time (stalled, its address still taking connections) only once it
                            # has also been silent this long: it keeps its sessions if it answers again
NOT_PROBED = "not probed yet"
FORGET_AFTER_S = 600.0      # a discovered (not --nodes) member down this long is forgotten


@dataclass
class Member:
    address: str
    source: str                  # "static" (--nodes) | "mdns" | "registered"
    node_id: str = ""
    status: stage_pb2.StatusReply | None = None
    down: str = NOT_PROBED  # why it cannot be planned on now ("" when it can)
    down_since: float = 0.0
    drained: bool = False         # lpctl drain: left out of planning until undrained
    misses: int = 0               # probes unanswered in a row
    answered: float = 0.0         # when it last answered a probe (monotonic)
    fell: float = 0.0             # when it last went down or said it stops (monotonic; 0: never)
    leaving: bool = False         # it told us it stops (Leave)
    refused_start: float | None = None  # its assignment failed for good: when that process started (monotonic)

    @property
    def usable(self) -> bool:
        return not (self.down or self.drained or self.leaving)

    def why_not(self) -> str:
        return self.down or ("drained" if self.drained else "leaving" if self.leaving else "")


def same_process(a: stage_pb2.StatusReply | None, b: stage_pb2.StatusReply) -> bool:
    """Two Status answers from one node process (reached at two addresses): same id and compute
    device, started at the same moment (uptime, give or take the probes' spacing)."""
    return (a is not None and a.node_id == b.node_id and a.compute_id == b.compute_id
            and abs((time.monotonic() - a.uptime_s) - (time.monotonic() - b.uptime_s)) < 2 * PROBE_S + 1)


class Members:
    def __init__(self, probe: Callable[..., Awaitable[stage_pb2.StatusReply]], on_change: Callable[[str], None]):
        self._status = probe        # (address, timeout=) -> the node's Status, or a MeshError
        self.on_change = on_change
        self.by_address: dict[str, Member] = {}
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._probe_loop(), name="members")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()

    # ---- lookups ------------------------------------------------------------------------------
    def usable(self) -> list[Member]:
        return [m for m in self.by_address.values() if m.usable]

    def find(self, node: str) -> Member | None:
        """The member with this node id or address."""
        return self.by_address.get(node) or next((m for m in self.by_address.values() if m.node_id == node), None)

    def owner_of_id(self, node_id: str, besides: str = "") -> Member | None:
        """An answering member other than at `besides` that calls itself `node_id`."""
        return next((m for m in self.by_address.values()
                     if m.node_id == node_id and m.address != besides and not m.down), None)

    def last_fault(self) -> float:
        """When a member last went down or said it stops (monotonic; 0: never)."""
        return max((m.fell for m in self.by_address.values()), default=0.0)

    # ---- changes ------------------------------------------------------------------------------
    def add(self, address: str, source: str) -> Member:
        """Know of a node at `address` (probed at once; usable once it answers)."""
        m = self.by_address.get(address)
        if m is None:
            m = self.by_address[address] = Member(address, source, down_since=time.monotonic())
            log.info("node at %s known (%s); probing it", address, source)
            asyncio.get_running_loop().create_task(self.probe(m))
        elif m.source != "static":
            m.source = source
        return m

    def mark_down(self, address: str, why: str) -> None:
        m = self.by_address.get(address)
        if m is not None and m.down in ("", NOT_PROBED):
            m.down, m.down_since = why, time.monotonic()
            m.fell = m.down_since
            log.warning("node %s (%s) is down: %s", m.node_id or "?", address, why)
            self.on_change(f"node {m.node_id or address} down: {why}")

    def refuse(self, address: str, why: str) -> None:
        """Its assignment failed for a reason that will not pass by itself (another model on its
        disk, a format it cannot run): left out, saying why, until that process is replaced (a
        restart: its operator fixed it), rather than planned on again every time it answers."""
        m = self.by_address.get(address)
        if m is None:
            return
        if m.status is not None:
            m.refused_start = time.monotonic() - m.status.uptime_s
        m.down = ""  # mark_down reports the change with the new reason
        self.mark_down(address, why)

    def gone(self, node_id: str, why: str) -> None:
        """A hint (its mDNS record was withdrawn): probe it now rather than at the next round."""
        m = self.find(node_id)
        if m is not None:
            asyncio.get_running_loop().create_task(self.probe(m, hint=why))

    async def probe(self, m: Member, hint: str = "") -> None:
        try:
            st = await self._status(m.address, timeout=PROBE_TIMEOUT_S)
        except MeshError as exc:
            m.misses += 1
            stalled = "no answer in time" in str(exc) and time.monotonic() - m.answered < STALL_GRACE_S
            if (m.misses >= DOWN_AFTER_MISSES and not stalled) or m.down == NOT_PROBED or hint:  # one slow answer is not death
                self.mark_down(m.address, hint or str(exc))
            return
        m.misses, m.answered = 0, time.monotonic()
        if st.stopping:
            if not m.leaving:
                m.leaving, m.fell = True, time.monotonic()
                self.on_change(f"node {st.node_id} is stopping")
            return
        other = self.owner_of_id(st.node_id, besides=m.address)
        if other is not None:
            if same_process(other.status, st):  # one node seen at two addresses (--nodes and mDNS, ...)
                why = f"another address of node {st.node_id} (planned at {other.address})"
                if m.down != why:
                    log.info("the node at %s is %s", m.address, why)
            else:
                why = (f"node id {st.node_id!r} is already taken by the node at {other.address}; give each a "
                       "distinct --node-id")
                if m.down != why:
                    log.error("refusing the node at %s: %s", m.address, why)
            if m.down != why:
                m.down, m.node_id = why, ""
                self.on_change(f"the node at {m.address}: {why}")
            return
        if not st.profile.flops or not st.profile.mem_bandwidth:
            why = f"node {st.node_id} reports no measured profile (started with --no-profile?)"
            if m.down != why:
                log.warning("cannot plan on the node at %s: %s", m.address, why)
                m.down, m.node_id, m.status = why, st.node_id, st
                self.on_change(why)
            return
        if m.refused_start is not None:
            if abs((time.monotonic() - st.uptime_s) - m.refused_start) < 2 * PROBE_S + 1:
                m.node_id, m.status = st.node_id, st
                return  # the process whose assignment failed: still left out (lpctl nodes says why)
            m.refused_start = None  # restarted: try it again
        was = m.down or ("leaving" if m.leaving else "")  # a node that said it stops, answering as usual: back
        m.node_id, m.status = st.node_id, st
        if was:
            m.down, m.leaving = "", False
            log.info("node %s at %s is usable (%s, %s)", st.node_id, m.address, st.device,
                     "back" if was != NOT_PROBED else "new")
            self.on_change(f"node {st.node_id} {'joined' if was == NOT_PROBED else 'is back'}")

    async def _probe_loop(self) -> None:
        last_round = time.monotonic()
        while True:
            await asyncio.sleep(DOWN_PROBE_S)
            now = time.monotonic()
            for m in list(self.by_address.values()):
                if m.source != "static" and m.down and now - m.down_since > FORGET_AFTER_S:
                    log.info("forgetting node %s (%s): down for %.0f s", m.node_id or "?", m.address, now - m.down_since)
                    del self.by_address[m.address]
            every = now - last_round >= PROBE_S
            if every:
                last_round = now
            due = [m for m in self.by_address.values()
                   if every or (m.down and m.down != NOT_PROBED and m.refused_start is None) or m.leaving]
            await asyncio.gather(*(self.probe(m) for m in due), return_exceptions=True)
