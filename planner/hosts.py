"""A tensor-parallel stage over several nodes (issue 36): nodes that the operator groups (the controller's
`--tp-group A,B`) planned as one stage whose rank 0 is the first node.

A group is one profile (`group_profile`): the first node's id, links and kind, `devices` the member count,
`members` their ids by rank. Each member holds 1/n of every layer, so the stage has n times the slowest
member's memory, FLOP/s and bandwidths (a step waits for its slowest rank). Its two all-reduces a layer are
a ring over the worst measured link between any two members (`Link`: latency, bandwidth): a ring's
all-reduce of B bytes over n ranks sends 2(n-1)/n B through each link in 2(n-1) steps, so its latency is
2(n-1) link latencies and its bandwidth the link's times n / (2(n-1)) (what `cost.allreduce_time_s`
charges twice a layer).

`auto_groups` proposes groups by itself (the controller's `--tp-hosts auto`): pairs of one-device nodes of
one kind on different hosts, joined greedily, the pair that shortens the one-stream step most first (the
latency plan's cost: a token's trip through the stages), while it shortens it by more than AUTO_GAIN. Pairs
only: a group of four is not proposed.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Mapping, Sequence

from logicpipe.planner.api import make_plan
from logicpipe.planner.model import ModelSpec
from logicpipe.planner.types import DeviceProfile, InfeasibleError, Objective, Workload

FLAG = "--tp-group"
AUTO_GAIN = 0.10
"""`auto_groups` joins a pair only where the one-stream step gets shorter by more than this share."""
AUTO_MAX_NODES = 12
"""`auto_groups` considers at most this many nodes (each round plans every pair of them once)."""


def parse_groups(text: str) -> tuple[tuple[str, ...], ...]:
    """`--tp-group A,B[;C,D]` -> (("A", "B"), ("C", "D")); ValueError naming the flag for a group of fewer
    than two nodes, an empty id, or a node named twice (in one group or two)."""
    groups, seen = [], set()
    for part in (p.strip() for p in text.split(";")):
        if not part:
            continue
        ids = tuple(n.strip() for n in part.split(","))
        if any(not n for n in ids):
            raise ValueError(f"{FLAG} {text!r}: an empty node id in {part!r} (give NODE,NODE[;NODE,NODE])")
        if len(ids) < 2:
            raise ValueError(f"{FLAG} {text!r}: group {part!r} has one node; a group spans two or more")
        for n in ids:
            if n in seen:
                raise ValueError(f"{FLAG} {text!r}: node {n} is in two groups (or twice in one); a node "
                                 "belongs to one stage")
            seen.add(n)
        groups.append(ids)
    return tuple(groups)


def group_profile(members: Sequence[DeviceProfile], model: ModelSpec) -> DeviceProfile:
    """The members (rank order, each one device: not --tp / --tp-max) as one stage's profile (module
    docstring); ValueError naming the flag where they cannot be one (a member of several devices, other
    device kinds, a width that does not divide the model)."""
    ids = [p.node_id for p in members]
    n = len(members)
    where = f"{FLAG} {','.join(ids)}"
    for p in members:
        if p.devices > 1 or p.max_devices > 1 or p.members:
            raise ValueError(f"{where}: node {p.node_id} spans several devices itself (--tp/--tp-max); a group "
                             "joins nodes of one device each")
    kinds = {p.device_kind for p in members}
    if len(kinds) > 1:
        raise ValueError(f"{where}: the nodes compute on different kinds of device ({', '.join(sorted(kinds))})")
    if n not in model.tp_widths(n):
        sizes = ", ".join(map(str, model.tp_sizes)) or "none: its attention does not split"
        raise ValueError(f"{where}: {n} nodes do not divide model {model.name} (heads, KV heads, MLP or experts, "
                         f"vocabulary: {sizes})")
    worst = max((a.link_to(b.node_id) for a in members for b in members if a is not b),
                key=lambda link: (link.latency, 1 / link.bandwidth))
    lead = members[0]

    def least(name: str) -> float:
        return min(getattr(p, name) for p in members) * n

    wb = least("weight_bandwidth") if all(p.weight_bandwidth for p in members) else 0.0
    formats = tuple(f for f in lead.weight_formats if all(f in p.weight_formats for p in members)) or lead.weight_formats
    return dataclasses.replace(
        lead, devices=n, members=tuple(ids), memory_bytes=min(p.memory_bytes for p in members) * n,
        flops=least("flops"), mem_bandwidth=least("mem_bandwidth"), weight_bandwidth=wb, weight_formats=formats,
        allreduce_latency_s=2 * (n - 1) * worst.latency, allreduce_bandwidth=worst.bandwidth * n / (2 * (n - 1)),
        full_sliding_kv=True)  # (a stage of several ranks keeps every position of its sliding-window layers)


def apply_groups(profiles: Sequence[DeviceProfile], groups: Sequence[Sequence[str]], model: ModelSpec,
                 known: set[str] | None = None) -> tuple[list[DeviceProfile], list[str]]:
    """(the profiles with each group whose members are all among them joined into one, in its first
    node's place; a note for each group that could not form). A group naming a node that is neither in
    `profiles` nor `known` (nodes seen down) is a ValueError naming the flag; one with a member down plans
    the others one by one, noted."""
    by_id = {p.node_id: p for p in profiles}
    seen = set(by_id) | (known or set())
    notes, joined, taken = [], {}, set()
    for g in groups:
        unknown = [n for n in g if n not in seen]
        if unknown:
            raise ValueError(f"{FLAG} {','.join(g)}: no stage node {', '.join(unknown)} in the mesh (nodes: "
                             f"{', '.join(sorted(seen)) or 'none'})")
        missing = [n for n in g if n not in by_id]
        if missing:
            notes.append(f"{FLAG} {','.join(g)}: {', '.join(missing)} not usable now; its other nodes are planned "
                         "one by one")
            continue
        joined[g[0]] = group_profile([by_id[n] for n in g], model)
        taken.update(g[1:])
    return [joined.get(p.node_id, p) for p in profiles if p.node_id not in taken], notes


def one_stream_step_s(profiles: Sequence[DeviceProfile], model: ModelSpec, context_tokens: int) -> float:
    """Seconds a token of one stream takes through the best latency plan over `profiles` (inf: none fits)."""
    try:
        return make_plan(profiles, model, Workload(context_tokens=context_tokens), Objective.LATENCY).cost_s
    except InfeasibleError:
        return math.inf


def auto_groups(profiles: Sequence[DeviceProfile], model: ModelSpec, context_tokens: int,
                hosts: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    """Pairs of `profiles` (one device each, one kind, `hosts[node]` different; a node whose host is not
    known is never paired) that, joined (`group_profile`), shorten the one-stream step by more than
    AUTO_GAIN each, the best pair first (module docstring); () where none does or the model does not split
    in two."""
    if 2 not in model.tp_widths(2):
        return ()
    current = list(profiles)
    free = [p.node_id for p in profiles if p.devices == 1 and p.max_devices <= 1 and not p.members
            and hosts.get(p.node_id)][:AUTO_MAX_NODES]
    step = one_stream_step_s(current, model, context_tokens)
    groups: list[tuple[str, str]] = []
    while True:
        by_id = {p.node_id: p for p in current}
        best = None
        for a, b in itertools.combinations(free, 2):
            if hosts[a] == hosts[b] or by_id[a].device_kind != by_id[b].device_kind:
                continue
            trial, _ = apply_groups(current, [(a, b)], model)
            t = one_stream_step_s(trial, model, context_tokens)
            if t < step * (1 - AUTO_GAIN) and (best is None or t < best[0]):
                best = (t, (a, b), trial)
        if best is None:
            return tuple(groups)
        step, pair, current = best
        groups.append(pair)
        free = [n for n in free if n not in pair]
