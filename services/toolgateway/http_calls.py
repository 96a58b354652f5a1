"""Modern-era (2026-07-28) `tools/call` sent straight over pooled HTTP/1.1 connections.

Why: in that era a call is one self-contained POST (no session, no handshake), yet the SDK's client spends
about as much CPU on it as the server spends running the tool (a task group and memory streams per
request, httpx2, pydantic round trips); this path spends a fifth of that (`bench/`, docs/benchmarks.md).
The SDK still does everything else: discovery, tool listing, the handshake era, and it builds each
request's `_meta` envelope and headers (`x-mcp-header` mirroring included) through its session's stamp,
so the wire carries what the SDK would send. Responses are handled as the SDK's transport handles them
(JSON or an SSE stream; a JSON-RPC error body on a 4xx; 404 is METHOD_NOT_FOUND; 202 and redirects are
refused).

Responses are parsed with httptools (llhttp, C): h11's pure-Python state machine cost about 50 µs of a
call's CPU, the parser about 3 (docs/benchmarks.md).

Connections are pooled per origin and shared by every session of the gateway. A connection carries one
request at a time (HTTP/1.1, no pipelining) and goes back to the pool only after a complete response; a
timed-out or cancelled call closes its connection, which in this era is how a call is cancelled.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import re
import ssl
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httptools
from mcp import MCPError
from mcp_types import INTERNAL_ERROR, INVALID_REQUEST, METHOD_NOT_FOUND, PARSE_ERROR

from rlgate.runtime import jsoncodec
from rlgate.toolgateway.catalog import UpstreamUnavailable

READ_SIZE = 65536
MAX_RESPONSE_BYTES = 64 * 2**20  # the gateway's gRPC replies are capped at 64 MiB as well
MAX_HEAD_BYTES = 65536  # status line and headers of one response (the parser itself sets no bound)
ACCEPT = "application/json, text/event-stream"


class SendFailed(UpstreamUnavailable):
    """No connection could be had: the request was never written (safe to retry)."""


class ResponseLost(UpstreamUnavailable):
    """The connection failed after the request was written: the tool may or may not have run."""


class RequestTimedOut(Exception):
    """The time ran out; `sent`: the request had been written (the tool may have partly run)."""

    def __init__(self, message: str, *, sent: bool) -> None:
        super().__init__(message)
        self.sent = sent


@dataclass
class _Attempt:
    sent: bool = False  # the request bytes were handed to the connection


@dataclass(frozen=True)
class HttpCallSettings:
    max_connections: int = 128  # per origin, in use at once
    max_idle: int = 32  # per origin, kept for reuse
    keepalive_s: float = 4.0  # an idle connection older than this is closed instead of reused (below uvicorn's 5 s)
    connect_timeout_s: float = 10.0


@dataclass(frozen=True)
class Origin:
    scheme: str
    host: str
    port: int

    @classmethod
    def of(cls, url: str) -> tuple[Origin, str]:
        """(origin, request target) of an http(s) URL."""
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        port = parts.port or (443 if parts.scheme == "https" else 80)
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        return cls(parts.scheme, parts.hostname, port), target

    @property
    def host_header(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        default = 443 if self.scheme == "https" else 80
        return host if self.port == default else f"{host}:{self.port}"


class ProtocolError(Exception):
    """The server's bytes are not an HTTP/1.1 response, or the connection ended in the middle of one."""


# RFC 9110 token characters (header names); a value may not hold CR, LF or NUL (no header injection).
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_BAD_VALUE = re.compile(r"[\r\n\x00]")
_BAD_TARGET = re.compile(r"[\x00-\x20\x7f]")


def request_head(target: str, host: str, body_length: int, headers: Mapping[str, str]) -> bytes:
    """The request line and headers of one POST; ValueError for a target or header that cannot be sent."""
    if _BAD_TARGET.search(target):
        raise ValueError(f"request target {target!r} has whitespace or control characters")
    lines = [f"POST {target} HTTP/1.1", f"host: {host}", f"accept: {ACCEPT}", "content-type: application/json",
             f"content-length: {body_length}"]
    for name, value in headers.items():
        if not _TOKEN.fullmatch(name) or _BAD_VALUE.search(value):
            raise ValueError(f"header {name!r}: {value[:80]!r} is not a valid HTTP header")
        lines.append(f"{name}: {value}")
    try:
        return ("\r\n".join(lines) + "\r\n\r\n").encode("ascii")
    except UnicodeEncodeError as exc:
        raise ValueError(f"request head is not ASCII: {exc}") from None


