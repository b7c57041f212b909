"""Revoked certificate names (`lpctl revoke NODE`): refused on every call, never planned with,
never let join again. One object per controller process, made in its main and handed to the
server's role check, the join authority and the planner's driver."""
from __future__ import annotations

import json
import logging
from pathlib import Path

from logicpipe.common.security.bundle import TlsError, check_name

log = logging.getLogger(__name__)

REVOKED_FILE = "revoked.json"


class Revocations:
    """A set of names, kept in `path` (JSON) when given, else in memory only."""

    def __init__(self, path: Path | None = None):
        self.path = path
        self._names: set[str] = set()
        if path is not None:
            try:
                self._names = set(json.loads(path.read_text()))
            except FileNotFoundError:
                pass
            except (OSError, ValueError) as exc:
                raise TlsError(f"{path}: unreadable ({exc}); fix or remove it") from exc

    @classmethod
    def in_ca_dir(cls, ca_dir) -> "Revocations":
        """The list kept beside the mesh's CA (it outlives controller restarts)."""
        return cls(Path(ca_dir) / REVOKED_FILE)

    def __contains__(self, name: str) -> bool:
        return name in self._names

    def __len__(self) -> int:
        return len(self._names)

    def __iter__(self):
        return iter(sorted(self._names))

    def add(self, name: str) -> bool:
        """Refuse `name` from now on (persisted); False if it already was. TlsError: `name` is
        no certificate name (it would be kept, and written, for nothing)."""
        check_name(name)
        if name in self._names:
            return False
        self._names.add(name)
        if self.path is not None:
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(sorted(self._names)))
            tmp.replace(self.path)
        log.warning("%s revoked: its certificate is refused from now on", name)
        return True
