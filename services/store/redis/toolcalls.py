"""The tool-call log in Redis: `tc:<id>` (the entries, a list), `tcn:<id>` (per-episode counts) and
`tcr:<id>` (the request ids logged)."""

from __future__ import annotations

from rlgate.store import _common
from rlgate.store.models import ToolCallEntry
from rlgate.store.redis.connection import RedisBase


class RedisToolCalls(RedisBase):
    """The `ToolCallLog` of the Redis store."""

    async def append_tool_call(self, entry: ToolCallEntry) -> int:
        count = await self._script(
            "append_tool_call",
            "append_tool_call",
            entry.session_id,
            str(entry.episode),
            entry.request_id,
            entry.to_json(),
        )
        return int(count)

    async def list_tool_calls(self, session_id: str, episode: int | None = None) -> list[ToolCallEntry]:
        raw: list[str] = await self._call(
            "list_tool_calls", lambda: self._client.lrange(self._key(f"tc:{session_id}"), 0, -1)
        )
        entries = [_common.decode(ToolCallEntry, item) for item in raw]
        return entries if episode is None else [e for e in entries if e.episode == episode]

    async def tool_calls(
        self, session_id: str, *, episode: int | None = None, after: int = 0, limit: int
    ) -> tuple[list[ToolCallEntry], int | None]:
        limit = _common.page_limit(limit)
        # A position is an entry's place in the list, counted from 1: entries are only ever appended (the
        # list goes only with its session), so a position names the same entry on every read.
        rows: list[tuple[int, str]] = []
        start = max(0, after)
        while len(rows) <= limit:  # each read bounded; for one episode, other episodes' entries are skipped
            batch = await self._log_range(session_id, start, limit + 1)
            for offset, raw in enumerate(batch):
                if episode is None or _common.decode(ToolCallEntry, raw).episode == episode:
                    rows.append((start + offset + 1, raw))
            if len(batch) <= limit:
                break
            start += len(batch)
        return _common.log_page(rows[: limit + 1], limit)

    async def _log_range(self, session_id: str, start: int, count: int) -> list[str]:
        key = self._key(f"tc:{session_id}")
        batch: list[str] = await self._call("tool_calls", lambda: self._client.lrange(key, start, start + count - 1))
        return batch

    async def count_tool_calls(self, session_id: str, episode: int) -> int:
        count = await self._call(
            "count_tool_calls", lambda: self._client.hget(self._key(f"tcn:{session_id}"), str(episode))
        )
        return int(count or 0)
