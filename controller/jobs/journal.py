"""The request journal: every admitted request, durably, so that a controller that dies (SIGKILL, a
crash, a power cut short of the disk) or stops resumes each one from its tokens, and a standby
controller can take over from a copy.

What is kept per request: its id, the job (prompt token ids, options, the seed it samples with),
its arrival order, and the tokens the last stage reported so far. Tokens are written in batches:
operations queue in memory and a writer thread commits them together every FLUSH_S, so a decode
step costs one list append, not a disk write. A token that had not reached the disk when the
controller died is simply computed again on resume (replay is exact: greedy, and seeded sampling,
whose draws depend only on seed, sequence and position), and a client that already holds it says
so when it resumes.

The store is SQLite in WAL mode (Python's own `sqlite3`: no new dependency, one file, crash-safe:
a committed transaction survives the process being killed; with synchronous=NORMAL only a power
cut can lose the last few batches, which replay recomputes). A finished or failed request leaves
the journal (its rows are deleted), so the journal holds the requests in flight and no more; the
WAL is truncated back to JOURNAL_SIZE_LIMIT after each checkpoint.

The journal also keeps a mirror of what it holds in memory: the state a standby needs to start
from (`snapshot`), and every operation after that in order (`subscribe`), which is how the active
controller ships its journal to a standby (controller.standby).
"""
from __future__ import annotations

import asyncio
import errno
import fcntl
import json
import logging
import os
import sqlite3
import threading
import time
from array import array
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from logicpipe.controller.jobs import journal_files as files
from logicpipe.controller.jobs.journal_files import JournalError
from logicpipe.errors import MeshError, ResourceExhausted, Unavailable

log = logging.getLogger(__name__)

FLUSH_S = 0.05                 # queued operations are committed together this often
JOURNAL_SIZE_LIMIT = 8 * 2**20  # the WAL file is cut back to this after a checkpoint, bytes
SCHEMA = 1

ADMIT, TOKENS, DROP, EPOCH = "admit", "tokens", "drop", "epoch"


TABLES = {"meta": ["key", "value"], "requests": ["id", "priority", "admitted", "job"],
          "tokens": ["id", "start", "ids"]}
TABLE_SQL = ("CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
             "CREATE TABLE IF NOT EXISTS requests (id TEXT PRIMARY KEY, priority INTEGER NOT NULL, "
             "admitted REAL NOT NULL, job TEXT NOT NULL)",
             "CREATE TABLE IF NOT EXISTS tokens (id TEXT NOT NULL, start INTEGER NOT NULL, "
             "ids BLOB NOT NULL, PRIMARY KEY (id, start))")
RETRY_MAX_S = 5.0  # a failing writer tries again after FLUSH_S, doubling up to this


@dataclass
class Entry:
    """One journaled request."""

    id: str
    job: dict                 # the scheduler's Job, as JSON (scheduler.job_to_json)
    priority: int             # arrival order
    tokens: list[int] = field(default_factory=list)  # reported by the last stage so far
    admitted: float = field(default_factory=time.time)


@dataclass(frozen=True)
class Op:
    """One change to the journal, in the order it was made (what a standby receives)."""

    kind: str                 # ADMIT | TOKENS | DROP | EPOCH
    id: str = ""
    job: dict | None = None   # ADMIT
    priority: int = 0         # ADMIT
    start: int = 0            # TOKENS: the index of the first token
    tokens: tuple[int, ...] = ()
    epoch: int = 0            # EPOCH


def _pack(tokens) -> bytes:
    return array("q", tokens).tobytes()


def _unpack(blob: bytes) -> list[int]:
    return array("q", blob).tolist()


