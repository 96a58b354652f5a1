"""Upstream clients as the gateway keeps them: forwarders that hold no per-client copy of the tool list, and
only for endpoints that own a tool the session can call."""

from __future__ import annotations

import mcp_types as mt

from rlgate.mcpclient.connect import list_tools_forwarding, open_client
from rlgate.mcpclient.transport import HttpSettings
from rlgate.store import SessionStore
from rlgate.toolgateway.server import GatewayHandle
from rlgate.v1 import common_pb2
from rlgate.v1.toolgateway_pb2_grpc import ToolGatewayServiceStub as Stub
from tests.support.localfleet import LocalfleetProcess
from tests.toolgateway.conftest import ERA_HANDSHAKE, create_instance, make_session
from tests.toolgateway.test_gateway import call, text, tool_names


async def test_clients_forward_results_without_schema_copies(lf: LocalfleetProcess, era: str) -> None:
    url = create_instance(lf, era)["urls"]["mcp"]["api"]
    async with open_client(url, HttpSettings.create(), 15.0) as client:
        tools = await list_tools_forwarding(client)
        add = next(t for t in tools if t.name == "add")
        assert add.output_schema is not None  # the SDK would validate every `add` result against it
        assert not client.session._tool_output_schemas  # no per-client copy kept alive
        off_schema = mt.CallToolResult(content=[], structured_content={"result": 5})  # not a string
        await client.session.validate_tool_result("add", off_schema)  # the SDK's check would raise here
        result = await client.call_tool("add", {"n": 1})
        assert result.structured_content == {"result": "2 (int)"}


async def test_endpoint_owning_no_visible_tool_is_closed_after_listing(
    gateway: GatewayHandle, stub: Stub, store: SessionStore, lf: LocalfleetProcess, era: str
) -> None:
    s = await make_session(store, lf, era)  # tool_use: the aggregator owns no tool of its own
    lf.reset_counters()
    assert text(await call(stub, s, "add", {"n": 1})) == "2 (int)"
    assert gateway.pool.open_clients() == 1
    counters = lf.counters()["by_env"][era]
    assert (counters[ERA_HANDSHAKE[era]], counters["mcp_tools_list"]) == (2, 2)  # both listed once
    # An unknown name re-lists both endpoints: the aggregator reconnects for that, then is closed again.
    unknown = await call(stub, s, "computer", {"action": "screenshot"})
    assert unknown.result.error_kind == common_pb2.TOOL_ERROR_KIND_UNKNOWN_TOOL
    counters = lf.counters()["by_env"][era]
    assert (counters[ERA_HANDSHAKE[era]], counters["mcp_tools_list"]) == (3, 4)
    assert gateway.pool.open_clients() == 1
    assert "computer" not in await tool_names(stub, s)
    assert text(await call(stub, s, "add", {"n": 2})) == "3 (int)"  # served from the cached lists
    assert lf.counters()["by_env"][era]["mcp_tools_list"] == 4
