"""The journal's files before SQLite opens them: the state directory checked (every mistake one
line naming the fix), damage found (a truncated main file, a bad header, a damaged WAL), a damaged
journal moved aside for the operator, and the fencing epoch kept in a file of its own.

Why a check before SQLite: SQLite opens a truncated main file or a WAL with a damaged frame without
a word (it reads what checks out and drops the rest), so a journal that lost its requests would look
empty. Here the files are read first, the way SQLite writes them (https://sqlite.org/fileformat.html):
- the main file: the 16-byte magic, a page size that is a power of two, a length that is a whole
  number of pages and, with no WAL to hold the rest, at least the pages its header counts;
- the WAL: its header's magic and checksum, then every frame that carries the header's salts (the
  frames of the current WAL; older ones carry older salts) must carry a good checksum; SQLite
  stops at the first bad one and drops every commit after it.
What SQLite itself can check after opening (`PRAGMA quick_check`, the tables' columns) is checked
by the journal (controller.jobs.journal).

The fencing epoch is also written to `journal.epoch` (atomically, with fsync) each time it
changes: a journal whose main file or WAL is lost or damaged still knows the epoch, so a restarted
controller never silently starts again at epoch 1.
"""
from __future__ import annotations

import errno
import logging
import os
import shutil
import sqlite3
import struct
import time
from pathlib import Path

from logicpipe.common import statedir
from logicpipe.common.statedir import StateDirError, os_problem

log = logging.getLogger(__name__)

MAIN, WAL, SHM = "journal.sqlite3", "journal.sqlite3-wal", "journal.sqlite3-shm"
EPOCH_FILE = "journal.epoch"
RELEASED_FILE = "journal.released"  # the epoch whose controller released every stage it held as it stopped
DAMAGED_PREFIX = "journal.damaged-"
HEADER = b"SQLite format 3\x00"
WAL_MAGIC = (0x377F0682, 0x377F0683)  # checksums in little-endian / big-endian words


class JournalError(Exception):
    """The journal cannot be used (another controller holds it, the state directory is a file, is
    not writable or is full); the message is one line that names the fix."""


# ---- the state directory ----------------------------------------------------------------------
def prepare(directory: Path) -> None:
    """Make `directory` if missing and check that a journal can be written there (JournalError
    otherwise, one line): not a file, writable, not full (common.statedir)."""
    try:
        statedir.prepare(directory)
    except StateDirError as exc:
        raise JournalError(str(exc)) from None


def sqlite_problem(directory: Path, exc: sqlite3.Error) -> str:
    """An SQLite error that is the directory's fault, as one line naming the fix."""
    text = str(exc)
    if "full" in text:
        return os_problem(directory, OSError(errno.ENOSPC, f"SQLite: {text}"))
    if "readonly" in text or "read-only" in text:
        return os_problem(directory, OSError(errno.EACCES, f"SQLite: {text}"))
    return f"the journal in {directory} cannot be used ({text}): give --state-dir a writable local directory"


# ---- damage -----------------------------------------------------------------------------------
def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def main_file_damage(path: Path, wal_frames: bool) -> list[str]:
    """What is wrong with the main file (nothing for a missing or empty one)."""
    size = _size(path)
    if not size:
        return []
    with open(path, "rb") as f:
        head = f.read(100)
    if len(head) < 100 or head[:16] != HEADER:
        return [f"{path.name} has no SQLite header (bad header, or not a journal)"]
    page = struct.unpack(">H", head[16:18])[0]
    page = 65536 if page == 1 else page
    if page < 512 or page & (page - 1):
        return [f"{path.name} has a bad header (page size {page})"]
    if size % page:
        return [f"{path.name} is {size} bytes, not a whole number of {page}-byte pages (truncated)"]
    pages = struct.unpack(">I", head[28:32])[0]
    if head[24:28] == head[92:96] and pages * page > size and not wal_frames:  # (the header's count is valid)
        return [f"{path.name} is {size} bytes but its header counts {pages} pages of {page} (truncated)"]
    return []


def _checksum(data: bytes, s0: int, s1: int, big: bool) -> tuple[int, int]:
    words = struct.unpack(f"{'>' if big else '<'}{len(data) // 4}I", data)
    for i in range(0, len(words), 2):
        s0 = (s0 + words[i] + s1) & 0xFFFFFFFF
        s1 = (s1 + words[i + 1] + s0) & 0xFFFFFFFF
    return s0, s1


