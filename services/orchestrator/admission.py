"""Whether a new session may start: never while the orchestrator drains, and not past max_sessions (the
open sessions in the store plus the ones this process is creating and has not registered yet).

The store's count of open sessions is read once for every Reset that asks while a read is in flight (they
share it), not once per Reset in turn: a burst of Resets would otherwise queue behind one another for a
store round trip each. A shared read may predate a creation of this process that finished since (its
session now open in the store, its place no longer reserved), so every place given back since the read
began counts as open too: admission never lets more in than reads made one by one would. A refusal is
only made on a read begun after the refusing Reset arrived, so a session closed meanwhile is seen.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from rlgate.core.errors import ResourceExhausted, Unavailable
from rlgate.orchestrator.config import OrchestratorConfig
from rlgate.store import SessionRecords


class Admission:
    def __init__(self, config: OrchestratorConfig, store: SessionRecords) -> None:
        self._config = config
        self._store = store
        self.accepting = True  # False once shutdown begins: new sessions are refused (SHUTTING_DOWN)
        self._reserved = 0  # sessions being created by this process (not yet in the store)
        self._released = 0  # places given back so far (a finished creation's session is open from then on)
        self._read: asyncio.Future[tuple[int, int]] | None = None  # the count being read, shared
        self._no_creations = asyncio.Event()  # set while no new-session Reset is in flight here
        self._no_creations.set()

    @contextlib.asynccontextmanager
    async def new_session(self) -> AsyncIterator[None]:
        """Hold a place for one session being created; UNAVAILABLE while draining, RESOURCE_EXHAUSTED at the
        limit."""
        if not self.accepting:
            raise Unavailable(
                "the orchestrator is shutting down; retry on another replica", reason="SHUTTING_DOWN", retry_after_s=1.0
            )
        limit = self._config.max_sessions
        arrived = self._read  # a read already in flight began before this Reset came
        if not self._room(await self._open(), limit) and (arrived is None or not self._room(await self._open(), limit)):
            raise ResourceExhausted(
                f"max sessions reached ({limit} open)",
                subject="sessions",
                reason="MAX_SESSIONS",
                metadata={"limit": limit},
                retry_after_s=5.0,
            )
        self._reserved += 1  # no await since the check: the check and the reservation are one step
        self._no_creations.clear()
        try:
            yield
        finally:
            self._reserved -= 1
            self._released += 1
            if self._reserved == 0:
                self._no_creations.set()

    def _room(self, read: tuple[int, int], limit: int) -> bool:
        count, released_before = read
        return count + (self._released - released_before) + self._reserved < limit

    async def _open(self) -> tuple[int, int]:
        """(open sessions in the store, places given back when the read began): the read in flight, or a new one."""
        if self._read is None:
            self._read = asyncio.ensure_future(self._count())
            # Every sharer may be cancelled before it lands: its error must not go unretrieved.
            self._read.add_done_callback(lambda read: read.cancelled() or read.exception())
        return await asyncio.shield(self._read)

    async def _count(self) -> tuple[int, int]:
        released = self._released
        try:
            return await self._store.count_open_sessions(), released
        finally:
            self._read = None

    async def wait_creations(self) -> None:
        """Until every admitted new-session Reset of this process has finished (shutdown drains them
        before closing sessions, so none registers a session after the close sweep)."""
        await self._no_creations.wait()
