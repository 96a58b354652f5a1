"""One mcp `Client` inside its owner task, and the tool lists links share.

mcp 2.x constraints this is built around (docs/toolgateway.md, "Upstream clients"):
- a `Client` must be exited in the task that entered it -> each lives inside its owner task (`Link.run`);
  callers in other tasks only call its methods (concurrent calls are multiplexed by JSON-RPC id);
- a client can die (its transport task group ended, a legacy session the server forgot answers -32600
  forever) -> the link is marked dead and its `EndpointClient` builds a new one;
- a client of a stateless era (2026-07-28) holds nothing of one session, so one link per URL may serve
  every session on that URL (`common`, handed out by the pool); a legacy-era client is its session's.
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref

import anyio
import mcp_types as mt
from mcp import Client, MCPError
from mcp.shared.inbound import x_mcp_header_map
from mcp_types import METHOD_NOT_FOUND
from mcp_types.version import MODERN_PROTOCOL_VERSIONS

from rlgate.core.errors import MAX_MESSAGE, clip
from rlgate.mcpclient.catalog import listing_key
from rlgate.mcpclient.connect import connect_error, leaves, list_tools_forwarding, open_client
from rlgate.mcpclient.errors import CallNotSent, EndpointNotFound, UpstreamUnavailable
from rlgate.mcpclient.stateless import MAX_CONNECTIONS
from rlgate.mcpclient.transport import HttpSettings, exchange
from rlgate.runtime import metrics

log = logging.getLogger(__name__)

_open_clients = metrics.gauge("rlgate_toolgateway_upstream_clients", "Open upstream MCP clients")
_connects = metrics.counter("rlgate_toolgateway_upstream_connects_total", "Upstream MCP handshakes", ["result"])

STATELESS_ERAS = frozenset(MODERN_PROTOCOL_VERSIONS)  # no session on the server: a client may serve many


class SharedTools:
    """A tool list shared by every client whose endpoint lists exactly these tools (same env version), and
    each tool's `x-mcp-header` positions, found on its first stateless-era call."""

    __slots__ = ("__weakref__", "_header_maps", "tools")

    def __init__(self, tools: list[mt.Tool]) -> None:
        self.tools = tools
        self._header_maps: dict[str, dict[tuple[str, ...], str]] = {}

    def header_map(self, name: str) -> dict[tuple[str, ...], str]:
        """The `Mcp-Param-*` header positions of tool `name` (none for a tool this list lacks)."""
        found = self._header_maps.get(name)
        if found is None:
            tool = next((t for t in self.tools if t.name == name), None)
            found = self._header_maps[name] = x_mcp_header_map(tool.input_schema) if tool is not None else {}
        return found


class ToolListInterner:
    """Sessions of one environment list identical tools; keep one parsed copy instead of one per client."""

    def __init__(self) -> None:
        self._lists: weakref.WeakValueDictionary[str, SharedTools] = weakref.WeakValueDictionary()

    def intern(self, tools: list[mt.Tool]) -> SharedTools:
        key = listing_key(tools)
        shared = self._lists.get(key)
        if shared is None:
            shared = self._lists[key] = SharedTools(tools)
        return shared

    def __len__(self) -> int:
        return len(self._lists)


