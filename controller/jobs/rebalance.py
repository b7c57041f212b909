"""Which running requests move onto a pipeline that just joined (issue 34). A join moved nothing
before: in a storm of faults every running request collected on the one replica that had not
failed yet, and the next fault there paused all of them. Now a pipeline that joins while others
serve takes its share of the running requests at once: the most loaded pipelines give it first the
requests still waiting for their replay after an earlier fault or move, the one that has waited
longest first, then their cheapest requests (the fewest tokens to replay), until it holds its even
share (the running requests over the pipelines serving, rounded up) or a move would only swap which
one is busier. A moved request replays its prompt and tokens there, exactly as after a fault (the
same tokens; a seeded sampled request the same draws).

Why the waiting ones first: stage 0 replays them one at a time, the longest wait first, so those of a
fault that moved them all onto one pipeline wait in one queue; a pipeline that joins then takes the
head of that queue and serves it in parallel. Before, it took the cheapest replays, often requests
that had their tokens and ran well: in a 1.5 s storm's one miss of 30 runs, six requests tied for
the longest wait stayed queued on the one replica, which was stopped 2.1 s later with the last of
them still without a token (docs/benchmarks.md, fifteenth sitting). A request decoding well moves
last: a move costs it a replay, which one that waits for its replay anyway does not pay again."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable


@dataclass(frozen=True)
class Movable:
    """A running request as the choice sees it."""

    key: Hashable       # the caller's handle for it (a session id)
    pipeline: Hashable  # the pipeline it runs on now
    replay_tokens: int  # tokens a replay recomputes (prompt + tokens so far)
    waiting_since: float | None = None  # still waiting for its replay's first token: when it last had one


def moves_onto(target: Hashable, running: list[Movable], pipelines: list[Hashable],
               movable: set[Hashable] | None = None) -> list[Hashable]:
    """Keys of the requests to move onto `target` (a pipeline that holds `running`'s requests of
    its own too, usually none): one at a time from the most loaded of `pipelines` (ties: the first
    listed) while it holds at least 2 more than `target` and `target` holds less than its even
    share (every running request over `pipelines`, rounded up): first those waiting for their
    replay (`waiting_since`), the longest wait first, then the cheapest replay first.
    `movable`: the keys that may move (None: all); the others still count as load."""
    load = {p: 0 for p in pipelines}
    load.setdefault(target, 0)
    for r in running:
        load[r.pipeline] = load.get(r.pipeline, 0) + 1
    candidates: dict[Hashable, list[Movable]] = {}
    order = sorted(running, key=lambda r: (0, r.waiting_since, 0) if r.waiting_since is not None
                   else (1, 0.0, r.replay_tokens))
    for r in order:
        if r.pipeline != target and (movable is None or r.key in movable):
            candidates.setdefault(r.pipeline, []).append(r)
    share = -(-len(running) // len(load))
    picked: list[Hashable] = []
    while load[target] < share:
        donors = [p for p in load if p != target and candidates.get(p)]
        if not donors:
            return picked
        donor = max(donors, key=lambda p: (load[p], -list(load).index(p)))
        if load[donor] - load[target] < 2:  # a move would only swap which one is busier
            return picked
        picked.append(candidates[donor].pop(0).key)
        load[donor] -= 1
        load[target] += 1
    return picked
