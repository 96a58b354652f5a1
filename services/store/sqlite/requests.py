"""The request ledger's records in SQLite (`requests` rows), and `commit`: a result recorded with its
session's compare-and-set and its log entry in one transaction."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import apsw

from rlgate.store import _common
from rlgate.store.models import RequestExists, RequestRecord, RequestState, Session, SessionStatus, Writes, call_scope
from rlgate.store.sqlite.connection import SqliteBase
from rlgate.store.sqlite.sessions import (
    SESSION_COLUMNS,
    by_token_row,
    create_rows,
    session_from_row,
    touch_rows,
    update_rows,
)
from rlgate.store.sqlite.sql import changed_rows
from rlgate.store.sqlite.toolcalls import append_row

REQUEST_COLUMNS = "scope, request_id, state, owner, result, created_at, finished_at"


def request_from_row(row: tuple[Any, ...]) -> RequestRecord:
    return _common.request_record(*row)


def request_row(conn: apsw.Connection, scope: str, request_id: str) -> RequestRecord | None:
    row = conn.execute(
        f"SELECT {REQUEST_COLUMNS} FROM requests WHERE scope = ? AND request_id = ?",
        (scope, request_id),
    ).fetchone()
    return request_from_row(row) if row else None


def claim_row(conn: apsw.Connection, scope: str, request_id: str, owner: str) -> tuple[RequestRecord, bool]:
    now = time.time()
    created = changed_rows(
        conn,
        "INSERT OR IGNORE INTO requests (scope, request_id, state, owner, result, created_at,"
        " finished_at) VALUES (?, ?, ?, ?, '', ?, 0)",
        (scope, request_id, RequestState.PENDING.value, owner, now),
    )
    if created == 1:  # the record is exactly what was inserted: no need to read it back
        return RequestRecord(scope, request_id, RequestState.PENDING.value, owner, "", now, 0.0), True
    existing = request_row(conn, scope, request_id)
    assert existing is not None  # the insert was ignored because it exists, inside this transaction
    return existing, False


def complete_row(conn: apsw.Connection, scope: str, request_id: str, result: str, now: float) -> None:
    # An upsert: a result is never dropped, even if the PENDING record was lost or pruned.
    conn.execute(
        "INSERT INTO requests (scope, request_id, state, owner, result, created_at, finished_at)"
        " VALUES (?, ?, 'done', '', ?, ?, ?) ON CONFLICT (scope, request_id) DO UPDATE SET"
        " state = 'done', result = excluded.result, finished_at = excluded.finished_at",
        (scope, request_id, result, now, now),
    )


def commit_rows(
    conn: apsw.Connection, stored: Session | None, writes: Writes, now: float, new_session: bool = False
) -> float | None:
    """`commit`'s writes inside a transaction; the session's last_active_at (None without a session)."""
    request, tool_call = writes.request, writes.tool_call
    if (writes.new_request or writes.held_by) and request is not None:
        existing = request_row(conn, request[0], request[1])
        if existing is not None and (
            writes.new_request or _common.held_elsewhere(existing, writes.held_by, request[2])
        ):
            raise RequestExists(existing)  # rolls the (still empty) transaction back
    # Then the session: a lost compare-and-set (or an id taken) raises before anything else is written.
    last: float | None = None
    if stored is not None and new_session:
        create_rows(conn, stored)
        last = stored.last_active_at
    elif stored is not None:
        last = update_rows(conn, stored)
    if request is not None:
        complete_row(conn, *request, now)
    if tool_call is not None:
        append_row(conn, tool_call)
        touch_rows(conn, tool_call.session_id, tool_call.finished_at)
    return last


class SqliteRequests(SqliteBase):
    """The `RequestRecords` of the SQLite store."""

    def _release_abandoned(self, scope: str, request_id: str) -> None:
        """A claim landed after its caller was cancelled: release it (see `SessionStore.claim_request`)."""
        if not self._closed:
            self._background.spawn(self.release_request(scope, request_id))

    async def _commit_writes(self, session: Session | None, writes: Writes, new_session: bool) -> Session | None:
        stored = _common.written(session, new_session) if session is not None else None
        last_active_at = await self._write(commit_rows, stored, writes, time.time(), new_session)
        if stored is not None and last_active_at is not None:
            stored.last_active_at = last_active_at
        return stored

    async def change_session(
        self, session_id: str, change: Callable[[Session], Writes | None]
    ) -> tuple[Session | None, bool]:
        # One transaction on the store's thread: the read, `change` and the commit (no other writer between
        # them, so no compare-and-set can be lost).
        def run(conn: apsw.Connection) -> tuple[Session | None, bool]:
            row = conn.execute(f"SELECT {SESSION_COLUMNS} FROM sessions WHERE session_id = ?", (session_id,)).fetchone()
            if row is None:
                return None, False
            session = session_from_row(row)
            writes = change(session)
            if writes is None:
                return session, False
            stored = _common.next_version(session)
            last_active_at = commit_rows(conn, stored, writes, time.time())
            assert last_active_at is not None
            stored.last_active_at = last_active_at
            return stored, True

        return await self._write(run)

    async def claim_request(self, scope: str, request_id: str, owner: str) -> tuple[RequestRecord, bool]:
        def abandoned(claim: tuple[RequestRecord, bool]) -> None:
            if claim[1]:
                self._release_abandoned(scope, request_id)

        return await self._write(claim_row, scope, request_id, owner, abandoned=abandoned)

    async def authorize_call(
        self, token_hash: str, request_id: str, owner: str
    ) -> tuple[Session | None, RequestRecord | None, bool]:
        if not token_hash:  # a revoked session holds ""; it must never match
            return None, None, False

        def authorize(conn: apsw.Connection) -> tuple[Session | None, RequestRecord | None, bool]:
            session = by_token_row(conn, token_hash)
            if session is None or not request_id or session.status != SessionStatus.ACTIVE:
                return session, None, False
            record, created = claim_row(conn, call_scope(session.session_id), request_id, owner)
            return session, record, created

        def abandoned(result: tuple[Session | None, RequestRecord | None, bool]) -> None:
            if result[2] and result[0] is not None:
                self._release_abandoned(call_scope(result[0].session_id), request_id)

        # Without a request_id nothing is written: a plain read, no write lock.
        return await (self._write(authorize, abandoned=abandoned) if request_id else self._run(authorize))

    async def complete_request(self, scope: str, request_id: str, result: str) -> None:
        await self._write(complete_row, scope, request_id, result, time.time())

    async def release_request(self, scope: str, request_id: str) -> None:
        def release(conn: apsw.Connection) -> None:
            conn.execute(
                "DELETE FROM requests WHERE scope = ? AND request_id = ? AND state = 'pending'",
                (scope, request_id),
            )

        await self._write(release)

    async def take_over_request(
        self, scope: str, request_id: str, dead_owner: str, owner: str
    ) -> tuple[RequestRecord | None, bool]:
        def take(conn: apsw.Connection) -> tuple[RequestRecord | None, bool]:
            now = time.time()
            taken = changed_rows(
                conn,
                "UPDATE requests SET owner = ?, created_at = ? WHERE scope = ? AND request_id = ?"
                " AND state = 'pending' AND owner = ?",
                (owner, now, scope, request_id, dead_owner),
            )
            if taken == 1:
                return RequestRecord(scope, request_id, RequestState.PENDING.value, owner, "", now, 0.0), True
            return request_row(conn, scope, request_id), False

        def abandoned(result: tuple[RequestRecord | None, bool]) -> None:
            if result[1] and not self._closed:  # taken after the caller gave up: hand it back
                self._background.spawn(self.take_over_request(scope, request_id, owner, dead_owner))

        return await self._write(take, abandoned=abandoned)

    async def get_request(self, scope: str, request_id: str) -> RequestRecord | None:
        return await self._run(request_row, scope, request_id)

    async def pending_requests(self, scope: str, limit: int) -> list[RequestRecord]:
        def pending(conn: apsw.Connection) -> list[RequestRecord]:
            rows = conn.execute(
                f"SELECT {REQUEST_COLUMNS} FROM requests WHERE scope = ? AND state = 'pending' LIMIT ?",
                (scope, limit),
            )
            return [request_from_row(row) for row in rows]

        return await self._run(pending)
