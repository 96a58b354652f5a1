"""Sessions in Redis: the `s:<id>` hash and its indexes (token, status, run, labels), changed by one script
per write."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rlgate.store import _common
from rlgate.store.models import OPEN_STATUSES, ConflictError, Session
from rlgate.store.redis.codec import SESSION_FIELDS, label_index, score, session_args, session_from_fields
from rlgate.store.redis.connection import RedisBase

_WALK_BATCH = 200


def update_args(session: Session, new_session: bool = False) -> tuple[Session, list[str]]:
    """The record update_session (or, `new_session`, create_session) writes and the script args of the
    update (commit's: a create's expected version is "")."""
    stored = _common.written(session, new_session)
    expected = "" if new_session else str(session.version)
    args = [stored.session_id, expected, str(stored.version), stored.to_json()]
    return stored, args + session_args(stored)


def created(stored: Session, code: int) -> Session:
    """`stored`, or the ConflictError a create's code means."""
    if code == 0:
        raise ConflictError(f"session {stored.session_id} already exists")
    if code == -1:
        raise ConflictError(f"agent token of session {stored.session_id} is already in use")
    return stored


def updated(stored: Session, code: int, last_active: str) -> Session:
    """`stored` with the stored last_active_at, or the ConflictError the update's code means."""
    sid, expected = stored.session_id, stored.version - 1
    if code == -2:
        raise ConflictError(f"session {sid} does not exist")
    if code == 0:
        raise ConflictError(f"session {sid} changed (version {last_active}, expected {expected})")
    if code == -1:
        raise ConflictError(f"agent token of session {sid} is already in use")
    stored.last_active_at = float(last_active)
    return stored


class RedisSessions(RedisBase):
    """The `SessionRecords` of the Redis store."""

    async def _load_sessions(self, ids: list[str]) -> list[Session | None]:
        async def load() -> list[Any]:
            pipe = self._client.pipeline(transaction=False)
            for sid in ids:
                pipe.hmget(self._key(f"s:{sid}"), list(SESSION_FIELDS))
            rows: list[Any] = await pipe.execute()
            return rows

        if not ids:
            return []
        rows = await self._call("load sessions", load)
        return [session_from_fields(row) for row in rows]

    async def create_session(self, session: Session) -> Session:
        stored = session.copy(version=1)
        code = await self._script(
            "create_session", "create_session", stored.session_id, stored.to_json(), *session_args(stored)
        )
        return created(stored, code)

    async def get_session(self, session_id: str) -> Session | None:
        return (await self._load_sessions([session_id]))[0]

    async def update_session(self, session: Session) -> Session:
        stored, args = update_args(session)
        code, last_active = await self._script("update_session", "update_session", *args)
        return updated(stored, code, last_active)

    async def session_by_token(self, token_hash: str) -> Session | None:
        if not token_hash:  # "" is what a revoked session holds; it must never match
            return None
        key = self._key(f"tok:{token_hash}")
        session_id = await self._call("session_by_token", lambda: self._client.get(key))
        if session_id is None:
            return None
        session = await self.get_session(session_id)
        # The index and the record change in one script; checking again costs nothing and guards reads.
        return session if session is not None and session.token_hash == token_hash else None

    async def touch_session(self, session_id: str, now: float) -> None:
        await self._script("touch_session", "touch_session", session_id, score(now))

    async def sessions_open(self, session_ids: Sequence[str]) -> set[str]:
        ids = list(dict.fromkeys(session_ids))
        found: set[str] = set()
        for start in range(0, len(ids), _WALK_BATCH):
            chunk = ids[start : start + _WALK_BATCH]
            sessions = await self._load_sessions(chunk)
            for sid, session in zip(chunk, sessions, strict=True):
                if session is not None and session.is_open and session.token_hash:
                    found.add(sid)
        return found

    async def count_open_sessions(self) -> int:
        return int(await self._call("count_open_sessions", lambda: self._client.zcard(self._key("idx:open"))))

    def _walk_key(self, statuses: frozenset[str] | None, labels: Mapping[str, str] | None, run_id: str) -> str:
        """The most selective index for a listing; remaining filters are applied to the loaded records."""
        if run_id:
            return self._key(f"idx:run:{run_id}")
        if labels:
            key, value = next(iter(labels.items()))
            return self._key(label_index(key, value))
        if statuses is not None and statuses <= OPEN_STATUSES:
            return self._key("idx:open")
        return self._key("idx:all")

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
        if statuses is not None and not statuses:
            return [], ""
        key = self._walk_key(statuses, labels, run_id)
        # Walk the index newest first from the cursor, by score position rather than by offset, so
        # sessions created or deleted meanwhile do not shift the walk. `skip` counts the entries at
        # score `high` already examined.
        high = "+inf" if position is None else score(position[0])
        skip = 0
        found: dict[str, Session] = {}
        while len(found) <= limit:
            batch = await self._index_batch(key, high, skip)
            for session in await self._load_sessions([sid for sid, _ in batch]):
                if (
                    session is not None
                    and _common.after_cursor(session, position)
                    and _common.matches(session, statuses, labels, run_id)
                ):
                    found[session.session_id] = session
            if len(batch) < _WALK_BATCH:
                break
            last = score(batch[-1][1])
            if last == high:
                skip += len(batch)
            else:
                high, skip = last, sum(1 for _, at in batch if score(at) == last)
        # Records loaded one by one may tie-break differently from the index; order them exactly.
        page = sorted(found.values(), key=lambda s: (s.created_at, s.session_id), reverse=True)
        if len(page) > limit:
            page = page[:limit]
            return page, _common.encode_cursor(page[-1])
        return page, ""

    async def _index_batch(self, key: str, high: str, skip: int) -> list[tuple[str, float]]:
        """Up to _WALK_BATCH (id, created_at) pairs of a sorted-set index, from score `high` down."""
        batch: list[tuple[str, float]] = await self._call(
            "list_sessions",
            lambda: self._client.zrevrangebyscore(key, high, "-inf", start=skip, num=_WALK_BATCH, withscores=True),
        )
        return batch

    async def delete_session(self, session_id: str) -> None:
        await self._script("delete_session", "delete_session", session_id)
