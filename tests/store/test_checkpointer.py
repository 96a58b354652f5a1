"""The SQLite store's WAL checkpoints: made by `_checkpointer.Checkpointer` on its own thread, never inside a
store call's commit, with the WAL kept bounded under steady writes and the thread gone after close()."""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

import pytest

from rlgate.store import Session, SessionStatus, ToolCallEntry, _checkpointer
from rlgate.store.sqlite import SqliteStore
from tests.store import sqlite_files


def wal_pages(path: Path) -> int:
    size = os.path.getsize(f"{path}-wal") if os.path.exists(f"{path}-wal") else 0
    return size // 4096


async def write_calls(store: SqliteStore, n: int) -> None:
    """What the gateway writes per CallTool: a claim, then the log entry and DONE record."""
    for _ in range(n):
        rid = uuid.uuid4().hex
        await store.authorize_call("th", rid, "owner")
        entry = ToolCallEntry(session_id="s1", episode=1, request_id=rid, tool="t", result_summary="x" * 200)
        await store.commit(request=("call:s1", rid, "r" * 900), tool_call=entry)


async def open_with_session(path: Path) -> SqliteStore:
    store = await SqliteStore.open(str(path))
    await store.create_session(Session(session_id="s1", env_key="e:v", status=SessionStatus.ACTIVE, token_hash="th"))
    return store


async def test_commits_never_checkpoint_and_the_checkpointer_does(tmp_path: Path) -> None:
    path = tmp_path / "store.db"
    store = await open_with_session(path)
    try:
        assert store.checkpointer is not None and store.checkpointer.thread.is_alive()
        with sqlite_files.connection(path) as probe:  # the setting is per connection: ask the store's own
            assert sqlite_files.value(probe, "PRAGMA journal_mode") == "wal"
        assert await store._run(sqlite_files.value, "PRAGMA wal_autocheckpoint") == 0
        await write_calls(store, 300)
        deadline = time.monotonic() + 10
        while store.checkpointer.checkpoints == 0:
            assert time.monotonic() < deadline, "no checkpoint within 10 s"
            await write_calls(store, 10)
    finally:
        await store.close()
    assert store.checkpointer is not None and not store.checkpointer.thread.is_alive()


async def test_the_wal_stays_bounded_under_steady_writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A passive checkpoint alone never lets the WAL restart while commits keep landing during it (it grew
    without bound in a benchmark); past RESTART_PAGES the checkpointer restarts it."""
    monkeypatch.setattr(_checkpointer, "RESTART_PAGES", 256)
    monkeypatch.setattr(_checkpointer, "INTERVAL_S", 0.02)
    path = tmp_path / "store.db"
    store = await open_with_session(path)
    try:
        largest = 0
        for _ in range(20):
            await write_calls(store, 100)
            largest = max(largest, wal_pages(path))
        assert store.checkpointer is not None and store.checkpointer.restarts > 0
        # 2,000 calls write ~24,000 pages (unbounded, the WAL ends there); bounded stays far below, with room
        # for a checkpointer thread that a loaded machine schedules late.
        assert largest < 10_000, f"WAL reached {largest} pages"
    finally:
        await store.close()


async def test_a_reader_from_another_connection_sees_every_commit(tmp_path: Path) -> None:
    """Checkpoints moving pages from the WAL into the file lose nothing a reader can see."""
    path = tmp_path / "store.db"
    store = await open_with_session(path)
    try:
        await write_calls(store, 500)
        with sqlite_files.connection(path, read_only=True) as reader:
            assert sqlite_files.value(reader, "SELECT count(*) FROM tool_calls") == 500
        assert sqlite_files.integrity(path) == ["ok"]
    finally:
        await store.close()
