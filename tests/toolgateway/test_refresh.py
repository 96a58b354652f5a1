"""A tool added upstream after the first listing is found when a call names it (re-list on unknown name)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest
from mcp.server import MCPServer

from rlgate.store import SessionStore
from rlgate.toolgateway.server import start_gateway
from rlgate.v1 import common_pb2, toolgateway_pb2
from rlgate.v1.toolgateway_pb2_grpc import ToolGatewayServiceStub
from tests.toolgateway.conftest import byo_session, gateway_config
from tests.toolgateway.upstreams import serve_mcp


@pytest.fixture
async def mcp_url() -> AsyncIterator[tuple[str, MCPServer]]:
    server = MCPServer("changing")

    @server.tool()
    def early() -> str:
        return "early"

    async with serve_mcp(server) as url:
        yield url, server


async def test_unknown_tool_name_triggers_a_relist(mcp_url: tuple[str, MCPServer], store: SessionStore) -> None:
    url, server = mcp_url
    md = (await byo_session(store, [url])).metadata
    handle = await start_gateway(gateway_config(), store)
    try:
        async with grpc.aio.insecure_channel(handle.address) as channel:
            stub = ToolGatewayServiceStub(channel)
            listed = await stub.ListTools(toolgateway_pb2.ListToolsRequest(), metadata=md, timeout=10)
            assert [t.name for t in listed.tools] == ["early"]

            @server.tool()
            def late() -> str:
                return "late"

            resp = await stub.CallTool(toolgateway_pb2.CallToolRequest(name="late"), metadata=md, timeout=10)
            assert not resp.result.is_error and resp.result.content[0].text.text == "late"
            listed = await stub.ListTools(toolgateway_pb2.ListToolsRequest(), metadata=md, timeout=10)
            assert [t.name for t in listed.tools] == ["early", "late"]
            gone = await stub.CallTool(toolgateway_pb2.CallToolRequest(name="never"), metadata=md, timeout=10)
            assert gone.result.error_kind == common_pb2.TOOL_ERROR_KIND_UNKNOWN_TOOL
    finally:
        await handle.stop(grace=0)
