"""HTTP under the mcp SDK: the connection settings every upstream client shares, and the transport that bounds
what one reply may cost.

The SDK reads every reply itself (httpx2): a JSON body with `Response.aread()`, an SSE stream incrementally
through httpx2's `EventSource`. Both read from the transport's response stream, so `UpstreamTransport` (a
public httpx2 transport wrapping the pooled one) is where replies are bounded for both MCP eras:

- each reply's bytes are counted as they arrive; past `max_reply_bytes` the stream raises, the reply is
  dropped unread and its connection closed (a body not read to its end is never reused);
- a reply whose call has ended (answered, timed out or cancelled: `Exchange.end`) is no longer read, even
  while it waits for bytes, so its buffers are returned at once; one whose head has not come is no longer
  waited for;
- a transport failure becomes a per-request JSON-RPC error answer. Raised, it would escape into the SDK's
  task group and tear the whole client down with every call in flight (mcp issue #3522);
- the call's `Exchange` records whether a failed request could have reached the server: a connection that
  was never made proves it did not, anything later does not (`CallNotSent` vs `CallLost`); and whether the
  server's reply was read, which tells a JSON-RPC error the server answered from the SDK's own "connection
  closed": both use -32000, the first code of the range servers answer their own errors with;
- a tool listing's replies (`listing`) are bounded more tightly, by `max_page_bytes` each: the SDK parses
  and validates a page on the event loop in one go, so its size is how long every other call waits;
- replies are asked for uncompressed and a compressed one is refused, so the bytes counted are the bytes
  the SDK parses (a small compressed reply could otherwise expand without bound);
- the legacy era's standalone GET stream is declined (HTTP 405, which the spec allows and the SDK accepts):
  nothing consumes server pushes, and it would hold a connection, a task and buffers per client;
- the SDK's writer sends a client's notifications one at a time, and every later message of that client,
  requests and the courtesy cancels of other calls included, waits for each one's answer (mcp 2.3.0). So the
  legacy era's `notifications/cancelled` is answered 202 to the SDK at once and POSTed by a task the
  transport owns: several calls of a session ending together (a caller's parallel tool calls under one
  deadline) each get their cancel out, where behind a remote server's round trips the later ones were cut
  off by the caller's deadline and their tools ran on. Any notification's answer is awaited
  `notification_wait_s` at most (a server that never answered one would stall the client for good), and
  closing the transport waits that long for cancels still going out.

The SDK runs each request in a copy of the caller's context (it propagates contextvars for tracing), so the
transport finds the call's `Exchange` in `current_exchange`, and the call's trace context, which it sends as
W3C `traceparent` / `tracestate` headers (the SDK writes the same into the request's `_meta`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import ssl
from collections.abc import AsyncIterator, Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import ClassVar

import anyio
import httpx2
from mcp_types import CONNECTION_CLOSED, INTERNAL_ERROR

from rlgate.core.redact import public_url
from rlgate.mcpclient.errors import CallRejected, ReplyTooLarge
from rlgate.runtime import tracing

log = logging.getLogger(__name__)

MAX_REPLY_BYTES = 8 * 2**20
# One tools/list reply (a page). The SDK's parse of a page holds the event loop in proportion to its bytes;
# this many hold MAX_TOOLS tools of ~200 bytes (catalog), and a server listing more pages its listing.
MAX_PAGE_BYTES = 2 * 2**20
KEEPALIVE_S = 4.0  # below common servers' idle timeout (uvicorn: 5 s): a call racing the server's close is lost
# A notification's answer is a bare 202; every later message of its client waits for it (module docstring).
NOTIFICATION_WAIT_S = 2.0
CANCELLED = "notifications/cancelled"
# A POST body this small may be a notification; the SDK's client sends no larger one, and a larger body is
# taken for a request.
_NOTIFICATION_MAX_BYTES = 4096

# Failures that prove the request never reached the server: no connection was made, or the request could
# not even be formed for the wire.
_NOT_SENT = (
    httpx2.ConnectError,
    httpx2.ConnectTimeout,
    httpx2.PoolTimeout,
    httpx2.UnsupportedProtocol,
    httpx2.LocalProtocolError,
)


@dataclass(eq=False)
class Exchange:
    """What the transport saw of one call's HTTP requests (all requests made in its context)."""

    started: int = 0  # requests handed to the connection pool, minus those that provably never left
    unsent: str = ""  # why a request did not reach the server
    lost: str = ""  # why a request that may have reached the server failed
    refused: CallRejected | None = None  # the server answered, but the reply was not accepted
    replied: bool = False  # the server's reply to the latest request was read (so its error is the server's)
    listing: bool = False  # the requests list tools: each reply (a page) is bounded by `max_page_bytes`
    ended: bool = False
    _waiting: dict[anyio.CancelScope, httpx2.Request] = field(default_factory=dict)  # for their reply's head
    _reading: set[ReplyStream] = field(default_factory=set)

    @property
    def never_sent(self) -> bool:
        return bool(self.unsent) and self.started == 0

    def end(self) -> None:
        """The call is over: stop waiting for and reading its replies, now and for requests it starts later.
        A notification still goes out (the legacy era's `notifications/cancelled` is sent just as a call
        ends, and is how that era cancels)."""
        self.ended = True
        for scope, request in list(self._waiting.items()):
            if not _notification(request):
                scope.cancel()
        for stream in list(self._reading):
            stream.abandon()


