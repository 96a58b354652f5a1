"""Backend-independent pieces of the store: list cursors, page limits, pages of the tool-call log, retention
times and the per-session invariants every backend checks. Kept here so the backends agree by construction."""

from __future__ import annotations

import base64
import binascii
import json
import time
from collections.abc import Mapping, Sequence
from typing import TypeVar

from rlgate.store.models import (
    OPEN_STATUSES,
    Intent,
    RequestRecord,
    RequestState,
    Session,
    SessionStatus,
    StoreError,
    ToolCallEntry,
)

R = TypeVar("R", Session, ToolCallEntry, Intent)

DEFAULT_PAGE = 100
MAX_PAGE = 1000


def decode(cls: type[R], raw: str | bytes) -> R:
    """A record from its stored JSON; StoreError (not a bare ValueError) when the stored bytes are corrupt."""
    try:
        return cls.from_json(raw)
    except (ValueError, TypeError) as exc:
        raise StoreError(f"corrupt {cls.__name__} record in the store: {exc}") from exc


def held_elsewhere(record: RequestRecord | None, held_by: str, result: str) -> bool:
    """Whether `commit(held_by=...)` must refuse (see `SessionStore.commit`): the record exists and is neither
    PENDING under `held_by` nor DONE with `result` already."""
    if record is None:
        return False
    if record.state == RequestState.PENDING:
        return record.owner != held_by
    return record.result != result


def request_record(
    scope: str, request_id: str, state: str, owner: str, result: str, created_at: float | str, finished_at: float | str
) -> RequestRecord:
    """A request record from a row (SQLite) or a script's reply fields (Redis, timestamps as strings)."""
    return RequestRecord(
        scope=scope,
        request_id=request_id,
        state=state,
        owner=owner,
        result=result,
        created_at=float(created_at),
        finished_at=float(finished_at),
    )


def page_limit(limit: int) -> int:
    """`limit` clamped to [1, MAX_PAGE]; 0 or less means the default page size."""
    if limit <= 0:
        return DEFAULT_PAGE
    return min(limit, MAX_PAGE)


def log_page(rows: Sequence[tuple[int, str]], limit: int) -> tuple[list[ToolCallEntry], int | None]:
    """`ToolCallLog.tool_calls`' answer from up to `limit` + 1 (position, entry JSON) rows, in order: the first
    `limit` entries, and the position of the last of them when another row follows."""
    entries = [decode(ToolCallEntry, data) for _, data in rows[:limit]]
    return entries, (rows[limit - 1][0] if len(rows) > limit else None)


def encode_cursor(session: Session) -> str:
    """An opaque cursor positioned after `session` in newest-first order."""
    raw = json.dumps([session.created_at, session.session_id], separators=(",", ":"))
    return base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")


def decode_cursor(cursor: str) -> tuple[float, str] | None:
    """(created_at, session_id) of the last session of the previous page; None for the first page.
    ValueError for a cursor this store did not produce."""
    if not cursor:
        return None
    try:
        padded = cursor + "=" * (-len(cursor) % 4)
        created_at, session_id = json.loads(base64.urlsafe_b64decode(padded.encode()))
        if not isinstance(session_id, str) or isinstance(created_at, bool):
            raise TypeError("bad cursor fields")
        return float(created_at), session_id
    except (ValueError, TypeError, binascii.Error) as exc:
        raise ValueError(f"invalid list cursor {cursor!r}") from exc


def after_cursor(session: Session, position: tuple[float, str] | None) -> bool:
    """Whether `session` comes after the cursor position in newest-first (created_at, id) order."""
    if position is None:
        return True
    created_at, session_id = position
    return session.created_at < created_at or (session.created_at == created_at and session.session_id < session_id)


def matches(session: Session, statuses: frozenset[str] | None, labels: Mapping[str, str] | None, run_id: str) -> bool:
    """The list_sessions filter, for backends that filter in Python."""
    if statuses is not None and session.status not in statuses:
        return False
    if run_id and session.run_id != run_id:
        return False
    return not labels or all(session.labels.get(k) == v for k, v in labels.items())


def retention_time(session: Session) -> float | None:
    """When a finished session became prunable (closed_at, else updated_at); None while it is open."""
    if session.status in OPEN_STATUSES:
        return None
    return session.closed_at or session.updated_at


def session_problems(session: Session) -> list[str]:
    """Invariants of one session record, independent of how the backend indexes it."""
    problems: list[str] = []
    sid = session.session_id
    if session.version < 1:
        problems.append(f"session {sid}: version {session.version} < 1")
    if session.status == SessionStatus.ACTIVE and not session.token_hash:
        problems.append(f"session {sid}: ACTIVE without an agent token hash")
    if session.status not in OPEN_STATUSES and session.token_hash:
        problems.append(f"session {sid}: {session.status} but its agent token is not revoked")
    if session.episode < 1:
        problems.append(f"session {sid}: episode {session.episode} < 1")
    return problems


def next_version(session: Session) -> Session:
    """What update_session writes: a copy with version + 1 and updated_at now."""
    return session.copy(version=session.version + 1, updated_at=time.time())


def written(session: Session, new_session: bool) -> Session:
    """What `commit` writes for `session`: created (version 1, as `create_session` stores it) or updated."""
    return session.copy(version=1) if new_session else next_version(session)
