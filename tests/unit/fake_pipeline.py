"""A pipeline stand-in for the controller's Scheduler in unit tests (test_journal, test_rebalance)."""
from __future__ import annotations

import asyncio


class FakePipeline:
    """Opens sessions, takes feeds, closes sessions: records them."""

    def __init__(self, index: int = 0):
        self.stages, self.down, self.generation = [object()], [], 1
        self.retired, self.detaches, self.index, self.tokens_per_s, self.plan = False, 0, index, 0.0, None
        self.opened, self.closed = [], []
        self.silent, self.heard = None, 0.0  # the stage handle silent_stage() reports (None: every stage answers)

    def silent_stage(self):
        return self.silent

    def largest_request(self) -> int:
        return 0

    async def open_session(self, request) -> int:
        self.opened.append(request)
        return 0

    async def send_feed(self, batch) -> None:
        pass

    def close_session_soon(self, session_id: str, *, swap: bool = False) -> None:
        self.closed.append(session_id)

    async def close_session(self, session_id: str, *, swap: bool = False) -> None:
        self.closed.append(session_id)


async def until(check, what: str, tries: int = 200):
    """Wait (10 ms a try) until `check()` holds; AssertionError naming `what` after `tries`."""
    for _ in range(tries):
        if check():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(what)
