"""The SQLite schema: a new database gets the current one, an older database is migrated to exactly that
shape with its rows kept, and a database from a newer rlgate is refused with a clear error."""

from __future__ import annotations

import asyncio
from pathlib import Path

import apsw
import pytest

from rlgate.store import RequestState, StoreError, ToolCallEntry, call_scope
from rlgate.store.sqlite import SCHEMA_VERSION, SqliteStore
from tests.store import sqlite_files

# The tables version 1 had where version 2 differs (the rest of its schema is version 2's too).
V1_TABLES = """
CREATE TABLE tool_calls (
    seq        INTEGER PRIMARY KEY AUTOINCREMENT,
    session_id TEXT NOT NULL,
    episode    INTEGER NOT NULL,
    request_id TEXT NOT NULL,
    data       TEXT NOT NULL
);
CREATE INDEX tool_calls_session ON tool_calls(session_id, episode, seq);
CREATE UNIQUE INDEX tool_calls_request ON tool_calls(session_id, episode, request_id) WHERE request_id != '';
CREATE TABLE requests (
    scope       TEXT NOT NULL,
    request_id  TEXT NOT NULL,
    state       TEXT NOT NULL,
    owner       TEXT NOT NULL,
    result      TEXT NOT NULL,
    created_at  REAL NOT NULL,
    finished_at REAL NOT NULL,
    PRIMARY KEY (scope, request_id)
) WITHOUT ROWID;
CREATE INDEX requests_done ON requests(finished_at) WHERE state = 'done';
"""


def shape(path: Path) -> dict[str, object]:
    """Everything about the schema that queries depend on: columns, keys, indexes, rowid-ness."""
    conn = sqlite_files.connect(path, read_only=True)
    try:
        out: dict[str, object] = {"user_version": sqlite_files.value(conn, "PRAGMA user_version")}
        tables = [
            r[0]
            for r in conn.execute(
                "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%' ORDER BY name"
            )
        ]
        for table in tables:
            indexes = sorted((r[1], r[2], r[4]) for r in conn.execute(f"PRAGMA index_list({table})"))
            out[table] = {
                "columns": conn.execute(f"PRAGMA table_info({table})").fetchall(),
                "without_rowid": sqlite_files.value(conn, "SELECT wr FROM pragma_table_list WHERE name = ?", (table,)),
                "autoincrement": "AUTOINCREMENT"
                in sqlite_files.value(conn, "SELECT sql FROM sqlite_master WHERE name = ?", (table,)).upper(),
                "indexes": {
                    name: (unique, partial, [c[2] for c in conn.execute(f"PRAGMA index_info({name})")])
                    for name, unique, partial in indexes
                },
            }
        return out
    finally:
        conn.close()


def make_v1(path: Path, current: Path) -> None:
    """A version-1 database as rlgate 1 left it, with log entries and request records in it. Its other
    tables are the current ones, copied from `current` (a new database), without what version 3 added."""
    ref = sqlite_files.connect(current, read_only=True)
    try:
        others = [
            r[0]
            for r in ref.execute(
                "SELECT sql FROM sqlite_master WHERE sql IS NOT NULL AND tbl_name NOT IN ('tool_calls', 'requests')"
                " AND name != 'sessions_open' ORDER BY type DESC"
            )
        ]  # tables before their indexes
    finally:
        ref.close()
    conn = apsw.Connection(str(path))  # creates the file
    try:
        conn.execute("PRAGMA journal_mode = WAL")
        for statement in [*others, *V1_TABLES.split(";")]:
            if statement.strip():
                conn.execute(statement)
        entries = [ToolCallEntry("s1", 1, f"r{i}", "search", arguments={"q": i}) for i in range(3)]
        conn.executemany(
            "INSERT INTO tool_calls (session_id, episode, request_id, data) VALUES (?, ?, ?, ?)",
            [(e.session_id, e.episode, e.request_id, e.to_json()) for e in entries],
        )
        conn.execute("DELETE FROM tool_calls WHERE request_id = 'r2'")  # AUTOINCREMENT's counter stays at 3
        conn.execute("INSERT INTO requests VALUES (?, 'r0', 'done', '', ?, 1.0, 2.0)", (call_scope("s1"), "x" * 1500))
        conn.execute("INSERT INTO requests VALUES (?, 'r1', 'pending', 'gw-1', '', 3.0, 0)", (call_scope("s1"),))
        conn.execute("PRAGMA user_version = 1")
    finally:
        conn.close()


