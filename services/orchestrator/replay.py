"""Fork by replay: re-run a source episode's logged tool calls, in order, on a freshly reset instance.

The calls go through the same MCP client code as every other upstream call (`rlgate.mcpclient.open_client`,
both eras). A call is replayed only if it reached an upstream (its log entry names an endpoint) and its tool
is not annotated `readOnlyHint` (a read changes no state). Each replayed result is compared with the
logged one, on what the log keeps of it (`is_error` and the summary, computed the gateway's way); the first
difference fails the replay naming the call, since the branch's state is then not the source's.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from typing import Any

import mcp_types as mt
from mcp import Client, MCPError

from rlgate.mcpclient import results
from rlgate.mcpclient.connect import list_tools_forwarding, open_client
from rlgate.mcpclient.errors import CallRejected, CallTimedOut, EndpointNotFound, UpstreamUnavailable
from rlgate.mcpclient.transport import HttpSettings
from rlgate.store import ToolCallEntry

log = logging.getLogger(__name__)

_CALL_FAILURES = (CallRejected, CallTimedOut, EndpointNotFound, UpstreamUnavailable, MCPError, OSError, TimeoutError)
# A replayed result is converted without the gateway's output bound: the summary reads only its first
# characters, which a result cut to the gateway's bound keeps too.
REPLAY_OUTPUT_BYTES = 1 << 24


class ReplayMismatch(Exception):
    """A replayed call's result differs from the logged one (or the call could not run)."""

    def __init__(self, position: int, entry: ToolCallEntry, detail: str) -> None:
        super().__init__(
            f"replay of call #{position + 1} ({entry.tool}, request_id {entry.request_id!r}) differs: {detail}"
        )
        self.position = position
        self.entry = entry


def result_summary(result: mt.CallToolResult) -> str:
    """The log's summary of an MCP result: the gateway's own conversion and summary (`rlgate.mcpclient.results`),
    so a faithful replay summarizes exactly as the logged call did."""
    return results.summary(results.truncate(results.tool_result(result, REPLAY_OUTPUT_BYTES), REPLAY_OUTPUT_BYTES))


def replayable(entries: Sequence[ToolCallEntry]) -> list[tuple[int, ToolCallEntry]]:
    """The log's calls that reached an upstream, with their positions in the log."""
    return [(i, e) for i, e in enumerate(entries) if e.endpoint]


async def replay_calls(
    entries: Sequence[ToolCallEntry],
    source_endpoints: Sequence[str],
    endpoints: Sequence[str],
    *,
    timeout_s: float,
    http: HttpSettings | None = None,
) -> int:
    """Re-run `entries` (the source's log, oldest first) on `endpoints` (the branch's, in the order of
    `source_endpoints`). Returns how many calls ran; `ReplayMismatch` on the first difference."""
    settings = http or HttpSettings.shared()
    calls = replayable(entries)
    if not calls:
        return 0
    ran = 0
    async with contextlib.AsyncExitStack() as stack:
        clients: dict[str, tuple[Client, dict[str, mt.Tool]]] = {}

        async def client_for(url: str) -> tuple[Client, dict[str, mt.Tool]]:
            if url not in clients:
                client = await stack.enter_async_context(open_client(url, settings, timeout_s))
                tools = {t.name: t for t in await list_tools_forwarding(client, url)}
                clients[url] = (client, tools)
            return clients[url]

        for position, entry in calls:
            try:
                url = endpoints[list(source_endpoints).index(entry.endpoint)]
            except (ValueError, IndexError):
                raise ReplayMismatch(position, entry, f"its endpoint {entry.endpoint} is not the source's") from None
            try:
                client, tools = await client_for(url)
                tool = tools.get(entry.tool)
                if tool is not None and tool.annotations is not None and tool.annotations.read_only_hint:
                    continue
                result = await client.call_tool(entry.tool, _arguments(entry), read_timeout_seconds=timeout_s)
            except _CALL_FAILURES as exc:
                raise ReplayMismatch(position, entry, f"the call failed: {exc}") from exc
            ran += 1
            summary = result_summary(result)
            if bool(result.is_error) != entry.is_error or summary != entry.result_summary:
                raise ReplayMismatch(
                    position,
                    entry,
                    f"logged {_outcome(entry.is_error, entry.result_summary)}, "
                    f"replayed {_outcome(bool(result.is_error), summary)}",
                )
    return ran


def _arguments(entry: ToolCallEntry) -> dict[str, Any]:
    return dict(entry.arguments)


def _outcome(is_error: bool, summary: str) -> str:
    shown = summary if len(summary) <= 80 else summary[:79] + "…"
    return f"{'error' if is_error else 'result'} {shown!r}"
