"""WAL checkpoints on a thread of their own, so no store call waits for one.

SQLite's default checkpoints inside the COMMIT that pushes the WAL past 1,000 pages: that commit copies the
WAL into the database and, with `synchronous=NORMAL`, fsyncs both files, which held up its caller (and every
store call queued behind it on the worker thread) about once per 200 writes: a tail that every caller of
the store paid now and then (the benchmarks log in docs/ has the figures). So the store's connection runs
with `wal_autocheckpoint = 0`, and a `Checkpointer` makes passive checkpoints from its own connection every
INTERVAL_S: they never block writers or readers, and the next writer after one that copied everything
restarts the WAL from its start (`journal_size_limit` then trims the file). Under steady writes a commit
lands during nearly every passive checkpoint and that restart never comes, so past RESTART_PAGES the
checkpointer restarts the WAL itself, holding writers back for the little the passive checkpoint left and
one fsync (at most RESTART_BUSY_TIMEOUT_S, then it tries again later). Any process sharing the file may
checkpoint it; one at a time does, the others skip that round. Checkpoints from several connections racing
with commits are what the WAL-reset bug needs, so this runs on apsw's SQLite, as the store does (see
`sqlite.py`).
"""

from __future__ import annotations

import logging
import threading

import apsw

log = logging.getLogger(__name__)

INTERVAL_S = 0.25  # between checkpoint attempts: a few MB of WAL at most under heavy write load
RESTART_PAGES = 8192  # a WAL this long (32 MiB of 4 KiB pages) is restarted even if writers must wait
RESTART_BUSY_TIMEOUT_S = 0.25  # how long a restart may hold writers back waiting for the lock and readers
JOURNAL_SIZE_LIMIT = 64 * 2**20  # bytes of WAL file kept after a restart


class Checkpointer:
    """A daemon thread checkpointing the database at `path` every `interval_s` until `stop()`."""

    def __init__(self, path: str, *, interval_s: float | None = None) -> None:
        self.path = path
        self.interval_s = INTERVAL_S if interval_s is None else interval_s
        self.checkpoints = 0  # passive checkpoints with something in the WAL (for tests and curiosity)
        self.restarts = 0  # completed restarts of a long WAL
        self._failing = False  # the last round failed for another reason than a lock (warned once per streak)
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rlgate-sqlite-checkpoint", daemon=True)

    def start(self) -> Checkpointer:
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        """Ask the thread to end and wait for it (blocking: call it off the event loop)."""
        self._stopping.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    @property
    def thread(self) -> threading.Thread:
        return self._thread

    def _run(self) -> None:
        try:
            # The store's own connection created the file; this one never creates it. No busy timeout: a
            # round that meets a lock is skipped.
            conn = apsw.Connection(self.path, flags=apsw.SQLITE_OPEN_READWRITE)
            conn.set_busy_timeout(0)
        except apsw.Error as exc:  # the store's own connection would have failed first; keep serving
            log.warning("sqlite checkpointer for %s could not connect: %s", self.path, exc)
            return
        try:
            while not self._stopping.wait(self.interval_s):
                self.checkpoint(conn)
        finally:
            conn.close()

    def checkpoint(self, conn: apsw.Connection) -> None:
        try:
            _busy, wal_pages, _copied = _checkpoint(conn, "PASSIVE")
            self.checkpoints += wal_pages > 0
            if wal_pages >= RESTART_PAGES:  # see the module's docstring
                conn.set_busy_timeout(int(RESTART_BUSY_TIMEOUT_S * 1000))
                try:
                    busy, _pages, _copied = _checkpoint(conn, "RESTART")
                    self.restarts += not busy
                finally:
                    conn.set_busy_timeout(0)
            self._failing = False
        except (apsw.BusyError, apsw.LockedError) as exc:  # another process is checkpointing, or contention
            log.debug("sqlite checkpoint skipped: %s", exc)
        except apsw.Error as exc:  # e.g. a corrupt or full store: the store's calls say so; keep trying
            if not self._failing:
                log.warning("sqlite checkpoint of %s failed: %s", self.path, exc)
            self._failing = True


def _checkpoint(conn: apsw.Connection, mode: str) -> tuple[int, int, int]:
    """`PRAGMA wal_checkpoint(mode)`: (1 if it could not finish for a lock else 0, WAL pages, pages copied)."""
    row = conn.execute(f"PRAGMA wal_checkpoint({mode})").fetchone()
    assert row is not None  # the pragma always answers one row
    busy, pages, copied = row
    return int(busy), int(pages), int(copied)