class _Response:
    """The parser's callbacks for the current response: status, headers and body chunks as they arrive.

    Interim (1xx) responses are skipped. Bytes past the end of the response (a server writing more than one
    answer) mark the connection `spoiled`, so it is not reused."""

    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.head_done = False
        self.chunks: collections.deque[bytes] = collections.deque()
        self.complete = False
        self.spoiled = False
        self.keep_alive = False
        self.head_bytes = 0
        self._interim = False

    def on_message_begin(self) -> None:
        if self.complete:
            self.spoiled = True

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self.complete:
            self.head_bytes += len(name) + len(value)
            if self.head_bytes > MAX_HEAD_BYTES:
                raise ProtocolError(f"response headers larger than {MAX_HEAD_BYTES} bytes")
            self.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        if self.complete:
            return
        status = self.parser.get_status_code()
        if 100 <= status < 200:
            self._interim = True  # its end is not the response's end
            self.headers = []
            return
        self.status = status
        self.head_done = True

    def on_body(self, body: bytes) -> None:
        if not self.complete:
            self.chunks.append(body)

    def on_message_complete(self) -> None:
        if self._interim:
            self._interim = False
        elif not self.complete:
            self.complete = True
            self.keep_alive = self.parser.should_keep_alive()  # only valid inside the callback

    def header(self, name: bytes) -> bytes | None:
        return next((v for k, v in self.headers if k == name), None)

    def delimited_by_close(self) -> bool:
        """No length and not chunked: the body ends where the connection does."""
        return self.header(b"content-length") is None and b"chunked" not in (self.header(b"transfer-encoding")
                                                                           or b"").lower()


class _Connection:
    """One HTTP/1.1 connection: requests written as bytes, responses read with httptools (llhttp)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer
        self._response: _Response  # each request's own, made by `send`
        self.idle_since = 0.0
        self._idle = True

    @classmethod
    async def open(cls, origin: Origin, ssl_context: ssl.SSLContext | None, timeout_s: float) -> _Connection:
        tls = origin.scheme == "https"
        # asyncio.timeout, not wait_for: 3.11's wait_for swallows an enclosing timeout's cancel that lands just
        # as the connect completes, and the call would then run with no deadline.
        async with asyncio.timeout(timeout_s):
            reader, writer = await asyncio.open_connection(
                origin.host, origin.port, ssl=ssl_context if tls else None,
                server_hostname=origin.host if tls else None, limit=READ_SIZE)
        return cls(reader, writer)

    def reusable(self, now: float, keepalive_s: float) -> bool:
        """Still good for a next request: idle at both ends, not closed by the server meanwhile."""
        return (self._idle and not self._writer.is_closing() and not self._reader.at_eof()
                and now - self.idle_since < keepalive_s)

    async def send(self, head: bytes, body: bytes) -> None:
        self._idle = False
        self._response = _Response()
        self._writer.write(head + body)
        await self._writer.drain()

    async def _receive(self) -> None:
        """Feed the parser what the socket has next; the end of the connection may end a response."""
        data = await self._reader.read(READ_SIZE)
        response = self._response
        if data:
            try:
                response.parser.feed_data(data)
            except httptools.HttpParserUpgrade:
                raise ProtocolError("the server switched protocols") from None
            except httptools.HttpParserError as exc:
                if response.complete:  # garbage after a whole response: keep the response, drop the connection
                    response.spoiled = True
                    return
                if isinstance(exc.__context__, ProtocolError):  # raised by a callback (a limit)
                    raise exc.__context__ from None
                raise ProtocolError(f"malformed response: {exc}") from None
            return
        if response.head_done and not response.complete and response.delimited_by_close():
            response.complete = True
            return
        where = "in the response body" if response.head_done else "before a complete response head"
        raise ProtocolError(f"the server closed the connection {where}")

    async def head(self) -> tuple[int, _Response]:
        """The final (non-1xx) response's status code and headers."""
        while not self._response.head_done:
            await self._receive()
        return self._response.status, self._response

    async def chunk(self) -> bytes | None:
        """The next piece of the body as received; None at its end."""
        response = self._response
        while not response.chunks:
            if response.complete:
                return None
            await self._receive()
        return response.chunks.popleft()

    async def body(self, limit: int | None = None) -> bytes:
        limit = MAX_RESPONSE_BYTES if limit is None else limit
        chunks: list[bytes] = []
        size = 0
        while (data := await self.chunk()) is not None:
            size += len(data)
            if size > limit:
                raise MCPError(INTERNAL_ERROR, f"response larger than {limit} bytes")
            chunks.append(data)
        return b"".join(chunks)

    def finish(self) -> bool:
        """After a complete exchange: ready the connection for the next one (False if it must close)."""
        response = self._response
        if response.complete and response.keep_alive and not response.spoiled:
            self._idle = True
            return True
        return False

    def close(self) -> None:
        self._writer.close()


