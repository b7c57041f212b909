"""The controller's mesh state: one phase and the reason for it, with one owner (the app, which
plans) and readers (admission, Status, /health, /metrics)."""
from __future__ import annotations

import time
from enum import Enum
from typing import Callable


class Phase(Enum):
    WAITING = "waiting"        # no plan serves: requests queue, each for at most --wait-for-nodes-s
    PLANNING = "planning"      # the first plan is being installed
    REPLANNING = "replanning"  # a new plan is being installed; running requests replay on it
    DEGRADED = "degraded"      # a stage of the plan in force stopped answering; a re-plan comes
    READY = "ready"            # a plan serves: requests are admitted


class MeshState:
    """What the mesh can do now and why. Set only by the app; `watch` callbacks run on each change."""

    def __init__(self, phase: Phase = Phase.WAITING, reason: str = "no stage nodes yet"):
        self.phase = phase
        self.reason = reason             # why it is not READY ("" when it is)
        self.since = time.monotonic()    # when this phase began (setting the same phase again keeps it)
        self.unready_since = self.since  # when it last stopped admitting (kept while it goes on not admitting)
        self._watchers: list[Callable[[], None]] = []

    def set(self, phase: Phase, reason: str = "") -> None:
        if phase is not self.phase:
            self.since = time.monotonic()
            if self.phase is Phase.READY:
                self.unready_since = self.since
        self.phase, self.reason = phase, reason
        for watch in self._watchers:
            watch()

    def watch(self, callback: Callable[[], None]) -> None:
        self._watchers.append(callback)

    @property
    def admitting(self) -> bool:
        """Requests may open on the stages now."""
        return self.phase is Phase.READY

    @property
    def replanning(self) -> bool:
        """A plan is being made or a stage is down: pipelines that serve still take requests."""
        return self.phase in (Phase.DEGRADED, Phase.REPLANNING)

    @property
    def waiting(self) -> bool:
        """No plan fits the nodes there are: queued requests wait for one, bounded."""
        return self.phase is Phase.WAITING
