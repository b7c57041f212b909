"""What a stage tells a session's owner (a token event, or an error), and the fan-out by owner:
each Events subscription hears only its owner's sessions, through a bounded queue; and the
liveness of owners, which decides how long their sessions live. The wire adapter turns events
into protobuf (stage_node.wire); nothing here does."""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from logicpipe.errors import MeshError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TokenEvent:
    """The last stage's new tokens for a session (its accepted candidates, then the sampled one)."""

    session_id: str
    token_ids: tuple[int, ...]
    index: int               # how many tokens the session had generated before these
    finish_reason: str = ""  # "stop" | "length" when they end it
    candidates: int = 0      # candidates verified in the step that made them
    logprobs: tuple = ()     # a sampling.TokenLogprob per token, when the session asked for them
    prompt_logprobs: tuple = ()  # the first event, when asked: a TokenLogprob per prompt token from position 1


@dataclass(frozen=True)
class ErrorEvent:
    """A session failed on this stage (it may be replayed by its owner)."""

    session_id: str
    error: MeshError
    node_id: str


Event = TokenEvent | ErrorEvent

MAX_QUEUED_BATCHES = 4096  # event batches a subscriber may fall behind before it is cut off


class Subscriber:
    def __init__(self, owner: str):
        self.owner = owner
        self.queue: asyncio.Queue[list[Event]] = asyncio.Queue()
        self.overflowed = False  # it fell too far behind: its stream ends

    async def next_batch(self) -> list[Event]:
        """Every event waiting (at least one batch)."""
        events = list(await self.queue.get())
        while not self.queue.empty():
            events.extend(self.queue.get_nowait())
        return events


class EventHub:
    def __init__(self):
        self._subs: dict[str, set[Subscriber]] = {}
        self._left: dict[str, float] = {}  # owner -> when its last subscription ended (monotonic)

    def subscribe(self, owner: str) -> Subscriber:
        sub = Subscriber(owner)
        self._subs.setdefault(owner, set()).add(sub)
        self._left.pop(owner, None)
        return sub

    def unsubscribe(self, sub: Subscriber) -> None:
        subs = self._subs.get(sub.owner)
        if subs is None or sub not in subs:
            return
        subs.discard(sub)
        if not subs:
            del self._subs[sub.owner]
            self._left[sub.owner] = time.monotonic()

    def listening(self, owner: str) -> bool:
        return bool(self._subs.get(owner))

    def left_at(self, owner: str) -> float | None:
        """When `owner`'s last subscription ended (None: listening now, or never seen)."""
        return self._left.get(owner)

    def forget(self, owner: str) -> None:
        self._left.pop(owner, None)

    def emit(self, owner: str, events: list[Event]) -> None:
        for sub in list(self._subs.get(owner, ())):
            if sub.queue.qsize() >= MAX_QUEUED_BATCHES:
                log.warning("an Events subscriber of owner %r is %d batches behind: cutting it off",
                            owner, MAX_QUEUED_BATCHES)
                sub.overflowed = True
                sub.queue.put_nowait([])  # wakes it to end its stream
                self.unsubscribe(sub)
            else:
                sub.queue.put_nowait(events)

    @property
    def subscribers(self) -> int:
        return sum(len(s) for s in self._subs.values())
