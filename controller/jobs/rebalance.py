"""Which running requests move onto a pipeline that just joined (issue 34). A join moved nothing
before: in a storm of faults every running request collected on the one replica that had not
failed yet, and the next fault there paused all of them. Now a pipeline that joins while others
serve takes its share of the running requests at once: the most loaded pipelines give it their
cheapest requests (the fewest tokens to replay), until it holds its even share (the running
requests over the pipelines serving, rounded up) or a move would only swap which one is busier. A moved request replays its prompt and tokens there, exactly as after a
fault (the same tokens; a seeded sampled request the same draws)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable


@dataclass(frozen=True)
class Movable:
    """A running request as the choice sees it."""

    key: Hashable       # the caller's handle for it (a session id)
    pipeline: Hashable  # the pipeline it runs on now
    replay_tokens: int  # tokens a replay recomputes (prompt + tokens so far)


def moves_onto(target: Hashable, running: list[Movable], pipelines: list[Hashable],
               movable: set[Hashable] | None = None) -> list[Hashable]:
    """Keys of the requests to move onto `target` (a pipeline that holds `running`'s requests of
    its own too, usually none): one at a time from the most loaded of `pipelines` (ties: the first
    listed) while it holds at least 2 more than `target` and `target` holds less than its even
    share (every running request over `pipelines`, rounded up), its cheapest replay first.
    `movable`: the keys that may move (None: all); the others still count as load."""
    load = {p: 0 for p in pipelines}
    load.setdefault(target, 0)
    for r in running:
        load[r.pipeline] = load.get(r.pipeline, 0) + 1
    candidates: dict[Hashable, list[Movable]] = {}
    for r in sorted(running, key=lambda r: r.replay_tokens):
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
