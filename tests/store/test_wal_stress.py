"""The SQLite store under what corrupted it in production: several processes writing one WAL-mode file while
checkpoints from other connections reset the WAL, then `PRAGMA integrity_check` must say "ok".

SQLite 3.7.0 to 3.51.2 can corrupt a WAL database when one connection checkpoints right after another
checkpoint completed while a third connection's commit restarts the WAL (https://sqlite.org/wal.html#walresetbug;
the orchestrator, the gateway and their checkpointer threads do exactly that). Here: WRITERS processes, each a
real `SqliteStore` with its own checkpointer thread, write an episode's records round after round, while a
thread of this process runs back-to-back PASSIVE, RESTART and TRUNCATE checkpoints on its own connection (each
RESTART / TRUNCATE that completes resets the WAL under the writers). Afterwards the file must be sound, the
store's invariants must hold, and every record must be there exactly once.

Quick size in `make test` (a few seconds); RLGATE_FULL=1 for the full size (a few minutes).
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import apsw
import pytest

from rlgate.store import Session
from rlgate.store.sqlite import SqliteStore
from tests.store import sqlite_files, worker
from tests.store.test_processes import run_worker

FULL = os.environ.get("RLGATE_FULL", "").strip().lower() not in ("", "0", "false", "no")
WRITERS = 3
ROUNDS = 10_000 if FULL else 1000  # per writer; about five commits a round
LIMIT_S = 1800.0 if FULL else 240.0  # per writer process


@dataclass
class Hammer:
    """Checkpoints back to back from a connection of its own until stopped; counts what completed."""

    path: Path
    attempts: int = 0
    resets: int = 0  # RESTART / TRUNCATE checkpoints that copied a non-empty WAL: each one resets it
    busy: int = 0
    errors: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        conn = sqlite_files.connect(self.path)
        conn.set_busy_timeout(50)  # a RESTART / TRUNCATE waits this long for writers and readers, then skips
        try:
            while not self._stop.is_set():
                # A checkpoint that completes, another right after it, and one more that truncates: the
                # sequence the bug needs, while the writers' commits restart the WAL under them.
                for mode in ("PASSIVE", "RESTART", "TRUNCATE"):
                    self.attempts += 1
                    try:
                        busy, log, copied = conn.execute(f"PRAGMA wal_checkpoint({mode})").fetchone() or (1, 0, 0)
                    except apsw.BusyError:
                        self.busy += 1
                        continue
                    except apsw.Error as exc:
                        self.errors.append(f"{mode}: {exc!r}")
                        return
                    if busy:
                        self.busy += 1
                    elif mode != "PASSIVE" and log > 0 and copied == log:
                        self.resets += 1
                time.sleep(0.001)  # leave the two cores to the writers now and then
        finally:
            conn.close()

    def stop(self) -> None:
        self._stop.set()


@pytest.mark.timeout(LIMIT_S + 120)
async def test_writers_and_wal_resets_leave_a_sound_file(tmp_path: Path) -> None:
    path = tmp_path / "store.db"
    url = f"sqlite:///{path}"
    store = await SqliteStore.open(str(path))
    await store.create_session(Session(session_id=worker.SHARED_COUNTER, env_key="counter"))
    hammer = Hammer(path)
    thread = threading.Thread(target=hammer.run, name="checkpoint-hammer", daemon=True)
    started = time.monotonic()
    thread.start()
    try:
        results = await asyncio.gather(
            *(run_worker(url, "stress", f"w{n}", str(ROUNDS), limit_s=LIMIT_S) for n in range(WRITERS))
        )
    finally:
        hammer.stop()
        await asyncio.to_thread(thread.join, 30)
    elapsed = time.monotonic() - started
    commits = sum(r["commits"] for r in results)
    print(
        f"\nwal stress: {WRITERS} writers x {ROUNDS} rounds = {commits} commits in {elapsed:.1f} s; "
        f"{hammer.attempts} checkpoints ({hammer.resets} WAL resets, {hammer.busy} busy)"
    )
    assert not thread.is_alive()
    assert hammer.errors == []
    assert hammer.resets > 0, "no checkpoint ever reset the WAL: the test did not test what it is for"
    assert commits >= WRITERS * ROUNDS * 5

    try:
        assert sqlite_files.integrity(path) == ["ok"]
        assert await store.check_invariants() == []
        closed = ROUNDS // worker.CLOSE_EVERY  # closed and pruned, with their logs
        for n in range(WRITERS):
            kept, cursor = await store.list_sessions(run_id=f"w{n}", limit=1000)
            while cursor:
                page, cursor = await store.list_sessions(run_id=f"w{n}", limit=1000, cursor=cursor)
                kept.extend(page)
            assert len(kept) == ROUNDS - closed
            assert all(s.turn == 1 and s.version == 2 for s in kept)
            assert [e.request_id for e in await store.list_tool_calls(f"w{n}-0")] == ["c0"]
            assert await store.get_request(f"step:w{n}-{ROUNDS - 1}", f"s{ROUNDS - 1}") is not None
        counter = await store.get_session(worker.SHARED_COUNTER)
        assert counter is not None and counter.turn == WRITERS * ROUNDS
        await store.health()
    finally:
        await store.close()
    assert sqlite_files.integrity(path) == ["ok"]
