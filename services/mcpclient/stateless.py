"""tools/call on a stateless-era (2026-07-28) endpoint: one HTTP POST on aiohttp's pooled connector.

That era keeps no session on the server, so a call is one POST that carries all it needs. The SDK's client
session (a dispatcher task and memory streams per request, envelope models, httpx2 over httpcore2 and h11 in
pure Python) cost most of the gateway's CPU per call, so a link whose server speaks this era sends its calls
here, on one connection pool for the process (`StatelessCalls`); the handshake and tool listings stay with
the SDK.
What the POST carries is what the SDK's client sends, built from the SDK's public pieces
(`mcp.shared.inbound`, `mcp_types`): the request's `_meta` (protocol version, client info, capabilities, and
the W3C trace context, SEP-414) and the routing headers (`Mcp-Protocol-Version`, `Mcp-Method`, `Mcp-Name`,
and the `Mcp-Param-*` headers a tool's `x-mcp-header` arguments ask for). A real SDK server checks them
(tests/toolgateway/test_upstream_calls.py).

What this keeps of the transport's promises for the other requests (`transport.UpstreamTransport`):
- the same reply limit (`HttpSettings.max_reply_bytes`), counted as bytes arrive, for a JSON body and an SSE
  stream alike; past it the connection is closed and the reply dropped unread (`ReplyTooLarge`);
- a reply is read in the caller's task, so a call that times out or is cancelled stops reading at once, and
  a reply not read to its end closes its connection (never reused);
- compressed replies are refused (asked for uncompressed, never decompressed: the bytes counted are the bytes
  parsed);
- a pooled connection the server may be closing for idleness, or has closed, is never used (`_Connector`),
  so a call is not lost to the race between a server's idle timeout and the pool's keep-alive;
- what a failure means: a request whose headers never left (no connection could be made, or none came from
  the pool, or no slot of its link, in time) is `CallNotSent` or an unsent `CallTimedOut`; after that,
  `CallLost` or a sent `CallTimedOut`. aiohttp's `on_request_headers_sent` signal marks the moment.
No HTTP is parsed here (aiohttp's parser), nor SSE (httpx2's `EventSource` over the counted bytes), nor JSON
by hand (the standard decoder, which keeps integers of any size exact).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import json
import select
import time
import weakref
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, TypeGuard

import aiohttp
import httpx2
import mcp_types as mt
from mcp.shared.inbound import (
    MCP_METHOD_HEADER,
    MCP_NAME_HEADER,
    MCP_PROTOCOL_VERSION_HEADER,
    encode_header_value,
    mcp_param_headers,
)
from pydantic import ValidationError

from rlgate.mcpclient.connect import CLIENT_INFO
from rlgate.mcpclient.errors import CallLost, CallNotSent, CallRejected, CallTimedOut, ReplyTooLarge
from rlgate.mcpclient.transport import HttpSettings, too_large
from rlgate.runtime import jsoncodec, tracing

_CLIENT_INFO_JSON = CLIENT_INFO.model_dump(mode="json", exclude_none=True)
_ACCEPT = "application/json, text/event-stream"
_ids = itertools.count(1)  # JSON-RPC ids: the era pairs a reply with its POST; the id is only echoed


@dataclass
class _Progress:
    """What one POST got to (set from aiohttp's trace signals)."""

    sent: bool = False  # the request's headers were written to a connection


async def _headers_sent(
    _session: aiohttp.ClientSession, context: SimpleNamespace, _params: aiohttp.TraceRequestHeadersSentParams
) -> None:
    progress = context.trace_request_ctx
    if isinstance(progress, _Progress):
        progress.sent = True


class _Connector(aiohttp.TCPConnector):
    """aiohttp's connector, with two checks before a pooled connection is used again.

    A server closes a connection once it has been idle for its keep-alive timeout, counted from its last
    reply; a request that reaches it as it closes is reset unread, and since it was sent it must be reported
    as a call that may have run (OUTCOME_UNKNOWN). aiohttp counts a connection's idle time from when its reply
    was read and learns of a close when its loop reads the FIN; on a busy loop both come late, so it would
    reuse connections the server is closing or has closed (`scale_sessions` lost calls this way). So:
    - the keep-alive clock starts when the connection's last request went out: the server read that request
      before its own clock started, so however late a busy loop reads the reply, the connection never looks
      younger than the server thinks it is;
    - a connection with something to read is closed: an idle HTTP/1.1 connection has nothing to read unless
      the server closed it (EOF) or broke the protocol (urllib3 and httpcore check the same).
    `connect` is aiohttp's public connector method; `_get`, its hook for taking a connection from the pool, is
    private (aiohttp is pinned by constraints.txt; tests/toolgateway/test_upstream_calls.py fails without it)."""

    def __init__(self, *, keepalive_s: float, **kwargs: Any) -> None:
        super().__init__(keepalive_timeout=keepalive_s, **kwargs)
        self._keepalive_s = keepalive_s
        self._sent_at: weakref.WeakKeyDictionary[Any, float] = weakref.WeakKeyDictionary()

    async def connect(self, req: Any, traces: Any, timeout: Any) -> aiohttp.connector.Connection:  # noqa: ASYNC109  # aiohttp's signature
        conn = await super().connect(req, traces, timeout)
        if conn.protocol is not None:
            self._sent_at[conn.protocol] = time.monotonic()  # its request is written next
        return conn

    async def _get(self, key: Any, traces: Any) -> aiohttp.connector.Connection | None:
        while (conn := await super()._get(key, traces)) is not None:
            sent_at = self._sent_at.get(conn.protocol)
            fresh = sent_at is not None and time.monotonic() - sent_at <= self._keepalive_s
            if fresh and not _dropped(conn):
                return conn
            conn.close()  # aiohttp's way to discard it: the transport is closed, the slot freed
        return None


def _dropped(conn: aiohttp.connector.Connection) -> bool:
    """The server closed this idle connection (or sent what no request asked for): its socket is readable."""
    transport = conn.transport
    sock = transport.get_extra_info("socket") if transport is not None else None
    if sock is None:
        return True
    poller = select.poll()  # not select(): descriptors past 1,024 are common with thousands of connections
    poller.register(sock.fileno(), select.POLLIN)
    return bool(poller.poll(0))


MAX_CONNECTIONS = 16_384  # upstream connections of all 2026-07-28 calls of a process, in use or idle


class StatelessCalls:
    """2026-07-28 calls: one connection pool for every such upstream of the process (the `UpstreamPool`'s),
    so sessions on one server share its connections whatever their URL. Each link bounds its own calls in
    flight (`slots`, its client's connection limit)."""

    def __init__(self, http: HttpSettings, max_connections: int = MAX_CONNECTIONS) -> None:
        self._http = http
        keepalive = http.limits.keepalive_expiry
        connector = _Connector(
            limit=max_connections,
            limit_per_host=0,
            keepalive_s=keepalive if keepalive is not None else 0,
            ssl=http.ssl_context,
        )
        tracer = aiohttp.TraceConfig()
        tracer.on_request_headers_sent.append(_headers_sent)
        self._session = aiohttp.ClientSession(
            connector=connector,
            # Only connecting has a timeout of its own: the call's deadline bounds the rest (asyncio.timeout).
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=http.timeout.connect),
            auto_decompress=False,
            trust_env=http.trust_env,
            trace_configs=[tracer],
            skip_auto_headers=("User-Agent",),
        )

    async def close(self) -> None:
        await self._session.close()

    async def call(
        self,
        url: str,
        era: str,
        name: str,
        arguments: Mapping[str, Any],
        header_map: Mapping[tuple[str, ...], str],
        timeout_s: float,
        slots: asyncio.Semaphore | None = None,
    ) -> mt.CallToolResult:
        """Call tool `name` within `timeout_s`, holding one of `slots` (the caller's bound on its calls in
        flight) if given. `header_map`: the tool's `x-mcp-header` positions (`mcp.shared.inbound.x_mcp_header_map` of
        its input schema). Raises CallNotSent, CallLost, CallTimedOut, CallRejected (ReplyTooLarge among
        them)."""
        request_id, body, headers = request_for(era, name, arguments, header_map)
        progress = _Progress()
        try:
            async with asyncio.timeout(timeout_s), slots if slots is not None else contextlib.nullcontext():
                response = await self._session.post(
                    url, data=body, headers=headers, allow_redirects=False, trace_request_ctx=progress
                )
                try:
                    return _result(await _reply(response, request_id, self._http.max_reply_bytes))
                finally:
                    if response.content.at_eof():
                        response.release()  # read whole: the connection goes back to the pool
                    else:
                        response.close()  # abandoned, cut off or failed: never reused
        except (aiohttp.ClientError, httpx2.SSEError, httpx2.StreamError, OSError) as exc:
            if isinstance(exc, TimeoutError) and not isinstance(exc, aiohttp.ClientError):
                # The call's deadline (aiohttp's own timeouts, connecting's, are ClientErrors).
                raise CallTimedOut(f"{name!r} did not finish within {timeout_s:.2f}s", sent=progress.sent) from None
            if not progress.sent:  # no connection, or it failed before the request's headers were written
                raise CallNotSent(f"{url}: request not sent: {_describe(exc)}") from exc
            raise CallLost(f"{url}: connection lost during {name!r}: {_describe(exc)}") from exc


