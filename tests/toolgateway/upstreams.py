"""An in-process MCP server (the SDK's low-level `Server`) for tests that need exact control over what the
upstream says: schemas with integer keywords, structured results with integers (2^60 among them), and
JSON-RPC errors. Every tool call is counted, so a test can prove a tool ran once."""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import AsyncIterator
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


@contextlib.asynccontextmanager
async def serve_mcp(server: Server[Any] | MCPServer) -> AsyncIterator[str]:
    """Serve `server` over streamable HTTP on a free loopback port in this event loop; yields its MCP URL."""
    port = free_port()
    uv = uvicorn.Server(
        uvicorn.Config(server.streamable_http_app(), host="127.0.0.1", port=port, log_level="warning", lifespan="on")
    )
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
