"""Every upstream client of a process: sessions' upstreams, their owner tasks, and the janitor that closes
the clients of sessions that ended or went idle.

State here is a cache: any replica rebuilds it from the session store and the upstreams.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rlgate.mcpclient.errors import CallNotSent
from rlgate.mcpclient.link import ToolListInterner
from rlgate.mcpclient.session import SessionUpstreams
from rlgate.mcpclient.transport import HttpSettings

log = logging.getLogger(__name__)

JANITOR_CONCURRENCY = 16  # store reads of one janitor pass in flight at once
# A session idle for t seconds is re-checked every max(janitor_interval_s, t / IDLE_BACKOFF): a session
# closed right after its last call (the usual end of an episode) is noticed within one interval, while
# long-idle open sessions cost few store reads.
IDLE_BACKOFF = 8.0


@dataclass
class PoolSettings:
    """Timeouts and lifetimes of upstream clients."""

    upstream_timeout_s: float = 30.0  # handshake and tools/list
    client_idle_s: float = 300.0  # close a session's clients unused this long
    tools_refresh_s: float = 300.0  # re-list tools at most this old
    janitor_interval_s: float = 1.0  # how often idle/closed sessions are looked for
    http: HttpSettings = field(default_factory=HttpSettings.shared)


class UpstreamPool:
    """Every upstream client of this process. Owns all owner tasks and the janitor."""

    def __init__(self, settings: PoolSettings | None = None) -> None:
        self.settings = settings or PoolSettings()
        self._sessions: dict[str, SessionUpstreams] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._janitor: asyncio.Task[None] | None = None
        self._closed = False
        self.tool_lists = ToolListInterner()

    def spawn(self, coro: Any, name: str) -> asyncio.Task[Any]:
        if self._closed:
            coro.close()
            raise CallNotSent("shutting down")
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def session(self, session_id: str, endpoints: Sequence[str]) -> SessionUpstreams:
        """The upstreams of a session an RPC just found open; a changed endpoint list (instance replaced)
        starts afresh."""
        current = self._sessions.get(session_id)
        if current is not None and current.endpoints == tuple(endpoints):
            current.confirmed_at = time.monotonic()
            return current
        if current is not None:
            self.spawn(current.close(), f"close-upstreams {session_id}")
        fresh = self._sessions[session_id] = SessionUpstreams(session_id, endpoints, self)
        return fresh

    def open_clients(self) -> int:
        return sum(s.connected_count() for s in self._sessions.values())

    async def close_session(self, session_id: str) -> None:
        ups = self._sessions.pop(session_id, None)
        if ups is not None:
            await ups.close()

    def start_janitor(self, still_open: Callable[[str], Awaitable[bool]]) -> None:
        """Close clients of sessions idle for `client_idle_s` or no longer open (`still_open(sid)` reads the
        store). A session that an RPC found open since the last look is not read again."""
        self._janitor = self.spawn(self._janitor_loop(still_open), "upstream-janitor")

    async def _janitor_loop(self, still_open: Callable[[str], Awaitable[bool]]) -> None:
        while True:
            await asyncio.sleep(self.settings.janitor_interval_s)
            await self.sweep(still_open)

    async def sweep(self, still_open: Callable[[str], Awaitable[bool]]) -> None:
        """One janitor pass."""
        now = time.monotonic()
        interval = self.settings.janitor_interval_s
        gate = asyncio.Semaphore(JANITOR_CONCURRENCY)

        async def look(sid: str, ups: SessionUpstreams) -> None:
            try:
                idle = ups.in_flight == 0 and now - ups.last_used > self.settings.client_idle_s
                if not idle:
                    async with gate:
                        if await still_open(sid):
                            ups.confirmed_at = time.monotonic()
                            return
                log.info("closing upstream clients of session %s (%s)", sid, "idle" if idle else "closed")
                if self._sessions.get(sid) is ups:
                    del self._sessions[sid]
                await ups.close()
            except Exception:
                log.warning("janitor could not check session %s", sid, exc_info=True)

        due = [
            (sid, ups)
            for sid, ups in self._sessions.items()
            if now - ups.confirmed_at >= max(interval, (now - ups.last_used) / IDLE_BACKOFF)
            or now - ups.last_used > self.settings.client_idle_s
        ]
        if due:
            await asyncio.gather(*(look(sid, ups) for sid, ups in due))

    async def close(self) -> None:
        """Close every client (each exits in its owner task) and cancel every background task."""
        if self._janitor is not None:
            self._janitor.cancel()
        sessions, self._sessions = list(self._sessions.values()), {}
        await asyncio.gather(*(s.close() for s in sessions), return_exceptions=True)
        self._closed = True
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