def request_for(
    era: str, name: str, arguments: Mapping[str, Any], header_map: Mapping[tuple[str, ...], str]
) -> tuple[int, bytes, dict[str, str]]:
    """(JSON-RPC id, body, headers) of a tools/call, as the SDK's client would send it."""
    meta: dict[str, Any] = {
        mt.PROTOCOL_VERSION_META_KEY: era,
        mt.CLIENT_INFO_META_KEY: _CLIENT_INFO_JSON,
        mt.CLIENT_CAPABILITIES_META_KEY: {},
    }
    tracing.inject_headers(meta)  # `traceparent` / `tracestate` in `_meta`, as the SDK's client writes them
    request_id = next(_ids)
    message = {
        "jsonrpc": "2.0",
        "id": request_id,
        "method": "tools/call",
        "params": {"name": name, "arguments": arguments, "_meta": meta},
    }
    headers = {
        "accept": _ACCEPT,
        "accept-encoding": "identity",  # a compressed reply is refused
        "content-type": "application/json",
        MCP_PROTOCOL_VERSION_HEADER: era,
        MCP_METHOD_HEADER: "tools/call",
        MCP_NAME_HEADER: encode_header_value(name),
        **mcp_param_headers(header_map, arguments),
    }
    tracing.inject_headers(headers)
    return request_id, jsoncodec.dumps_bytes(message), headers


