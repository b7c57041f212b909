"""The controller's member registry without a network: ids learnt by probing, a taken id refused,
two missed probes before a node counts as down, a node that answers again re-admitted, a node
without a profile or one that is stopping left out; and the caller's host filled into an address."""
from __future__ import annotations

import asyncio

import pytest

from logicpipe.common.transport import caller_address
from logicpipe.controller.mesh.membership import Members
from logicpipe.errors import Unavailable
from logicpipe.v1 import stage_pb2


def status(node_id: str, profiled: bool = True, stopping: bool = False, uptime: float = 100.0) -> stage_pb2.StatusReply:
    profile = stage_pb2.DeviceProfile(flops=1e10, mem_bandwidth=1e10) if profiled else stage_pb2.DeviceProfile()
    return stage_pb2.StatusReply(node_id=node_id, profile=profile, stopping=stopping, uptime_s=uptime,
                                 compute_id="cpu@host")


class World(dict):
    """address -> StatusReply (or None: it does not answer); what Members' probes see."""

    async def probe(self, address, timeout=0):
        if self.get(address) is None:
            raise Unavailable(f"stage node {address} is unreachable")
        return self[address]


@pytest.fixture
def world():
    return World()


def test_members_learn_ids_refuse_a_taken_one_and_come_back(world):
    async def main():
        changes: list[str] = []
        m = Members(world.probe, changes.append)
        world.update({"a:1": status("a"), "b:1": status("a", uptime=30.0), "c:1": status("c", profiled=False)})
        for addr in world:
            m.add(addr, "static")
        await asyncio.sleep(0.05)  # the probes add() starts
        assert [x.node_id for x in m.usable()] == ["a"]
        assert "already taken" in m.by_address["b:1"].down and "--no-profile" in m.by_address["c:1"].down
        assert changes[0] == "node a joined"
        world["a:1"] = None  # silent: one missed probe is not death, two are
        await m.probe(m.by_address["a:1"])
        assert m.by_address["a:1"].usable
        await m.probe(m.by_address["a:1"])
        assert not m.by_address["a:1"].usable and changes[-1].startswith("node a down")
        await m.probe(m.by_address["b:1"])  # the id is free now: b takes it
        assert m.by_address["b:1"].usable and changes[-1] == "node a is back"
        world["a:1"] = status("a")
        await m.probe(m.by_address["a:1"])  # and a, back, is refused while b holds it
        assert "already taken" in m.by_address["a:1"].down
        world["b:1"] = status("a", stopping=True, uptime=30.0)
        await m.probe(m.by_address["b:1"])
        assert m.by_address["b:1"].leaving and not m.usable() and changes[-1] == "node a is stopping"
        world["b:1"] = status("a", uptime=31.0)  # it answers as usual again: back in
        await m.probe(m.by_address["b:1"])
        assert m.by_address["b:1"].usable and changes[-1] == "node a is back"
        # one process reached at a second address is an alias, not a duplicate
        world["d:1"] = status("a", uptime=31.0)
        m.add("d:1", "mdns")
        await asyncio.sleep(0.05)
        assert "another address of node a" in m.by_address["d:1"].down
    asyncio.run(main())


@pytest.mark.parametrize("address,peer,expect", [
    ("10.0.0.5:50061", "ipv4:10.0.0.9:4000", "10.0.0.5:50061"),
    ("0.0.0.0:50061", "ipv4:10.0.0.9:4000", "10.0.0.9:50061"),
    (":50061", "ipv6:[fe80::1]:4000", "[fe80::1]:50061"),
    ("", "ipv4:10.0.0.9:4000", ""),
    (":50061", "unix:/tmp/x", ""),
])
def test_caller_address_fills_in_a_wildcard_host(address, peer, expect):
    assert caller_address(address, peer) == expect


def test_a_stalled_node_is_waited_for_within_the_grace(world, monkeypatch):
    """A node that answers no probe in time (SIGSTOPped, its port still open) is not down while it
    has been silent less than STALL_GRACE_S, however many probes it missed; past that it is; a
    node that refuses connections is down after two misses as before."""
    import logicpipe.controller.mesh.membership as membership

    class Stalling(World):
        async def probe(self, address, timeout=0):
            if self.get(address) == "stalled":
                raise Unavailable(f"stage node {address} is unreachable: no answer in time")
            return await super().probe(address, timeout)

    async def main():
        w = Stalling(a=status("a"))
        changes: list[str] = []
        m = Members(w.probe, changes.append)
        m.add("a", "static")
        await asyncio.sleep(0.05)
        a = m.by_address["a"]
        assert a.usable
        w["a"] = "stalled"
        for _ in range(4):
            await m.probe(a)
        assert a.usable and a.misses == 4 and not any("down" in c for c in changes)
        w["a"] = status("a")  # answers again: nothing changed, nothing to re-plan
        await m.probe(a)
        assert a.usable and a.misses == 0 and changes == ["node a joined"]
        w["a"] = "stalled"
        monkeypatch.setattr(membership, "STALL_GRACE_S", 0.0)  # silent past the grace: down
        await m.probe(a)
        assert a.usable
        await m.probe(a)
        assert not a.usable and changes[-1].startswith("node a down")
    asyncio.run(main())


def test_a_down_node_is_probed_sooner_than_the_round(world, monkeypatch):
    """Every member is probed every PROBE_S; one that is down (a node restarting) every
    DOWN_PROBE_S too, so that it is back in the plan soon after it answers again."""
    import logicpipe.controller.mesh.membership as membership

    monkeypatch.setattr(membership, "PROBE_S", 60.0)
    monkeypatch.setattr(membership, "DOWN_PROBE_S", 0.02)
    asked: list[str] = []

    async def probe(address, timeout=0):
        asked.append(address)
        return await world.probe(address, timeout)

    async def main():
        changes: list[str] = []
        m = Members(probe, changes.append)
        world.update({"up:1": status("up"), "down:1": status("down")})
        m.add("up:1", "static")
        m.add("down:1", "static")
        await asyncio.sleep(0.05)
        m.mark_down("down:1", "killed")
        m.start()
        try:
            await asyncio.sleep(0.3)
        finally:
            await m.close()
        assert asked.count("up:1") == 1  # its first probe only: the round is 60 s
        assert m.by_address["down:1"].usable and changes[-1] == "node down is back"
    asyncio.run(main())
