"""Owners' heartbeats (`owners` rows) and leases (`leases` rows) in SQLite, each with its expiry time."""

from __future__ import annotations

import time

import apsw

from rlgate.store.sqlite.connection import SqliteBase
from rlgate.store.sqlite.sql import changed_rows


class SqliteOwners(SqliteBase):
    """The `Owners` of the SQLite store."""

    async def heartbeat_owner(self, owner: str, ttl_s: float) -> None:
        def beat(conn: apsw.Connection) -> None:
            conn.execute(
                "INSERT INTO owners (owner, expires_at) VALUES (?, ?)"
                " ON CONFLICT (owner) DO UPDATE SET expires_at = excluded.expires_at",
                (owner, time.time() + ttl_s),
            )

        await self._write(beat)

    async def owner_alive(self, owner: str) -> bool:
        def alive(conn: apsw.Connection) -> bool:
            row = conn.execute("SELECT expires_at FROM owners WHERE owner = ?", (owner,)).fetchone()
            return row is not None and row[0] > time.time()

        return await self._run(alive)


class SqliteLeases(SqliteBase):
    """The `Leases` of the SQLite store."""

    async def acquire_lease(self, name: str, holder: str, ttl_s: float) -> bool:
        def acquire(conn: apsw.Connection) -> bool:
            now = time.time()
            # One statement: take a free or expired lease, or renew our own; otherwise change nothing.
            changed = changed_rows(
                conn,
                "INSERT INTO leases (name, holder, expires_at) VALUES (?, ?, ?)"
                " ON CONFLICT (name) DO UPDATE SET holder = excluded.holder, expires_at = excluded.expires_at"
                " WHERE leases.holder = excluded.holder OR leases.expires_at <= ?",
                (name, holder, now + ttl_s, now),
            )
            return changed == 1

        return await self._write(acquire)

    async def release_lease(self, name: str, holder: str) -> None:
        def release(conn: apsw.Connection) -> None:
            conn.execute("DELETE FROM leases WHERE name = ? AND holder = ?", (name, holder))

        await self._write(release)