async def test_a_new_database_gets_the_current_schema(tmp_path: Path) -> None:
    store = await SqliteStore.open(str(tmp_path / "store.db"))
    await store.close()
    got = shape(tmp_path / "store.db")
    assert got["user_version"] == SCHEMA_VERSION == 4
    assert got["sessions"]["indexes"]["sessions_open"] == (0, 1, ["status"])  # type: ignore[index]
    for table in ("tool_calls", "requests"):
        assert got[table]["without_rowid"] == 0 and not got[table]["autoincrement"]  # type: ignore[index]


async def test_a_version_1_database_is_migrated_with_its_rows(tmp_path: Path) -> None:
    ref = await SqliteStore.open(str(tmp_path / "ref.db"))
    await ref.close()
    make_v1(tmp_path / "store.db", tmp_path / "ref.db")
    assert shape(tmp_path / "store.db") != shape(tmp_path / "ref.db")

    store = await SqliteStore.open(str(tmp_path / "store.db"))
    try:
        assert shape(tmp_path / "store.db") == shape(tmp_path / "ref.db")  # exactly a new database's schema
        assert [e.request_id for e in await store.list_tool_calls("s1", 1)] == ["r0", "r1"]
        done = await store.get_request(call_scope("s1"), "r0")
        pending = await store.get_request(call_scope("s1"), "r1")
        assert done is not None and done.state == RequestState.DONE and done.result == "x" * 1500
        assert pending is not None and pending.state == RequestState.PENDING and pending.owner == "gw-1"
        # New entries still sort after the old ones.
        await store.append_tool_call(ToolCallEntry("s1", 1, "r3", "search"))
        assert [e.request_id for e in await store.list_tool_calls("s1", 1)] == ["r0", "r1", "r3"]
    finally:
        await store.close()
    again = await SqliteStore.open(str(tmp_path / "store.db"))  # a migrated database opens as it is
    await again.close()


async def test_a_database_from_a_newer_rlgate_is_refused(tmp_path: Path) -> None:
    conn = apsw.Connection(str(tmp_path / "store.db"))
    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    conn.close()
    with pytest.raises(StoreError, match=f"schema version {SCHEMA_VERSION + 1} is newer than this rlgate"):
        await SqliteStore.open(str(tmp_path / "store.db"))


async def test_two_processes_opening_a_version_1_database_at_once_migrate_it_once(tmp_path: Path) -> None:
    ref = await SqliteStore.open(str(tmp_path / "ref.db"))
    await ref.close()
    make_v1(tmp_path / "store.db", tmp_path / "ref.db")
    # Two store objects: two connections on two threads, as an orchestrator and a gateway starting together.
    first, second = await asyncio.gather(
        SqliteStore.open(str(tmp_path / "store.db")), SqliteStore.open(str(tmp_path / "store.db"))
    )
    try:
        assert shape(tmp_path / "store.db") == shape(tmp_path / "ref.db")
        for store in (first, second):
            assert [e.request_id for e in await store.list_tool_calls("s1", 1)] == ["r0", "r1"]
    finally:
        await first.close()
        await second.close()


async def test_a_version_2_database_gets_the_index_of_open_sessions(tmp_path: Path) -> None:
    ref = await SqliteStore.open(str(tmp_path / "ref.db"))
    await ref.close()
    conn = apsw.Connection(str(tmp_path / "ref.db"))
    conn.execute("DROP INDEX sessions_open")
    conn.execute("DROP TABLE admission")
    conn.execute("PRAGMA user_version = 2")
    conn.close()
    store = await SqliteStore.open(str(tmp_path / "ref.db"))
    try:
        got = shape(tmp_path / "ref.db")
        assert got["user_version"] == SCHEMA_VERSION
        assert "admission" in got  # and the migrations after 2
        assert got["sessions"]["indexes"]["sessions_open"] == (0, 1, ["status"])  # type: ignore[index]
        assert await store.count_open_sessions() == 0
    finally:
        await store.close()
