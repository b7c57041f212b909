"""Outline requests as the journal keeps them (the front door's side): admitted with what runs them
again (outline.outline_record: the question, the options, a seed), run again from their start for
a client that resumes one — the tokens it holds of each point skipped, since the points decode in
parallel — failed when the journal cannot hold them, and dropped from the journal once delivered,
or when no client resumed them within OUTLINE_RETAIN_S."""
from __future__ import annotations

import contextlib
import random
import time
import uuid
from typing import AsyncIterator

from logicpipe.controller.jobs.job import OUTLINE_RECORD
from logicpipe.controller.jobs.outline import MAX_POINTS, OutlineRun, outline_record, run_of_record
from logicpipe.controller.jobs.scheduler import Scheduler
from logicpipe.errors import AlreadyExists, InvalidArgument, MeshError, NotFound
from logicpipe.sampling import SamplingParams

OUTLINE_RETAIN_S = 600.0  # an outline request its client left stays in the journal this long for a resume, s


class OutlineRequests:
    """The journaled outline requests of one front door."""

    def __init__(self, scheduler: Scheduler, tokenizer):
        self.scheduler, self.tokenizer = scheduler, tokenizer
        self.streaming: dict[str, int] = {}    # outline request id -> its runs streaming now
        self.lost: dict[str, MeshError] = {}   # outline request id -> why the journal could not keep it
        scheduler.journal.on_lost.append(self._not_durable)

    def admit(self, question: str, request_id: str, *, outline_text: str, max_points: int, point_tokens: int,
              sampling: SamplingParams, sequential: bool, speculate: int | None, client: str,
              prompt_tokens: int) -> tuple[str, dict]:
        """Journal a new outline request (refused when the journal cannot hold it); its id and record."""
        rid = request_id or uuid.uuid4().hex
        journal = self.scheduler.journal
        if rid in journal.entries or self.scheduler.find(rid) is not None:
            raise AlreadyExists(f"request {rid} exists; resume it instead of submitting it again")
        journal.check_durable()
        self._sweep()
        if not sampling.greedy and sampling.seed is None:  # a seed of our own: run again, it draws the same
            sampling = sampling.with_seed(random.getrandbits(63))
        doc = outline_record(question, outline_text=outline_text, max_points=max_points, point_tokens=point_tokens,
                             sampling=sampling, sequential=sequential, speculate=speculate, client=client,
                             prompt_tokens=prompt_tokens)
        journal.admit(rid, doc, 0)
        return rid, doc

    def record(self, request_id: str, client: str) -> dict | None:
        """The journal's record of outline request `request_id` (None: no outline request of that
        id; NotFound: another client's)."""
        entry = self.scheduler.journal.entries.get(request_id)
        if entry is None or OUTLINE_RECORD not in entry.job:
            return None
        if entry.job[OUTLINE_RECORD].get("client") not in ("", client):
            raise NotFound(f"no request {request_id!r} here: it ended (its tokens were all delivered, or it "
                           "failed) or was never admitted; submit it again")
        return entry.job

    def run(self, doc: dict) -> OutlineRun:
        return run_of_record(self.scheduler, self.tokenizer, doc)

    async def events(self, rid: str, run: OutlineRun,
                     held: dict[int, int]) -> AsyncIterator[tuple[int, int, bool, bool]]:
        """(point, token, finished, held) of `run` as they come; held: the client has it already
        (the first held[p] of point p). Delivered to the end, the request leaves the journal."""
        seen: dict[int, int] = {}
        self.streaming[rid] = self.streaming.get(rid, 0) + 1
        try:
            async with contextlib.aclosing(run.events()) as events:
                async for pid, token, finished in events:
                    if rid in self.lost:
                        raise self.lost[rid]
                    seen[pid] = seen.get(pid, 0) + 1
                    yield pid, token, finished, seen[pid] <= held.get(pid, 0)
            self.scheduler.journal.drop(rid)
        finally:
            self.streaming[rid] -= 1
            if not self.streaming[rid]:
                del self.streaming[rid]
                self.lost.pop(rid, None)

    def _not_durable(self, ids: list[str], err: MeshError) -> None:
        """The journal could not commit these admissions: an outline request among them fails
        (journal.on_lost) rather than run as if it were durable."""
        for rid in ids:
            if rid in self.streaming:
                self.lost[rid] = err
                self.scheduler.journal.drop(rid)

    def _sweep(self) -> None:
        """Outline requests no client resumed within OUTLINE_RETAIN_S leave the journal."""
        now = time.time()
        journal = self.scheduler.journal
        for rid, e in list(journal.entries.items()):
            if OUTLINE_RECORD in e.job and rid not in self.streaming and now - e.admitted > OUTLINE_RETAIN_S:
                journal.drop(rid)


def held_points(have: int, have_points: tuple[int, ...]) -> dict[int, int]:
    """The tokens a resuming client holds of each point of an outline request (0: the outline)."""
    if len(have_points) > MAX_POINTS + 1:
        raise InvalidArgument(f"have_points: {len(have_points)} counts for at most {MAX_POINTS} points and the outline")
    if have_points:
        if sum(have_points) != have and have:
            raise InvalidArgument(f"have_points adds up to {sum(have_points)}, have_tokens says {have}")
        return {p: n for p, n in enumerate(have_points) if n}
    if not have:
        return {}
    raise InvalidArgument("resuming an outline request needs have_points: the tokens held of each point (0: the "
                          "outline), as lpctl sends them")