async def _reply(response: aiohttp.ClientResponse, request_id: int, limit: int) -> dict[str, Any]:
    """The JSON-RPC response to `request_id` (a dict with "result" or "error")."""
    status = response.status
    content_type = response.headers.get("content-type", "").partition(";")[0].strip().lower()
    encoding = response.headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        raise CallRejected(
            f"its server compressed the reply ({encoding}) although an uncompressed one was asked for; the "
            "reply was refused unread (the tool ran)",
            mt.INTERNAL_ERROR,
        )
    if status >= 300 or status == 202:
        return await _error_reply(response, status, content_type, limit)
    if content_type == "application/json":
        message = _parse(await _body(response, limit))
        if not _is_response(message):
            raise CallRejected("the tools/call reply is not a JSON-RPC response", mt.PARSE_ERROR)
        return message
    if content_type == "text/event-stream":
        # httpx2's SSE decoder reads the counted bytes as they come; an event may be as large as the reply.
        events = httpx2.Response(
            status,
            headers={"content-type": content_type},
            stream=_Counted(response, limit),
            request=_named_request(str(response.url)),
        )
        async for event in httpx2.EventSource(events, max_event_size=None):
            if event.event != "message" or not event.data:
                continue  # priming events, keep-alives, other event types
            message = _parse(event.data)
            if _is_response(message) and message.get("id") in (request_id, None):
                return message
            # Anything else (progress, log notifications, server requests) has no reader in a forwarder.
        raise CallLost(f"{response.url}: connection lost: the SSE stream ended before the reply came")
    raise CallRejected(f"unexpected content type {content_type!r} in the tools/call reply", mt.INVALID_REQUEST)


