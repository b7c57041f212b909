"""What an operator asks of the mesh (lpctl drain / undrain / revoke, a node's Leave and Register,
a plan preview): each re-plans through the Replanner and answers once the outcome serves."""
from __future__ import annotations

import asyncio
import logging
from dataclasses import replace
from typing import TYPE_CHECKING

from logicpipe.controller.mesh import planning
from logicpipe.errors import FailedPrecondition, InvalidArgument, NotFound, Unavailable
from logicpipe.v1 import stage_pb2

if TYPE_CHECKING:
    from logicpipe.controller.app import ControllerApp

log = logging.getLogger(__name__)

PUSH_TIMEOUT_S = 5.0    # a node that does not take the revocation list this fast gets it with its next Assign


class OperatorCommands:
    """The operator's commands over the app's mesh."""

    def __init__(self, app: ControllerApp):
        self.app = app

    async def revoke(self, node_id: str) -> str:
        """Drop a revoked node at once: a new plan without it serves (or none, if none fits: its
        requests then wait), and it is never planned with again."""
        self.app.revocations.add(node_id)
        self.app.pipelines.revoked = list(self.app.revocations)
        told = await self._push_revoked()
        m = self.app.members.find(node_id)
        if m is None or not any(h.node_id == node_id for h in self.app.pipelines.nodes):
            return f"{node_id} revoked (it was not in the plan); {told}"
        m.drained = True
        await self.app.replanner.replan_now(f"node {node_id} revoked")
        return f"node {node_id} revoked; plan generation {self.app.pipelines.generation} serves without it; {told}"

    async def _push_revoked(self) -> str:
        """Tell every answering member the revocation list now (the plan's stages get it with each
        Assign too): a revoked controller or stage certificate is refused by the stages
        themselves, not only here. Returns what happened, in words."""
        members = [m for m in self.app.members.by_address.values() if not m.down and m.node_id not in self.app.revocations]
        request = stage_pb2.RevokedRequest(names=self.app.pipelines.revoked, controller_epoch=self.app.pipelines.epoch,
                                           controller_id=self.app.pipelines.owner)

        async def push(address: str):
            async with self.app.transport.channel(address, "stage") as ch:
                return await self.app.pipelines.stub(ch).Revoked(request, timeout=PUSH_TIMEOUT_S)

        results = await asyncio.gather(*(push(m.address) for m in members), return_exceptions=True)
        failed = [(m, r) for m, r in zip(members, results) if isinstance(r, BaseException)]
        for m, r in failed:
            log.warning("node %s (%s) did not take the revocation list now (it gets it with its next assignment): %s",
                        m.node_id or "?", m.address, getattr(r, "details", lambda: r)())
        return f"{len(members) - len(failed)} of {len(members)} nodes refuse it now"

    async def drain(self, node: str, undrain: bool = False) -> str:
        """Take a node out of planning (its requests move) or let it back in. Answers once the
        plan that follows serves."""
        m = self.app.members.find(node)
        if m is None:
            raise NotFound(f"no node {node!r} is known; see `lpctl status`")
        if m.drained == (not undrain):
            return f"node {m.node_id or m.address} is already {'drained' if m.drained else 'in planning'}"
        m.drained = not undrain
        why = f"node {m.node_id or m.address} {'undrained' if undrain else 'drained'}"
        unfit = "" if undrain else self._why_no_plan_without(m)
        if unfit:
            m.drained = False
            raise FailedPrecondition(f"no plan fits without node {m.node_id}: {unfit}")
        await self.app.replanner.replan_now(why)
        return why + f"; plan generation {self.app.pipelines.generation} serves"

    def _why_no_plan_without(self, m) -> str:
        """Why no plan fits the usable nodes (`m` already left out of them); "" when one does."""
        usable = [x for x in self.app.members.usable() if x.status is not None]
        if not usable:
            return "no other usable node"
        try:
            planning.mesh_for([planning.device_profile(x.status, self.app.replanner.links.get(x.node_id, {}), self.app.spec) for x in usable],
                              self.app.spec, self.app.replanner.workload, self.app.options)
        except (InvalidArgument, Unavailable) as exc:
            return str(exc)
        return ""

    async def leave(self, node_id: str, timeout: float) -> tuple[bool, str]:
        """A node stops: re-plan without it; answers once its requests have moved (or timeout)."""
        m = self.app.members.find(node_id)
        if m is None:
            return False, f"node {node_id} is not known here"
        m.leaving = True
        if not any(h.address == m.address for h in self.app.pipelines.nodes):
            return True, "it serves no stage of the plan in force"
        try:
            await asyncio.wait_for(self.app.replanner.replan_now(f"node {node_id} is stopping"), timeout)
        except asyncio.TimeoutError:
            return False, f"no new plan within {timeout:.0f} s"
        moved = not any(h.address == m.address for h in self.app.pipelines.nodes)
        return moved, ("its requests moved to plan generation %d" % self.app.pipelines.generation) if moved else \
            self.app.state.reason

    def name_taken(self, name: str) -> str:
        """Why a certificate name is in use in this mesh ("" when it is not): a join must not get it."""
        if self.app.transport.bundle is not None and name == self.app.transport.bundle.name:
            return "it is this controller's name"
        m = next((m for m in self.app.members.by_address.values() if m.node_id == name), None)
        if m is not None:
            return f"the node at {m.address} goes by it"
        if any(h.node_id == name for h in self.app.pipelines.nodes):
            return "a stage of the plan goes by it"
        return ""

    async def register(self, address: str, node_id: str) -> tuple[bool, str]:
        other = self.app.members.owner_of_id(node_id, besides=address)
        if other is not None:
            msg = (f"node id {node_id!r} is already taken by the node at {other.address}; "
                   "give each node a distinct --node-id (or its own --state-dir)")
            log.error("refusing the node at %s: %s", address, msg)
            return False, msg
        self.app.members.add(address, "registered")
        return True, ""

    async def plan_preview(self, strategy: str, objective: str, boundaries: list[int]) -> tuple[str, str]:
        """The plan in force (strategy "") or the plan another strategy/objective would make now."""
        if not strategy:
            if self.app.replanner.plan is None:
                raise Unavailable(f"no plan is in force yet ({self.app.state.reason})")
            return self.app.replanner.plan_json, planning.plan_table(self.app.replanner.plan, self.app.spec)
        if not self.app.replanner.profiles:
            raise Unavailable("the controller has not profiled any node yet")
        options = replace(self.app.options, strategy=strategy, objective=objective or self.app.options.objective)
        mesh = planning.mesh_for(self.app.replanner.profiles, self.app.spec, self.app.replanner.workload, options, boundaries=boundaries)
        return planning.to_json(mesh), planning.plan_table(mesh, self.app.spec)
