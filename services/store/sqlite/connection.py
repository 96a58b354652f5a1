"""The SQLite store's connection: opened, checked and migrated on its own worker thread; transactions;
the plumbing every call of the store runs through (`SqliteBase`)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import time
from collections.abc import Callable
from typing import Any, Self, TypeVar

import apsw

from rlgate.core.backoff import Backoff
from rlgate.store._checkpointer import JOURNAL_SIZE_LIMIT, Checkpointer
from rlgate.store._worker import Abandoned, GroupLost, ThreadWorker, WorkerStopped
from rlgate.store.claims import BackgroundWrites
from rlgate.store.models import StoreCorrupt, StoreError, StoreFull
from rlgate.store.sqlite.library import check_sqlite_library, corrupt_error
from rlgate.store.sqlite.schema import migrate
from rlgate.store.sqlite.sql import transaction

log = logging.getLogger(__name__)

T = TypeVar("T")

# How long a write waits between tries for the write lock another process holds. SQLite's own busy timeout
# sleeps 1, 2, 5, 10, 15, 20, 25, 25, 25, 50, 50, 100 ms between tries: a process that misses the lock a few
# times sleeps tens of ms while the lock is free again within a fraction of one (another process's group
# commit), and every store call of the process waits behind it on its worker thread. Retried in well under a
# millisecond at first, never more than a few apart: the sleeps cost a wakeup each, the lock is seldom held long.
BUSY_BACKOFF = Backoff(0.0002, 0.004, jitter=0.5)
QUICK_CHECK_BUDGET_S = 5.0  # open()'s quick_check gives up (and logs) past this: it reads every page
_QUICK_CHECK_STEPS = 1000  # how often (in SQLite's steps) the quick_check looks at the clock
CORRUPT_ERRORS = (apsw.CorruptError, apsw.NotADBError)


def quick_check(conn: apsw.Connection, path: str) -> None:
    """StoreCorrupt unless `PRAGMA quick_check` passes. O(file size) but fast (it reads each page once and
    skips index-vs-table checks); past QUICK_CHECK_BUDGET_S it is interrupted and the store opens with a
    warning, so a huge store still starts."""
    deadline = time.monotonic() + QUICK_CHECK_BUDGET_S
    conn.set_progress_handler(lambda: time.monotonic() > deadline, _QUICK_CHECK_STEPS)
    try:
        problems = [str(row[0]).replace("\n", "; ") for row in conn.execute("PRAGMA quick_check(5)")]
    except apsw.InterruptError:
        log.warning(
            "sqlite store %s: quick_check stopped after %.0f s (%d MB); opened unchecked",
            path,
            QUICK_CHECK_BUDGET_S,
            os.path.getsize(path) // 2**20,
        )
        return
    finally:
        conn.set_progress_handler(None)
    if problems != ["ok"]:
        raise corrupt_error(path, "quick_check: " + "; ".join(problems))


class BusyWait:
    """The connection's busy handler: try again after a `BUSY_BACKOFF` delay until `budget_s` has passed since
    the first refusal of this lock, then give up (SQLITE_BUSY: a `StoreError`). Runs on the worker thread."""

    def __init__(self, budget_s: float) -> None:
        self.budget_s = budget_s
        self._since = 0.0

    def __call__(self, prior_calls: int) -> bool:
        now = time.monotonic()
        if prior_calls == 0:
            self._since = now
        elif now - self._since >= self.budget_s:
            return False
        time.sleep(BUSY_BACKOFF.delay(prior_calls))
        return True


def connect(path: str, busy_timeout_s: float) -> apsw.Connection:
    """Open, check and migrate the database (runs on the store's worker thread)."""
    if path != ":memory:":
        parent = os.path.dirname(os.path.abspath(path))
        os.makedirs(parent, exist_ok=True)
    conn = apsw.Connection(path)  # read-write, created if missing; autocommit until an explicit BEGIN
    try:
        conn.set_busy_handler(BusyWait(busy_timeout_s))
        retry_busy(lambda: conn.execute("PRAGMA journal_mode = WAL").fetchall(), busy_timeout_s)
        conn.execute("PRAGMA synchronous = NORMAL")
        if path != ":memory:":
            conn.execute("PRAGMA wal_autocheckpoint = 0")  # the Checkpointer's job
            conn.execute(f"PRAGMA journal_size_limit = {JOURNAL_SIZE_LIMIT}")
            quick_check(conn, path)
        with transaction(conn):
            migrate(conn)
    except CORRUPT_ERRORS as exc:
        conn.close()
        raise corrupt_error(path, str(exc)) from exc
    except BaseException:
        conn.close()
        raise
    return conn


def retry_busy(op: Callable[[], object], budget_s: float) -> None:
    """Switching to WAL needs a moment with no other writer; retry while another process holds the lock
    (this switch answers SQLITE_BUSY at once rather than calling the busy handler), on its schedule."""
    wait = BusyWait(budget_s)
    for tries in itertools.count():
        try:
            op()
            return
        except apsw.BusyError:
            if not wait(tries):
                raise


class GroupCommit:
    """The writes the worker runs back to back share one BEGIN IMMEDIATE transaction (group commit). Each runs
    in a SAVEPOINT of its own, so one that fails undoes only itself; the worker COMMITs before it answers any
    call of the group (`ThreadWorker`'s groups), so every reply still follows its own durable write, and a
    failed COMMIT fails every call of the group. Reads queued among the writes run in the open transaction
    and are answered after the COMMIT too (they may have seen the group's writes). The write lock is held
    from the group's BEGIN, so each write's read-check-write stays atomic for other processes, which see a
    group's writes all at once. Fewer transactions: fewer WAL lock calls, and a page that several writes of
    a group touch is appended to the WAL once."""

    def __init__(self, conn: apsw.Connection) -> None:
        self._conn = conn
        self._open = False

    def run(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> Any:
        try:
            return fn(*args)
        except BaseException as exc:
            if self._open and not self._conn.in_transaction:  # SQLite rolled the whole transaction back
                self._open = False
                raise GroupLost(exc) from exc
            raise

    def write(self, conn: apsw.Connection, fn: Callable[..., T], *args: Any) -> T:
        """`fn(conn, *args)` in its own savepoint of the group's transaction (begun if none is open)."""
        if not self._open:
            conn.execute("BEGIN IMMEDIATE")
            self._open = True
        conn.execute("SAVEPOINT write")
        try:
            result = fn(conn, *args)
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK TO write")
                conn.execute("RELEASE write")
            raise
        conn.execute("RELEASE write")
        return result

    def finish(self) -> BaseException | None:
        if not self._open:
            return None
        self._open = False
        try:
            self._conn.execute("COMMIT")
        except BaseException as exc:
            if self._conn.in_transaction:  # never leave the connection mid-transaction
                with contextlib.suppress(apsw.Error):
                    self._conn.execute("ROLLBACK")
            return exc
        return None


class SqliteBase:
    """The store's connection and its worker thread: every backend call runs through `_run` (a read) or
    `_write` (its own savepoint of a BEGIN IMMEDIATE transaction that the writes queued with it share:
    `GroupCommit`). The concerns' mixins (sessions, requests, ...) build on it."""

    def __init__(
        self, path: str, conn: apsw.Connection, worker: ThreadWorker, checkpointer: Checkpointer | None = None
    ) -> None:
        self.path = path
        self._conn = conn
        self._worker = worker
        self.checkpointer = checkpointer
        self._closed = False
        self._background = BackgroundWrites()
        self._corrupt = ""  # what the first malformed page a call met said; health() fails from then on
        self._group = GroupCommit(conn)

    @classmethod
    async def open(cls, path: str, *, busy_timeout_s: float = 15.0) -> Self:
        """Open (creating, checking and migrating) the database at `path`. StoreCorrupt if the file is damaged,
        StoreError if it cannot be opened or the SQLite library is too old (MIN_SQLITE_VERSION)."""
        check_sqlite_library()
        worker = ThreadWorker("rlgate-sqlite")
        try:
            conn = await worker.submit(connect, path, busy_timeout_s)
        except StoreCorrupt:
            worker.stop()
            raise
        except (StoreError, apsw.Error, OSError) as exc:  # StoreError: a schema from a newer rlgate
            worker.stop()
            kind = StoreFull if isinstance(exc, apsw.FullError) else StoreError
            raise kind(f"cannot open sqlite store {path!r}: {exc}") from exc
        except BaseException:
            worker.stop()
            raise
        checkpointer = Checkpointer(path).start() if path != ":memory:" else None
        return cls(path, conn, worker, checkpointer)

    def __repr__(self) -> str:
        return f"SqliteStore({self.path!r})"

    async def _run(
        self, fn: Callable[..., T], *args: Any, abandoned: Abandoned | None = None, grouped: bool = True
    ) -> T:
        """Run `fn(conn, *args)` on the worker thread, in the writes' open transaction if there is one
        (`grouped=False`: after it is committed, for a call that runs a transaction of its own). A cancelled
        caller does not undo a started write; `abandoned(result)` gets the result of one whose caller was
        cancelled."""
        if self._closed:
            raise StoreError("store is closed")
        try:
            return await self._worker.submit(
                fn, self._conn, *args, abandoned=abandoned, group=self._group if grouped else None
            )
        except apsw.Error as exc:
            raise self._error(exc) from exc
        except WorkerStopped as exc:  # a concurrent close() got there first
            raise StoreError("store is closed") from exc

    def _error(self, exc: apsw.Error) -> StoreError:
        """The StoreError for an SQLite error: StoreCorrupt (remembered for health()), StoreFull, or plain."""
        if isinstance(exc, CORRUPT_ERRORS):
            self._corrupt = self._corrupt or str(exc)
            return corrupt_error(self.path, str(exc))
        if isinstance(exc, apsw.FullError):
            return StoreFull(f"sqlite store {self.path!r} is full ({exc}): free disk space")
        return StoreError(f"sqlite store {self.path!r}: {exc}")

    async def _write(self, fn: Callable[..., T], *args: Any, abandoned: Abandoned | None = None) -> T:
        """Run `fn(conn, *args)` atomically: in its own savepoint of a BEGIN IMMEDIATE transaction, answered
        once that transaction is committed (`GroupCommit`)."""
        return await self._run(self._group.write, fn, *args, abandoned=abandoned)

    async def close(self) -> None:
        if self._closed:
            return
        await self._background.drain()  # releases of abandoned claims, before the connection goes
        self._closed = True
        try:
            await self._worker.submit(self._conn.close)  # after every call already queued
        finally:
            self._worker.stop()
            if self.checkpointer is not None:
                await asyncio.to_thread(self.checkpointer.stop)