def wal_damage(path: Path) -> tuple[list[str], int]:
    """What is wrong with the WAL, and how many good frames it holds."""
    size = _size(path)
    if not size:
        return [], 0
    with open(path, "rb") as f:
        data = f.read()
    if len(data) < 32:
        return [f"{path.name} is {len(data)} bytes, shorter than its header (damaged WAL)"], 0
    magic, version, page, _, salt1, salt2, c0, c1 = struct.unpack(">8I", data[:32])
    if magic not in WAL_MAGIC or version != 3007000 or page < 512 or page > 65536 or page & (page - 1):
        return [f"{path.name} has a bad header (damaged WAL)"], 0
    big = magic == WAL_MAGIC[1]
    if _checksum(data[:24], 0, 0, big) != (c0, c1):
        return [f"{path.name}'s header checksum is wrong (damaged WAL)"], 0
    s, good, bad = (c0, c1), 0, 0
    for at in range(32, len(data) - 24 - page + 1, 24 + page):
        fh = data[at:at + 24]
        fsalt1, fsalt2, f0, f1 = struct.unpack(">4I", fh[8:24])
        if (fsalt1, fsalt2) != (salt1, salt2):
            continue  # a frame of an earlier WAL (before a checkpoint restarted it): not read by SQLite
        if bad:
            bad += 1
            continue
        nxt = _checksum(fh[:8] + data[at + 24:at + 24 + page], *s, big)
        if nxt != (f0, f1):
            bad = 1
            continue
        s, good = nxt, good + 1
    tail = 32 + (len(data) - 32) // (24 + page) * (24 + page)  # where a frame cut short would start
    if not bad and len(data) - tail >= 24 and struct.unpack(">2I", data[tail + 8:tail + 16]) == (salt1, salt2):
        return [f"{path.name} ends inside frame {good + 1} of the current WAL (truncated WAL)"], good
    if bad:
        return [f"{path.name}: frame {good + 1} of the current WAL has a bad checksum; SQLite would drop it and "
                f"{bad - 1} frame(s) after it (damaged WAL)"], good
    return [], good


def find_damage(directory: Path) -> list[str]:
    """Every sign of damage in the journal's files, read as they are (before SQLite recovers them)."""
    reasons, frames = wal_damage(directory / WAL)
    return main_file_damage(directory / MAIN, frames > 0) + reasons


def move_aside(directory: Path, reasons: list[str]) -> Path:
    """Move the journal's SQLite files to journal.damaged-<UTC time>/ (with why.txt); returns where."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    dest = directory / f"{DAMAGED_PREFIX}{stamp}"
    n = 1
    while dest.exists():
        n += 1
        dest = directory / f"{DAMAGED_PREFIX}{stamp}-{n}"
    dest.mkdir()
    for name in (MAIN, WAL, SHM):
        if (directory / name).exists():
            shutil.move(str(directory / name), dest / name)
    (dest / "why.txt").write_text("".join(f"{r}\n" for r in reasons))
    return dest


def damaged_copies(directory: Path) -> list[Path]:
    """The damaged journals moved aside earlier and still there (the operator has not dealt with them)."""
    return sorted(p for p in directory.glob(f"{DAMAGED_PREFIX}*") if p.is_dir())


# ---- the epoch file ---------------------------------------------------------------------------
def read_epoch(directory: Path) -> tuple[int | None, str]:
    """(the epoch kept in journal.epoch, or None when there is none or it is unreadable; the problem)."""
    try:
        text = (directory / EPOCH_FILE).read_text()
    except FileNotFoundError:
        return None, ""
    except OSError as exc:
        return None, f"{EPOCH_FILE} cannot be read ({exc.strerror})"
    try:
        epoch = int(text.strip())
        if epoch < 0:
            raise ValueError
        return epoch, ""
    except ValueError:
        return None, f"{EPOCH_FILE} does not hold an epoch ({text[:40]!r})"


def write_epoch(directory: Path, epoch: int) -> None:
    """journal.epoch := epoch, atomically and on disk before it returns (OSError when it cannot)."""
    tmp = directory / f"{EPOCH_FILE}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, f"{epoch}\n".encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, directory / EPOCH_FILE)
    dfd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


# ---- the released mark -------------------------------------------------------------------------
def write_released(directory: Path, epoch: int) -> None:
    """The controller of `epoch` stopped and ended its lease on every stage it held (Release): the
    next one on this journal need not wait for the lease to run out (OSError when it cannot say so)."""
    tmp = directory / f"{RELEASED_FILE}.tmp"
    tmp.write_text(f"{epoch}\n")
    os.replace(tmp, directory / RELEASED_FILE)


def take_released(directory: Path) -> int:
    """The epoch of the released mark, which is removed (0: none, or unreadable)."""
    path = directory / RELEASED_FILE
    try:
        text = path.read_text()
        path.unlink()
    except OSError:
        return 0
    try:
        return max(0, int(text.strip()))
    except ValueError:
        return 0
