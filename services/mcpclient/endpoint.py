"""A session's connection to one MCP endpoint: the current `Link` (its own, or the URL's common one the pool
hands out), its cached tool list, and tool calls.

A 2026-07-28 call is one POST on the pool's `StatelessCalls` (`stateless`, which sorts its failures); a
legacy-era call goes through the link's SDK session (`Client.call_tool`). There, what the transport saw of
the call's requests (`transport.Exchange`) decides what a failure means, and only a call that provably
never reached the upstream is retried: a failed handshake, a connection that was never made, a link found
dead before sending, or a -32600 session rejection (the server refused the request without running it).
A JSON-RPC error the server answered is its answer, whatever its code: the SDK's own "connection closed"
(-32000) and "request timed out" (-32001) lie in the range servers use for their own errors, so they mean
a lost connection or a timeout only when the transport read no reply.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from typing import TYPE_CHECKING, Any

import anyio
import mcp_types as mt
from mcp import Client, MCPError
from mcp_types import CONNECTION_CLOSED, INVALID_REQUEST, PARSE_ERROR, REQUEST_TIMEOUT
from pydantic import ValidationError

from rlgate.core.redact import public_url
from rlgate.mcpclient.errors import (
    CallLost,
    CallNotSent,
    CallRejected,
    CallTimedOut,
    EndpointNotFound,
    UpstreamUnavailable,
)
from rlgate.mcpclient.link import Link, SharedTools
from rlgate.mcpclient.transport import Exchange, exchange
from rlgate.runtime import metrics, tracing

if TYPE_CHECKING:
    from rlgate.mcpclient.pool import UpstreamPool

log = logging.getLogger(__name__)

# The SDK's own timeout of a legacy-era call comes this much after the call's deadline, as a backstop only
# (`EndpointClient._call_sdk`).
SDK_BACKSTOP_S = 1.0
ENDING_WAIT_S = 1.0  # how long `close` lets ended calls' cancellations go out

_rebuilds = metrics.counter(
    "rlgate_toolgateway_upstream_rebuilds_total",
    "Upstream MCP clients rebuilt after a dead connection or forgotten session",
    ["reason"],
)


def _is_session_gone(exc: MCPError) -> bool:
    msg = exc.message.lower()
    return exc.code == INVALID_REQUEST and ("session not found" in msg or "session terminated" in msg)


def _is_lost(exc: MCPError, ex: Exchange) -> bool:
    """The connection went away under the request (the transport saw it fail, or the SDK says so and no reply
    was read), rather than the server answering -32000 itself."""
    return bool(ex.lost) or (exc.code == CONNECTION_CLOSED and not ex.replied)


class EndpointClient:
    """A session's connection to one MCP endpoint: the current link plus its cached tool list."""

    def __init__(self, url: str, pool: UpstreamPool) -> None:
        self.url = url
        self._pool = pool
        self._link: Link | None = None
        self._lock = asyncio.Lock()
        self._tools_lock = asyncio.Lock()
        self.tools: list[mt.Tool] | None = None
        self._shared: SharedTools | None = None
        self.tools_at = 0.0
        self.not_found = ""  # set when the endpoint answered 404 (dropped until the next refresh)
        # Set once it has listed tools: a 404 after that is not an endpoint this instance lacks (dropped, as
        # at discovery) but one that went away under a live session (its instance deleted): unavailable.
        self.served = False
        self.calls = 0  # calls in flight on this endpoint
        self.closed = False  # set by `close`: no new link after it (nothing would release one)
        self._ending: set[asyncio.Task[mt.CallToolResult]] = set()  # legacy calls ended early, cancelling

    @property
    def connected(self) -> bool:
        return self._link is not None and not self._link.dead and self._link.client is not None

    def _fresh(self) -> bool:
        return time.monotonic() - self.tools_at < self._pool.settings.tools_refresh_s

    # -- the link -------------------------------------------------------------------------------------------
    async def _get_link(self, timeout_s: float) -> tuple[Link, Client]:
        async with self._lock:  # single flight: concurrent callers share one handshake
            if self.closed:  # the session ended while this call or listing was on its way
                raise CallNotSent(f"{self.url}: the session's upstream connections were closed (it ended)")
            link = self._link
            if link is None or link.dead:
                if link is not None:
                    if link.ready.done() and not link.ready.exception():
                        _rebuilds.labels("connection_lost").inc()
                    self._pool.release(link)
                link = self._link = self._pool.link(self.url)
                if link.ready.done():  # a common link already open: its listing is this endpoint's at once
                    self._adopt_listing(link, link.ready)
                else:
                    link.ready.add_done_callback(functools.partial(self._adopt_listing, link))
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

    def _adopt_listing(self, link: Link, ready: asyncio.Future[None]) -> None:
        if ready.cancelled():
            return
        exc = ready.exception()
        if isinstance(exc, EndpointNotFound):
            if self.served:  # gone, not absent: listed again (and refused as unavailable) on the next look
                self.tools, self.tools_at = None, 0.0
                return
            if not self.not_found:
                log.info("endpoint dropped from the session's tools: %s", exc)
            self.not_found, self.tools, self.tools_at = str(exc), None, time.monotonic()
        elif exc is None:
            self.not_found, self.tools, self.tools_at = "", link.tools, link.listed_at
            self._shared = link.shared  # keeps the interned list alive while this endpoint caches it
            self.served = True

    def retire(self) -> bool:
        """Close the connection of an endpoint that owns no tool the session can call, keeping its cached
        tool list (a refresh reconnects briefly; a call, should one need it, reconnects). Only an idle,
        connected link is closed: not one that is connecting, listing or carrying a call."""
        link = self._link
        if (
            link is None
            or link.dead
            or link.client is None
            or self.calls
            or self._tools_lock.locked()
            or self._lock.locked()
        ):
            return False
        self._link = None
        self._pool.release(link)  # a private link's owner task exits the client
        return True

    def _discard(self, link: Link, reason: str, *, broken: bool = False) -> None:
        """Stop using `link` after a failure: a private link is closed; a URL's common link only when
        `broken`, since one request's failure (answered per request by the transport) says nothing about
        the calls other sessions have in flight on it."""
        if self._link is link:
            self._link = None
            _rebuilds.labels(reason).inc()
            self._pool.release(link, broken=broken)
        elif broken or not link.common:
            link.stop()

    # -- tools ----------------------------------------------------------------------------------------------
    async def _relist(self, link: Link, since: float) -> None:
        """The link's listing, at least as recent as `since` (re-listed unless it is), as this endpoint's."""
        await link.relist(since)
        self.not_found, self.tools, self.tools_at = "", link.tools, link.listed_at
        self._shared = link.shared
        self.served = True

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
            # A listing at least this recent will do: one made since now (a refresh), or within the refresh
            # age (e.g. the URL's common link, listed for another session).
            since = time.monotonic() - (0.0 if refresh else self._pool.settings.tools_refresh_s)
            with tracing.span("upstream tools/list", self._span_attributes("tools/list")):
                try:
                    return await self._list(timeout_s, since)
                except EndpointNotFound as exc:
                    if self.served:
                        raise UpstreamUnavailable(f"{exc}, after serving tools: its instance is gone") from exc
                    raise

    async def _list(self, timeout_s: float, since: float) -> list[mt.Tool]:
        for attempt in range(2):
            try:
                link, _ = await self._get_link(timeout_s)  # outside the exchange: a new link's task copies it
                if not await self._relist_once(link, since, last=attempt == 1):
                    continue
            except CallNotSent:
                if attempt == 0 and self._link is not None and self._link.dead:
                    continue
                raise
            if self.not_found:
                raise EndpointNotFound(self.not_found)
            return self.tools if self.tools is not None else []
        raise UpstreamUnavailable(f"{self.url}: tools/list failed twice")

    async def _relist_once(self, link: Link, since: float, *, last: bool) -> bool:
        """`_relist` on `link`; False: its connection was lost (or its session forgotten), try a new one."""
        with exchange() as ex:
            try:
                await self._relist(link, since)  # a no-op when a new connection has just listed
            except MCPError as exc:
                gone = _is_session_gone(exc)
                if (gone or _is_lost(exc, ex)) and not last:
                    self._discard(link, "session_gone" if gone else "connection_lost")
                    return False
                raise UpstreamUnavailable(f"{self.url}: tools/list failed: {exc.message}") from exc
        return True

    # -- calls ----------------------------------------------------------------------------------------------
    async def call(self, name: str, arguments: dict[str, Any], timeout_s: float) -> mt.CallToolResult:
        """Call a tool within `timeout_s` seconds. Raises CallNotSent, CallLost, CallTimedOut, CallRejected
        (ReplyTooLarge among them)."""
        self.calls += 1
        try:
            if not tracing.recording():  # no span's name and attributes to build
                return await self._call(name, arguments, timeout_s)
            with tracing.span(f"upstream tools/call {name}", self._span_attributes("tools/call", name)) as span:
                result = await self._call(name, arguments, timeout_s)
                if result.is_error:
                    span.set_attribute("error.type", "tool_error")
                return result
        finally:
            self.calls -= 1

    def _span_attributes(self, method: str, tool: str = "") -> dict[str, str]:
        """An upstream call's span attributes (the URL without its query, which may carry a credential)."""
        attributes = {"mcp.method.name": method, "url.full": public_url(self.url)}
        if tool:
            attributes["gen_ai.tool.name"] = tool
        return attributes

    async def _call(self, name: str, arguments: dict[str, Any], timeout_s: float) -> mt.CallToolResult:
        deadline = time.monotonic() + timeout_s
        for attempt in range(2):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise CallTimedOut(f"deadline passed before {name!r} could be sent", sent=False)
            try:
                link, client = await self._get_link(remaining)
            except EndpointNotFound as exc:  # a new link's handshake answered 404: the endpoint went away
                raise CallNotSent(f"{exc}; {name!r} was not sent") from exc
            # A client that has not listed the tool lists first (idempotent), so the SDK knows its
            # x-mcp-header arguments and never has to re-list around the call.
            if name not in link.names and not await self._list_before_call(link, name, deadline, last=attempt == 1):
                continue
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise CallTimedOut(f"deadline passed before {name!r} could be sent", sent=False)
            if link.stateless:
                return await self._call_stateless(link, name, arguments, remaining)
            with exchange() as ex:  # ended on the way out: a reply still arriving is no longer read
                try:
                    return await self._call_sdk(client, name, arguments, remaining)
                except MCPError as exc:
                    failure = self._failure(link, name, exc, ex, timeout_s, last=attempt == 1)
                    if failure is None:
                        continue
                    raise failure from exc
                except ValidationError as exc:
                    raise CallRejected(f"malformed tools/call result: {exc}", PARSE_ERROR) from exc
                except (anyio.ClosedResourceError, anyio.BrokenResourceError) as exc:
                    # The client's streams were already closed: nothing was written.
                    self._discard(link, "connection_lost", broken=True)
                    if attempt == 0:
                        continue
                    raise CallNotSent(f"{self.url}: connection closed before the call was sent") from exc
        raise CallNotSent(f"{self.url}: could not send {name!r}")

    async def _call_sdk(
        self, client: Client, name: str, arguments: dict[str, Any], timeout_s: float
    ) -> mt.CallToolResult:
        """A legacy-era call through the SDK's session, in a task of its own that only this method cancels,
        once. The SDK sends the call's `notifications/cancelled` from its cancellation handler, shielded, but
        a second cancellation while it hands the notification to its writer drops it (the caller's gRPC
        deadline 50 ms after ours, both due in one turn of a busy loop), and its own timeout's handler is not
        shielded at all: each dropped the cancel of some calls, whose tools ran on. So the deadline is ours,
        the SDK's own timeout is a backstop, and a call that ends early (deadline, or the caller's cancel)
        cancels the task and leaves it to send the notification without the caller waiting."""
        call = asyncio.ensure_future(client.call_tool(name, arguments, read_timeout_seconds=timeout_s + SDK_BACKSTOP_S))
        call.add_done_callback(lambda done: done.cancelled() or done.exception())  # an outcome nobody awaits
        try:
            async with asyncio.timeout(timeout_s) as deadline:
                return await asyncio.shield(call)
        except TimeoutError:
            if deadline.expired():
                raise CallTimedOut(f"{name!r} did not finish within {timeout_s:.2f}s", sent=True) from None
            raise
        finally:
            if not call.done():
                call.cancel()
                self._ending.add(call)
                call.add_done_callback(self._ending.discard)

    async def _call_stateless(
        self, link: Link, name: str, arguments: dict[str, Any], timeout_s: float
    ) -> mt.CallToolResult:
        """A 2026-07-28 call: one POST on the pool's `stateless.StatelessCalls`, outside the SDK's session."""
        calls = self._pool.stateless_calls()
        header_map = link.shared.header_map(name)
        try:
            return await calls.call(self.url, link.era, name, arguments, header_map, timeout_s, link.call_slots)
        except CallLost:
            self._discard(link, "connection_lost")
            raise

    async def _list_before_call(self, link: Link, name: str, deadline: float, *, last: bool) -> bool:
        """List the tools on `link` before calling `name`; False: the link died, try again on a new one.
        Nothing of the call has been sent yet, so every failure here is CallNotSent or a CallTimedOut
        that was not sent."""
        try:
            relisted = self._relist_once(link, time.monotonic(), last=last)
            return await asyncio.wait_for(relisted, max(deadline - time.monotonic(), 0.001))
        except TimeoutError as exc:
            raise CallTimedOut(f"deadline passed before {name!r} could be sent", sent=False) from exc
        except CallNotSent:
            raise
        except (UpstreamUnavailable, EndpointNotFound) as exc:
            raise CallNotSent(f"{exc} (listing before {name!r})") from exc

    def _failure(
        self, link: Link, name: str, exc: MCPError, ex: Exchange, timeout_s: float, *, last: bool
    ) -> Exception | None:
        """What an MCPError from `call_tool` means, given what the transport saw; None: retry on a new link."""
        if ex.refused is not None:  # the upstream answered; its reply was refused (too large, compressed)
            return ex.refused
        if _is_session_gone(exc):
            # The server refused the request without running it: rebuild and retry once.
            self._discard(link, "session_gone")
            if not last:
                return None
            return CallNotSent(f"{self.url}: upstream session rejected twice: {exc.message}")
        if ex.never_sent:
            return CallNotSent(ex.unsent)
        if _is_lost(exc, ex):
            self._discard(link, "connection_lost")
            return CallLost(f"{self.url}: connection lost during {name!r}: {ex.lost or exc.message}")
        if exc.code == REQUEST_TIMEOUT and not ex.replied:
            return CallTimedOut(f"{name!r} did not finish within {timeout_s:.2f}s", sent=True)
        return CallRejected(exc.message, exc.code)  # the server answered with an error

    async def close(self) -> None:
        self.closed = True
        if self._ending:  # calls that ended just before: their cancellations go out first (bounded by the SDK)
            await asyncio.wait(set(self._ending), timeout=ENDING_WAIT_S)
        link, self._link = self._link, None
        if link is not None:
            self._pool.release(link)
            if not link.common and link.task is not None:
                with contextlib.suppress(BaseException):
                    await asyncio.wait_for(asyncio.shield(link.task), 5.0)
                if not link.task.done():
                    link.task.cancel()
