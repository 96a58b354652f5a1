"""Persistent upstream MCP clients: one per (session, endpoint), each owned by one task.

mcp 2.x constraints this module is built around (see docs/toolgateway.md):
- a `Client` must be exited in the task that entered it -> each lives inside its owner task (`_Link.run`);
  callers in other tasks only call its methods (concurrent calls are multiplexed by JSON-RPC id);
- one transport error tears the whole client down (in-flight calls get -32000 "Connection closed") and a
  legacy-era session the server forgot answers -32600 "Session not found" forever -> the link is marked
  dead and the next user builds a new one (counted as a rebuild);
- an httpx2 read timeout that fires kills the client -> HTTP reads have no timeout; every MCP request
  carries `read_timeout_seconds` instead (the caller's gRPC deadline for calls);
- a default client builds its own SSL context (~1 MB, ~30 ms) -> all clients share `HttpSettings`.

Only calls that provably never reached the upstream are retried: a failed handshake, a link found dead
before sending, or a -32600 session rejection (the server refused the request without running it).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import json
import logging
import os
import ssl
import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, cast

import anyio
import httpx2
import mcp_types as mt
from mcp import Client, MCPError
from mcp.client.streamable_http import streamable_http_client
from mcp_types import (
    CONNECTION_CLOSED,
    HEADER_MISMATCH,
    INVALID_REQUEST,
    METHOD_NOT_FOUND,
    PARSE_ERROR,
    REQUEST_TIMEOUT,
)
from mcp_types.version import MODERN_PROTOCOL_VERSIONS
from pydantic import ValidationError

from rlgate.runtime import metrics
from rlgate.toolgateway.catalog import (
    CatalogTool,
    EndpointNotFound,
    ToolCatalog,
    UpstreamUnavailable,
    list_all_tools,
    union_tools,
)
from rlgate.toolgateway.http_calls import HttpCaller, HttpCallSettings, RequestTimedOut, ResponseLost, SendFailed

log = logging.getLogger(__name__)

_rebuilds = metrics.counter("rlgate_toolgateway_upstream_rebuilds_total",
                            "Upstream MCP clients rebuilt after a dead connection or forgotten session", ["reason"])
_open_clients = metrics.gauge("rlgate_toolgateway_upstream_clients", "Open upstream MCP clients")
_connects = metrics.counter("rlgate_toolgateway_upstream_connects_total", "Upstream MCP handshakes", ["result"])
_sent = metrics.counter("rlgate_toolgateway_upstream_calls_sent_total",
                        "Tool calls sent upstream, by path: direct (http_calls) or sdk (the mcp client)", ["path"])
_sent_direct, _sent_sdk = _sent.labels("direct"), _sent.labels("sdk")


class CallNotSent(UpstreamUnavailable):
    """The call provably never reached the upstream (safe to retry, request record released)."""


class CallLost(UpstreamUnavailable):
    """The connection died after the call was sent: the tool may or may not have run."""


class CallTimedOut(Exception):
    """The MCP call timeout (the caller's deadline) passed. `sent`: the request had gone out (the SDK then
    cancelled it upstream) and the tool may have partly run; otherwise it provably never started."""

    def __init__(self, message: str, *, sent: bool) -> None:
        super().__init__(message)
        self.sent = sent


class CallRejected(Exception):
    """The upstream answered the call with a JSON-RPC error (not a tool result)."""

    def __init__(self, error: MCPError) -> None:
        super().__init__(error.message)
        self.code = error.code


@dataclass(frozen=True)
class HttpSettings:
    """Connection settings shared by every upstream client: one SSL context, limits and timeouts."""

    ssl_context: ssl.SSLContext
    limits: httpx2.Limits
    timeout: httpx2.Timeout
    trust_env: bool = False

    _shared: ClassVar[HttpSettings | None] = None

    @classmethod
    def create(cls, *, connect_timeout: float = 10.0, max_connections: int = 8,
               trust_env: bool = False) -> HttpSettings:
        ctx = ssl.create_default_context(cafile=os.environ.get("SSL_CERT_FILE") or None)
        # Only connecting has an HTTP timeout: any httpx2 timeout that fires (read, write, pool) tears the
        # whole MCP client down. Every MCP request has its own read_timeout_seconds instead, which also
        # bounds waiting for a pooled connection. Keep-alive connections live long enough to be reused.
        timeout = httpx2.Timeout(connect=connect_timeout, read=None, write=None, pool=None)
        limits = httpx2.Limits(max_connections=max_connections, max_keepalive_connections=max_connections,
                               keepalive_expiry=120.0)
        return cls(ssl_context=ctx, limits=limits, timeout=timeout, trust_env=trust_env)

    @classmethod
    def shared(cls) -> HttpSettings:
        if cls._shared is None:
            cls._shared = cls.create()
        return cls._shared

    def client(self) -> httpx2.AsyncClient:
        transport = _NoStandaloneStream(httpx2.AsyncHTTPTransport(
            verify=self.ssl_context, limits=self.limits, trust_env=self.trust_env))
        return httpx2.AsyncClient(transport=transport, timeout=self.timeout, trust_env=self.trust_env)


class _NoStandaloneStream(httpx2.AsyncBaseTransport):
    """Declines the legacy era's standalone GET SSE stream locally (HTTP 405, which the spec allows and the
    SDK accepts). The gateway does not consume server-initiated messages (it re-lists tools on a timer and
    on unknown names), and that stream would hold a connection, a task and buffers per client.
    GETs resuming a request's stream (`Last-Event-ID`) go through."""

    def __init__(self, inner: httpx2.AsyncBaseTransport) -> None:
        self._inner = inner

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        if (request.method == "GET" and "text/event-stream" in request.headers.get("accept", "")
                and "last-event-id" not in request.headers):
            return httpx2.Response(405, request=request)
        return await self._inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self._inner.aclose()


