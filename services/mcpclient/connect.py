"""Opening an mcp 2.x `Client` on an upstream endpoint, as a forwarder, and what a failed handshake means.

Era detection is the SDK's `auto` mode: `server/discover` (2026-07-28, stateless), falling back to `initialize`
+ `Mcp-Session-Id` for legacy servers. Every request goes through `transport.UpstreamTransport`.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator

import mcp_types as mt
from mcp import Client, MCPError
from mcp.client.streamable_http import streamable_http_client
from mcp_types import METHOD_NOT_FOUND

from rlgate.mcpclient.catalog import list_all_tools
from rlgate.mcpclient.errors import CallNotSent, EndpointNotFound, UpstreamUnavailable
from rlgate.mcpclient.transport import HttpSettings, listing

CLIENT_INFO = mt.Implementation(name="rlgate", version="1")  # what every upstream client says it is


def _expected_termination(record: logging.LogRecord) -> bool:
    """The SDK warns "Session termination failed: 404" when it ends a legacy-era session the server had
    already forgotten (its instance deleted first, an idle timeout): the session is gone either way, so
    that is a debug line, not a warning per closed session."""
    if record.levelno == logging.WARNING and record.getMessage() == "Session termination failed: 404":
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)
    return True


logging.getLogger("mcp.client.streamable_http").addFilter(_expected_termination)


def leaves(exc: BaseException) -> list[BaseException]:
    """The exceptions inside an (anyio task group's) exception group, flattened."""
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for e in exc.exceptions for leaf in leaves(e)]
    return [exc]


def connect_error(url: str, exc: BaseException) -> Exception:
    """What a failed handshake means: EndpointNotFound (HTTP 404) or CallNotSent."""
    for leaf in leaves(exc):
        if isinstance(leaf, MCPError) and leaf.code == METHOD_NOT_FOUND:
            return EndpointNotFound(f"{url} answered 404 Not Found (no MCP endpoint there)")
    first = leaves(exc)[0]
    return CallNotSent(f"{url} unreachable: {type(first).__name__}: {first}".rstrip(": "))


@contextlib.asynccontextmanager
async def open_client(url: str, http: HttpSettings, timeout_s: float) -> AsyncIterator[Client]:
    """An entered mcp `Client` (auto era detection) on a fresh httpx2 client with the shared settings.
    Enter and exit in the same task (the SDK's cancel scopes require it). Handshake failures raise
    EndpointNotFound / CallNotSent; what the block raises is raised as it was, not wrapped in the exception
    group of the SDK's task group."""
    try:
        async with contextlib.AsyncExitStack() as stack:
            try:
                hc = await stack.enter_async_context(http.client())
                # SSE events may be as large as a whole reply; the transport bounds the reply itself.
                transport = streamable_http_client(url, http_client=hc, max_sse_event_size=http.max_reply_bytes)
                client = Client(transport, read_timeout_seconds=timeout_s, cache=None, client_info=CLIENT_INFO)
                entered = await stack.enter_async_context(client)
            except Exception as exc:
                raise connect_error(url, exc) from exc
            except BaseExceptionGroup as exc:  # anyio task groups wrap transport errors
                raise connect_error(url, exc) from exc
            _forward_only(entered)
            yield entered
    except BaseExceptionGroup as group:
        found = leaves(group)
        if len(found) == 1 and isinstance(found[0], Exception):
            raise found[0] from None
        raise


async def _results_pass_through(name: str, result: mt.CallToolResult) -> None:
    """Results are forwarded; the caller's side has the tool's output schema from the tool list."""


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


async def list_tools_forwarding(client: Client, url: str = "") -> list[mt.Tool]:
    """Every page of the client's tools/list, each reply bounded by `max_page_bytes`, without leaving a
    per-client copy of the schemas in the SDK. A page past the bound raises UpstreamUnavailable (the listing
    is refused whole: the tools of a page cut off cannot be read); other failures raise as the SDK's
    `MCPError`, and the transport's record of them is in the current `Exchange` when the caller opened one."""
    with listing() as ex:
        try:
            tools = await list_all_tools(client)
        except MCPError as exc:
            if ex.refused is not None:
                where = f"{url}: " if url else ""
                raise UpstreamUnavailable(f"{where}tools/list refused: {ex.refused}") from exc
            raise
    forget_output_schemas(client)
    return tools
