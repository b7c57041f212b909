"""A planning instance: the devices that can take part, with the cost model evaluated once into
small tables the searches index by device number (0..n-1).

A device plays one of four roles in a pipeline, which decide its extra memory and compute:
FIRST (embedding), MID, LAST (final norm + LM head, sends tokens back), SINGLE (all of it).
A chain is the searches' answer: ((device, layer count), ...) in pipeline order.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from logicpipe.planner.cost import (
    activation_transfer_s,
    compose_compute_s,
    embed_time_s,
    head_time_s,
    layer_time_s,
    max_layers,
    return_transfer_s,
)
from logicpipe.planner.model import ModelSpec, device_weight_format
from logicpipe.planner.types import DeviceProfile, Objective, Reserve, Workload

log = logging.getLogger(__name__)

FIRST, MID, LAST, SINGLE = 0, 1, 2, 3
ROLES = (FIRST, MID, LAST, SINGLE)
ROLE_FLAGS = ((True, False), (False, False), (False, True), (True, True))  # role -> (is_first, is_last)

Chain = tuple[tuple[int, int], ...]
"""((device index, layer count), ...) in pipeline order."""


def role_of(position: int, length: int) -> int:
    """The role of the stage at `position` in a pipeline of `length` stages."""
    if length == 1:
        return SINGLE
    if position == 0:
        return FIRST
    return LAST if position == length - 1 else MID


@dataclass(frozen=True)
class Instance:
    """Cost tables over the eligible devices. All times in s per step, sizes in layers."""

    profiles: tuple[DeviceProfile, ...]        # eligible devices; index = device number
    num_layers: int                            # layers to place
    layer_s: tuple[float, ...]                 # [d] s per layer
    embed_s: tuple[float, ...]                 # [d] s of the embedding lookup (first stage)
    head_s: tuple[float, ...]                  # [d] s of final norm + LM head (last stage)
    caps: tuple[tuple[int, ...], ...]          # [d][role] most layers memory allows
    hop_s: tuple[tuple[float, ...], ...]       # [i][j] activation transfer i -> j
    ret_s: tuple[tuple[float, ...], ...]       # [i][j] token return from last stage i to first stage j

    @property
    def n(self) -> int:
        """Number of eligible devices."""
        return len(self.profiles)

    def compute_s(self, d: int, role: int, k: int) -> float:
        """Compute time of `k` layers on device `d` in `role` (same expression as `build_stages`)."""
        is_first, is_last = ROLE_FLAGS[role]
        return compose_compute_s(k, self.layer_s[d], self.embed_s[d], self.head_s[d], is_first=is_first, is_last=is_last)

    def transfer_s(self, d: int, role: int, succ: int, first: int) -> float:
        """Outgoing transfer of device `d` in `role`: to `succ`, or back to `first` when last."""
        return self.ret_s[d][first] if role in (LAST, SINGLE) else self.hop_s[d][succ]

    def chain_times(self, chain: Chain) -> list[float]:
        """Per-stage compute + transfer of a chain, as `build_stages` would compute them."""
        first = chain[0][0]
        out = []
        for pos, (d, k) in enumerate(chain):
            role = role_of(pos, len(chain))
            succ = chain[pos + 1][0] if pos + 1 < len(chain) else first
            out.append(self.compute_s(d, role, k) + self.transfer_s(d, role, succ, first))
        return out

    def chain_cost(self, chain: Chain, objective: Objective) -> float:
        """The objective's value for a chain."""
        times = self.chain_times(chain)
        return max(times) if objective is Objective.THROUGHPUT else sum(times)

    def chain_fits(self, chain: Chain) -> bool:
        """Every stage within its memory cap, at least one layer each, all layers placed."""
        return (sum(k for _, k in chain) == self.num_layers
                and all(1 <= k <= self.caps[d][role_of(pos, len(chain))] for pos, (d, k) in enumerate(chain)))


def eligible_profiles(profiles: Sequence[DeviceProfile], model: ModelSpec, workload: Workload,
                      reserve: Reserve) -> tuple[DeviceProfile, ...]:
    """Devices that can run the weight format and hold at least one layer (in the middle)."""
    out = []
    for p in profiles:
        if device_weight_format(p, model) is None:
            log.debug("node %s left out: no weight format for %s", p.node_id, model.weight_format)
        elif max_layers(p, model, workload, reserve, is_first=False, is_last=False) < 1:
            log.debug("node %s left out: cannot hold one layer", p.node_id)
        else:
            out.append(p)
    return tuple(out)


def make_instance(profiles: Sequence[DeviceProfile], model: ModelSpec, workload: Workload,
                  reserve: Reserve) -> Instance:
    """Evaluate the cost model for `profiles` (all of them; filter with `eligible_profiles`)."""
    ps = tuple(profiles)
    return Instance(
        profiles=ps,
        num_layers=model.num_layers,
        layer_s=tuple(layer_time_s(p, model, workload) for p in ps),
        embed_s=tuple(embed_time_s(p, model, workload) for p in ps),
        head_s=tuple(head_time_s(p, model, workload) for p in ps),
        caps=tuple(tuple(max_layers(p, model, workload, reserve, is_first=f, is_last=l) for f, l in ROLE_FLAGS) for p in ps),
        hop_s=tuple(tuple(activation_transfer_s(a, b, model, workload) for b in ps) for a in ps),
        ret_s=tuple(tuple(return_transfer_s(a, b, workload) for b in ps) for a in ps),
    )


def fill_fastest(inst: Instance, devices: Sequence[int], caps: Sequence[int]) -> list[int] | None:
    """Layer counts for `devices` (caps[i] >= 1 each) minimizing sum(count * layer_s): one layer
    each, the rest to the fastest devices first up to their caps. None if they cannot hold all."""
    remaining = inst.num_layers - len(devices)
    if remaining < 0 or any(c < 1 for c in caps):
        return None
    counts = [1] * len(devices)
    for i in sorted(range(len(devices)), key=lambda i: (inst.layer_s[devices[i]], i)):
        take = min(caps[i] - 1, remaining)
        counts[i] += take
        remaining -= take
    return counts if remaining == 0 else None
