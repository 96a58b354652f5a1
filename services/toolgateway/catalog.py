"""A session's tools: the union of its endpoints' listings under its filter (`rlgate.mcpclient`), what
ListTools returns, and the lookup of a tool by name for CallTool (re-listing when a name is unknown, since
an upstream's tools may have changed)."""

from __future__ import annotations

import asyncio
import logging
import time

from rlgate.core.errors import MAX_MESSAGE, DeadlineExceeded, Unavailable, clip
from rlgate.mcpclient.catalog import CatalogTool
from rlgate.mcpclient.pool import UpstreamPool
from rlgate.mcpclient.session import SessionCatalog
from rlgate.runtime.deadline import Deadline
from rlgate.store import Session
from rlgate.v1 import toolgateway_pb2

log = logging.getLogger(__name__)

UNKNOWN_TOOL_REFRESH_S = 2.0  # an unknown tool name re-lists the upstreams at most this often per session


class Catalogs:
    """The tool catalog of each session, listed through the upstream pool within the caller's deadline."""

    def __init__(self, pool: UpstreamPool, upstream_timeout_s: float) -> None:
        self._pool = pool
        self._upstream_timeout_s = upstream_timeout_s  # handshake + tools/list when the caller sets no deadline

    async def catalog(self, session: Session, deadline: Deadline, *, refresh: bool = False) -> SessionCatalog:
        ups = self._pool.session(session.session_id, session.endpoints)
        if not refresh and (cached := ups.cached_catalog(session.tool_filter, session.modality)) is not None:
            return cached  # every endpoint's listing is cached and fresh: nothing to wait for
        if deadline.expired():
            raise DeadlineExceeded("deadline exceeded before listing tools")
        try:
            async with asyncio.timeout(deadline.remaining()):
                cat = await ups.catalog(
                    deadline.cap(self._upstream_timeout_s),
                    session.tool_filter,
                    session.modality,
                    refresh=refresh,
                )
        except TimeoutError:
            raise DeadlineExceeded("deadline exceeded while listing tools") from None
        if cat.unavailable:
            if not cat.catalog.tools:
                raise Unavailable(
                    "no MCP endpoint reachable: " + "; ".join(cat.unavailable.values()), reason="UPSTREAM_UNAVAILABLE"
                )
            log.warning(
                "endpoints unavailable (partial tool list): %s", clip("; ".join(cat.unavailable.values()), MAX_MESSAGE)
            )
        return cat

    async def list_tools(self, session: Session, deadline: Deadline) -> toolgateway_pb2.ListToolsResponse:
        cat = await self.catalog(session, deadline)
        return toolgateway_pb2.ListToolsResponse(tools=[t.spec() for t in cat.visible.tools])

    async def lookup(
        self, session: Session, name: str, deadline: Deadline
    ) -> tuple[CatalogTool | None, SessionCatalog]:
        """The callable tool `name` (None: no visible tool has it) and the catalog it was looked up in. An
        unknown name re-lists the upstreams first, at most every UNKNOWN_TOOL_REFRESH_S per session."""
        ups = self._pool.session(session.session_id, session.endpoints)
        cat = await self.catalog(session, deadline)
        tool = cat.find(name)
        stale = time.monotonic() - ups.last_forced_refresh > UNKNOWN_TOOL_REFRESH_S
        if tool is None and stale and name not in cat.catalog.left_out:  # a left-out tool stays left out
            ups.last_forced_refresh = time.monotonic()  # the upstream's tool list may have changed
            cat = await self.catalog(session, deadline, refresh=True)
            tool = cat.find(name)
        return tool, cat
