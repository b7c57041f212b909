"""A process's state directory (--state-dir: a controller's journal, a stage's identity and fence)
checked at start: every mistake is one line naming the fix, said before anything loads."""
from __future__ import annotations

import errno
import os
from pathlib import Path

PROBE_BYTES = 64 * 1024  # written and removed at start: a full or read-only directory says so then


class StateDirError(Exception):
    """The state directory cannot be used; the message is one line that names the fix."""


def os_problem(directory: Path, exc: OSError) -> str:
    """`exc` met in `directory` as one line naming the fix."""
    why = exc.strerror or str(exc)
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"{directory} is full ({why}): free space there, or give --state-dir a directory on another disk"
    if exc.errno == errno.EROFS:
        return f"{directory} is on a read-only file system: give --state-dir a writable directory"
    if exc.errno in (errno.EACCES, errno.EPERM):
        return (f"{directory} is not writable by this user ({why}): give --state-dir a directory it owns, or "
                "change the owner of this one")
    if exc.errno in (errno.ENOTDIR, errno.EEXIST):
        return f"{directory} is not a directory (a file is in its place): give --state-dir a directory"
    return f"{directory}: {why}: give --state-dir a writable directory"


def prepare(directory: Path) -> None:
    """Make `directory` if missing (private: 0700) and check that it can be written (StateDirError
    otherwise): not a file, writable, not full."""
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise StateDirError(f"{directory} is a file, not a directory: give --state-dir a directory (it is made "
                            "when missing)")
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        probe = directory / ".state-probe"
        try:
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.write(fd, bytes(PROBE_BYTES))
                os.fsync(fd)
            finally:
                os.close(fd)
        finally:
            probe.unlink(missing_ok=True)
    except OSError as exc:
        raise StateDirError(os_problem(directory, exc)) from None
