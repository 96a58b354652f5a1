"""A tool added upstream after the first listing is found when a call names it (re-list on unknown name)."""

from __future__ import annotations

import asyncio
import secrets
import uuid
from collections.abc import AsyncIterator

import grpc
import pytest
import uvicorn
from mcp.server import MCPServer

from rlgate.runtime.auth import token_hash
from rlgate.store import Session, SessionStatus, SessionStore
from rlgate.toolgateway.server import start_gateway
from rlgate.v1 import common_pb2, toolgateway_pb2
from rlgate.v1.toolgateway_pb2_grpc import ToolGatewayServiceStub
from tests.support.ports import free_port
from tests.toolgateway.conftest import gateway_config


@pytest.fixture
async def mcp_url() -> AsyncIterator[tuple[str, MCPServer]]:
    server = MCPServer("changing")

    @server.tool()
    def early() -> str:
        return "early"

    port = free_port()
    uv = uvicorn.Server(uvicorn.Config(server.streamable_http_app(), host="127.0.0.1", port=port,
                                       log_level="warning", lifespan="on"))
    task = asyncio.create_task(uv.serve())
    for _ in range(500):  # uvicorn offers no started event; bounded wait
        if uv.started:
            break
        await asyncio.sleep(0.02)
    else:
        raise TimeoutError("uvicorn did not start")
    yield f"http://127.0.0.1:{port}/mcp", server
    uv.should_exit = True
    await asyncio.wait_for(task, 10)


async def test_unknown_tool_name_triggers_a_relist(mcp_url: tuple[str, MCPServer], store: SessionStore) -> None:
    url, server = mcp_url
    token = secrets.token_urlsafe(16)
    await store.create_session(Session(session_id=uuid.uuid4().hex, env_key="byo:v1", status=SessionStatus.ACTIVE,
                                       provider="mcp", endpoints=[url], token_hash=token_hash(token)))
    handle = await start_gateway(gateway_config(), store)
    md = (("authorization", f"Bearer {token}"),)
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
