"""State's pages of the tool-call log: at most a page size of entries and at most `PAGE_BYTES` of them, so a
State reply stays under the message limit whatever the calls carried (arguments up to the gateway's
`max_arguments_bytes` each).

The store pages by count only, so the log is read in batches sized from the entries seen so far: memory
stays near one page, and a page that ends on its byte bound inside a batch learns where it ended by reading
just its own entries again (the log is append-only, so they are the same entries).
"""

from __future__ import annotations

from dataclasses import dataclass

from rlgate.core.errors import InvalidArgument
from rlgate.orchestrator.tasks import decode_token, encode_token, validate_page_size
from rlgate.orchestrator.views import tool_call_entry
from rlgate.store import ToolCallLog
from rlgate.v1 import orchestrator_pb2

PAGE_BYTES = 4 << 20  # the encoded entries of one page; the proto's comments state it
_ENTRY_FRAMING = 6  # a repeated field's tag and length prefix, at most
_FIRST_BATCH = 4  # entries read before their size is known: a page's worth of 1 MiB arguments at most
TOKEN_FIELD = "tool_calls_page_token"
SIZE_FIELD = "tool_calls_page_size"


@dataclass(frozen=True)
class LogPage:
    entries: list[orchestrator_pb2.ToolCallLogEntry]
    next_token: str  # "" on the last page


@dataclass(frozen=True)
class _Cursor:
    episode: int
    after: int  # the store's position of the last entry read


def _scope(session_id: str) -> str:
    return f"state:{session_id}"


def _encode(session_id: str, cursor: _Cursor) -> str:
    return encode_token(f"{cursor.episode}:{cursor.after}", scope=_scope(session_id))


def _decode(session_id: str, token: str, current_episode: int) -> _Cursor:
    position = decode_token(token, scope=_scope(session_id), field=TOKEN_FIELD)
    episode, _, after = position.partition(":")
    try:
        cursor = _Cursor(int(episode), int(after))
    except ValueError:
        raise InvalidArgument(TOKEN_FIELD, "not a token returned by State") from None
    if not 1 <= cursor.episode <= current_episode or cursor.after < 0:
        raise InvalidArgument(TOKEN_FIELD, "not a token returned by State")
    return cursor


def _framed(entry: orchestrator_pb2.ToolCallLogEntry) -> int:
    return entry.ByteSize() + _ENTRY_FRAMING


class LogPages:
    """One page of a session's tool-call log per State call."""

    def __init__(self, log: ToolCallLog, page_bytes: int = PAGE_BYTES) -> None:
        self._log = log
        self._page_bytes = page_bytes

    @staticmethod
    def check(page_size: int, token: str, session_id: str, current_episode: int) -> None:
        """Refuse a bad page size or token (INVALID_ARGUMENT naming the field) before any read."""
        validate_page_size(page_size, SIZE_FIELD)
        if token:
            _decode(session_id, token, current_episode)

    async def page(self, session_id: str, current_episode: int, page_size: int, token: str) -> LogPage:
        size = validate_page_size(page_size, SIZE_FIELD)
        cursor = _decode(session_id, token, current_episode) if token else _Cursor(current_episode, 0)
        entries: list[orchestrator_pb2.ToolCallLogEntry] = []
        used = 0
        batch = min(size, _FIRST_BATCH)
        after = cursor.after
        while True:
            rows, next_after = await self._log.tool_calls(session_id, episode=cursor.episode, after=after, limit=batch)
            taken = 0
            for row in rows:
                entry = tool_call_entry(row)
                cost = _framed(entry)
                if entries and used + cost > self._page_bytes:
                    break
                if cost > self._page_bytes:  # alone on its page and still too big: its arguments stay out
                    entry.arguments_json = ""
                    entry.arguments_elided = True
                    cost = _framed(entry)
                entries.append(entry)
                used += cost
                taken += 1
            if taken == 0 and rows:  # the batch's first entry opens the next page
                next_after = after
            elif taken < len(rows):
                # The byte bound ended the page inside this batch: the position after its last entry.
                _, next_after = await self._log.tool_calls(session_id, episode=cursor.episode, after=after, limit=taken)
            elif next_after is not None and len(entries) < size:
                after = next_after
                average = max(1, used // len(entries))
                batch = max(1, min(size - len(entries), (self._page_bytes - used) // average + 1))
                continue
            token_out = "" if next_after is None else _encode(session_id, _Cursor(cursor.episode, next_after))
            return LogPage(entries, token_out)