@functools.lru_cache(maxsize=1024)
def _named_request(url: str) -> httpx2.Request:
    """The request an SSE reply's EventSource names in its errors (it reads nothing else of it): one per URL,
    shared by its calls, since building one parses the URL."""
    return httpx2.Request("POST", url)


async def _error_reply(response: aiohttp.ClientResponse, status: int, content_type: str, limit: int) -> dict[str, Any]:
    """A non-2xx answer (or a 202, or a redirect, never followed): the JSON-RPC error it carries, or one
    that says what happened."""
    if status == 202:
        raise CallRejected("the server answered the tools/call with 202 Accepted and no result", mt.INVALID_REQUEST)
    if status < 400:
        raise CallRejected(f"the server redirected the tools/call (HTTP {status}); not followed", mt.INVALID_REQUEST)
    if content_type == "application/json":
        try:
            message = _parse(await _body(response, limit))
        except CallRejected as exc:
            if isinstance(exc, ReplyTooLarge):
                raise
            message = None
        if isinstance(message, dict) and isinstance(message.get("error"), dict):
            return message
    if status == 404:
        raise CallRejected("Not Found", mt.METHOD_NOT_FOUND)
    raise CallRejected(f"Server returned an error response (HTTP {status})", mt.INTERNAL_ERROR)


class _Counted(httpx2.AsyncByteStream):
    """A reply's bytes as they arrive, cut off past `limit` (ReplyTooLarge)."""

    def __init__(self, response: aiohttp.ClientResponse, limit: int) -> None:
        self._response = response
        self._limit = limit

    async def __aiter__(self) -> AsyncIterator[bytes]:
        received = 0
        async for chunk in self._response.content.iter_any():
            received += len(chunk)
            if received > self._limit:
                raise too_large(self._limit, listing=False)
            yield chunk


async def _body(response: aiohttp.ClientResponse, limit: int) -> bytes:
    """The whole body, bounded by `limit`."""
    length = response.content_length
    if length is not None and length > limit:
        raise too_large(limit, listing=False)  # refused before reading a byte of it
    return b"".join([chunk async for chunk in _Counted(response, limit)])


def _is_response(message: Any) -> TypeGuard[dict[str, Any]]:
    return isinstance(message, dict) and ("result" in message or "error" in message)


def _parse(raw: bytes | str) -> Any:
    # The standard decoder: it reads integers of any size exactly (orjson turns those past 64 bits into floats).
    try:
        return json.loads(raw)
    except ValueError as exc:
        raise CallRejected(f"the tools/call reply is not JSON: {exc}", mt.PARSE_ERROR) from exc
    except RecursionError:
        raise CallRejected("the tools/call reply nests too deeply to be read", mt.PARSE_ERROR) from None


def _result(message: dict[str, Any]) -> mt.CallToolResult:
    """The tool result of a JSON-RPC response, or CallRejected for an error or a result that is not one."""
    error = message.get("error")
    if error is not None:
        if not isinstance(error, dict):
            raise CallRejected(f"malformed JSON-RPC error: {str(error)[:200]}", mt.PARSE_ERROR)
        code, text = error.get("code"), error.get("message")
        code = code if isinstance(code, int) and not isinstance(code, bool) else mt.INTERNAL_ERROR
        raise CallRejected(text if isinstance(text, str) else "error without a message", code)
    result = message.get("result")
    if isinstance(result, dict) and result.get("resultType", "complete") != "complete":
        kind = result.get("resultType")
        if kind == "input_required":
            raise CallRejected(
                "the tool asked for more input (InputRequiredResult), which a forwarded call cannot give",
                mt.INVALID_REQUEST,
            )
        raise CallRejected(f"unsupported tools/call result type {str(kind)[:100]!r}", mt.INVALID_REQUEST)
    try:
        return mt.CallToolResult.model_validate(result)
    except ValidationError as exc:
        raise CallRejected(f"malformed tools/call result: {exc}", mt.PARSE_ERROR) from exc


def _describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