def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for e in exc.exceptions for leaf in _leaves(e)]
    return [exc]


def connect_error(url: str, exc: BaseException) -> Exception:
    """What a failed handshake means: EndpointNotFound (HTTP 404) or UpstreamUnavailable."""
    for leaf in _leaves(exc):
        if isinstance(leaf, MCPError) and leaf.code == METHOD_NOT_FOUND:
            return EndpointNotFound(f"{url} answered 404 Not Found (no MCP endpoint there)")
    first = _leaves(exc)[0]
    return CallNotSent(f"{url} unreachable: {type(first).__name__}: {first}".rstrip(": "))


@contextlib.asynccontextmanager
async def open_client(url: str, http: HttpSettings, timeout_s: float) -> AsyncIterator[Client]:
    """An entered mcp `Client` (auto era detection) on a fresh httpx2 client with the shared settings.
    Enter and exit in the same task. Handshake failures raise EndpointNotFound / CallNotSent."""
    async with contextlib.AsyncExitStack() as stack:
        try:
            hc = await stack.enter_async_context(http.client())
            client = Client(streamable_http_client(url, http_client=hc), read_timeout_seconds=timeout_s, cache=None)
            entered = await stack.enter_async_context(client)
        except Exception as exc:
            raise connect_error(url, exc) from exc
        except BaseExceptionGroup as exc:  # anyio task groups wrap transport errors
            raise connect_error(url, exc) from exc
        _forward_only(entered)
        yield entered


async def _results_pass_through(name: str, result: mt.CallToolResult) -> None:
    """The gateway forwards results; the agent's side has the tool's output schema from ListTools."""


def _forward_only(client: Client) -> None:
    """Make an entered client a forwarder: no output-schema validation of results, no schemas kept.

    mcp 2.3.0 has no switch for this (`Client(cache=None)` only turns the response cache off):
    `ClientSession.call_tool` re-validates every structured result against the tool's output schema
    (compiling one jsonschema validator per tool per client: ~13 % of the gateway's CPU with the argument
    check), and `_absorb_tool_listing` keeps every listed tool's output schema per client for that. The
    public method is replaced on this session instance only; the kept schemas are dropped after each
    listing (`forget_output_schemas`)."""
    client.session.validate_tool_result = _results_pass_through  # type: ignore[method-assign]


def forget_output_schemas(client: Client) -> None:
    """Drop the SDK's per-client copy of the listed output schemas (read only by the validation that
    `_forward_only` switched off), so a client holds no parsed tool list of its own. Private SDK state:
    left alone if a later SDK version keeps it elsewhere."""
    schemas = getattr(client.session, "_tool_output_schemas", None)
    if isinstance(schemas, dict):
        schemas.clear()


