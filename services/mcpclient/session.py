"""A session's upstreams: one `EndpointClient` per endpoint, in precedence order, and the catalog they make."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import mcp_types as mt

from rlgate.mcpclient.catalog import CatalogTool, ToolCatalog, union_tools
from rlgate.mcpclient.endpoint import EndpointClient
from rlgate.mcpclient.errors import EndpointNotFound

if TYPE_CHECKING:
    from rlgate.mcpclient.pool import UpstreamPool

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SessionCatalog:
    """A session's catalog: every endpoint's tools (`catalog`, unfiltered), the endpoints that could not be
    reached (url -> reason), and what the session can call (`visible`, filtered) indexed by name."""

    catalog: ToolCatalog
    unavailable: Mapping[str, str]
    visible: ToolCatalog
    by_name: Mapping[str, CatalogTool]

    @classmethod
    def build(
        cls, catalog: ToolCatalog, unavailable: Mapping[str, str], tool_filter: Mapping[str, Any] | None, modality: str
    ) -> SessionCatalog:
        visible = catalog.filtered(tool_filter, modality)
        return cls(catalog, dict(unavailable), visible, {t.name: t for t in visible.tools})

    def find(self, name: str) -> CatalogTool | None:
        return self.by_name.get(name)

    def endpoints_in_use(self) -> frozenset[str]:
        """Endpoints owning at least one tool the session can call (after precedence and filters)."""
        return frozenset(t.endpoint for t in self.visible.tools)


class SessionUpstreams:
    """All endpoint clients of one session, in the session's precedence order.

    Only endpoints owning a tool the session can call keep a connection; the others (for a `tool_use`
    session on Fleet, the aggregator `{root}api/v1/mcp`, whose only own tool is `computer`) are closed
    once listed, and reconnect only to re-list."""

    def __init__(self, session_id: str, endpoints: Sequence[str], pool: UpstreamPool) -> None:
        self.session_id = session_id
        self.endpoints = tuple(endpoints)
        self.clients = {url: EndpointClient(url, pool) for url in self.endpoints}
        self.last_used = time.monotonic()
        self.confirmed_at = time.monotonic()  # last time an RPC or the janitor saw the session open
        self.last_forced_refresh = 0.0
        self.in_flight = 0  # calls running now: a long call keeps the session from idling out
        # The last catalog and what it was built from (the endpoints' cached lists, by identity, and the
        # filter): a call rebuilds nothing while the lists and the filter are unchanged.
        self._memo_key: tuple[Any, ...] = ()
        self._memo_lists: tuple[object, ...] = ()
        self._memo: SessionCatalog | None = None

    def cached_catalog(self, tool_filter: Mapping[str, Any] | None = None, modality: str = "") -> SessionCatalog | None:
        """The catalog from every endpoint's fresh cached listing, or None when one must be listed."""
        results = [self.clients[u].cached() for u in self.endpoints]
        if any(res is None for res in results):
            return None
        self.last_used = time.monotonic()
        return self._adopt(results, tool_filter, modality)

    async def catalog(
        self,
        timeout_s: float,
        tool_filter: Mapping[str, Any] | None = None,
        modality: str = "",
        *,
        refresh: bool = False,
    ) -> SessionCatalog:
        if not refresh and (cat := self.cached_catalog(tool_filter, modality)) is not None:
            return cat
        self.last_used = time.monotonic()
        results = await asyncio.gather(
            *(self.clients[u].list_tools(timeout_s, refresh=refresh) for u in self.endpoints), return_exceptions=True
        )
        return self._adopt(results, tool_filter, modality)

    def _adopt(self, results: Sequence[object], tool_filter: Mapping[str, Any] | None, modality: str) -> SessionCatalog:
        key: list[Any] = [repr(tool_filter), modality]
        for res in results:
            if isinstance(res, BaseException) and not isinstance(res, Exception):
                raise res
            key.append(id(res) if isinstance(res, list) else (type(res).__name__, str(res)))
        memo = self._memo
        if memo is None or tuple(key) != self._memo_key:
            memo = self._memo = self._build(results, tool_filter, modality)
            self._memo_key = tuple(key)
            self._memo_lists = tuple(results)  # keeps the ids in the key from being reused
        self._retire_unused(memo)
        return memo

    def _build(self, results: Sequence[object], tool_filter: Mapping[str, Any] | None, modality: str) -> SessionCatalog:
        per_endpoint: list[tuple[str, Sequence[mt.Tool]]] = []
        dropped: dict[str, str] = {}
        unavailable: dict[str, str] = {}
        for url, res in zip(self.endpoints, results, strict=True):
            if isinstance(res, EndpointNotFound):
                dropped[url] = str(res)
            elif isinstance(res, Exception):
                unavailable[url] = str(res)
            else:
                per_endpoint.append((url, cast("list[mt.Tool]", res)))
        return SessionCatalog.build(union_tools(per_endpoint, dropped), unavailable, tool_filter, modality)

    def _retire_unused(self, cat: SessionCatalog) -> None:
        in_use = cat.endpoints_in_use()
        for url, client in self.clients.items():
            if url not in in_use and client.connected and client.retire():
                log.debug(
                    "session %s: closed the connection to %s (owns no tool the session can call)", self.session_id, url
                )

    async def call(self, endpoint: str, name: str, arguments: dict[str, Any], timeout_s: float) -> mt.CallToolResult:
        self.last_used = time.monotonic()
        self.in_flight += 1
        try:
            return await self.clients[endpoint].call(name, arguments, timeout_s)
        finally:
            self.in_flight -= 1
            self.last_used = time.monotonic()

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self.clients.values()))
