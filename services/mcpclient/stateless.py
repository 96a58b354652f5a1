"""tools/call on a stateless-era (2026-07-28) endpoint: one HTTP request through the link's pooled transport.

That era keeps no session on the server, so a call is one POST that carries all it needs. The SDK's client
session adds what a forwarder does not use (a dispatcher task and memory streams per request, envelope
models, the output-schema re-validation rlgate switches off) and costs a large share of a call's CPU, so a
call is sent here instead; discovery and listings stay with the SDK. What this sends is what the SDK's
client sends, built from the SDK's public pieces (`mcp.shared.inbound`, `mcp_types`): the request's `_meta`
(protocol version, client info, capabilities, and the W3C trace context, SEP-414) and the routing headers
(`Mcp-Protocol-Version`, `Mcp-Method`, `Mcp-Name`, and the `Mcp-Param-*` headers a tool's `x-mcp-header`
arguments ask for). A real SDK server checks all of them (tests/mcpclient/test_stateless.py).

Everything about bytes on the wire is the transport's (`transport.UpstreamTransport`): the reply cap, an
abandoned reply no longer read, whether a failed request could have reached the server. This module reads
the reply (JSON, or an SSE stream parsed incrementally by httpx2's `EventSource`) and sorts the outcome into
the `errors` a caller can act on: CallNotSent (provably not sent), CallLost (may have run), CallTimedOut,
CallRejected (the server answered with an error, or with a reply that is not a tool result).
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import Mapping
from typing import Any, TypeGuard

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
from rlgate.mcpclient.errors import CallLost, CallNotSent, CallRejected, CallTimedOut
from rlgate.mcpclient.transport import Exchange, UpstreamTransport, exchange
from rlgate.runtime import jsoncodec, tracing

_CLIENT_INFO_JSON = CLIENT_INFO.model_dump(mode="json", exclude_none=True)
_ACCEPT = "application/json, text/event-stream"
_ids = itertools.count(1)  # JSON-RPC ids: the era correlates a reply with its POST, the id only echoes


def request_for(
    url: str, era: str, name: str, arguments: Mapping[str, Any], header_map: Mapping[tuple[str, ...], str]
) -> tuple[int, httpx2.Request]:
    """(JSON-RPC id, the POST) of a tools/call. `header_map`: the tool's `x-mcp-header` positions
    (`mcp.shared.inbound.x_mcp_header_map` of its input schema)."""
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
        "accept-encoding": "identity",  # the transport refuses a compressed reply
        "content-type": "application/json",
        MCP_PROTOCOL_VERSION_HEADER: era,
        MCP_METHOD_HEADER: "tools/call",
        MCP_NAME_HEADER: encode_header_value(name),
        **mcp_param_headers(header_map, arguments),
    }
    return request_id, httpx2.Request("POST", url, content=jsoncodec.dumps_bytes(message), headers=headers)


async def call_tool(
    transport: UpstreamTransport,
    request: tuple[int, httpx2.Request],
    timeout_s: float,
    connect_timeout_s: float | None,
) -> mt.CallToolResult:
    """Send a `request_for` POST and read its reply, all within `timeout_s`. Raises CallNotSent, CallLost,
    CallTimedOut, CallRejected (ReplyTooLarge among them)."""
    request_id, http_request = request
    name = http_request.headers.get(MCP_NAME_HEADER, "")
    http_request.extensions["timeout"] = {"connect": connect_timeout_s, "read": None, "write": None, "pool": None}
    with exchange() as ex:  # ended on the way out: a reply still arriving is no longer read
        try:
            async with asyncio.timeout(timeout_s):
                response = await transport.handle_async_request(http_request)
                try:
                    return _result(await _reply(response, ex, request_id), ex)
                finally:
                    await response.aclose()
        except TimeoutError:
            raise CallTimedOut(f"{name!r} did not finish within {timeout_s:.2f}s", sent=ex.started > 0) from None
        except (httpx2.StreamError, httpx2.SSEError, httpx2.TransportError) as exc:
            raise _read_failure(ex, http_request, exc) from exc


def _read_failure(ex: Exchange, request: httpx2.Request, exc: Exception) -> Exception:
    """What a reply that could not be read to its end means."""
    if ex.refused is not None:  # cut off past the reply cap, or compressed: the server answered
        return ex.refused
    return CallLost(ex.lost or f"{request.url}: the reply broke off: {type(exc).__name__}: {exc}")


async def _reply(response: httpx2.Response, ex: Exchange, request_id: int) -> dict[str, Any]:
    """The JSON-RPC response to `request_id` (a dict with "result" or "error")."""
    status = response.status_code
    content_type = response.headers.get("content-type", "").partition(";")[0].strip().lower()
    if status >= 400 or status == 202 or 300 <= status < 400:
        return await _error_reply(response, ex, status, content_type)
    if content_type == "application/json":
        message = _parse(await response.aread())
        if not _is_response(message):
            raise CallRejected("the tools/call reply is not a JSON-RPC response", mt.PARSE_ERROR)
        return message
    if content_type == "text/event-stream":
        # Events may be as large as a whole reply; the transport bounds the reply itself.
        async for event in httpx2.EventSource(response, max_event_size=None):
            if event.event != "message" or not event.data:
                continue  # priming events, keep-alives, other event types
            message = _parse(event.data)
            if _is_response(message) and message.get("id") in (request_id, None):
                return message
            # Anything else (progress, log notifications, server requests) has no reader in a forwarder.
        raise CallLost(f"{response.request.url}: connection lost: the SSE stream ended before the reply came")
    raise CallRejected(f"unexpected content type {content_type!r} in the tools/call reply", mt.INVALID_REQUEST)


async def _error_reply(response: httpx2.Response, ex: Exchange, status: int, content_type: str) -> dict[str, Any]:
    """A non-2xx answer (or 202, or a redirect, neither followed): the JSON-RPC error it carries, or one that
    says what happened. The transport answers its own failures as 5xx JSON-RPC errors and notes them in `ex`."""
    if ex.never_sent:
        raise CallNotSent(ex.unsent)
    if ex.lost:
        raise CallLost(ex.lost)
    if ex.refused is not None:
        raise ex.refused
    if status == 202:
        raise CallRejected("the server answered the tools/call with 202 Accepted and no result", mt.INVALID_REQUEST)
    if 300 <= status < 400:
        raise CallRejected(f"the server redirected the tools/call (HTTP {status}); not followed", mt.INVALID_REQUEST)
    if content_type == "application/json":
        try:
            message = _parse(await response.aread())
        except CallRejected:
            message = None
        if isinstance(message, dict) and isinstance(message.get("error"), dict):
            return message
    if status == 404:
        raise CallRejected("Not Found", mt.METHOD_NOT_FOUND)
    raise CallRejected(f"Server returned an error response (HTTP {status})", mt.INTERNAL_ERROR)


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


def _result(message: dict[str, Any], ex: Exchange) -> mt.CallToolResult:
    """The tool result of a JSON-RPC response, or CallRejected for an error or a result that is not one."""
    ex.replied = True
    error = message.get("error")
    if error is not None:
        if not isinstance(error, dict):
            raise CallRejected(f"malformed JSON-RPC error: {str(error)[:200]}", mt.PARSE_ERROR)
        code = error.get("code")
        text = error.get("message")
        return_code = code if isinstance(code, int) and not isinstance(code, bool) else mt.INTERNAL_ERROR
        raise CallRejected(text if isinstance(text, str) else "error without a message", return_code)
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