async def list_tools_forwarding(client: Client) -> list[mt.Tool]:
    """Every page of the client's tools/list, without leaving a per-client copy in the SDK.

    The SDK's message reader (`JSONRPCDispatcher.run`) holds the last message it received until the next
    one arrives. A modern-era link's calls go direct (`http_calls`), so after listing it would receive
    nothing and hold the whole raw listing (~115 KiB per session measured with localfleet's mailbox
    tools). It therefore ends its listing with a `ping`, whose small answer (a result, or the modern
    era's "method not found") takes the listing's place. Handshake-era calls go through the SDK and
    replace it anyway."""
    tools = await list_all_tools(client)
    forget_output_schemas(client)
    if client.protocol_version in MODERN_PROTOCOL_VERSIONS:
        with contextlib.suppress(MCPError):
            await client.session.send_ping()
    return tools


def _is_session_gone(exc: MCPError) -> bool:
    msg = exc.message.lower()
    return exc.code == INVALID_REQUEST and ("session not found" in msg or "session terminated" in msg)


class _SharedTools:
    """A tool list shared by every client whose endpoint lists exactly these tools (same env version)."""

    __slots__ = ("__weakref__", "tools")

    def __init__(self, tools: list[mt.Tool]) -> None:
        self.tools = tools


class ToolListInterner:
    """Sessions of one environment list identical tools; keep one parsed copy instead of one per client."""

    def __init__(self) -> None:
        self._lists: weakref.WeakValueDictionary[str, _SharedTools] = weakref.WeakValueDictionary()

    def intern(self, tools: list[mt.Tool]) -> _SharedTools:
        key = hashlib.sha256(json.dumps(
            [t.model_dump(mode="json", by_alias=True, exclude_none=True) for t in tools], sort_keys=True,
        ).encode()).hexdigest()
        shared = self._lists.get(key)
        if shared is None:
            shared = self._lists[key] = _SharedTools(tools)
        return shared

    def __len__(self) -> int:
        return len(self._lists)


class _Link:
    """One mcp `Client` living inside its owner task (entered and exited there). Connecting includes the
    tool discovery (every page): the session's catalog needs it, and on 2026-07-28 connections the SDK
    mirrors `x-mcp-header` arguments into request headers only for tools this client has listed."""

    def __init__(self, url: str, http: HttpSettings, timeout_s: float, interner: ToolListInterner) -> None:
        self.url = url
        self._http = http
        self._timeout = timeout_s
        self._interner = interner
        self.client: Client | None = None
        self.era = ""
        self.dead = False
        self.shared = _SharedTools([])
        self.names: frozenset[str] = frozenset()
        self.ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.ready.add_done_callback(lambda f: f.cancelled() or f.exception())  # never "unretrieved"
        self._stop = anyio.Event()
        self.task: asyncio.Task[None] | None = None

    @property
    def tools(self) -> list[mt.Tool]:
        return self.shared.tools

    def set_tools(self, tools: list[mt.Tool]) -> None:
        self.shared = self._interner.intern(tools)
        self.names = frozenset(t.name for t in tools)

    async def run(self) -> None:
        opened = False
        try:
            async with open_client(self.url, self._http, self._timeout) as client:
                self.set_tools(await list_tools_forwarding(client))
                self.client, self.era, opened = client, client.protocol_version, True
                _open_clients.inc()
                _connects.labels("ok").inc()
                self.ready.set_result(None)
                await self._stop.wait()
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
                leaf = _leaves(exc)[0]
                log.info("upstream %s connection ended: %s: %s", self.url, type(leaf).__name__, leaf)
        finally:
            self.dead = True
            self.client = None
            if opened:
                _open_clients.dec()

    def stop(self) -> None:
        self.dead = True
        self._stop.set()


@dataclass
class PoolSettings:
    """Timeouts and lifetimes of upstream clients."""

    upstream_timeout_s: float = 30.0  # handshake and tools/list
    client_idle_s: float = 300.0  # close a session's clients unused this long
    tools_refresh_s: float = 300.0  # re-list tools at most this old
    janitor_interval_s: float = 1.0  # how often idle/closed sessions are looked for
    connect_timeout_s: float = 10.0
    http: HttpSettings = field(default_factory=HttpSettings.shared)
    # Modern-era tools/call over the gateway's own pooled HTTP connections (`http_calls`) instead of the
    # SDK client's per-request machinery; False sends every call through the SDK.
    direct_calls: bool = True
    direct_http: HttpCallSettings = field(default_factory=HttpCallSettings)


