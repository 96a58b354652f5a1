"""A store that cannot serve says so: the SQLite library must be past the WAL-reset bug, a corrupt file is
refused at open with StoreCorrupt (naming the file and the recovery doc), and `health()` (a read + write probe)
fails on a corrupt or full store, on both backends, and leaves nothing behind when it passes."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
import time
from pathlib import Path

import apsw
import pytest
import redis.asyncio as aioredis

from rlgate.store import (
    MemoryStore,
    Session,
    SessionStatus,
    SessionStore,
    StoreCorrupt,
    StoreError,
    StoreFull,
    ToolCallEntry,
    open_store,
)
from rlgate.store import sqlite as sqlite_store
from rlgate.store.redis import RedisStore
from rlgate.store.sqlite import MIN_SQLITE_VERSION, SCHEMA_VERSION, SqliteStore, check_sqlite_library
from rlgate.store.sqlite import connection as sqlite_connection
from rlgate.store.sqlite import library as sqlite_library
from tests.store import sqlite_files
from tests.store.conftest import Backend
from tests.support.redis import RedisServer


async def fill(store: SessionStore, n: int = 200) -> None:
    """Sessions with labels and logged calls: enough rows for tables and indexes over several pages."""
    for i in range(n):
        await store.create_session(
            Session(
                session_id=f"s{i:04d}",
                env_key="mail:v1",
                run_id="r",
                labels={"k": "v"},
                status=SessionStatus.ACTIVE,
                token_hash=f"t{i}",
            )
        )
        await store.append_tool_call(ToolCallEntry(f"s{i:04d}", 1, "c1", "search", result_summary="x" * 300))


async def filled_file(path: Path) -> Path:
    store = await SqliteStore.open(str(path))
    try:
        await fill(store)
    finally:
        await store.close()
    sqlite_files.checkpoint_truncate(path)  # the file alone holds every page, so garbage in it is what is read
    return path


# -- the library ----------------------------------------------------------------------------------------------
def test_the_store_runs_on_a_sqlite_past_the_wal_reset_bug() -> None:
    version = check_sqlite_library()
    assert tuple(int(p) for p in version.split(".")) >= MIN_SQLITE_VERSION == (3, 51, 3)
    assert version == apsw.sqlite_lib_version()


@pytest.mark.parametrize("old", ["3.40.1", "3.51.2", "3.7.0"])
async def test_an_older_sqlite_library_is_refused(old: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sqlite_library, "sqlite_library_version", lambda: old)
    with pytest.raises(StoreError, match=rf"needs SQLite 3\.51\.3 or later, .* runs SQLite {old}.*WAL-reset"):
        await SqliteStore.open(str(tmp_path / "store.db"))
    assert not (tmp_path / "store.db").exists()  # refused before the file is touched


def test_fixed_releases_pass_the_library_check(monkeypatch: pytest.MonkeyPatch) -> None:
    for fixed in ("3.51.3", "3.52.0", "3.54.1", "4.0.0"):
        monkeypatch.setattr(sqlite_library, "sqlite_library_version", lambda fixed=fixed: fixed)
        assert check_sqlite_library() == fixed


# -- corrupt files are refused at open ----------------------------------------------------------------------------
async def test_a_file_with_garbage_pages_is_refused_at_open(tmp_path: Path) -> None:
    path = await filled_file(tmp_path / "store.db")
    roots = sqlite_files.root_pages(path)
    sqlite_files.overwrite_pages(path, [roots["tool_calls"], roots["sessions_token"]])
    with pytest.raises(StoreCorrupt) as refused:
        await open_store(f"sqlite:///{path}")  # what every service calls at start-up
    message = str(refused.value)
    assert str(path.resolve()) in message and "docs/operations.md" in message and "quick_check" in message
    assert "will not run on it" in message


async def test_a_file_with_a_garbage_header_is_refused_at_open(tmp_path: Path) -> None:
    path = await filled_file(tmp_path / "store.db")
    sqlite_files.overwrite_pages(path, [1])
    with pytest.raises(StoreCorrupt, match="not a database") as refused:
        await SqliteStore.open(str(path))
    assert str(path.resolve()) in str(refused.value) and "docs/operations.md" in str(refused.value)


async def test_a_quick_check_over_its_budget_opens_with_a_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    path = await filled_file(tmp_path / "store.db")
    monkeypatch.setattr(sqlite_connection, "QUICK_CHECK_BUDGET_S", -1.0)  # out of time at the first look at the clock
    monkeypatch.setattr(sqlite_connection, "_QUICK_CHECK_STEPS", 1)
    with caplog.at_level(logging.WARNING, logger="rlgate.store.sqlite"):
        store = await SqliteStore.open(str(path))
    try:
        assert "opened unchecked" in caplog.text
        assert await store.count_open_sessions() == 200
    finally:
        await store.close()


# -- health() -----------------------------------------------------------------------------------------------------
async def test_health_passes_and_leaves_nothing_behind(store: SessionStore, backend: Backend) -> None:
    await store.acquire_lease("leader", "me", 60)
    for _ in range(3):
        await store.health()
    if isinstance(store, MemoryStore):
        assert list(store.data.leases) == ["leader"]
    elif backend.redis is None:
        with sqlite_files.connection(backend.url.removeprefix("sqlite:///"), read_only=True) as conn:
            assert list(conn.execute("SELECT name FROM leases")) == [("leader",)]
    else:
        client = aioredis.Redis.from_url(backend.url, decode_responses=True)
        try:
            assert [key async for key in client.scan_iter(match="*health*")] == []
        finally:
            await client.aclose()
    await store.close()
    with pytest.raises(StoreError, match="closed"):
        await store.health()


async def test_health_fails_on_a_file_corrupted_under_an_open_store(tmp_path: Path) -> None:
    path = await filled_file(tmp_path / "store.db")
    store = await SqliteStore.open(str(path))
    try:
        await store.health()
        sqlite_files.checkpoint_truncate(path)
        roots = sqlite_files.root_pages(path)
        sqlite_files.overwrite_pages(path, [roots["leases"], roots["sessions"]])
        with sqlite_files.connection(path) as other:  # another process commits: the store rereads the file
            other.execute("INSERT INTO owners (owner, expires_at) VALUES ('other', 0)")
        with pytest.raises(StoreCorrupt, match="malformed") as unhealthy:
            await store.health()
        assert str(path.resolve()) in str(unhealthy.value) and "docs/operations.md" in str(unhealthy.value)
        with pytest.raises(StoreCorrupt):
            await store.get_session("s0001")
        with pytest.raises(StoreCorrupt):  # stays unhealthy: corruption does not heal by itself
            await store.health()
    finally:
        await store.close()


async def test_a_malformed_page_met_by_any_call_makes_health_fail(tmp_path: Path) -> None:
    path = await filled_file(tmp_path / "store.db")
    store = await SqliteStore.open(str(path))
    try:
        sqlite_files.checkpoint_truncate(path)
        sqlite_files.overwrite_pages(path, [sqlite_files.root_pages(path)["tool_calls"]])
        with sqlite_files.connection(path) as other:
            other.execute("INSERT INTO owners (owner, expires_at) VALUES ('other', 0)")
        with pytest.raises(StoreCorrupt):
            await store.list_tool_calls("s0001")
        with pytest.raises(StoreCorrupt, match="malformed"):
            await store.health()
    finally:
        await store.close()


async def test_health_fails_on_a_full_store_and_recovers_when_room_is_made(tmp_path: Path) -> None:
    store = await SqliteStore.open(str(tmp_path / "store.db"))
    try:
        await store.create_session(Session(session_id="s1", env_key="mail:v1"))

        def cap(conn: apsw.Connection, pages: int | None) -> int:
            """Cap the file at its current size (SQLite's page limit stands in for a full disk), or lift it."""
            assert sqlite_files.value(conn, "PRAGMA freelist_count") == 0  # no free page left to reuse
            limit = pages if pages is not None else sqlite_files.value(conn, "PRAGMA page_count")
            return int(sqlite_files.value(conn, f"PRAGMA max_page_count = {limit}"))

        await store._run(cap, None)
        with pytest.raises(StoreFull, match="full"):
            await store.health()
        with pytest.raises(StoreFull):  # a write that needs room fails the same way
            await store.create_session(Session(session_id="s2", env_key="mail:v1", task_key="k" * 10_000))
        assert await store.get_session("s1") is not None  # reads still work
        await store._run(lambda conn: conn.execute("PRAGMA max_page_count = 1073741823"))
        await store.health()  # full is not sticky: room made, healthy again
        await store.create_session(Session(session_id="s2", env_key="mail:v1", task_key="k" * 10_000))
    finally:
        await store.close()


@pytest.mark.redis
async def test_redis_health_fails_on_a_full_server_and_recovers(redis_server: RedisServer) -> None:
    store = await RedisStore.open(redis_server.url)
    client = aioredis.Redis.from_url(redis_server.url)
    try:
        await store.health()
        await client.config_set("maxmemory-policy", "noeviction")
        await client.config_set("maxmemory", "1")  # every write is now refused with OOM
        with pytest.raises(StoreFull, match="maxmemory"):
            await store.health()
        await client.config_set("maxmemory", "0")
        await store.health()
    finally:
        await client.aclose()
        await store.close()


@pytest.mark.redis
async def test_redis_health_fails_at_once_when_the_server_is_gone(redis_server: RedisServer) -> None:
    store = await RedisStore.open(redis_server.url)  # retry_s=20: ordinary calls ride out an outage
    try:
        await redis_server.stop_async()
        started = time.monotonic()
        with pytest.raises(StoreError):
            await store.health()
        assert time.monotonic() - started < 5  # one attempt: a health check answers now
    finally:
        await store.close()


# -- recovery, as docs/operations.md tells it -------------------------------------------------------------------
def test_the_doc_the_error_points_to_exists() -> None:
    doc = Path(__file__).resolve().parents[2] / "docs" / "operations.md"
    assert sqlite_store.RECOVERY_DOC == 'docs/operations.md, "Recovering a store"'
    assert "\n## Recovering a store\n" in doc.read_text()


def test_the_documented_salvage_gives_back_a_store_that_opens(tmp_path: Path) -> None:
    """docs/operations.md: `.clone` the broken file into a new one with the sqlite3 shell apsw ships (the store's
    own SQLite; it copies every row it can read, values exact, and rebuilds the indexes), carry `user_version`
    over (the clone leaves it out), and rlgate opens the result."""
    from apsw import sqlite_extra

    if sqlite_extra.has("sqlite3_shell") != "executable":
        pytest.skip("this apsw build ships no sqlite3 shell")
    broken = asyncio.run(filled_file(tmp_path / "store.db"))
    sqlite_files.overwrite_pages(broken, [sqlite_files.root_pages(broken)["sessions_token"]])  # an index page
    with pytest.raises(StoreCorrupt):
        asyncio.run(SqliteStore.open(str(broken)))

    def shell(db: Path, *args: str) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run(
            [sys.executable, "-m", "apsw.sqlite_extra", "sqlite3_shell", str(db), *args],
            capture_output=True,
            timeout=60,
        )

    version = shell(broken, "PRAGMA user_version").stdout.strip()
    assert version == str(SCHEMA_VERSION).encode()
    recovered = tmp_path / "recovered.db"
    assert shell(broken, f".clone {recovered}").returncode == 0
    assert shell(recovered, f"PRAGMA user_version = {version.decode()}").returncode == 0
    assert sqlite_files.integrity(recovered) == ["ok"]

    async def reopen() -> tuple[int, int, list[str]]:
        store = await SqliteStore.open(str(recovered))
        try:
            calls = len(await store.list_tool_calls("s0007"))
            return await store.count_open_sessions(), calls, await store.check_invariants()
        finally:
            await store.close()

    # Only an index page was damaged: .clone reads tables, not indexes, and builds the new file's indexes.
    assert asyncio.run(reopen()) == (200, 1, [])
