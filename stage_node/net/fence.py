"""Who may steer this stage: the controller that holds it, and the certificate names it refuses.

A stage takes Assign, OpenSession, CloseSession, Events, MeasureLink, Revoked and prompt feeds
from one party only, the controller that holds it (the last one to Assign it; an Assign takes
the fence only once its assignment loaded). MeasureLink is refused while nobody holds the node. A caller is known
by a `Caller`: its certificate's name (mutual TLS) and a digest of the key its process sends in
the call metadata (KEY_HEADER; in plaintext the only proof). The owner id a controller stamps on
its sessions is no secret (any stage learns it from Register): it names sessions, it proves nothing.

The holder holds a lease: every call of its (Assign, OpenSession, CloseSession, Events, prompts,
MeasureLink, and the Status probe it sends every 2 s with its key) renews it for LEASE_S. Whether
its Events streams are open says nothing (a stopped process keeps them open). Another
controller takes the stage over only
- once the holder's lease expired (it is gone, or stopped), and
- with the holder's epoch + 1 exactly (the journal's next: a standby's takeover, or the holder
  started again on its journal), never a number above it; and
- over TLS, only with the holder's own certificate or the standby's it named in its Assign
  (AssignRequest.standby_name); any other certificate gets PERMISSION_DENIED.
A holder whose certificate is revoked holds nothing from then on: the next controller takes the
stage. A refused controller gets FENCED (and steps down, see controller.app.on_fenced).

The revocation list is the controller's (pushed with every Assign and by Revoked); it and the
holder are kept in the node's state directory, so a restarted node still refuses a revoked
certificate and an older controller before any controller reaches it again.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

from logicpipe.errors import Fenced, PermissionDenied
from logicpipe.policy import KEY_HEADER

log = logging.getLogger(__name__)

FENCE_FILE = "fence.json"
LEASE_S = 3.0  # the holder is taken for gone this long after its last call (its Status probe every 2 s renews it)
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
    standby: str = ""   # over TLS: the certificate name of its standby (AssignRequest.standby_name)


class Fence:
    """The holder and the revoked names of one node; `path`: where they are kept (None: memory);
    `clock`: monotonic seconds (tests give a fake one)."""

    def __init__(self, node_id: str, path: Path | None = None, *, tls: bool, lease_s: float = LEASE_S,
                 clock: Callable[[], float] = time.monotonic):
        self.node_id, self.path, self.tls = node_id, path, tls
        self.lease_s, self.clock = lease_s, clock
        self.holder: Holder | None = None
        self.revoked: frozenset[str] = frozenset()
        self.renewed = clock()  # the holder's lease runs lease_s from here (a restarted node gives it a new one)
        self.released = False   # the holder ended its lease (Release: it stops); its next Assign holds it again
        if path is not None:
            self._load()

    @property
    def epoch(self) -> int:
        return self.holder.epoch if self.holder else 0

    @property
    def controller_id(self) -> str:
        return self.holder.controller_id if self.holder else ""

    def lease_left(self) -> float:
        """Seconds the holder's lease runs still (0: expired, or nobody holds this node)."""
        return max(0.0, self.renewed + self.lease_s - self.clock()) if self.holder and not self.released else 0.0

    def __contains__(self, name: str) -> bool:
        """A revoked certificate name (the server's role check asks)."""
        return bool(name) and name in self.revoked

    # ---- the checks ------------------------------------------------------------------------
    def take(self, caller: Caller, controller_id: str, epoch: int, standby: str = "") -> None:
        """Assign: `caller` holds this node afterwards (its lease renewed), or Fenced /
        PermissionDenied says why not. `standby`: the certificate name of its standby."""
        h = self.holder
        self.may_take(caller, controller_id, epoch)
        same = h is not None and (h.caller, h.controller_id) == (caller, controller_id)
        if h is not None and not same:
            log.warning("controller %s (epoch %d, %s) takes this node over from %s (epoch %d)", controller_id,
                        epoch, caller.describe(), h.controller_id, h.epoch)
        held = Holder(caller, controller_id, max(epoch, h.epoch) if same else epoch, standby)
        self.renewed, self.released = self.clock(), False
        if held != h:
            self._hold(held)

    def may_take(self, caller: Caller, controller_id: str, epoch: int) -> None:
        """take's checks, holding nothing (an Assign is checked before its weights load, and takes
        the fence only once they did). Raises Fenced / PermissionDenied.

        Another controller takes a held node over only (a) once the holder's lease expired, (b)
        with the holder's epoch + 1, no other (a number no caller can pick: the journal's next),
        and (c) over TLS, with the holder's own certificate (the same controller, started again)
        or its standby's. A holder whose certificate was revoked holds nothing (set_revoked)."""
        self._refuse_revoked(caller)
        h = self.holder
        if h is None or (h.caller, h.controller_id) == (caller, controller_id):
            return
        who = f"{caller.describe()} as {controller_id or '?'}"
        if epoch <= h.epoch:
            raise Fenced(f"{Fenced.PREFIX} node {self.node_id} follows controller {h.controller_id} of epoch "
                         f"{h.epoch}; {who} of epoch {epoch} was replaced")
        if self.tls and caller.name not in {h.caller.name, h.standby}:
            allowed = " or its standby's " + repr(h.standby) if h.standby else " (it names no standby)"
            raise PermissionDenied(f"node {self.node_id} is held by controller {h.controller_id}; only its own "
                                   f"certificate {h.caller.name!r}{allowed} may take it over, not {who}")
        left = self.lease_left()
        if left > 0:
            raise Fenced(f"{Fenced.PREFIX} node {self.node_id} follows controller {h.controller_id}, whose lease "
                         f"runs {left:.1f} s more; {who} cannot take it over while it is alive")
        if epoch != h.epoch + 1:
            raise Fenced(f"{Fenced.PREFIX} node {self.node_id} is taken over only with epoch {h.epoch + 1} (its "
                         f"holder's + 1, from the journal), not {epoch}: {who} was refused")

    def check(self, caller: Caller, what: str) -> None:
        """CloseSession, Events, a prompt feed: only from the holder (anyone while nobody holds
        this node: tests and tools drive an unassigned node by hand). The holder's lease is renewed."""
        self._refuse_revoked(caller)
        h = self.holder
        if h is not None and h.caller != caller:
            raise PermissionDenied(f"node {self.node_id} takes {what} only from the controller that holds it "
                                   f"({h.controller_id}); {caller.describe()} is not it")
        if h is not None:
            self.renewed = self.clock()

    def renew(self, caller: Caller) -> bool:
        """Status: the holder's probe renews its lease (anyone else's changes nothing; nor the
        holder's, once it released it)."""
        h = self.holder
        if h is None or h.caller != caller or caller.name in self or self.released:
            return False
        self.renewed = self.clock()
        return True

    def release(self, caller: Caller, controller_id: str) -> bool:
        """Release: the holder stops, and its lease ends now (the next controller of its journal, epoch
        + 1, or its standby takes over without waiting LEASE_S). The holder and its epoch stay: every
        rule of `may_take` holds as after an expired lease. False (nothing changes) for anyone else."""
        self._refuse_revoked(caller)
        h = self.holder
        if h is None or (h.caller, h.controller_id) != (caller, controller_id):
            return False
        if not self.released:
            log.info("controller %s (epoch %d) released this node: its lease ended", controller_id, h.epoch)
        self.released = True
        return True

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
        h = self.holder
        if h is not None and h.caller.name in names:  # a revoked holder holds nothing: the next controller takes it
            log.warning("controller %s (certificate %r) held this node and was revoked: it is free", h.controller_id,
                        h.caller.name)
            self.holder = None
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
                                                   "controller_id": h.controller_id, "epoch": h.epoch,
                                                   "standby": h.standby},
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
                self.holder = Holder(Caller(str(h["name"]), str(h["key"])), str(h["controller_id"]), int(h["epoch"]),
                                     str(h.get("standby", "")))
            self.revoked = frozenset(str(n) for n in data.get("revoked", ()))
        except FileNotFoundError:
            return
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.error("ignoring %s (%s): this node trusts the next controller that assigns it", self.path, exc)
            self.holder, self.revoked = None, frozenset()
            return
        log.info("fence kept from before: controller %s of epoch %d, %d revoked names", self.controller_id, self.epoch,
                 len(self.revoked))
