"""The tool-call log in SQLite: one `tool_calls` row per entry, ordered by `seq` (a plain rowid)."""

from __future__ import annotations

import apsw

from rlgate.store import _common
from rlgate.store.models import ToolCallEntry
from rlgate.store.sqlite.connection import SqliteBase
from rlgate.store.sqlite.sql import scalar


def append_row(conn: apsw.Connection, entry: ToolCallEntry) -> None:
    # (session, episode, request_id) is logged once, so a retried append does not double-count.
    conn.execute(
        "INSERT OR IGNORE INTO tool_calls (session_id, episode, request_id, data) VALUES (?, ?, ?, ?)",
        (entry.session_id, entry.episode, entry.request_id, entry.to_json()),
    )


def count_calls(conn: apsw.Connection, session_id: str, episode: int) -> int:
    return int(
        scalar(conn, "SELECT count(*) FROM tool_calls WHERE session_id = ? AND episode = ?", (session_id, episode))
    )


class SqliteToolCalls(SqliteBase):
    """The `ToolCallLog` of the SQLite store."""

    async def append_tool_call(self, entry: ToolCallEntry) -> int:
        def append(conn: apsw.Connection) -> int:
            append_row(conn, entry)
            return count_calls(conn, entry.session_id, entry.episode)

        return await self._write(append)

    async def list_tool_calls(self, session_id: str, episode: int | None = None) -> list[ToolCallEntry]:
        def list_calls(conn: apsw.Connection) -> list[ToolCallEntry]:
            if episode is None:
                rows = conn.execute("SELECT data FROM tool_calls WHERE session_id = ? ORDER BY seq", (session_id,))
            else:
                rows = conn.execute(
                    "SELECT data FROM tool_calls WHERE session_id = ? AND episode = ? ORDER BY seq",
                    (session_id, episode),
                )
            return [_common.decode(ToolCallEntry, row[0]) for row in rows]

        return await self._run(list_calls)

    async def tool_calls(
        self, session_id: str, *, episode: int | None = None, after: int = 0, limit: int
    ) -> tuple[list[ToolCallEntry], int | None]:
        limit = _common.page_limit(limit)

        def page(conn: apsw.Connection) -> list[tuple[int, str]]:
            # A position is the entry's seq; both statements search the index tool_calls_session (for every episode,
            # the session's rows are then sorted, as list_tool_calls does).
            if episode is None:
                rows = conn.execute(
                    "SELECT seq, data FROM tool_calls WHERE session_id = ? AND seq > ? ORDER BY seq LIMIT ?",
                    (session_id, after, limit + 1),
                )
            else:
                rows = conn.execute(
                    "SELECT seq, data FROM tool_calls WHERE session_id = ? AND episode = ? AND seq > ?"
                    " ORDER BY seq LIMIT ?",
                    (session_id, episode, after, limit + 1),
                )
            return [(int(row[0]), str(row[1])) for row in rows]

        return _common.log_page(await self._run(page), limit)

    async def count_tool_calls(self, session_id: str, episode: int) -> int:
        return await self._run(count_calls, session_id, episode)
