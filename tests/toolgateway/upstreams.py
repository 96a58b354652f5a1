"""In-process MCP servers (the SDK's low-level `Server`) for tests that need exact control over what the
upstream says: schemas with integer keywords, structured results with integers (2^60 among them), and
JSON-RPC errors (`exact_server`; every tool call is counted, so a test can prove a tool ran once); and a slow
tool whose server records, by itself, the cancellations it received (`slow_server`)."""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import mcp_types as mt
import uvicorn
from mcp import MCPError
from mcp.server import MCPServer, Server

from tests.support.ports import free_port
from tests.support.wait import wait_until

BIG = 2**60  # past 2^53: a double cannot hold it, so only exact JSON carries it

ECHO_INPUT: dict[str, Any] = {
    "type": "object",
    "properties": {
        "items": {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 4},
        "label": {"type": "string", "maxLength": 12, "default": "x"},
        "n": {"type": "integer", "minimum": 0, "maximum": BIG, "default": 3},
        "ratio": {"type": "number", "default": 0.5},
    },
    "required": ["items"],
}
ECHO_OUTPUT: dict[str, Any] = {
    "type": "object",
    "properties": {"count": {"type": "integer", "minimum": 0}, "big": {"type": "integer", "default": BIG}},
}
# What `echo` returns besides the arguments it got: integers, a float, and a whole number written as a float.
ECHO_EXTRA: dict[str, Any] = {"count": 3, "big": BIG, "nested": [1, 2.5, {"n": -7}], "whole_float": 2.0}
REJECTION = "the server refuses: " + "no " * 3000  # ~9 KB: longer than the gateway's output limit in the tests


def exact_server(calls: Counter[str]) -> Server[Any]:
    tools = [
        mt.Tool(
            name="echo",
            description="Returns its arguments as structured content.",
            input_schema=ECHO_INPUT,
            output_schema=ECHO_OUTPUT,
            annotations=mt.ToolAnnotations(read_only_hint=True),
        ),
        mt.Tool(name="reject", description="Answers with a JSON-RPC error.", input_schema={"type": "object"}),
    ]

    async def list_tools(_ctx: Any, _params: mt.PaginatedRequestParams | None) -> mt.ListToolsResult:
        return mt.ListToolsResult(tools=tools)

    async def call_tool(_ctx: Any, params: mt.CallToolRequestParams) -> mt.CallToolResult:
        calls[params.name] += 1
        if params.name == "reject":
            raise MCPError(-32602, REJECTION)
        return mt.CallToolResult(
            content=[mt.TextContent(text=f"echo #{calls[params.name]}")],
            structured_content={"arguments": params.arguments, **ECHO_EXTRA},
        )

    return Server("exact", on_list_tools=list_tools, on_call_tool=call_tool)


@dataclass
class SlowRecord:
    """What `slow_server` saw, by JSON-RPC request id: `slow` calls started, finished and cancelled (its
    handler interrupted), and the `notifications/cancelled` it received (the request ids they name)."""

    started: list[mt.RequestId] = field(default_factory=list)
    finished: list[mt.RequestId] = field(default_factory=list)
    cancelled: list[mt.RequestId] = field(default_factory=list)
    notified: list[mt.RequestId] = field(default_factory=list)
    versions: list[str] = field(default_factory=list)  # the protocol version of each `slow` call


def slow_server(record: SlowRecord, *, legacy: bool) -> Server[Any]:
    """A server with one tool, `slow`, which sleeps `seconds` (5 by default) in the SDK's own handler. It
    records what it saw in `record`, from its own side: nothing stands between it and the client.

    `legacy`: the server has no `server/discover` (it answers METHOD_NOT_FOUND, as an mcp 1.x server's
    dispatcher does), so clients fall back to the `initialize` handshake; otherwise it serves both eras."""

    tool = mt.Tool(
        name="slow",
        description="Sleeps `seconds`.",
        input_schema={"type": "object", "properties": {"seconds": {"type": "number", "minimum": 0}}},
    )

    async def list_tools(_ctx: Any, _params: mt.PaginatedRequestParams | None) -> mt.ListToolsResult:
        return mt.ListToolsResult(tools=[tool])

    async def call_tool(ctx: Any, params: mt.CallToolRequestParams) -> mt.CallToolResult:
        request_id = ctx.request_id
        record.started.append(request_id)
        record.versions.append(ctx.protocol_version)
        try:
            await asyncio.sleep(float((params.arguments or {}).get("seconds", 5.0)))
        except asyncio.CancelledError:
            record.cancelled.append(request_id)
            raise
        record.finished.append(request_id)
        return mt.CallToolResult(content=[mt.TextContent(text="slept")])

    server = Server("slow", on_list_tools=list_tools, on_call_tool=call_tool)

    async def cancelled(_ctx: Any, params: mt.CancelledNotificationParams) -> None:
        # The SDK's dispatcher interrupts the named request's handler itself, then passes the notification on.
        if params.request_id is not None:
            record.notified.append(params.request_id)

    server.add_notification_handler("notifications/cancelled", mt.CancelledNotificationParams, cancelled)
    if legacy:

        async def no_discover(_ctx: Any, _params: mt.RequestParams) -> mt.DiscoverResult:
            raise MCPError(mt.METHOD_NOT_FOUND, "Method not found")

        server.add_request_handler("server/discover", mt.RequestParams, no_discover)
    return server


@contextlib.asynccontextmanager
async def serve_mcp(server: Server[Any] | MCPServer, *, json_response: bool = False) -> AsyncIterator[str]:
    """Serve `server` over streamable HTTP on a free loopback port in this event loop; yields its MCP URL.
    `json_response`: legacy-era replies in plain JSON rather than the SDK's default, an event stream."""
    port = free_port()
    app = server.streamable_http_app(json_response=json_response)
    uv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on"))
    task = asyncio.create_task(uv.serve())

    def started() -> bool:  # uvicorn offers no started event: poll
        if task.done():
            task.result()  # raises why it stopped
        return bool(uv.started)

    try:
        await wait_until(started, 30, "uvicorn started", interval=0.02)
        yield f"http://127.0.0.1:{port}/mcp"
    finally:
        uv.should_exit = True
        await asyncio.wait_for(task, 10)
