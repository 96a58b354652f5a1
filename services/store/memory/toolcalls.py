"""The tool-call log in memory: each session's entries in a list, oldest first."""

from __future__ import annotations

from rlgate.store import _common
from rlgate.store.memory.data import Logged, MemoryBase, MemoryData
from rlgate.store.models import ToolCallEntry


def append_entry(data: MemoryData, entry: ToolCallEntry) -> None:
    log = data.tool_calls.setdefault(entry.session_id, [])
    if entry.request_id and any(e.episode == entry.episode and e.request_id == entry.request_id for e in log):
        return  # logged once per (session, episode, request_id): a retried append is not counted twice
    log.append(Logged(entry.episode, entry.request_id, entry.to_json()))


def count_calls(data: MemoryData, session_id: str, episode: int) -> int:
    return sum(e.episode == episode for e in data.tool_calls.get(session_id, ()))


class MemoryToolCalls(MemoryBase):
    """The `ToolCallLog` of the in-memory store."""

    async def append_tool_call(self, entry: ToolCallEntry) -> int:
        def append() -> int:
            append_entry(self.data, entry)
            return count_calls(self.data, entry.session_id, entry.episode)

        return await self._call("append_tool_call", append)

    async def list_tool_calls(self, session_id: str, episode: int | None = None) -> list[ToolCallEntry]:
        def list_calls() -> list[ToolCallEntry]:
            return [
                _common.decode(ToolCallEntry, e.data)
                for e in self.data.tool_calls.get(session_id, ())
                if episode is None or e.episode == episode
            ]

        return await self._call("list_tool_calls", list_calls)

    async def tool_calls(
        self, session_id: str, *, episode: int | None = None, after: int = 0, limit: int
    ) -> tuple[list[ToolCallEntry], int | None]:
        limit = _common.page_limit(limit)

        def page() -> list[tuple[int, str]]:
            # A position is an entry's place in the session's list, counted from 1 (entries are only appended).
            log = self.data.tool_calls.get(session_id, [])
            rows = []
            for position in range(max(0, after) + 1, len(log) + 1):
                entry = log[position - 1]
                if episode is None or entry.episode == episode:
                    rows.append((position, entry.data))
                    if len(rows) > limit:
                        break
            return rows

        return _common.log_page(await self._call("tool_calls", page), limit)

    async def count_tool_calls(self, session_id: str, episode: int) -> int:
        return await self._call("count_tool_calls", lambda: count_calls(self.data, session_id, episode))