class _OriginPool:
    """The connections to one origin: at most `max_connections` in use, the idle ones reused newest-first."""

    def __init__(self, origin: Origin, settings: HttpCallSettings, ssl_context: ssl.SSLContext | None) -> None:
        self.origin = origin
        self._settings = settings
        self._ssl = ssl_context
        self._idle: list[_Connection] = []
        self._slots = asyncio.Semaphore(settings.max_connections)
        self.in_use = 0
        self.closed = False

    async def acquire(self) -> _Connection:
        """A connection for one request (the caller bounds the wait). Raises SendFailed."""
        await self._slots.acquire()
        self.in_use += 1
        try:
            now = time.monotonic()
            while self._idle:
                conn = self._idle.pop()
                if conn.reusable(now, self._settings.keepalive_s):
                    return conn
                conn.close()
            try:
                return await _Connection.open(self.origin, self._ssl, self._settings.connect_timeout_s)
            except (OSError, TimeoutError, ssl.SSLError) as exc:
                raise SendFailed(f"{self.origin.host_header} unreachable: {type(exc).__name__}: {exc}") from exc
        except BaseException:
            self._release_slot()
            raise

    def release(self, conn: _Connection, reuse: bool) -> None:
        if reuse and not self.closed and len(self._idle) < self._settings.max_idle:
            conn.idle_since = time.monotonic()
            self._idle.append(conn)
        else:
            conn.close()
        self._release_slot()

    def _release_slot(self) -> None:
        self.in_use -= 1
        self._slots.release()

    def prune(self, now: float) -> None:
        keep = [c for c in self._idle if c.reusable(now, self._settings.keepalive_s)]
        for conn in self._idle:
            if conn not in keep:
                conn.close()
        self._idle = keep

    @property
    def idle(self) -> int:
        return len(self._idle)

    @property
    def empty(self) -> bool:
        return not self._idle and self.in_use == 0

    def close(self) -> None:
        self.closed = True
        for conn in self._idle:
            conn.close()
        self._idle.clear()


def _jsonrpc_error(message: Mapping[str, Any]) -> MCPError:
    error = message.get("error")
    if not isinstance(error, Mapping) or not isinstance(error.get("code"), int):
        return MCPError(PARSE_ERROR, "malformed JSON-RPC error response")
    return MCPError(error["code"], str(error.get("message", "")), error.get("data"))


def _outcome(message: Any, request_id: int) -> dict[str, Any] | None:
    """The result of our request from one JSON-RPC message, or None if the message is something else
    (a notification, a progress report). A JSON-RPC error raises MCPError."""
    if not isinstance(message, Mapping) or message.get("id") != request_id:
        return None
    if "error" in message:
        raise _jsonrpc_error(message)
    result = message.get("result")
    if not isinstance(result, dict):
        raise MCPError(PARSE_ERROR, "JSON-RPC response without a result object")
    return result


def _parse_json(data: bytes | str) -> Any:
    try:
        return jsoncodec.loads(data)
    except ValueError as exc:
        raise MCPError(PARSE_ERROR, f"Failed to parse JSON response: {exc}") from exc


