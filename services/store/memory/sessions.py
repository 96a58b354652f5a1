"""Sessions in memory: their JSON by id, and the index of current tokens."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from rlgate.store import _common
from rlgate.store.memory.data import MemoryBase, MemoryData, current_token, session_of
from rlgate.store.models import OPEN_STATUSES, ConflictError, Session


def token_taken(data: MemoryData, token_hash: str, session_id: str) -> bool:
    owner = data.tokens.get(token_hash) if token_hash else None
    return owner is not None and owner != session_id


def store_session(data: MemoryData, session: Session, previous_token: str) -> None:
    data.sessions[session.session_id] = session.to_json()
    if previous_token != session.token_hash and data.tokens.get(previous_token) == session.session_id:
        del data.tokens[previous_token]
    if session.token_hash:
        data.tokens[session.token_hash] = session.session_id


def check_create(data: MemoryData, stored: Session) -> None:
    """ConflictError if the new session `stored` may not be stored: its id exists or its token is taken."""
    if stored.session_id in data.sessions:
        raise ConflictError(f"session {stored.session_id} already exists")
    if token_taken(data, stored.token_hash, stored.session_id):
        raise ConflictError(f"agent token of session {stored.session_id} is already in use")


def check_update(data: MemoryData, stored: Session) -> Session:
    """The stored session `stored` (version already bumped) replaces; ConflictError if it may not."""
    sid = stored.session_id
    raw = data.sessions.get(sid)
    if raw is None:
        raise ConflictError(f"session {sid} does not exist")
    current = session_of(raw)
    if current.version != stored.version - 1:
        raise ConflictError(f"session {sid} changed (version {current.version}, expected {stored.version - 1})")
    if stored.token_hash != current.token_hash and token_taken(data, stored.token_hash, sid):
        raise ConflictError(f"agent token of session {sid} is already in use")
    return current


def apply_update(data: MemoryData, stored: Session, current: Session) -> None:
    stored.last_active_at = max(current.last_active_at, stored.last_active_at)  # never backwards
    store_session(data, stored, current.token_hash)


def by_token(data: MemoryData, token_hash: str) -> Session | None:
    sid = data.tokens.get(token_hash) if token_hash else None
    raw = data.sessions.get(sid) if sid is not None else None
    return session_of(raw) if raw is not None else None


def touch_record(data: MemoryData, session_id: str, now: float) -> None:
    raw = data.sessions.get(session_id)
    if raw is None:
        return
    session = session_of(raw)
    if now > session.last_active_at:
        session.last_active_at = now
        data.sessions[session_id] = session.to_json()


def drop_session(data: MemoryData, session_id: str) -> int:
    raw = data.sessions.pop(session_id, None)
    data.tool_calls.pop(session_id, None)
    if raw is None:
        return 0
    token = current_token(raw)
    if token and data.tokens.get(token) == session_id:
        del data.tokens[token]
    return 1


class MemorySessions(MemoryBase):
    """The `SessionRecords` of the in-memory store."""

    async def create_session(self, session: Session) -> Session:
        stored = session.copy(version=1)

        def create() -> None:
            check_create(self.data, stored)
            store_session(self.data, stored, "")

        await self._call("create_session", create)
        return stored

    async def get_session(self, session_id: str) -> Session | None:
        def get() -> Session | None:
            raw = self.data.sessions.get(session_id)
            return session_of(raw) if raw is not None else None

        return await self._call("get_session", get)

    async def update_session(self, session: Session) -> Session:
        stored = _common.next_version(session)

        def update() -> None:
            apply_update(self.data, stored, check_update(self.data, stored))

        await self._call("update_session", update)
        return stored

    async def session_by_token(self, token_hash: str) -> Session | None:
        return await self._call("session_by_token", lambda: by_token(self.data, token_hash))

    async def touch_session(self, session_id: str, now: float) -> None:
        await self._call("touch_session", lambda: touch_record(self.data, session_id, now))

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

        def page() -> list[Session]:
            found = [
                s
                for s in map(session_of, self.data.sessions.values())
                if _common.matches(s, statuses, labels, run_id) and _common.after_cursor(s, position)
            ]
            found.sort(key=lambda s: (s.created_at, s.session_id), reverse=True)
            return found[: limit + 1]

        sessions = await self._call("list_sessions", page)
        if len(sessions) > limit:
            sessions = sessions[:limit]
            return sessions, _common.encode_cursor(sessions[-1])
        return sessions, ""

    async def sessions_open(self, session_ids: Sequence[str]) -> set[str]:
        def which() -> set[str]:
            found = set()
            for sid in session_ids:
                raw = self.data.sessions.get(sid)
                if raw is not None and (s := session_of(raw)).is_open and s.token_hash:
                    found.add(sid)
            return found

        return await self._call("sessions_open", which)

    async def count_open_sessions(self) -> int:
        def count() -> int:
            return sum(session_of(raw).status in OPEN_STATUSES for raw in self.data.sessions.values())

        return await self._call("count_open_sessions", count)

    async def delete_session(self, session_id: str) -> None:
        await self._call("delete_session", lambda: drop_session(self.data, session_id))
