"""Sessions in SQLite: the `sessions` row (indexed columns plus the record as JSON) and its `session_labels`
rows, written by compare-and-set on `version`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import apsw

from rlgate.store import _common
from rlgate.store.models import OPEN_STATUSES, ConflictError, Session
from rlgate.store.sqlite.connection import SqliteBase
from rlgate.store.sqlite.schema import BY_TOKEN_SQL, OPEN_SQL
from rlgate.store.sqlite.sql import changed_rows, scalar

SESSION_COLUMNS = "data, version, last_active_at"
IN_BATCH = 500  # ids per IN (...) list: far below SQLite's bound on bound parameters


def session_from_row(row: tuple[str, int, float]) -> Session:
    session = _common.decode(Session, row[0])
    session.version = int(row[1])
    session.last_active_at = float(row[2])
    return session


def insert_session_rows(conn: apsw.Connection, session: Session) -> None:
    conn.execute(
        "INSERT INTO sessions (created_at, status, run_id, token_hash, retain_at, version,"
        " last_active_at, data, session_id) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
        (
            session.created_at,
            session.status,
            session.run_id,
            session.token_hash,
            _common.retention_time(session),
            session.version,
            session.last_active_at,
            session.to_json(),
            session.session_id,
        ),
    )
    conn.executemany(
        "INSERT INTO session_labels (session_id, key, value) VALUES (?, ?, ?)",
        [(session.session_id, k, v) for k, v in session.labels.items()],
    )


def token_taken(conn: apsw.Connection, token_hash: str, session_id: str) -> bool:
    if not token_hash:
        return False
    row = conn.execute(f"SELECT session_id FROM sessions WHERE {BY_TOKEN_SQL}", (token_hash,)).fetchone()
    return row is not None and row[0] != session_id


def create_rows(conn: apsw.Connection, stored: Session) -> None:
    """Insert the new session `stored` (version 1) inside a transaction; ConflictError if its id exists or its
    token is another session's."""
    if conn.execute("SELECT 1 FROM sessions WHERE session_id = ?", (stored.session_id,)).fetchone():
        raise ConflictError(f"session {stored.session_id} already exists")
    if token_taken(conn, stored.token_hash, stored.session_id):
        raise ConflictError(f"agent token of session {stored.session_id} is already in use")
    insert_session_rows(conn, stored)


def update_rows(conn: apsw.Connection, stored: Session) -> float:
    """Compare-and-set `stored` (version already bumped) inside a transaction; its last_active_at.

    The hot path of every Step, so it writes only what changed: a turn rewrites `data`, `version` and
    `last_active_at`; the indexed columns and the label rows only when they differ from the stored
    ones (rewriting unchanged index entries costs more than the rest of the update)."""
    sid, expected = stored.session_id, stored.version - 1
    row = conn.execute(
        "SELECT version, created_at, status, run_id, token_hash, retain_at, last_active_at"
        " FROM sessions WHERE session_id = ?",
        (sid,),
    ).fetchone()
    if row is None:
        raise ConflictError(f"session {sid} does not exist")
    if row[0] != expected:
        raise ConflictError(f"session {sid} changed (version {row[0]}, expected {expected})")
    # A token this session holds already is no other session's (the index is unique).
    if stored.token_hash != row[4] and token_taken(conn, stored.token_hash, sid):
        raise ConflictError(f"agent token of session {sid} is already in use")
    last_active_at = max(float(row[6]), stored.last_active_at)  # activity never moves backwards
    indexed = (stored.created_at, stored.status, stored.run_id, stored.token_hash, _common.retention_time(stored))
    if indexed == tuple(row[1:6]):
        conn.execute(
            "UPDATE sessions SET version = ?, last_active_at = ?, data = ? WHERE session_id = ?",
            (stored.version, last_active_at, stored.to_json(), sid),
        )
    else:
        conn.execute(
            "UPDATE sessions SET created_at = ?, status = ?, run_id = ?, token_hash = ?, retain_at = ?,"
            " version = ?, last_active_at = ?, data = ? WHERE session_id = ?",
            (*indexed, stored.version, last_active_at, stored.to_json(), sid),
        )
    labels = dict(conn.execute("SELECT key, value FROM session_labels WHERE session_id = ?", (sid,)))
    if labels != stored.labels:
        conn.execute("DELETE FROM session_labels WHERE session_id = ?", (sid,))
        conn.executemany(
            "INSERT INTO session_labels (session_id, key, value) VALUES (?, ?, ?)",
            [(sid, k, v) for k, v in stored.labels.items()],
        )
    return last_active_at


