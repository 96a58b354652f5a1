"""The SQLite store's wait for another process's write lock (`BusyWait`): it retries within milliseconds, so a
write follows a lock's release closely (SQLite's own busy timeout sleeps up to 100 ms between tries), and it
gives up once its budget is spent: a `StoreError`, never a hang. The lock is held through apsw, the SQLite
library the store runs on (tests/store/sqlite_files.py says why)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from rlgate.store import Session, SessionStatus, StoreError
from rlgate.store.sqlite import SqliteStore
from rlgate.store.sqlite.connection import BUSY_BACKOFF, BusyWait
from tests.store.sqlite_files import hold_write_lock

HELD_S = 0.3  # how long the other writer holds the lock: past SQLite's own sleeps of 1 ... 50 ms


def session(sid: str) -> Session:
    return Session(session_id=sid, env_key="mail:v1", status=SessionStatus.ACTIVE, token_hash=f"tok-{sid}")


def test_the_handler_retries_after_short_sleeps_until_its_budget_is_spent() -> None:
    wait = BusyWait(budget_s=0.05)
    start = time.monotonic()
    tries = 0
    while wait(tries):
        tries += 1
    spent = time.monotonic() - start
    # Many tries, none apart by more than the backoff's ceiling (plus jitter): a lock freed meanwhile is
    # taken within that.
    assert tries >= 0.05 / (BUSY_BACKOFF.maximum * (1 + BUSY_BACKOFF.jitter)), tries
    assert 0.05 <= spent < 1.0, spent
    assert BusyWait(budget_s=10.0)(0) is True  # a new lock's first refusal starts a new budget


async def test_a_write_behind_another_writer_lands_soon_after_the_lock_is_let_go(tmp_path: Path) -> None:
    path = tmp_path / "store.db"
    store = await SqliteStore.open(str(path))
    try:
        other = hold_write_lock(path)
        write = asyncio.ensure_future(store.create_session(session("s1")))
        await asyncio.sleep(HELD_S)
        assert not write.done()  # waiting for the lock, not failed
        other.execute("ROLLBACK")
        released = time.monotonic()
        other.close()
        await write
        # Generous: SQLite's own handler would be asleep for up to 50 ms more at this point of its schedule.
        assert time.monotonic() - released < 1.0
        assert await store.get_session("s1") is not None
    finally:
        await store.close()


async def test_a_write_gives_up_with_a_store_error_once_its_budget_is_spent(tmp_path: Path) -> None:
    path = tmp_path / "store.db"
    store = await SqliteStore.open(str(path), busy_timeout_s=0.2)
    other = hold_write_lock(path)
    try:
        start = time.monotonic()
        with pytest.raises(StoreError):
            await store.create_session(session("s1"))
        assert 0.2 <= time.monotonic() - start < 5.0
    finally:
        other.execute("ROLLBACK")
        other.close()
    try:
        await store.create_session(session("s1"))  # the lock gone, the store writes again
        assert await store.get_session("s1") is not None
    finally:
        await store.close()
