"""Session records as the episode logic reads and changes them: one by id, the compare-and-set loop every
change goes through, the task a session runs, and every open session matching some filters.

Everything durable lives in the store (sessions updated by compare-and-set), so any replica can serve any
session and a restarted process resumes where the last one stopped.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping

from rlgate.core.errors import InvalidArgument, NotFound, clip
from rlgate.orchestrator.providers.base import TaskDef
from rlgate.orchestrator.tasks import TaskCatalog
from rlgate.runtime.logs import session_id_var
from rlgate.store import OPEN_STATUSES, ConflictError, RequestExists, Session, SessionStore, Writes


class Sessions:
    def __init__(self, store: SessionStore, catalog: TaskCatalog) -> None:
        self.store = store
        self._catalog = catalog

    def task_of(self, session: Session) -> TaskDef | None:
        """The task the session runs; None for an env-only session or a task no longer in the catalog."""
        if not session.task_key:
            return None
        try:
            return self._catalog.get(session.task_key)
        except NotFound:
            return None

    async def get(self, session_id: str) -> Session:
        """The session, named in this RPC's log lines from here on; NOT_FOUND (SESSION_NOT_FOUND) if unknown."""
        return _found(session_id, await self.store.get_session(_required(session_id)))

    async def mutate(
        self,
        session_id: str,
        change: Callable[[Session], bool],
        *,
        start: Session | None = None,
        write: Callable[[Session], Awaitable[Session | None]] | None = None,
    ) -> tuple[Session, bool]:
        """Compare-and-set loop: `change` edits a fresh copy (the first time `start`, when the caller has just
        read or written it) and returns whether to write it; `write` writes it (default `update_session`).
        A lost compare-and-set reads the session again; `RequestExists` (the ledger's) propagates.

        Without `start` and `write`, the read, `change` and the write are the store's `change_session`: one
        round trip where the store can (`change` may then run on its thread: it must only edit the session)."""
        if start is None and write is None:
            changed, written = await self.store.change_session(
                _required(session_id), lambda s: Writes() if change(s) else None
            )
            return _found(session_id, changed), written
        session = start
        while True:
            if session is None:
                session = await self.get(session_id)
            if not change(session):
                return session, False
            try:
                updated = await (write or self.store.update_session)(session)
            except RequestExists:
                raise
            except ConflictError:
                session = None
                continue
            assert updated is not None
            return updated, True

    async def open_sessions(
        self, *, labels: Mapping[str, str] | None = None, run_id: str = "", orchestrator_run: str = ""
    ) -> list[Session]:
        """Every open session matching the filters (all pages)."""
        out: list[Session] = []
        cursor = ""
        while True:
            page, cursor = await self.store.list_sessions(
                statuses=OPEN_STATUSES, labels=labels, run_id=run_id, limit=500, cursor=cursor
            )
            out.extend(s for s in page if not orchestrator_run or s.orchestrator_run == orchestrator_run)
            if not cursor:
                return out


def _required(session_id: str) -> str:
    if not session_id:
        raise InvalidArgument("session_id", "required")
    return session_id


def _found(session_id: str, session: Session | None) -> Session:
    """The session read, named in this RPC's log lines from here on; NOT_FOUND when there was none."""
    if session is None:
        raise unknown_session(session_id)
    session_id_var.set(session_id)
    return session


def unknown_session(session_id: str) -> NotFound:
    return NotFound(
        f"unknown session {clip(session_id)!r}", reason="SESSION_NOT_FOUND", metadata={"session_id": session_id}
    )