def by_token_row(conn: apsw.Connection, token_hash: str) -> Session | None:
    row = conn.execute(f"SELECT {SESSION_COLUMNS} FROM sessions WHERE {BY_TOKEN_SQL}", (token_hash,)).fetchone()
    return session_from_row(row) if row else None


def touch_rows(conn: apsw.Connection, session_id: str, now: float) -> None:
    conn.execute(
        "UPDATE sessions SET last_active_at = max(last_active_at, ?) WHERE session_id = ?",
        (now, session_id),
    )


def delete_session_rows(conn: apsw.Connection, session_id: str) -> int:
    deleted = changed_rows(conn, "DELETE FROM sessions WHERE session_id = ?", (session_id,))
    conn.execute("DELETE FROM session_labels WHERE session_id = ?", (session_id,))
    conn.execute("DELETE FROM tool_calls WHERE session_id = ?", (session_id,))
    return int(deleted)


class SqliteSessions(SqliteBase):
    """The `SessionRecords` of the SQLite store."""

    async def create_session(self, session: Session) -> Session:
        stored = session.copy(version=1)
        await self._write(create_rows, stored)
        return stored

    async def get_session(self, session_id: str) -> Session | None:
        def get(conn: apsw.Connection) -> Session | None:
            row = conn.execute(f"SELECT {SESSION_COLUMNS} FROM sessions WHERE session_id = ?", (session_id,)).fetchone()
            return session_from_row(row) if row else None

        return await self._run(get)

    async def update_session(self, session: Session) -> Session:
        stored = _common.next_version(session)
        stored.last_active_at = await self._write(update_rows, stored)
        return stored

    async def session_by_token(self, token_hash: str) -> Session | None:
        if not token_hash:  # "" is what a revoked session holds; it must never match
            return None
        return await self._run(by_token_row, token_hash)

    async def touch_session(self, session_id: str, now: float) -> None:
        await self._write(touch_rows, session_id, now)

    async def list_sessions(
        self,
        *,
        statuses: frozenset[str] | None = None,
        labels: Mapping[str, str] | None = None,
        run_id: str = "",
        limit: int = 100,
        cursor: str = "",
    ) -> tuple[list[Session], str]:
        limit = _common.page_limit(limit)
        position = _common.decode_cursor(cursor)
        where: list[str] = []
        params: list[Any] = []
        if statuses is not None:
            if not statuses:
                return [], ""
            where.append(f"status IN ({', '.join('?' for _ in statuses)})")
            params.extend(sorted(statuses))
            if statuses <= OPEN_STATUSES:  # through the partial index of open sessions, not every session kept
                where.append(OPEN_SQL)
        if run_id:
            where.append("run_id = ?")
            params.append(run_id)
        for key, value in (labels or {}).items():
            where.append(
                "EXISTS (SELECT 1 FROM session_labels l"
                " WHERE l.session_id = s.session_id AND l.key = ? AND l.value = ?)"
            )
            params.extend((key, value))
        if position is not None:
            where.append("(created_at < ? OR (created_at = ? AND session_id < ?))")
            params.extend((position[0], position[0], position[1]))
        sql = f"SELECT {SESSION_COLUMNS} FROM sessions s"
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY created_at DESC, session_id DESC LIMIT ?"
        params.append(limit + 1)

        def page(conn: apsw.Connection) -> list[Session]:
            return [session_from_row(row) for row in conn.execute(sql, params)]

        sessions = await self._run(page)
        if len(sessions) > limit:
            sessions = sessions[:limit]
            return sessions, _common.encode_cursor(sessions[-1])
        return sessions, ""

    async def sessions_open(self, session_ids: Sequence[str]) -> set[str]:
        ids = list(dict.fromkeys(session_ids))

        def which(conn: apsw.Connection) -> set[str]:
            statuses = tuple(sorted(OPEN_STATUSES))
            marks = ", ".join("?" for _ in statuses)
            found: set[str] = set()
            for start in range(0, len(ids), IN_BATCH):
                chunk = ids[start : start + IN_BATCH]
                rows = conn.execute(
                    f"SELECT session_id FROM sessions WHERE session_id IN ({', '.join('?' for _ in chunk)}) "
                    f"AND status IN ({marks}) AND token_hash != ''",
                    (*chunk, *statuses),
                )
                found.update(str(row[0]) for row in rows)
            return found

        return await self._run(which) if ids else set()

    async def count_open_sessions(self) -> int:
        def count(conn: apsw.Connection) -> int:  # O(open sessions), from the partial index
            return int(scalar(conn, f"SELECT COUNT(*) FROM sessions WHERE {OPEN_SQL}"))

        return await self._run(count)

    async def delete_session(self, session_id: str) -> None:
        await self._write(delete_session_rows, session_id)
