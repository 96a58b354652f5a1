"""Provisioning intents in SQLite: one `intents` row each, indexed by run and creation time."""

from __future__ import annotations

import apsw

from rlgate.store import _common
from rlgate.store.models import Intent
from rlgate.store.sqlite.connection import SqliteBase


class SqliteIntents(SqliteBase):
    """The `IntentRecords` of the SQLite store."""

    async def put_intent(self, intent: Intent) -> None:
        def put(conn: apsw.Connection) -> None:
            conn.execute(
                "INSERT INTO intents (intent_id, run_id, created_at, data) VALUES (?, ?, ?, ?)"
                " ON CONFLICT (intent_id) DO UPDATE SET run_id = excluded.run_id,"
                " created_at = excluded.created_at, data = excluded.data",
                (intent.intent_id, intent.run_id, intent.created_at, intent.to_json()),
            )

        await self._write(put)

    async def get_intent(self, intent_id: str) -> Intent | None:
        def get(conn: apsw.Connection) -> Intent | None:
            row = conn.execute("SELECT data FROM intents WHERE intent_id = ?", (intent_id,)).fetchone()
            return _common.decode(Intent, row[0]) if row else None

        return await self._run(get)

    async def list_intents(self, run_id: str = "") -> list[Intent]:
        def list_all(conn: apsw.Connection) -> list[Intent]:
            if run_id:
                rows = conn.execute(
                    "SELECT data FROM intents WHERE run_id = ? ORDER BY created_at, intent_id", (run_id,)
                )
            else:
                rows = conn.execute("SELECT data FROM intents ORDER BY created_at, intent_id")
            return [_common.decode(Intent, row[0]) for row in rows]

        return await self._run(list_all)

    async def delete_intent(self, intent_id: str) -> None:
        def delete(conn: apsw.Connection) -> None:
            conn.execute("DELETE FROM intents WHERE intent_id = ?", (intent_id,))

        await self._write(delete)