class Journal:
    """The requests in flight, on disk under `directory` (journal.sqlite3), and in memory."""

    def __init__(self, directory: Path | str | None, model_digest: str = ""):
        """`directory` None: in memory only (nothing survives the process; tests, embedded use)."""
        self.directory = Path(directory) if directory is not None else None
        self.model_digest = model_digest
        self.entries: dict[str, Entry] = {}
        self.epoch = 0                      # the fencing epoch of the last active controller
        self.dropped_on_open: list[str] = []  # requests of another model found at open (not resumed)
        self._pending: list[Op] = []
        self._subscribers: list[Callable[[Op], None]] = []
        self._db: sqlite3.Connection | None = None
        self._lock_fd: int | None = None
        self._flusher: asyncio.Task | None = None
        self._write_lock = threading.Lock()
        self.seq = 0                        # operations made since open (a standby's position)
        self.damage = ""                    # what was found wrong at open (moved aside, reported); "" none
        self.epoch_lost = False             # ... and the fencing epoch went with it
        self.failure: MeshError | None = None  # why the last commit failed (None: the writer keeps up)
        # called with the requests whose admission could not be made durable, and why: they must fail
        self.on_lost: list[Callable[[list[str], MeshError], None]] = []

    # ---- opening ----------------------------------------------------------------------------
    def open(self, model_digest: str | None = None) -> "Journal":
        """Lock the directory (one controller per journal), check its files and read what is
        there. A damaged journal is moved aside (journal.damaged-<time>/) and reported (`damage`),
        and this one starts empty at the epoch journal.epoch kept; requests of another model are
        dropped (their token ids mean something else now), with a warning. JournalError: the
        directory cannot hold a journal (one line naming the fix)."""
        self.model_digest = model_digest if model_digest is not None else self.model_digest
        if self.directory is None:
            return self
        files.prepare(self.directory)
        lock = self.directory / "journal.lock"
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            raise JournalError(files.os_problem(self.directory, exc)) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise JournalError(f"another controller uses the journal in {self.directory}; give each controller "
                               "its own --state-dir") from None
        self._lock_fd = fd
        try:
            kept, problem = files.read_epoch(self.directory)
            reasons = files.find_damage(self.directory)
            main_size = (self.directory / files.MAIN).stat().st_size if (self.directory / files.MAIN).exists() else 0
            if not reasons and kept and not main_size:
                reasons.append(f"{files.MAIN} is missing or empty, but {files.EPOCH_FILE} says a journal of epoch "
                               f"{kept} was here")
            if not reasons:
                reasons = self._read(kept)
            if reasons:
                self._reopen_empty(reasons, kept)
            elif problem:  # the database is whole: its epoch stands, and the file is written again
                self.damage = f"{problem}; the epoch {self.epoch} of {files.MAIN} is used and the file written again"
                log.warning("the journal in %s: %s", self.directory, self.damage)
            self._db.execute("INSERT OR REPLACE INTO meta VALUES ('schema', ?), ('model_digest', ?)",
                             (str(SCHEMA), self.model_digest))
            if self.epoch and (kept != self.epoch or problem):
                files.write_epoch(self.directory, self.epoch)
        except sqlite3.Error as exc:
            self.close_now()
            raise JournalError(files.sqlite_problem(self.directory, exc)) from None
        except OSError as exc:
            self.close_now()
            raise JournalError(files.os_problem(self.directory, exc)) from None
        if not self.damage and (aside := files.damaged_copies(self.directory)):
            self.damage = (f"{len(aside)} damaged journal(s) kept aside in {self.directory} and not resumed "
                           f"({', '.join(p.name for p in aside[-3:])}); inspect, then remove them (docs/"
                           "membership-and-faults.md, \"A damaged journal\")")
            log.warning("%s", self.damage)
        return self

    def _connect(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.directory / files.MAIN, check_same_thread=False, isolation_level=None)
        self._db = db
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")
        db.execute(f"PRAGMA journal_size_limit={JOURNAL_SIZE_LIMIT}")
        return db

    def _read(self, kept: int | None) -> list[str]:
        """Open the database and read it; the signs of damage SQLite itself finds (none: read)."""
        try:
            db = self._connect()
            check = [r[0] for r in db.execute("PRAGMA quick_check(5)").fetchall()]
            if check != ["ok"]:
                return [f"SQLite's quick_check of {files.MAIN} fails: {'; '.join(check)[:300]}"]
            tables = {name: [c[1] for c in db.execute(f"PRAGMA table_info({name})")]
                      for (name,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            if tables and {n: tables.get(n) for n in TABLES} != TABLES:
                return [f"{files.MAIN} does not have this journal's tables (schema mismatch: "
                        f"{', '.join(sorted(tables))[:200]})"]
            for sql in TABLE_SQL:
                db.execute(sql)
            meta = dict(db.execute("SELECT key, value FROM meta").fetchall())
            if meta.get("schema", str(SCHEMA)) != str(SCHEMA):
                return [f"{files.MAIN} has schema {meta['schema'][:20]!r}, not {SCHEMA} (schema mismatch)"]
            self.epoch = int(meta.get("epoch", 0))
            if kept is not None and kept > self.epoch:
                return [f"{files.MAIN} is at epoch {self.epoch}, {files.EPOCH_FILE} at {kept}: commits were lost"]
            rows = db.execute("SELECT id, priority, admitted, job FROM requests").fetchall()
            tokens: dict[str, list[tuple[int, bytes]]] = {}
            for rid, start, blob in db.execute("SELECT id, start, ids FROM tokens"):
                tokens.setdefault(rid, []).append((start, blob))
            entries = {}
            for rid, priority, admitted, job in rows:
                got: list[int] = []
                for start, blob in sorted(tokens.get(rid, ())):
                    if start != len(got):  # a gap cannot happen (batches commit in order); keep the prefix
                        break
                    got.extend(_unpack(blob))
                entries[rid] = Entry(rid, json.loads(job), priority, got, admitted)
        except sqlite3.OperationalError:
            raise  # the directory's fault (full, read-only, locked): JournalError
        except (sqlite3.DatabaseError, ValueError, TypeError) as exc:  # not a database, malformed, bad JSON
            return [f"{files.MAIN} cannot be read: {exc}"]
        if meta.get("model_digest") not in (None, self.model_digest):
            self.dropped_on_open = sorted(entries)
            log.warning("the journal in %s holds %d requests of another model; they are not resumed",
                        self.directory, len(self.dropped_on_open))
            db.execute("DELETE FROM requests")
            db.execute("DELETE FROM tokens")
        else:
            self.entries = entries
        return []

    def _reopen_empty(self, reasons: list[str], kept: int | None) -> None:
        """Move the damaged files aside, start an empty journal at the epoch kept, and report."""
        self.close_db()
        self.entries, self.epoch = {}, kept or 0
        aside = files.move_aside(self.directory, reasons)
        self._connect()
        for sql in TABLE_SQL:
            self._db.execute(sql)
        if kept:
            self._db.execute("INSERT OR REPLACE INTO meta VALUES ('epoch', ?)", (str(kept),))
            epoch = f"the fencing epoch ({kept}) is kept from {files.EPOCH_FILE}"
        else:
            self.epoch_lost = True
            epoch = ("the fencing epoch was lost with it: stages that remember a later one refuse this controller "
                     "until the operator lets it back in")
        self.damage = (f"the journal in {self.directory} was damaged ({'; '.join(reasons)}); it was moved aside to "
                       f"{aside} and not resumed, this controller started with an empty journal, and {epoch}; "
                       "inspect it and restore or remove it (docs/membership-and-faults.md, \"A damaged journal\")")
        log.error("%s", self.damage)

    def start(self) -> None:
        """Commit queued operations in the background from now on (in the running loop)."""
        if self._db is not None and self._flusher is None:
            self._flusher = asyncio.get_running_loop().create_task(self._flush_loop(), name="journal-writer")

    # ---- changes ----------------------------------------------------------------------------
    def admit(self, rid: str, job: dict, priority: int) -> None:
        self._apply(Op(ADMIT, rid, job=job, priority=priority))

    def tokens(self, rid: str, start: int, tokens) -> None:
        self._apply(Op(TOKENS, rid, start=start, tokens=tuple(tokens)))

    def drop(self, rid: str) -> None:
        if rid in self.entries:
            self._apply(Op(DROP, rid))

    def set_epoch(self, epoch: int) -> None:
        self._apply(Op(EPOCH, epoch=epoch))

    def apply(self, op: Op) -> None:
        """An operation from the active controller (a standby's copy)."""
        self._apply(op)

    def _apply(self, op: Op) -> None:
        if op.kind == ADMIT:
            self.entries[op.id] = Entry(op.id, op.job or {}, op.priority)
        elif op.kind == TOKENS:
            e = self.entries.get(op.id)
            if e is None or op.start != len(e.tokens):
                return  # not the continuation of what is kept (a late report): nothing to keep
            e.tokens.extend(op.tokens)
        elif op.kind == DROP:
            if self.entries.pop(op.id, None) is None:
                return
        elif op.kind == EPOCH:
            self.epoch = op.epoch
        self.seq += 1
        if self._db is not None:
            self._pending.append(op)
        for send in list(self._subscribers):
            send(op)

    # ---- shipping ---------------------------------------------------------------------------
    def snapshot(self) -> list[Op]:
        """Operations that rebuild what the journal holds now (a standby's starting point)."""
        ops = [Op(EPOCH, epoch=self.epoch)]
        for e in sorted(self.entries.values(), key=lambda e: e.priority):
            ops.append(Op(ADMIT, e.id, job=e.job, priority=e.priority))
            if e.tokens:
                ops.append(Op(TOKENS, e.id, start=0, tokens=tuple(e.tokens)))
        return ops

    def subscribe(self, send: Callable[[Op], None]) -> Callable[[], None]:
        """`send` gets every operation from now on; returns the unsubscribe."""
        self._subscribers.append(send)
        return lambda: self._subscribers.remove(send) if send in self._subscribers else None

    def replace(self, ops: list[Op]) -> None:
        """Become exactly the state these operations build (a standby receiving a snapshot)."""
        for rid in list(self.entries):
            self._apply(Op(DROP, rid))
        for op in ops:
            self._apply(op)

    # ---- writing ----------------------------------------------------------------------------
    async def _flush_loop(self) -> None:
        delay = FLUSH_S
        while True:
            await asyncio.sleep(delay)
            if not self._pending:
                continue
            try:
                await asyncio.to_thread(self._commit)
            except (sqlite3.Error, OSError) as exc:  # the operations stay queued and are tried again
                self._failed(exc)
                delay = min(delay * 2, RETRY_MAX_S)
                continue
            delay = FLUSH_S
            if self.failure is not None:
                log.warning("the request journal in %s is written again; new requests are admitted", self.directory)
                self.failure = None

    def _failed(self, exc: Exception) -> None:
        """A commit failed: from now on new requests are refused (check_durable), and the requests
        whose admission was in the failed batch fail (on_lost): nothing runs as if it were durable."""
        text = getattr(exc, "strerror", None) or str(exc)
        full = "full" in text or getattr(exc, "errno", None) in (errno.ENOSPC, errno.EDQUOT)
        why = (f"the request journal in {self.directory} cannot be written ({text}): "
               + ("free space there (or give the controller another --state-dir); " if full else
                  "check the disk and the directory's permissions; ")
               + "new requests are refused until it can")
        if self.failure is None:
            log.error("%s; retrying every %.0f s at most, logged again when it works", why, RETRY_MAX_S)
        self.failure = (ResourceExhausted if full else Unavailable)(why)
        lost = [op.id for op in self._pending if op.kind == ADMIT and op.id in self.entries]
        if lost:
            for cb in list(self.on_lost):
                cb(lost, self.failure)

    def check_durable(self) -> None:
        """Raises why a new request cannot be journaled now (ResourceExhausted: the disk is full;
        Unavailable: it cannot be written); nothing when it can."""
        if self.failure is not None:
            raise self.failure

    def state(self) -> str:
        """The journal's health in a few words (Status, `lpctl status`)."""
        if self.failure is not None:
            return f"failing: {self.failure}"
        if self.directory is None:
            return "in memory only (nothing survives a restart)"
        return f"ok ({self.directory})"

    def flush(self) -> None:
        """Commit what is queued now (synchronously)."""
        if self._db is not None and self._pending:
            self._commit()

    def _commit(self) -> None:
        with self._write_lock:
            ops, self._pending = self._pending, []
            if not ops or self._db is None:
                return
            db = self._db
            try:
                db.execute("BEGIN")
                for op in ops:
                    if op.kind == ADMIT:
                        db.execute("INSERT OR REPLACE INTO requests VALUES (?, ?, ?, ?)",
                                   (op.id, op.priority, time.time(), json.dumps(op.job, separators=(",", ":"))))
                        db.execute("DELETE FROM tokens WHERE id = ?", (op.id,))
                    elif op.kind == TOKENS:
                        db.execute("INSERT OR REPLACE INTO tokens VALUES (?, ?, ?)", (op.id, op.start, _pack(op.tokens)))
                    elif op.kind == DROP:
                        db.execute("DELETE FROM requests WHERE id = ?", (op.id,))
                        db.execute("DELETE FROM tokens WHERE id = ?", (op.id,))
                    elif op.kind == EPOCH:
                        db.execute("INSERT OR REPLACE INTO meta VALUES ('epoch', ?)", (str(op.epoch),))
                db.execute("COMMIT")
                epochs = [op.epoch for op in ops if op.kind == EPOCH]
                if epochs:  # beside the database: a damaged one does not take the epoch with it
                    files.write_epoch(self.directory, epochs[-1])
            except (sqlite3.Error, OSError):
                if db.in_transaction:
                    try:
                        db.execute("ROLLBACK")
                    except sqlite3.Error:
                        pass  # rolled back already by SQLite itself
                self._pending = ops + self._pending  # (each op applies the same twice: in order, idempotent)
                raise

    def rows(self) -> int:
        """Requests on disk (after a flush): what the journal's size is bounded by."""
        if self._db is None:
            return len(self.entries)
        with self._write_lock:
            return self._db.execute("SELECT COUNT(*) FROM requests").fetchone()[0]

    def mark_released(self, epoch: int) -> None:
        """The controller of `epoch` released every stage it held as it stopped (journal_files.write_released)."""
        if self.directory is None:
            return
        try:
            files.write_released(self.directory, epoch)
        except OSError as exc:
            log.warning("could not mark the stages released in %s: %s (the next controller waits out the lease)",
                        self.directory, exc)

    def take_released(self) -> int:
        """The epoch whose controller released its stages as it stopped, once (0: none)."""
        return files.take_released(self.directory) if self.directory is not None else 0

    async def close(self) -> None:
        """Commit what is queued and let go of the file and the lock."""
        if self._flusher is not None:
            self._flusher.cancel()
            self._flusher = None
        if self._db is not None:
            try:
                await asyncio.to_thread(self._commit)
            except (sqlite3.Error, OSError) as exc:
                log.error("writing the request journal at stop failed: %s", exc)
        self.close_now()

    def close_db(self) -> None:
        if self._db is not None:
            with self._write_lock:
                self._db.close()
            self._db = None

    def close_now(self) -> None:
        self.close_db()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
