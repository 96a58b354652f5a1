"""Whether a new session may start: never while the orchestrator drains, and not past max_sessions (the
open sessions in the store plus the ones this process is creating and has not registered yet)."""

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
        self._lock = asyncio.Lock()
        self._reserved = 0  # sessions being created by this process (not yet in the store)
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
        async with self._lock:
            limit = self._config.max_sessions
            if await self._store.count_open_sessions() + self._reserved >= limit:
                raise ResourceExhausted(
                    f"max sessions reached ({limit} open)",
                    subject="sessions",
                    reason="MAX_SESSIONS",
                    metadata={"limit": limit},
                    retry_after_s=5.0,
                )
            self._reserved += 1
            self._no_creations.clear()
        try:
            yield
        finally:
            self._reserved -= 1
            if self._reserved == 0:
                self._no_creations.set()

    async def wait_creations(self) -> None:
        """Until every admitted new-session Reset of this process has finished (shutdown drains them
        before closing sessions, so none registers a session after the close sweep)."""
        await self._no_creations.wait()