class EndpointClient:
    """A session's connection to one MCP endpoint: the current link plus its cached tool list."""

    def __init__(self, url: str, pool: UpstreamPool) -> None:
        self.url = url
        self._pool = pool
        self._link: _Link | None = None
        self._lock = asyncio.Lock()
        self._tools_lock = asyncio.Lock()
        self.tools: list[mt.Tool] | None = None
        self._shared: _SharedTools | None = None
        self.tools_at = 0.0
        self.not_found = ""  # set when the endpoint answered 404 (dropped until the next refresh)
        self.calls = 0  # calls in flight on this endpoint
        self._direct_slots: asyncio.Semaphore | None = None  # direct calls in flight, as the SDK's limits

    @property
    def connected(self) -> bool:
        return self._link is not None and not self._link.dead and self._link.client is not None

    def _fresh(self) -> bool:
        return time.monotonic() - self.tools_at < self._pool.settings.tools_refresh_s

    async def _get_link(self, timeout_s: float) -> tuple[_Link, Client]:
        async with self._lock:  # single flight: concurrent callers share one handshake
            link = self._link
            if link is None or link.dead:
                if link is not None and link.ready.done() and not link.ready.exception():
                    _rebuilds.labels("connection_lost").inc()
                link = self._link = _Link(self.url, self._pool.settings.http, self._pool.settings.upstream_timeout_s,
                                          self._pool.tool_lists)
                link.ready.add_done_callback(functools.partial(self._adopt_listing, link))
                link.task = self._pool.spawn(link.run(), f"mcp-owner {self.url}")
        if link.ready.done():  # the usual case: no waiter task to build
            link.ready.result()  # raises the handshake's error
        else:
            try:
                await asyncio.wait_for(asyncio.shield(link.ready), timeout_s)
            except TimeoutError:
                raise CallNotSent(f"{self.url}: no MCP handshake within {timeout_s:.1f}s") from None
        client = link.client
        if client is None or link.dead:
            raise CallNotSent(f"{self.url}: connection closed before the call was sent")
        return link, client

    def _adopt_listing(self, link: _Link, ready: asyncio.Future[None]) -> None:
        if ready.cancelled():
            return
        exc = ready.exception()
        if isinstance(exc, EndpointNotFound):
            if not self.not_found:
                log.info("endpoint dropped from the session's tools: %s", exc)
            self.not_found, self.tools, self.tools_at = str(exc), None, time.monotonic()
        elif exc is None:
            self.not_found, self.tools, self.tools_at = "", link.tools, time.monotonic()
            self._shared = link.shared  # keeps the interned list alive while this endpoint caches it

    def retire(self) -> bool:
        """Close the connection of an endpoint that owns no tool the session can call, keeping its cached
        tool list (a refresh reconnects briefly; a call, should one need it, reconnects). Only an idle,
        connected link is closed: not one that is connecting, listing or carrying a call."""
        link = self._link
        if (link is None or link.dead or link.client is None or self.calls
                or self._tools_lock.locked() or self._lock.locked()):
            return False
        self._link = None
        link.stop()  # its owner task exits the client
        return True

    def _discard(self, link: _Link, reason: str) -> None:
        if self._link is link:
            self._link = None
            _rebuilds.labels(reason).inc()
        link.stop()

    async def _relist(self, link: _Link, client: Client) -> None:
        link.set_tools(await list_tools_forwarding(client))
        self.not_found, self.tools, self.tools_at = "", link.tools, time.monotonic()
        self._shared = link.shared

    def cached(self) -> list[mt.Tool] | EndpointNotFound | None:
        """The fresh cached listing (tools, or the 404 that dropped the endpoint), or None when it must be
        listed (again): lets a call skip the listing machinery entirely."""
        if not self._fresh() or self._tools_lock.locked():
            return None
        if self.not_found:
            return EndpointNotFound(self.not_found)
        return self.tools

    async def list_tools(self, timeout_s: float, *, refresh: bool = False) -> list[mt.Tool]:
        """The endpoint's tools (every page), cached for `tools_refresh_s`. Raises EndpointNotFound (404)
        or UpstreamUnavailable. Listing is idempotent, so it is retried once on a fresh connection."""
        async with self._tools_lock:
            if not refresh and self._fresh():
                if self.not_found:
                    raise EndpointNotFound(self.not_found)
                if self.tools is not None:
                    return self.tools
            listed_before = self.tools_at
            for attempt in range(2):
                try:
                    link, client = await self._get_link(timeout_s)
                    if self.tools_at == listed_before:  # not just listed by a new connection
                        await self._relist(link, client)
                except EndpointNotFound:
                    raise
                except MCPError as exc:
                    if (exc.code == CONNECTION_CLOSED or _is_session_gone(exc)) and attempt == 0:
                        self._discard(link, "session_gone" if _is_session_gone(exc) else "connection_lost")
                        continue
                    raise UpstreamUnavailable(f"{self.url}: tools/list failed: {exc.message}") from exc
                except CallNotSent:
                    if attempt == 0 and self._link is not None and self._link.dead:
                        continue
                    raise
                if self.not_found:
                    raise EndpointNotFound(self.not_found)
                return self.tools if self.tools is not None else []
            raise UpstreamUnavailable(f"{self.url}: tools/list failed twice")

    async def call(self, name: str, arguments: dict[str, Any], timeout_s: float) -> mt.CallToolResult:
        """Call a tool within `timeout_s` seconds. Raises CallNotSent, CallLost, CallTimedOut, CallRejected."""
        self.calls += 1
        try:
            return await self._call(name, arguments, timeout_s)
        finally:
            self.calls -= 1

    async def _call(self, name: str, arguments: dict[str, Any], timeout_s: float) -> mt.CallToolResult:
        deadline = time.monotonic() + timeout_s
        for attempt in range(2):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise CallTimedOut(f"deadline passed before {name!r} could be sent", sent=False)
            link, client = await self._get_link(remaining)
            try:
                if name not in link.names:
                    # This client has not listed the tool: list first (idempotent), so the SDK knows its
                    # x-mcp-header arguments and never has to re-list around the call.
                    await asyncio.wait_for(self._relist(link, client), max(deadline - time.monotonic(), 0.001))
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise CallTimedOut(f"deadline passed before {name!r} could be sent", sent=False)
                if self._direct(link, client):
                    _sent_direct.inc()
                    try:
                        return await self._call_direct(client, name, arguments, remaining)
                    except MCPError as exc:
                        if exc.code != HEADER_MISMATCH:
                            raise CallRejected(exc) from exc
                        # Refused before the tool ran: the SDK re-lists the tool's headers and resends.
                    remaining = deadline - time.monotonic()
                _sent_sdk.inc()
                return await client.call_tool(name, arguments, read_timeout_seconds=remaining)
            except TimeoutError as exc:
                raise CallTimedOut(f"deadline passed before {name!r} could be sent", sent=False) from exc
            except MCPError as exc:
                if _is_session_gone(exc):
                    # The server refused the request without running it: rebuild and retry once.
                    self._discard(link, "session_gone")
                    if attempt == 0:
                        continue
                    raise CallNotSent(f"{self.url}: upstream session rejected twice: {exc.message}") from exc
                if exc.code == CONNECTION_CLOSED:
                    self._discard(link, "connection_lost")
                    raise CallLost(f"{self.url}: connection lost during {name!r}: {exc.message}") from exc
                if exc.code == REQUEST_TIMEOUT:
                    raise CallTimedOut(f"{name!r} did not finish within {timeout_s:.2f}s", sent=True) from exc
                raise CallRejected(exc) from exc
            except (anyio.ClosedResourceError, anyio.BrokenResourceError) as exc:
                # The client's streams were already closed: nothing was written.
                self._discard(link, "connection_lost")
                if attempt == 0:
                    continue
                raise CallNotSent(f"{self.url}: connection closed before the call was sent") from exc
        raise CallNotSent(f"{self.url}: could not send {name!r}")

    def _direct(self, link: _Link, client: Client) -> bool:
        """Whether this call goes over `http_calls`: a modern-era link whose SDK session can stamp it."""
        return (self._pool.settings.direct_calls and link.era in MODERN_PROTOCOL_VERSIONS
                and callable(getattr(client.session, "_stamp", None)))

    async def _call_direct(self, client: Client, name: str, arguments: dict[str, Any],
                           timeout_s: float) -> mt.CallToolResult:
        """A modern-era call over `http_calls`, stamped (`_meta`, headers) by the SDK session as its own
        requests are. Raises CallNotSent, CallLost, CallTimedOut, CallRejected, or MCPError (retryable)."""
        data: dict[str, Any] = {"method": "tools/call", "params": {"name": name, "arguments": arguments}}
        opts: dict[str, Any] = {}
        client.session._stamp(data, opts)  # type: ignore[arg-type]  # the SDK's own request stamping
        try:
            if self._direct_slots is None:
                self._direct_slots = asyncio.Semaphore(self._pool.settings.http.limits.max_connections or 8)
            raw = await self._pool.http.request(self.url, data, opts.get("headers", {}), timeout_s,
                                                gate=self._direct_slots)
        except SendFailed as exc:
            raise CallNotSent(str(exc)) from exc
        except ResponseLost as exc:
            raise CallLost(str(exc)) from exc
        except RequestTimedOut as exc:
            raise CallTimedOut(f"{name!r}: {exc}", sent=exc.sent) from exc
        if raw.get("resultType", "complete") != "complete":
            raise CallRejected(MCPError(INVALID_REQUEST, f"the tool answered {raw.get('resultType')!r} (it asks "
                                                         "for input), which the gateway cannot supply"))
        try:
            return mt.CallToolResult.model_validate(raw, by_name=False)
        except ValidationError as exc:
            raise CallRejected(MCPError(PARSE_ERROR, f"malformed tools/call result: {exc}")) from exc

    async def close(self) -> None:
        link, self._link = self._link, None
        if link is not None:
            link.stop()
            if link.task is not None:
                with contextlib.suppress(BaseException):
                    await asyncio.wait_for(asyncio.shield(link.task), 5.0)
                if not link.task.done():
                    link.task.cancel()


