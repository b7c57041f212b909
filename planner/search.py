"""Search helpers the planner's exact DP, heuristic and bounds share."""
from __future__ import annotations

import bisect
from typing import Callable, Sequence


def smallest_feasible(cands: Sequence[float], feasible: Callable[[float], bool], at_least: float = 0.0) -> float | None:
    """The smallest of the sorted candidates for which `feasible` holds (it must hold for every
    larger one too), found by bisection from the first candidate >= `at_least` (a known lower
    bound); None when even the largest fails."""
    if not cands or not feasible(cands[-1]):
        return None
    lo, hi = min(bisect.bisect_left(cands, at_least), len(cands) - 1), len(cands) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if feasible(cands[mid]):
            hi = mid
        else:
            lo = mid + 1
    return cands[lo]


def parent_path(parents: dict, state: tuple, step: Callable[[tuple], int] = lambda s: s[1]) -> list:
    """The path that led to `state` through the `parents` links (state -> previous state), first
    element first; each state contributes `step(state)` (by default its second field)."""
    path = [step(state)]
    while state in parents:
        state = parents[state]
        path.append(step(state))
    path.reverse()
    return path
