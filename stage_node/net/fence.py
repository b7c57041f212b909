"""Who may steer this stage: the controller that holds it, and the certificate names it refuses.

A stage takes Assign, OpenSession, CloseSession, Events, MeasureLink, Revoked and prompt feeds
from one party only, the controller that holds it (the last one to Assign it; an Assign takes
the fence only once its assignment loaded). MeasureLink is refused while nobody holds the node. A caller is known
by a `Caller`: its certificate's name (mutual TLS) and a digest of the key its process sends in
the call metadata (KEY_HEADER; in plaintext the only proof). The owner id a controller stamps on
its sessions is no secret (any stage learns it from Register): it names sessions, it proves nothing.

Another controller takes the stage over
- over TLS, with a newer fencing epoch than the holder's (a standby taking over, a controller
  started again; certificates of the mesh's CA are trusted until revoked);
- in plaintext, only while the holder is not connected (none of its Events subscriptions is
  open): anyone can claim an epoch there, so a live holder is never displaced;
- at once, whatever the epoch, when the holder's certificate was revoked.
A refused controller gets FENCED (and steps down, see controller.app.on_fenced).

The revocation list is the controller's (pushed with every Assign and by Revoked); it and the
holder are kept in the node's state directory, so a restarted node still refuses a revoked
certificate and an older controller before any controller reaches it again.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

from logicpipe.errors import Fenced, PermissionDenied
from logicpipe.policy import KEY_HEADER

log = logging.getLogger(__name__)

FENCE_FILE = "fence.json"
MAX_REVOKED = 10_000  # names one list may hold


@dataclass(frozen=True)
class Caller:
    """Who made a call: its certificate's name ("" in plaintext) and the digest of the key it sent
    ("" none)."""

    name: str = ""
    key: str = ""

    @classmethod
    def of(cls, name: str, metadata: Iterable[tuple[str, object]] | None) -> "Caller":
        key = next((v for k, v in (metadata or ()) if k == KEY_HEADER), "")
        if isinstance(key, str):
            key = key.encode()
        return cls(name, hashlib.sha256(key).hexdigest()[:32] if key else "")

    def describe(self) -> str:
        return (f"certificate {self.name!r}" if self.name else "a plaintext caller") + \
            (f" (key {self.key[:8]})" if self.key else " (no key)")


@dataclass(frozen=True)
class Holder:
    caller: Caller
    controller_id: str  # the id it stamps on its sessions and subscribes to Events with
    epoch: int


class Fence:
    """The holder and the revoked names of one node; `path`: where they are kept (None: memory)."""

    def __init__(self, node_id: str, path: Path | None = None, *, tls: bool):
        self.node_id, self.path, self.tls = node_id, path, tls
        self.holder: Holder | None = None
        self.revoked: frozenset[str] = frozenset()
        if path is not None:
            self._load()

    @property
    def epoch(self) -> int:
        return self.holder.epoch if self.holder else 0

    @property
    def controller_id(self) -> str:
        return self.holder.controller_id if self.holder else ""

    def __contains__(self, name: str) -> bool:
        """A revoked certificate name (the server's role check asks)."""
        return bool(name) and name in self.revoked

    # ---- the checks ------------------------------------------------------------------------
    def take(self, caller: Caller, controller_id: str, epoch: int, connected: Callable[[str], bool]) -> None:
        """Assign: `caller` holds this node afterwards, or Fenced / PermissionDenied says why not.
        `connected(controller_id)`: whether that controller has an Events subscription open here."""
        h = self.holder
        if self.may_take(caller, controller_id, epoch, connected):
            if h is not None:
                log.warning("controller %s (epoch %d, %s) takes this node over from %s (epoch %d)", controller_id,
                            epoch, caller.describe(), h.controller_id, h.epoch)
            self._hold(Holder(caller, controller_id, epoch))

    def may_take(self, caller: Caller, controller_id: str, epoch: int, connected: Callable[[str], bool]) -> bool:
        """take's checks, holding nothing (an Assign is checked before its weights load, and takes
        the fence only once they did). Raises Fenced / PermissionDenied; returns whether taking
        would change the holder (False: the holder again, at no newer epoch)."""
        self._refuse_revoked(caller)
        h = self.holder
        if h is not None and (h.caller, h.controller_id) == (caller, controller_id):
            return epoch > h.epoch
        if h is not None and not (h.caller.name and h.caller.name in self.revoked):
            if self.tls:
                if epoch <= h.epoch:
                    raise Fenced(f"{Fenced.PREFIX} node {self.node_id} follows controller {h.controller_id} of epoch "
                                 f"{h.epoch}; controller {controller_id or '?'} of epoch {epoch} was replaced")
            elif connected(h.controller_id):
                raise Fenced(f"{Fenced.PREFIX} node {self.node_id} follows controller {h.controller_id}, which is "
                             f"connected; {caller.describe()} as {controller_id or '?'} cannot take it over")
        return True

    def check(self, caller: Caller, what: str) -> None:
        """CloseSession, Events, MeasureLink, a prompt feed: only from the holder (anyone while
        nobody holds this node: tests and tools drive an unassigned node by hand)."""
        self._refuse_revoked(caller)
        h = self.holder
        if h is not None and h.caller != caller:
            raise PermissionDenied(f"node {self.node_id} takes {what} only from the controller that holds it "
                                   f"({h.controller_id}); {caller.describe()} is not it")

    def check_holder(self, caller: Caller, what: str) -> None:
        """MeasureLink: only from the holder, and never while nobody holds this node (a node dials
        only where its controller asks it to, so no other party can make it connect anywhere)."""
        self._refuse_revoked(caller)
        h = self.holder
        if h is None:
            raise PermissionDenied(f"node {self.node_id} takes {what} only from the controller that holds it, and "
                                   "none does yet: a controller measures its links once it has assigned it")
        self.check(caller, what)

    def _refuse_revoked(self, caller: Caller) -> None:
        if caller.name in self:
            raise PermissionDenied(f"the certificate of {caller.name!r} was revoked")

    # ---- changes ---------------------------------------------------------------------------
    def set_revoked(self, names: Iterable[str]) -> bool:
        """Replace the revoked names (the controller's whole list); True if they changed."""
        names = frozenset(n for n in names if n)
        if len(names) > MAX_REVOKED:
            raise PermissionDenied(f"a revocation list of {len(names)} names is over the cap of {MAX_REVOKED}")
        if names == self.revoked:
            return False
        added = names - self.revoked
        self.revoked = names
        if added:
            log.warning("refusing the certificates of %s from now on (revoked)", ", ".join(sorted(added)[:20]))
        self._save()
        return True

    def _hold(self, holder: Holder) -> None:
        self.holder = holder
        self._save()

    def _save(self) -> None:
        if self.path is None:
            return
        h = self.holder
        data = {"holder": None if h is None else {"name": h.caller.name, "key": h.caller.key,
                                                   "controller_id": h.controller_id, "epoch": h.epoch},
                "revoked": sorted(self.revoked)}
        tmp = self.path.with_suffix(".tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump(data, f)
            tmp.replace(self.path)
        except OSError as exc:  # the node serves on; after a restart it would trust the next controller
            log.error("cannot keep the fence in %s: %s", self.path, exc)

    def _load(self) -> None:
        try:
            data = json.loads(self.path.read_text())
            h = data.get("holder")
            if h:
                self.holder = Holder(Caller(str(h["name"]), str(h["key"])), str(h["controller_id"]), int(h["epoch"]))
            self.revoked = frozenset(str(n) for n in data.get("revoked", ()))
        except FileNotFoundError:
            return
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.error("ignoring %s (%s): this node trusts the next controller that assigns it", self.path, exc)
            self.holder, self.revoked = None, frozenset()
            return
        log.info("fence kept from before: controller %s of epoch %d, %d revoked names", self.controller_id, self.epoch,
                 len(self.revoked))
