"""The SQLite store's upkeep: retention (prune), its invariants, and the health probe."""

from __future__ import annotations

import time
from typing import Any

import apsw

from rlgate.store import _common
from rlgate.store.models import RequestState, Session
from rlgate.store.sqlite.connection import SqliteBase
from rlgate.store.sqlite.library import corrupt_error
from rlgate.store.sqlite.sessions import delete_session_rows
from rlgate.store.sqlite.sql import changed_rows, scalar, transaction

_HEALTH_KEY = "rlgate:health-probe"  # the leases row health() writes and deletes in one transaction


class SqliteUpkeep(SqliteBase):
    """The `Upkeep` of the SQLite store (`close` is `SqliteBase`'s)."""

    async def prune(self, closed_before: float, requests_before: float) -> int:
        def prune(conn: apsw.Connection) -> int:
            now = time.time()
            doomed = [
                row[0]
                for row in conn.execute(
                    "SELECT session_id FROM sessions WHERE retain_at IS NOT NULL AND retain_at < ?",
                    (closed_before,),
                )
            ]
            removed = sum(delete_session_rows(conn, sid) for sid in doomed)
            removed += changed_rows(
                conn, "DELETE FROM requests WHERE state = 'done' AND finished_at < ?", (requests_before,)
            )
            # Expired heartbeats and leases are dead weight; they are not counted as records.
            conn.execute("DELETE FROM owners WHERE expires_at < ?", (now,))
            conn.execute("DELETE FROM leases WHERE expires_at < ?", (now,))
            return removed

        return await self._write(prune)

    async def check_invariants(self) -> list[str]:
        def check(conn: apsw.Connection) -> list[str]:
            problems: list[str] = []
            rows: list[Any] = conn.execute(
                "SELECT session_id, status, run_id, token_hash, created_at, retain_at, version, data FROM sessions"
            ).fetchall()
            labels: dict[str, dict[str, str]] = {}
            for sid, key, value in conn.execute("SELECT session_id, key, value FROM session_labels"):
                labels.setdefault(sid, {})[key] = value
            for sid, status, run_id, token_hash, created_at, retain_at, version, data in rows:
                try:
                    session = Session.from_json(data)
                except (ValueError, TypeError) as exc:
                    problems.append(f"session {sid}: undecodable record ({exc})")
                    continue
                session.version = version
                problems.extend(_common.session_problems(session))
                columns = (session.session_id, session.status, session.run_id, session.token_hash)
                if columns != (sid, status, run_id, token_hash) or session.created_at != created_at:
                    problems.append(f"session {sid}: indexed columns disagree with the record")
                if retain_at != _common.retention_time(session):
                    problems.append(f"session {sid}: retention time out of step with its status")
                if labels.pop(sid, {}) != session.labels:
                    problems.append(f"session {sid}: label index disagrees with the record")
            problems.extend(f"label index lists missing session {sid}" for sid in labels)
            for (state,) in conn.execute("SELECT DISTINCT state FROM requests"):
                if state not in {s.value for s in RequestState}:
                    problems.append(f"request records in unknown state {state!r}")
            return problems

        return await self._run(check)

    async def ping(self) -> None:
        def ping(conn: apsw.Connection) -> None:
            conn.execute("SELECT 1").fetchone()

        await self._run(ping)

    async def health(self) -> None:
        """Read the schema and the first page of every table, then write and delete a leases row of one page
        in one transaction (the row needs a page of its own, so a store that cannot grow fails here with
        StoreFull, and COMMIT appends to the WAL, so a full disk does too). Nothing is left behind; other
        connections never see the row. A malformed page met here or by any earlier call: StoreCorrupt."""

        def probe(conn: apsw.Connection) -> None:
            tables = [
                row[0]
                for row in conn.execute(
                    "SELECT name FROM sqlite_schema WHERE type = 'table' AND name NOT LIKE 'sqlite_%'"
                )
            ]
            for table in tables:
                conn.execute(f'SELECT 1 FROM "{table}" LIMIT 1').fetchall()
            page_size = int(scalar(conn, "PRAGMA page_size"))
            with transaction(conn):
                conn.execute(
                    "INSERT OR REPLACE INTO leases (name, holder, expires_at) VALUES (?, zeroblob(?), 0)",
                    (_HEALTH_KEY, page_size),
                )
                conn.execute("DELETE FROM leases WHERE name = ?", (_HEALTH_KEY,))

        if not self._corrupt:
            await self._run(probe, grouped=False)  # its own transaction
        if self._corrupt:
            raise corrupt_error(self.path, self._corrupt)
