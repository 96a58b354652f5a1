"""`SessionStore`: every protocol of rlgate.store.protocols in one object, as `open_store(url)` returns it.

It also holds what every backend shares: `commit` checks its arguments (`Writes`) before the backend's one
round trip (`_commit_writes`), and `change_session` is written here once for backends that cannot run
`change` where the data is (read, change, compare-and-set, again from a fresh read when another writer got
there first).
"""

from __future__ import annotations

import abc
from collections.abc import Callable

from rlgate.store.models import ConflictError, RequestExists, Session, ToolCallEntry, Writes
from rlgate.store.protocols import (
    CreateAdmission,
    IntentRecords,
    Leases,
    Owners,
    RequestRecords,
    SessionRecords,
    ToolCallLog,
    Upkeep,
)


class SessionStore(
    SessionRecords, ToolCallLog, RequestRecords, IntentRecords, CreateAdmission, Owners, Leases, Upkeep, abc.ABC
):
    """Sessions, tool-call logs, request records, provisioning intents, create admission, owners, leases and
    upkeep."""

    async def commit(
        self,
        *,
        session: Session | None = None,
        request: tuple[str, str, str] | None = None,
        tool_call: ToolCallEntry | None = None,
        new_request: bool = False,
        held_by: str = "",
        new_session: bool = False,
    ) -> Session | None:
        if new_session and session is None:
            raise ValueError("new_session=True needs a session")
        # Writes: ValueError for a combination that is not one.
        return await self._commit_writes(session, Writes(request, tool_call, new_request, held_by), new_session)

    async def change_session(
        self, session_id: str, change: Callable[[Session], Writes | None]
    ) -> tuple[Session | None, bool]:
        while True:
            session = await self.get_session(session_id)
            if session is None:
                return None, False
            writes = change(session)
            if writes is None:
                return session, False
            try:
                written = await self._commit_writes(session, writes, False)
            except RequestExists:
                raise
            except ConflictError:
                continue
            assert written is not None
            return written, True

    @abc.abstractmethod
    async def _commit_writes(self, session: Session | None, writes: Writes, new_session: bool) -> Session | None:
        """`commit` with its arguments checked: the backend's one round trip."""


async def open_store(url: str) -> SessionStore:
    """Open a store from its URL: `sqlite:///abs/or/rel/path.db`, `redis://host:port/db`, or `memory://[NAME]`
    (in this process only, for tests: see rlgate.store.memory)."""
    if url.startswith("sqlite:///"):  # sqlite:///relative.db, sqlite:////absolute.db
        from rlgate.store.sqlite import SqliteStore

        return await SqliteStore.open(url[len("sqlite:///") :])
    if url.startswith(("redis://", "rediss://", "unix://")):
        from rlgate.store.redis import RedisStore

        return await RedisStore.open(url)
    if url.startswith("memory://"):
        from rlgate.store.memory import open_memory_store

        return await open_memory_store(url)
    raise ValueError(f"unsupported store URL {url!r} (use sqlite:///path, redis://host:port/db or memory://)")