def _notification(request: httpx2.Request) -> str:
    """The method of a POSTed JSON-RPC notification (no id), which expects no reply; "" for anything else,
    which expects one."""
    if request.method != "POST":
        return ""
    try:
        content = request.content
    except httpx2.RequestNotRead:
        return ""
    # Every request carries an "id" key, so a request's body is not parsed here (a notification whose params
    # hold one is taken for a request: unbounded, as before).
    if len(content) > _NOTIFICATION_MAX_BYTES or b'"id"' in content:
        return ""
    try:
        message = json.loads(content)
    except ValueError:
        return ""
    method = message.get("method") if isinstance(message, dict) and "id" not in message else None
    return method if isinstance(method, str) else ""


current_exchange: ContextVar[Exchange | None] = ContextVar("rlgate_mcp_exchange", default=None)


@contextlib.contextmanager
def exchange() -> Iterator[Exchange]:
    """An `Exchange` for the requests made inside the block; ended when the block exits."""
    ex = Exchange()
    token = current_exchange.set(ex)
    try:
        yield ex
    finally:
        current_exchange.reset(token)
        ex.end()


@contextlib.contextmanager
def listing() -> Iterator[Exchange]:
    """The requests made inside the block list tools (each reply bounded by the transport's `max_page_bytes`):
    in the current exchange, whose owner reads what the transport saw, or in one of the block's own."""
    ex = current_exchange.get()
    if ex is None:
        with exchange() as ex:
            ex.listing = True
            yield ex
        return
    outer, ex.listing = ex.listing, True
    try:
        yield ex
    finally:
        ex.listing = outer


class ReplyCut(httpx2.SSEError, httpx2.StreamError):
    """Raised from a reply stream that stops early. Both bases on purpose: the SDK answers a JSON reply's
    `StreamError` and an SSE stream's `SSEError` as a failure of that one request (no resumption attempt),
    where any other exception would end the whole client."""


class _ReplyLost(httpx2.StreamError):
    """The connection failed while a JSON reply was read (as a `StreamError`, for the reason above)."""


class ReplyStream(httpx2.AsyncByteStream):
    """A reply's body as it arrives: counted, cut past the limit, abandoned when its call ends; and whether the
    SDK took the server's reply from it (`Exchange.replied`): a JSON body read to its end, or an SSE stream its
    reader closed before the end (the SDK stops reading once the response event came; a stream that ends,
    fails or is cancelled first carried none)."""

    def __init__(
        self, inner: httpx2.AsyncByteStream, limit: int, url: str, sse: bool, exchange: Exchange | None
    ) -> None:
        self._inner = inner
        self._chunks: AsyncIterator[bytes] | None = None
        self._limit = limit
        self._url = url
        self._sse = sse
        self._exchange = exchange
        self._scope: anyio.CancelScope | None = None
        self._abandoned = exchange is not None and exchange.ended
        self._ended = False  # its end was read
        self._failed = False  # reading it raised: cut off, abandoned, connection lost, cancelled
        self.received = 0

    def abandon(self) -> None:
        self._abandoned = True
        if self._scope is not None:
            self._scope.cancel()

    def __aiter__(self) -> ReplyStream:
        if self._chunks is None:
            self._chunks = self._inner.__aiter__()
            if self._exchange is not None:
                self._exchange._reading.add(self)
        return self

    async def __anext__(self) -> bytes:
        assert self._chunks is not None
        try:
            chunk = await self._next(self._chunks)
        except StopAsyncIteration:
            self._ended = True
            if not self._sse and self.received and self._exchange is not None:
                self._exchange.replied = True
            raise
        except BaseException:
            self._failed = True
            raise
        self.received += len(chunk)
        if self.received > self._limit:
            self._failed = True
            if self._exchange is not None:
                self._exchange.refused = too_large(self._limit, listing=self._exchange.listing)
            raise ReplyCut(f"{self._url}: reply larger than {self._limit} bytes; cut off")
        return chunk

    async def _next(self, chunks: AsyncIterator[bytes]) -> bytes:
        # A cancel scope per read, entered and left in the reading task, so `abandon` (from the caller's
        # task) can interrupt a read that waits for bytes.
        with anyio.CancelScope() as scope:
            self._scope = scope
            if self._abandoned:
                scope.cancel()
            try:
                return await chunks.__anext__()
            except httpx2.TransportError as exc:
                if self._exchange is not None and not self._exchange.lost:
                    self._exchange.lost = f"{self._url}: connection lost while reading the reply: {_describe(exc)}"
                if self._sse:
                    raise  # the SDK's SSE handling answers it per request and may resume the stream
                raise _ReplyLost(f"{self._url}: connection lost while reading the reply: {_describe(exc)}") from exc
            finally:
                self._scope = None
        raise ReplyCut(f"{self._url}: the call ended; its reply is no longer read")

    async def aclose(self) -> None:
        if self._exchange is not None:
            self._exchange._reading.discard(self)
            if self._sse and self.received and not (self._ended or self._failed or _unwinding()):
                self._exchange.replied = True
        await self._inner.aclose()