class Link:
    """One mcp `Client` living inside its owner task (entered and exited there); a 2026-07-28 link's calls
    go on the pool's `stateless.StatelessCalls`, at most `call_slots` at once. Connecting includes the tool discovery
    (every page): the session's catalog needs it, and a 2026-07-28 call mirrors `x-mcp-header` arguments
    into request headers from the listed tool's schema."""

    def __init__(
        self, url: str, http: HttpSettings, timeout_s: float, interner: ToolListInterner, *, common: bool = False
    ) -> None:
        self.url = url
        self._http = http
        self._timeout = timeout_s
        self._interner = interner
        self.client: Client | None = None
        # A 2026-07-28 link's calls in flight, at most its client's connection limit (`stateless`).
        self.call_slots = asyncio.Semaphore(http.limits.max_connections or MAX_CONNECTIONS)
        self.era = ""
        self.dead = False
        self.common = common  # serves every session on its URL (the pool counts `users`), else one session's
        self.users = 0
        self.shared = SharedTools([])
        self.names: frozenset[str] = frozenset()
        self.listed_at = 0.0  # monotonic time of the listing in `shared`
        self._listing = asyncio.Lock()  # single flight: sessions sharing the link share one re-listing
        self.ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.ready.add_done_callback(lambda f: f.cancelled() or f.exception())  # never "unretrieved"
        self._stop = anyio.Event()
        self.task: asyncio.Task[None] | None = None

    @property
    def tools(self) -> list[mt.Tool]:
        return self.shared.tools

    @property
    def stateless(self) -> bool:
        return self.era in STATELESS_ERAS

    def set_tools(self, tools: list[mt.Tool]) -> None:
        self.shared = self._interner.intern(tools)
        self.names = frozenset(t.name for t in tools)
        self.listed_at = time.monotonic()

    async def relist(self, since: float) -> None:
        """Make the link's tool list at least as recent as `since` (monotonic): listed again unless a
        listing that recent exists or lands while waiting for another caller's."""
        async with self._listing:
            if self.listed_at < since:
                client = self.client
                if client is None:
                    raise CallNotSent(f"{self.url}: connection closed before tools/list was sent")
                self.set_tools(await list_tools_forwarding(client, self.url))
                await self._drop_held_reply(client)

    async def _drop_held_reply(self, client: Client) -> None:
        """The SDK's message reader holds the last reply it read until the next one arrives. A legacy-era
        call's reply soon replaces a listing's; a 2026-07-28 link's calls bypass the SDK (`stateless`), so
        a ping's small reply replaces the parsed listing instead (a listing's worth of memory per link, so per
        session where every session has an instance of its own; docs/toolgateway.md has the size). Best
        effort: a failed ping changes nothing else."""
        if not self.stateless:
            return
        try:
            # The session's ping: the SDK's Client marks its own as removed in this era (a server may answer
            # METHOD_NOT_FOUND, which replaces the held reply as well).
            await client.session.send_ping()
        except Exception as exc:  # the next request on this link says what is wrong, if anything is
            log.debug("ping to %s after listing failed: %s: %s", self.url, type(exc).__name__, clip(exc, 200))

    async def run(self) -> None:
        opened = False
        try:
            async with open_client(self.url, self._http, self._timeout) as client:
                self.set_tools(await self._first_listing(client))
                self.client, self.era, opened = client, client.protocol_version, True
                _open_clients.inc()
                _connects.labels("ok").inc()
                self.ready.set_result(None)
                # Beside the wait for `stop`: calls need not wait for it, nor a stop for a ping nobody answers.
                dropping = asyncio.create_task(self._drop_held_reply(client), name=f"mcp-ping {self.url}")
                try:
                    await self._stop.wait()
                finally:
                    if not dropping.done():
                        dropping.cancel()
                        await asyncio.wait([dropping], timeout=1.0)
        except asyncio.CancelledError:
            if not self.ready.done():
                self.ready.set_exception(CallNotSent(f"{self.url}: connection closed while connecting"))
            raise
        except BaseException as exc:  # the owner must never let an upstream failure escape
            if not self.ready.done():
                _connects.labels("failed").inc()
                err = exc if isinstance(exc, EndpointNotFound | UpstreamUnavailable) else connect_error(self.url, exc)
                self.ready.set_exception(err)
            else:
                leaf = leaves(exc)[0]
                log.info("upstream %s connection ended: %s: %s", self.url, type(leaf).__name__, clip(leaf, MAX_MESSAGE))
        finally:
            self.dead = True
            self.client = None
            if opened:
                _open_clients.dec()

    async def _first_listing(self, client: Client) -> list[mt.Tool]:
        """The listing that completes connecting. An error the server answered (read by the transport) fails
        it as an upstream error; any other failure is the connection's, which `connect_error` sorts (a 404:
        EndpointNotFound; else CallNotSent, and the caller may connect again)."""
        with exchange() as ex:
            try:
                return await list_tools_forwarding(client, self.url)
            except MCPError as exc:
                if not ex.replied or exc.code == METHOD_NOT_FOUND:
                    raise
                raise UpstreamUnavailable(f"{self.url}: tools/list failed: {exc.message}") from exc

    def stop(self) -> None:
        self.dead = True
        self._stop.set()