@dataclass(frozen=True)
class SessionCatalog:
    """A session's catalog: every endpoint's tools (`catalog`, unfiltered), the endpoints that could not be
    reached (url -> reason), and what the session can call (`visible`, filtered) indexed by name."""

    catalog: ToolCatalog
    unavailable: Mapping[str, str]
    visible: ToolCatalog
    by_name: Mapping[str, CatalogTool]

    @classmethod
    def build(cls, catalog: ToolCatalog, unavailable: Mapping[str, str],
              tool_filter: Mapping[str, Any] | None, modality: str) -> SessionCatalog:
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

    async def catalog(self, timeout_s: float, tool_filter: Mapping[str, Any] | None = None, modality: str = "",
                      *, refresh: bool = False) -> SessionCatalog:
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

    def _build(self, results: Sequence[object], tool_filter: Mapping[str, Any] | None,
               modality: str) -> SessionCatalog:
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
                log.debug("session %s: closed the connection to %s (owns no tool the session can call)",
                          self.session_id, url)

    async def call(self, endpoint: str, name: str, arguments: dict[str, Any], timeout_s: float) -> mt.CallToolResult:
        self.last_used = time.monotonic()
        self.in_flight += 1
        try:
            return await self.clients[endpoint].call(name, arguments, timeout_s)
        finally:
            self.in_flight -= 1
            self.last_used = time.monotonic()

    def connected_count(self) -> int:
        return sum(1 for c in self.clients.values() if c.connected)

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self.clients.values()))