class HttpCaller:
    """Sends modern-era requests over per-origin connection pools. Owned by the gateway's `UpstreamPool`."""

    def __init__(self, settings: HttpCallSettings | None = None, ssl_context: ssl.SSLContext | None = None) -> None:
        self.settings = settings or HttpCallSettings()
        self._ssl = ssl_context
        self._pools: dict[Origin, _OriginPool] = {}
        self._ids = itertools.count(1)

    def _pool(self, origin: Origin) -> _OriginPool:
        pool = self._pools.get(origin)
        if pool is None:
            pool = self._pools[origin] = _OriginPool(origin, self.settings, self._ssl)
        return pool

    async def request(self, url: str, data: dict[str, Any], headers: Mapping[str, str], timeout_s: float,
                      gate: asyncio.Semaphore | None = None) -> dict[str, Any]:
        """POST one JSON-RPC request (`data`: method and params, stamped) and return its result object
        within `timeout_s` (a timeout or a cancel closes the connection: the server sees the call abort).

        Raises SendFailed (nothing was written), ResponseLost (the connection failed after writing),
        RequestTimedOut, or MCPError (the server's JSON-RPC error, or what the SDK's transport would
        report for that HTTP answer). `gate`: held for the request (a per-endpoint concurrency limit)."""
        attempt = _Attempt()
        try:
            async with asyncio.timeout(timeout_s):
                if gate is None:
                    return await self._request(url, data, headers, attempt)
                async with gate:
                    return await self._request(url, data, headers, attempt)
        except TimeoutError:
            what = "no response" if attempt.sent else "no connection"
            raise RequestTimedOut(f"{what} within {timeout_s:.2f}s", sent=attempt.sent) from None

    async def _request(self, url: str, data: dict[str, Any], headers: Mapping[str, str],
                       attempt: _Attempt) -> dict[str, Any]:
        origin, target = Origin.of(url)
        request_id = next(self._ids)
        body = jsoncodec.dumps_bytes({"jsonrpc": "2.0", "id": request_id, **data})
        try:
            head = request_head(target, origin.host_header, len(body), headers)
        except ValueError as exc:
            raise SendFailed(f"{origin.host_header}: request not sent: {exc}") from None
        pool = self._pool(origin)
        conn = await pool.acquire()
        reuse = False
        try:
            attempt.sent = True
            try:
                await conn.send(head, body)
            except OSError as exc:
                raise ResponseLost(f"{origin.host_header}: connection failed while sending: {exc}") from exc
            try:
                result = await self._response(conn, request_id)
            except (OSError, ProtocolError) as exc:
                raise ResponseLost(f"{origin.host_header}: connection lost before the response: "
                                   f"{type(exc).__name__}: {exc}") from exc
            reuse = conn.finish()
            return result
        finally:
            pool.release(conn, reuse)

    async def _response(self, conn: _Connection, request_id: int) -> dict[str, Any]:
        status, response = await conn.head()
        content_type = (response.header(b"content-type") or b"").decode("latin-1").lower()
        if status == 202:
            await conn.body()
            raise MCPError(INVALID_REQUEST, "server answered a request with 202 Accepted")
        if 300 <= status < 400:
            await conn.body()
            raise MCPError(INVALID_REQUEST, f"server redirected the request (HTTP {status}); not followed")
        if status >= 400:
            body = await conn.body()
            if content_type.startswith("application/json"):
                try:
                    message = jsoncodec.loads(body)
                except ValueError:
                    message = None
                if isinstance(message, Mapping) and "error" in message:
                    raise _jsonrpc_error(message)
            if status == 404:
                raise MCPError(METHOD_NOT_FOUND, "Not Found")
            raise MCPError(INTERNAL_ERROR, "Server returned an error response")
        if content_type.startswith("application/json"):
            result = _outcome(_parse_json(await conn.body()), request_id)
            if result is None:
                raise MCPError(PARSE_ERROR, "JSON response does not answer the request")
            return result
        if content_type.startswith("text/event-stream"):
            return await self._from_sse(conn, request_id)
        await conn.body()
        raise MCPError(INVALID_REQUEST, f"Unexpected content type: {content_type}")

    async def _from_sse(self, conn: _Connection, request_id: int) -> dict[str, Any]:
        """Read SSE events until our response, skipping notifications and pings. The connection is reused
        only if the stream ended with the response (`finish`); otherwise it is closed."""
        buffer = b""
        data_lines: list[str] = []
        event_type = "message"
        received = 0
        while (piece := await conn.chunk()) is not None:
            received += len(piece)
            if received > MAX_RESPONSE_BYTES:
                raise MCPError(INTERNAL_ERROR, f"response larger than {MAX_RESPONSE_BYTES} bytes")
            buffer += piece
            *lines, buffer = buffer.replace(b"\r\n", b"\n").split(b"\n")
            for raw in lines:
                line = raw.decode("utf-8", errors="replace")
                if line.startswith("data:"):
                    data_lines.append(line[5:].removeprefix(" "))
                elif line.startswith("event:"):
                    event_type = line[6:].strip()
                elif not line:  # a blank line ends an event
                    data = "\n".join(data_lines)
                    # As the SDK: only "message" events carry JSON-RPC; empty ones (priming) carry nothing.
                    if data and event_type == "message":
                        result = _outcome(_parse_json(data), request_id)
                        if result is not None:
                            return result  # reused only if the stream's end came with it (`finish`)
                    data_lines, event_type = [], "message"
                # id:, retry: and comments (": ping") carry nothing this path uses
        if data_lines and event_type == "message" and (
                result := _outcome(_parse_json("\n".join(data_lines)), request_id)) is not None:
            return result
        raise MCPError(INTERNAL_ERROR, "SSE stream ended without a response")

    def prune(self) -> None:
        """Close idle connections past their keep-alive; forget origins with no connection left."""
        now = time.monotonic()
        for origin, pool in list(self._pools.items()):
            pool.prune(now)
            if pool.empty:
                del self._pools[origin]

    def idle_connections(self) -> int:
        return sum(p.idle for p in self._pools.values())

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()
