"""After a fault the broken pipeline is repaired, not planned afresh (issue 34): survivors keep
their ranges (their KV serves the replays), a lost range goes whole to an idle node (the lost node
itself first, when it is back) or else to a neighbour; None where nothing can be repaired."""
from __future__ import annotations

from types import SimpleNamespace

from logicpipe.controller.mesh.planning import repair
from logicpipe.planner import DeviceProfile, Link, ModelSpec, Workload, make_plan

GiB = 2**30
MODEL = ModelSpec.llama(name="small", hidden_size=512, intermediate_size=1408, num_heads=8, num_kv_heads=4,
                        vocab_size=8000, num_layers=30)
WORKLOAD = Workload(tokens_per_step=4, context_tokens=1024, batch=4)
OPTIONS = SimpleNamespace(objective="throughput")


def dev(node: str, memory_gib: float = 8.0) -> DeviceProfile:
    return DeviceProfile(node, "cpu", int(memory_gib * GiB), 1e11, 2e10, default_link=Link(1.25e8, 5e-4))


NODES = [dev("n0"), dev("n1"), dev("n2"), dev("n3")]
PLAN = make_plan(NODES[:3], MODEL, WORKLOAD, strategy="uniform")


def ranges(plan) -> list[tuple[str, int, int]]:
    return [(s.node_id, s.start, s.end) for s in plan.stages]


def fixed(lost, idle=(), nodes=NODES):
    return repair(PLAN, set(lost), [n for n in nodes if n.node_id not in lost or n.node_id in idle], MODEL,
                  WORKLOAD, OPTIONS, list(idle))


def test_a_neighbour_takes_the_lost_range():
    assert ranges(PLAN) == [("n0", 0, 10), ("n1", 10, 20), ("n2", 20, 30)]
    assert ranges(fixed({"n1"})) == [("n0", 0, 20), ("n2", 20, 30)]   # the stage before it
    assert ranges(fixed({"n2"})) == [("n0", 0, 10), ("n1", 10, 30)]
    assert ranges(fixed({"n0"})) == [("n1", 0, 20), ("n2", 20, 30)]   # a first stage's: the one after
    assert ranges(fixed({"n0", "n1"})) == [("n2", 0, 30)]


def test_an_idle_node_takes_the_lost_range_whole_the_lost_node_first():
    assert ranges(fixed({"n1"}, idle=["n3"])) == [("n0", 0, 10), ("n3", 10, 20), ("n2", 20, 30)]
    assert ranges(fixed({"n1"}, idle=["n3", "n1"])) == [("n0", 0, 10), ("n1", 10, 20), ("n2", 20, 30)]
    assert ranges(fixed({"n0", "n2"}, idle=["n3"])) == [("n3", 0, 10), ("n1", 10, 30)]


def test_nothing_to_repair_or_no_fit_is_none():
    assert fixed({"n0", "n1", "n2"}) is None
    assert fixed({"n0", "n1", "n2"}, idle=["n3"]) is None  # no survivor keeps layers: planned afresh
    assert fixed(set()) is None
    tiny = [dev("n0", 0.01), dev("n1"), dev("n2")]  # n0 cannot hold the lost range on top of its own
    assert repair(PLAN, {"n1"}, [tiny[0], tiny[2]], MODEL, WORKLOAD, OPTIONS) is None