def too_large(limit: int, *, listing: bool) -> ReplyTooLarge:
    """What a reply cut off past `limit` means: a call's (the tool ran) or a tool listing page's."""
    if listing:
        return ReplyTooLarge(
            f"its tools/list reply was larger than {limit} bytes (rlgate's limit for one page of a "
            "tool listing) and was cut off, so none of its tools are listed; a server with this many tools "
            "must page its listing (tools/list cursors)",
            INTERNAL_ERROR,
        )
    return ReplyTooLarge(
        f"its reply was larger than {limit} bytes (the gateway's limit for one upstream reply) "
        "and was cut off; the tool ran, but its output was not kept. Ask for less output at once "
        "(a narrower query, fewer items, a page)",
        INTERNAL_ERROR,
    )


def _unwinding() -> bool:
    """The current task is being cancelled: a stream it closes now is abandoned, not finished."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def _describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _failure(request: httpx2.Request, status: int, message: str, code: int = CONNECTION_CLOSED) -> httpx2.Response:
    """A JSON-RPC error answer to `request`, which the SDK hands to the waiting caller alone."""
    body = json.dumps({"jsonrpc": "2.0", "id": None, "error": {"code": code, "message": message}})
    return httpx2.Response(status, headers={"content-type": "application/json"}, content=body.encode(), request=request)


def _standalone_stream(request: httpx2.Request) -> bool:
    """The legacy era's GET for server pushes (a GET resuming a request's stream carries Last-Event-ID)."""
    return (
        request.method == "GET"
        and "text/event-stream" in request.headers.get("accept", "")
        and "last-event-id" not in request.headers
    )


class UpstreamTransport(httpx2.AsyncBaseTransport):
    """The transport under every upstream MCP client (see the module docstring)."""

    def __init__(
        self,
        inner: httpx2.AsyncBaseTransport,
        max_reply_bytes: int,
        max_page_bytes: int,
        notification_wait_s: float = NOTIFICATION_WAIT_S,
    ) -> None:
        self._inner = inner
        self._limit = max_reply_bytes
        self._page_limit = min(max_page_bytes, max_reply_bytes)
        self._notification_wait = notification_wait_s
        self._cancels: set[asyncio.Task[None]] = set()  # `notifications/cancelled` POSTs still going out

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        if _standalone_stream(request):
            return httpx2.Response(405, request=request)
        tracing.inject_headers(request.headers)  # the call's trace, as `_meta` carries it in the body
        notification = _notification(request)
        if notification == CANCELLED:  # sent by a task of ours, so the SDK's writer goes on (module docstring)
            task = asyncio.create_task(self._notify(request), name="mcp notifications/cancelled")
            self._cancels.add(task)
            task.add_done_callback(self._cancels.discard)
            return httpx2.Response(202, request=request)
        ex = current_exchange.get()
        url = str(request.url)
        # The wait for the reply's head can be cut short by `Exchange.end`, from the caller's task; a
        # notification's wait is bounded (module docstring), and it is never cut short by its call's end.
        waiting = anyio.CancelScope()
        if notification:
            waiting.deadline = anyio.current_time() + self._notification_wait
        limit = self._limit
        if ex is not None:
            ex.started += 1
            ex.replied = False
            ex._waiting[waiting] = request
            if ex.listing:
                limit = self._page_limit
            if ex.ended and not notification:
                waiting.cancel()
        try:
            with waiting:
                response = await self._inner.handle_async_request(request)
        except _NOT_SENT as exc:
            message = f"{url}: request not sent: {_describe(exc)}"
            if ex is not None:
                ex.started -= 1
                ex.unsent = ex.unsent or message
            return _failure(request, 503, message)
        except httpx2.TransportError as exc:
            message = f"{url}: connection lost after the request was sent: {_describe(exc)}"
            if ex is not None:
                ex.lost = ex.lost or message
            return _failure(request, 502, message)
        finally:
            if ex is not None:
                del ex._waiting[waiting]
        if waiting.cancelled_caught:
            if notification:
                # The SDK drops an error answer to a notification; the message is for its debug log.
                wait = self._notification_wait
                return _failure(request, 504, f"{url}: no answer to a notification within {wait:g}s; not awaited")
            return _failure(request, 503, f"{url}: the call ended before the reply came; no longer awaited")
        encoding = response.headers.get("content-encoding", "identity").strip().lower()
        if encoding not in ("", "identity"):
            await response.aclose()
            message = (
                f"its server compressed the reply ({encoding}) although an uncompressed one was asked "
                "for; the reply was refused unread (the tool ran)"
            )
            if ex is not None:
                ex.refused = CallRejected(message, INTERNAL_ERROR)
            return _failure(request, 502, f"{url}: {message}", INTERNAL_ERROR)
        sse = response.headers.get("content-type", "").lower().startswith("text/event-stream")
        assert isinstance(response.stream, httpx2.AsyncByteStream)
        stream = ReplyStream(response.stream, limit, url, sse, ex)
        return httpx2.Response(
            response.status_code,
            headers=response.headers,
            stream=stream,
            extensions=response.extensions,
            request=request,
        )

    async def _notify(self, request: httpx2.Request) -> None:
        """POST a notification, awaiting its answer `notification_wait_s` at most; a failure is only logged (a
        notification has nobody to tell)."""
        try:
            with anyio.move_on_after(self._notification_wait) as waiting:
                response = await self._inner.handle_async_request(request)
                try:
                    await response.aread()
                finally:
                    await response.aclose()
            if waiting.cancelled_caught:
                wait = self._notification_wait
                log.debug("%s: no answer to a notification within %gs; not awaited", public_url(str(request.url)), wait)
        except (httpx2.TransportError, httpx2.StreamError) as exc:
            log.debug("%s: a notification was not delivered: %s", public_url(str(request.url)), _describe(exc))

    async def aclose(self) -> None:
        if self._cancels:  # cancels still going out get their bound (a session closing just after its calls)
            _, late = await asyncio.wait(set(self._cancels), timeout=self._notification_wait)
            for task in late:
                task.cancel()
        await self._inner.aclose()


@dataclass(frozen=True)
class HttpSettings:
    """Connection settings shared by every upstream client: one SSL context, limits, timeouts, reply limits."""

    ssl_context: ssl.SSLContext
    limits: httpx2.Limits
    timeout: httpx2.Timeout
    max_reply_bytes: int = MAX_REPLY_BYTES
    max_page_bytes: int = MAX_PAGE_BYTES
    trust_env: bool = False
    notification_wait_s: float = NOTIFICATION_WAIT_S

    _shared: ClassVar[HttpSettings | None] = None

    @classmethod
    def create(
        cls,
        *,
        connect_timeout: float = 10.0,
        max_connections: int = 8,
        keepalive_s: float = KEEPALIVE_S,
        max_reply_bytes: int = MAX_REPLY_BYTES,
        max_page_bytes: int = MAX_PAGE_BYTES,
        trust_env: bool = False,
    ) -> HttpSettings:
        # One SSL context for all clients: a default client builds (and holds) its own, loading the CA bundle each time.
        ctx = ssl.create_default_context(cafile=os.environ.get("SSL_CERT_FILE") or None)
        # Only connecting has an HTTP timeout: every MCP request has its own read_timeout_seconds instead,
        # which also bounds waiting for a pooled connection.
        timeout = httpx2.Timeout(connect=connect_timeout, read=None, write=None, pool=None)
        limits = httpx2.Limits(
            max_connections=max_connections, max_keepalive_connections=max_connections, keepalive_expiry=keepalive_s
        )
        return cls(
            ssl_context=ctx,
            limits=limits,
            timeout=timeout,
            max_reply_bytes=max_reply_bytes,
            max_page_bytes=max_page_bytes,
            trust_env=trust_env,
        )

    @classmethod
    def shared(cls) -> HttpSettings:
        if cls._shared is None:
            cls._shared = cls.create()
        return cls._shared

    def client(self) -> httpx2.AsyncClient:
        pooled = httpx2.AsyncHTTPTransport(verify=self.ssl_context, limits=self.limits, trust_env=self.trust_env)
        return httpx2.AsyncClient(
            transport=UpstreamTransport(
                pooled, self.max_reply_bytes, self.max_page_bytes, notification_wait_s=self.notification_wait_s
            ),
            timeout=self.timeout,
            trust_env=self.trust_env,
            headers={"accept-encoding": "identity"},
        )