JANITOR_CONCURRENCY = 16  # store reads of one janitor pass in flight at once
# A session idle for t seconds is re-checked every max(janitor_interval_s, t / IDLE_BACKOFF): a session
# closed right after its last call (the usual end of an episode) is noticed within one interval, while
# long-idle open sessions cost few store reads.
IDLE_BACKOFF = 8.0


class UpstreamPool:
    """Every upstream client of this gateway process. Owns all owner tasks and the janitor.

    State here is a cache: any replica rebuilds it from the session store and the upstreams."""

    def __init__(self, settings: PoolSettings | None = None) -> None:
        self.settings = settings or PoolSettings()
        self._sessions: dict[str, SessionUpstreams] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._janitor: asyncio.Task[None] | None = None
        self._closed = False
        self.tool_lists = ToolListInterner()
        self.http = HttpCaller(self.settings.direct_http, ssl_context=self.settings.http.ssl_context)

    def spawn(self, coro: Any, name: str) -> asyncio.Task[Any]:
        if self._closed:
            coro.close()
            raise CallNotSent("gateway is shutting down")
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
            self.http.prune()

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

        due = [(sid, ups) for sid, ups in self._sessions.items()
               if now - ups.confirmed_at >= max(interval, (now - ups.last_used) / IDLE_BACKOFF)
               or now - ups.last_used > self.settings.client_idle_s]
        if due:
            await asyncio.gather(*(look(sid, ups) for sid, ups in due))

    async def close(self) -> None:
        """Close every client (each exits in its owner task) and cancel every background task."""
        if self._janitor is not None:
            self._janitor.cancel()
        sessions, self._sessions = list(self._sessions.values()), {}
        await asyncio.gather(*(s.close() for s in sessions), return_exceptions=True)
        self._closed = True
        self.http.close()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
