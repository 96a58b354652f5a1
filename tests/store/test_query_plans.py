"""The SQLite store's per-RPC statements find their rows through an index, never by scanning a table that grows.

A store keeps closed sessions, their tool-call logs and request records for the retention period (a day), so
a statement that scans `sessions`, `requests`, `tool_calls` or `session_labels` costs in proportion to a day of
traffic, on every RPC: a stack then slows down batch after batch. SQLite uses a partial index only where the
query's own WHERE spells out the index's condition (a bound parameter never proves it), which is how the
agent-token lookup of every CallTool and Reset once scanned every session kept.

Every statement the store runs for what RPCs do (Reset, Step, CallTool, Close, the janitor's and reaper's
reads) is captured with apsw's exec tracer and its query plan read with EXPLAIN QUERY PLAN (with the same
bindings): none may scan a growing table without an index, and a listing of open sessions is an index search
(the partial index of open sessions, or a run's sessions). Maintenance that reads whole tables on purpose
(retention, invariants, integrity checks) is not part of the workload."""

from __future__ import annotations

import re
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import apsw
import pytest

from rlgate.store import OPEN_STATUSES, Session, SessionStatus, ToolCallEntry, call_scope, open_store
from rlgate.store.sqlite import SqliteStore

GROWING = ("sessions", "requests", "tool_calls", "session_labels")
# "SCAN sessions", "SCAN s" (an alias) with no index after it: a full table scan.
_FULL_SCAN = re.compile(r"^SCAN (\w+)(?: AS \w+)?$")


@pytest.fixture
async def traced(tmp_path: Path) -> AsyncIterator[tuple[SqliteStore, list[tuple[str, Any]]]]:
    store = await open_store(f"sqlite:///{tmp_path / 'store.db'}")
    assert isinstance(store, SqliteStore)
    seen: list[tuple[str, Any]] = []

    def trace(_cursor: apsw.Cursor, sql: str, bindings: Any) -> bool:
        seen.append((sql, bindings))
        return True

    def attach(conn: apsw.Connection) -> None:
        conn.exec_trace = trace

    await store._run(attach)
    try:
        yield store, seen
    finally:
        await store.close()


async def rpc_workload(store: SqliteStore) -> None:
    """What the services ask of the store per RPC, for a few sessions (one of them closed, as most kept are)."""
    now = time.time()
    for i in range(3):
        await store.create_session(
            Session(session_id=f"s{i}", env_key="e:v1", status=SessionStatus.ACTIVE, token_hash=f"h{i}",
                    run_id="run", labels={"job": "j"})
        )  # fmt: skip
    await store.get_session("s0")
    assert (await store.session_by_token("h0")) is not None
    await store.touch_session("s0", now)
    # CallTool: authenticate and claim in one step, the call's budget, then the log entry with the record.
    session, record, created = await store.authorize_call("h0", "call-1", "gw")
    assert session is not None and record is not None and created
    await store.count_tool_calls("s0", session.episode)
    entry = ToolCallEntry(session_id="s0", episode=session.episode, request_id="call-1", tool="t")
    await store.commit(request=(call_scope("s0"), "call-1", "{}"), tool_call=entry, held_by="gw")
    await store.list_tool_calls("s0")
    _, after = await store.tool_calls("s0", limit=1)  # the State RPC's pages of the log
    await store.tool_calls("s0", episode=session.episode, after=after or 0, limit=10)
    await store.get_request(call_scope("s0"), "call-1")
    await store.pending_requests(call_scope("s0"), 1)  # Fork's check that no call is in flight
    # Step: read, count and record in one step; a repeat's claim; a release; a takeover.
    await store.change_session("s0", lambda s: None)
    await store.claim_request("step", "r1", "orch")
    await store.release_request("step", "r1")
    await store.claim_request("step", "r2", "orch")
    await store.take_over_request("step", "r2", "orch", "orch-2")
    await store.complete_request("step", "r2", "{}")
    await store.heartbeat_owner("orch", 10.0)
    await store.owner_alive("orch")
    # Reset of a new episode: the token rotates.
    s1 = await store.get_session("s1")
    assert s1 is not None
    await store.update_session(replace(s1, token_hash="h1-next"))
    # Close: the token revoked.
    s2 = await store.get_session("s2")
    assert s2 is not None
    await store.update_session(replace(s2, status=SessionStatus.CLOSED, token_hash=""))
    # The janitor's, the reaper's and admission's reads.
    await store.sessions_open(["s0", "s1", "s2", "unknown"])
    await store.count_open_sessions()
    page, cursor = await store.list_sessions(statuses=OPEN_STATUSES, limit=1)
    assert page and cursor
    await store.list_sessions(statuses=OPEN_STATUSES, limit=1, cursor=cursor)
    await store.list_sessions(statuses=OPEN_STATUSES, run_id="run", labels={"job": "j"})


def plans(path: str, statements: list[tuple[str, Any]]) -> dict[str, list[str]]:
    """Each distinct statement's query plan (EXPLAIN QUERY PLAN with the bindings it ran with)."""
    conn = apsw.Connection(path)
    try:
        out: dict[str, list[str]] = {}
        for sql, bindings in statements:
            if sql in out or not re.match(r"\s*(SELECT|UPDATE|DELETE|INSERT|REPLACE)\b", sql, re.IGNORECASE):
                continue
            out[sql] = [str(row[3]) for row in conn.execute("EXPLAIN QUERY PLAN " + sql, bindings or ())]
        return out
    finally:
        conn.close()


async def test_no_rpc_statement_scans_a_growing_table(traced: tuple[SqliteStore, list[tuple[str, Any]]]) -> None:
    store, seen = traced
    await rpc_workload(store)
    found = plans(store.path, seen)
    assert len(found) > 15, found.keys()  # the workload reached the statements it names
    scans = {
        sql: line
        for sql, lines in found.items()
        for line in lines
        if (m := _FULL_SCAN.match(line)) and (m.group(1) in GROWING or m.group(1) in ("s", "l"))
    }
    assert not scans, scans


async def test_open_sessions_are_listed_through_their_partial_index(
    traced: tuple[SqliteStore, list[tuple[str, Any]]],
) -> None:
    store, seen = traced
    await rpc_workload(store)
    listings = {sql: lines for sql, lines in plans(store.path, seen).items() if "ORDER BY created_at" in sql}
    assert listings
    for sql, lines in listings.items():
        # An index search (the open sessions, or a run's), never a walk over every session kept in order.
        assert not any(line.startswith("SCAN s") for line in lines), (sql, lines)
    assert any("USING INDEX sessions_open" in line for lines in listings.values() for line in lines)


async def test_a_token_lookup_is_an_index_search(traced: tuple[SqliteStore, list[tuple[str, Any]]]) -> None:
    """The statement that once scanned every session kept, on every CallTool and Reset."""
    store, seen = traced
    await rpc_workload(store)
    by_token = {sql: lines for sql, lines in plans(store.path, seen).items() if "token_hash = ?" in sql}
    assert by_token
    for sql, lines in by_token.items():
        if sql.lstrip().upper().startswith("SELECT"):
            assert any("USING INDEX sessions_token" in line for line in lines), (sql, lines)
