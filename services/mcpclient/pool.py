"""Every upstream client of a process: sessions' upstreams, the links (SDK clients) they use, their owner tasks,
and the janitor that closes the clients of sessions that ended or went idle.

A URL whose server speaks a stateless era (2026-07-28) gets common links, each serving up to
`common_link_sessions` sessions on that URL: one handshake and one tool listing per refresh for them instead
of one of each per session. Their calls go on the process's `StatelessCalls` pool, so the link's own
connections carry only the handshake and listings; the bound is how many sessions one link's failure (a
handshake to redo, a broken link rebuilt) touches at once. The era is learnt from a URL's first link; until
then, and for legacy-era URLs (the server keeps a session per client), each session's endpoint client has a
link of its own.

State here is a cache: any replica rebuilds it from the session store and the upstreams.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx2

from rlgate.mcpclient.errors import CallNotSent
from rlgate.mcpclient.link import Link, ToolListInterner
from rlgate.mcpclient.session import SessionUpstreams
from rlgate.mcpclient.stateless import StatelessCalls
from rlgate.mcpclient.transport import HttpSettings

log = logging.getLogger(__name__)

JANITOR_BATCH = 500  # sessions one store call of the janitor asks about
# A session idle for t seconds is re-checked every max(janitor_interval_s, t / IDLE_BACKOFF): a session
# closed right after its last call (the usual end of an episode) is noticed within one interval, while
# long-idle open sessions cost few store reads.
IDLE_BACKOFF = 8.0
OpenOf = Callable[[list[str]], Awaitable[set[str]]]  # which of these sessions are open (one store call)
ERAS_KEPT = 4096  # URLs whose era is remembered (least recently used forgotten first)


@dataclass
class PoolSettings:
    """Timeouts and lifetimes of upstream clients."""

    upstream_timeout_s: float = 30.0  # handshake and tools/list
    client_idle_s: float = 300.0  # close a session's clients unused this long
    tools_refresh_s: float = 300.0  # re-list tools at most this old
    janitor_interval_s: float = 1.0  # how often idle/closed sessions are looked for
    http: HttpSettings = field(default_factory=HttpSettings.shared)
    # Sessions one common link serves; twice as many of their calls may be in flight at once (HTTP/1.1
    # carries one call at a time; a call finding every slot busy waits for one, within its deadline).
    common_link_sessions: int = 256


class UpstreamPool:
    """Every upstream client of this process. Owns all owner tasks and the janitor."""

    def __init__(self, settings: PoolSettings | None = None) -> None:
        self.settings = settings or PoolSettings()
        self._sessions: dict[str, SessionUpstreams] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._janitor: asyncio.Task[None] | None = None
        self._closed = False
        self.tool_lists = ToolListInterner()
        self._links: set[Link] = set()  # every link whose owner task runs
        self._common: dict[str, list[Link]] = {}  # url -> its common links
        self._stateless: OrderedDict[str, bool] = OrderedDict()  # url -> whether its server's era is stateless
        http = self.settings.http
        n = 2 * self.settings.common_link_sessions
        limits = httpx2.Limits(
            max_connections=n, max_keepalive_connections=n, keepalive_expiry=http.limits.keepalive_expiry
        )
        self._common_http = dataclasses.replace(http, limits=limits)
        self._calls: StatelessCalls | None = None  # 2026-07-28 calls, opened on the first

    def stateless_calls(self) -> StatelessCalls:
        """The connection pool of every 2026-07-28 call of this process."""
        if self._closed:
            raise CallNotSent("shutting down")
        if self._calls is None:
            self._calls = StatelessCalls(self.settings.http)
        return self._calls

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

    # -- links ------------------------------------------------------------------------------------------------
    def link(self, url: str) -> Link:
        """A link for an endpoint client of `url`, counted as used until `release`d: a common link of the URL
        with room for another session; else a new link, common from the start when the URL's era is known to
        be stateless, else private to the caller."""
        common = self._common.get(url, ())
        for current in common:
            if not current.dead and current.users < self.settings.common_link_sessions:
                current.users += 1
                return current
        stateless = self._stateless.get(url, False)
        settings = self.settings
        link = Link(
            url,
            self._common_http if stateless else settings.http,
            settings.upstream_timeout_s,
            self.tool_lists,
            common=stateless,
        )
        link.users = 1
        if stateless:
            self._common.setdefault(url, []).append(link)
        link.ready.add_done_callback(functools.partial(self._learn_era, link))
        link.task = self.spawn(link.run(), f"mcp-owner {url}")
        self._links.add(link)
        link.task.add_done_callback(functools.partial(self._link_ended, link))
        return link

    def release(self, link: Link, *, broken: bool = False) -> None:
        """An endpoint client no longer uses `link`. A private link is closed; a common one when its last
        user leaves, or at once when it is `broken` (its client cannot carry calls any more)."""
        link.users -= 1
        if not link.common or broken or link.users <= 0:
            self._forget_common(link)
            link.stop()

    def _learn_era(self, link: Link, ready: asyncio.Future[None]) -> None:
        if ready.cancelled() or ready.exception() is not None:
            self._forget_common(link)
            return
        self._stateless[link.url] = link.stateless
        self._stateless.move_to_end(link.url)
        while len(self._stateless) > ERAS_KEPT:
            self._stateless.popitem(last=False)
        if link.common and not link.stateless:  # the server changed era: its client is one session's now
            self._forget_common(link)
            link.stop()

    def _forget_common(self, link: Link) -> None:
        common = self._common.get(link.url)
        if common is not None and link in common:
            common.remove(link)
            if not common:
                del self._common[link.url]

    def _link_ended(self, link: Link, task: asyncio.Task[None]) -> None:
        self._links.discard(link)
        self._forget_common(link)

    def open_clients(self) -> int:
        """Upstream clients connected now (a common link counts once)."""
        return sum(1 for link in self._links if link.client is not None and not link.dead)

    async def close_session(self, session_id: str) -> None:
        ups = self._sessions.pop(session_id, None)
        if ups is not None:
            await ups.close()

    def start_janitor(self, open_of: OpenOf) -> None:
        """Close clients of sessions idle for `client_idle_s` or no longer open (`open_of(ids)` reads the
        store: which of these sessions are open). A session that an RPC found open since the last look is
        not read again."""
        self._janitor = self.spawn(self._janitor_loop(open_of), "upstream-janitor")

    async def _janitor_loop(self, open_of: OpenOf) -> None:
        while True:
            await asyncio.sleep(self.settings.janitor_interval_s)
            await self.sweep(open_of)

    async def sweep(self, open_of: OpenOf) -> None:
        """One janitor pass: the sessions due for a look are read JANITOR_BATCH at a time, one store call
        each (not a read and a task per session)."""
        now = time.monotonic()
        interval = self.settings.janitor_interval_s
        ended: list[tuple[str, SessionUpstreams, str]] = []
        due: list[tuple[str, SessionUpstreams]] = []
        for sid, ups in self._sessions.items():
            if ups.in_flight == 0 and now - ups.last_used > self.settings.client_idle_s:
                ended.append((sid, ups, "idle"))
            elif now - ups.confirmed_at >= max(interval, (now - ups.last_used) / IDLE_BACKOFF):
                due.append((sid, ups))
        for start in range(0, len(due), JANITOR_BATCH):
            batch = due[start : start + JANITOR_BATCH]
            try:
                still = await open_of([sid for sid, _ in batch])
            except Exception:
                log.warning("janitor could not check %d sessions", len(batch), exc_info=True)
                continue
            confirmed = time.monotonic()
            for sid, ups in batch:
                if sid in still:
                    ups.confirmed_at = confirmed
                else:
                    ended.append((sid, ups, "closed"))
        for sid, ups, why in ended:
            log.info("closing upstream clients of session %s (%s)", sid, why)
            if self._sessions.get(sid) is ups:
                del self._sessions[sid]
        if ended:
            await asyncio.gather(*(ups.close() for _, ups, _ in ended), return_exceptions=True)

    async def close(self) -> None:
        """Close every client (each exits in its owner task) and cancel every background task."""
        if self._janitor is not None:
            self._janitor.cancel()
        sessions, self._sessions = list(self._sessions.values()), {}
        await asyncio.gather(*(s.close() for s in sessions), return_exceptions=True)
        links, self._common = list(self._links), {}
        for link in links:
            link.stop()
        owners = [link.task for link in links if link.task is not None]
        if owners:
            with contextlib.suppress(TimeoutError):  # each client exits in its owner task; bounded
                await asyncio.wait_for(asyncio.gather(*owners, return_exceptions=True), 5.0)
        self._closed = True
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        calls, self._calls = self._calls, None
        if calls is not None:
            await calls.close()
