"""The pieces of the >8-device heuristic, each checked against brute force on small instances."""
from __future__ import annotations

import itertools
import math
import random

from logicpipe.planner import DeviceProfile, Link, ModelSpec, Objective, Reserve, Workload
from logicpipe.planner.bounds import lower_bound_s
from logicpipe.planner.dp import min_bottleneck_exact
from logicpipe.planner.heuristic import (
    insertion_order,
    memory_chain,
    restrict,
    ring_min_bottleneck,
    ring_min_latency,
    ring_orders,
    shortlists,
)
from logicpipe.planner.instance import Instance, eligible_profiles, make_instance, role_of

REL = 1e-9


def random_instance(rng: random.Random, n: int, L: int) -> Instance:
    model = ModelSpec(name="r", num_layers=L, layer_weight_bytes=100, layer_flops_per_token=rng.uniform(1e3, 1e5),
                      attention_flops_per_context_token=1.0, kv_bytes_per_token_per_layer=1,
                      activation_bytes_per_token=rng.choice([10, 100, 1000]), embedding_bytes=rng.choice([0, 150]),
                      lm_head_bytes=rng.choice([150, 300]), lm_head_flops_per_token=rng.uniform(0, 1e5))
    workload = Workload(context_tokens=4)
    ids = [f"n{i}" for i in range(n)]
    whole = 104 * L + 450
    profiles = [DeviceProfile(node, "cpu", int(whole * rng.uniform(0.15, 0.7)), rng.uniform(1e6, 1e8),
                              rng.uniform(1e5, 1e7),
                              links={o: Link(rng.choice([1e3, 1e4, 1e5, 1e6]), rng.uniform(0, 1e-2)) for o in ids if o != node})
                for node in ids]
    reserve = Reserve(0.0, 0)
    return make_instance(eligible_profiles(profiles, model, workload, reserve), model, workload, reserve)


def ordered_brute_force(inst: Instance, order: list[int], objective: Objective) -> float | None:
    """Best cost over subsequences of `order` that start with order[0], all splits."""
    L, best = inst.num_layers, None
    for r in range(1, min(len(order), L) + 1):
        for rest in itertools.combinations(order[1:], r - 1):
            devices = [order[0], *rest]
            for cuts in itertools.combinations(range(1, L), r - 1):
                bounds = (0, *cuts, L)
                chain = tuple((d, bounds[i + 1] - bounds[i]) for i, d in enumerate(devices))
                if inst.chain_fits(chain):
                    cost = inst.chain_cost(chain, objective)
                    best = cost if best is None or cost < best else best
    return best


def _instances(count: int, seed: int):
    rng = random.Random(seed)
    produced = 0
    while produced < count:
        n, L = rng.randint(2, 6), rng.randint(2, 7)
        inst = random_instance(rng, n, L)
        if inst.n >= 2:
            produced += 1
            yield rng, inst


def test_ring_min_latency_is_exact_for_its_order():
    for rng, inst in _instances(80, seed=3):
        order = list(range(inst.n))
        rng.shuffle(order)
        want = ordered_brute_force(inst, order, Objective.LATENCY)
        got = ring_min_latency(inst, order)
        assert (want is None) == (got is None)
        if got is not None:
            assert inst.chain_fits(got) and got[0][0] == order[0]
            positions = [order.index(d) for d, _ in got]
            assert positions == sorted(positions)          # a subsequence of the order
            assert math.isclose(inst.chain_cost(got, Objective.LATENCY), want, rel_tol=REL)


def test_ring_min_bottleneck_fits_and_is_never_better_than_exact():
    equal = total = 0
    for rng, inst in _instances(80, seed=5):
        exact = min_bottleneck_exact(inst)
        ring = ring_min_bottleneck(inst, ring_orders(inst), lower_bound_s(inst, Objective.THROUGHPUT))
        assert (exact is None) == (ring is None)
        if exact is None:
            continue
        assert inst.chain_fits(ring)
        e, r = inst.chain_cost(exact, Objective.THROUGHPUT), inst.chain_cost(ring, Objective.THROUGHPUT)
        assert r >= e * (1 - REL)
        equal += math.isclose(r, e, rel_tol=REL)
        total += 1
    assert equal >= 0.6 * total


def test_memory_chain_fits_whenever_anything_fits():
    for rng, inst in _instances(80, seed=9):
        chain = memory_chain(inst)
        assert (chain is None) == (min_bottleneck_exact(inst) is None)
        if chain is not None:
            assert inst.chain_fits(chain)
            assert all(inst.caps[d][role_of(i, len(chain))] >= k for i, (d, k) in enumerate(chain))


def test_orders_shortlists_and_restrict():
    rng = random.Random(1)
    inst = random_instance(rng, 12, 20)
    for order in ring_orders(inst):
        assert sorted(order) == list(range(inst.n))
    lists = shortlists(inst, size=8)
    assert all(len(s) == min(8, inst.n) for s in lists)
    sub = restrict(inst, [3, 1])
    assert sub.layer_s == (inst.layer_s[3], inst.layer_s[1]) and sub.hop_s[0][1] == inst.hop_s[3][1]
    full = insertion_order(inst, [2, 0])
    assert sorted(full) == list(range(inst.n)) and full.index(2) < full.index(0)
