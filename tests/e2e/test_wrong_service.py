"""A method sent to the wrong plane says where it is served: a CallTool sent to the orchestrator names the
toolgateway and its address, a ListTasks sent to the toolgateway names the orchestrator and its address
(the local stack gives each the other's address); a method no plane serves names what this one serves."""

from __future__ import annotations

import grpc
import pytest

from rlgate.devtools.stack import LocalStack
from rlgate.v1 import orchestrator_pb2, orchestrator_pb2_grpc, toolgateway_pb2, toolgateway_pb2_grpc


def test_call_tool_on_the_orchestrator_names_the_toolgateway(stack: LocalStack) -> None:
    with grpc.insecure_channel(stack.orchestrator_address) as channel, pytest.raises(grpc.RpcError) as caught:
        toolgateway_pb2_grpc.ToolGatewayServiceStub(channel).CallTool(toolgateway_pb2.CallToolRequest(), timeout=10)
    assert caught.value.code() == grpc.StatusCode.UNIMPLEMENTED
    details = caught.value.details() or ""
    assert "rlgate.v1.ToolGatewayService/CallTool is served by the toolgateway" in details, details
    assert stack.gateway_address in details and "not by the orchestrator" in details, details


def test_list_tasks_on_the_toolgateway_names_the_orchestrator(stack: LocalStack) -> None:
    with grpc.insecure_channel(stack.gateway_address) as channel, pytest.raises(grpc.RpcError) as caught:
        orchestrator_pb2_grpc.OrchestratorServiceStub(channel).ListTasks(
            orchestrator_pb2.ListTasksRequest(), timeout=10
        )
    assert caught.value.code() == grpc.StatusCode.UNIMPLEMENTED
    details = caught.value.details() or ""
    assert "rlgate.v1.OrchestratorService/ListTasks is served by the orchestrator" in details, details
    assert stack.orchestrator_address in details and "not by the toolgateway" in details, details


def test_an_unknown_method_names_what_this_plane_serves(stack: LocalStack) -> None:
    with grpc.insecure_channel(stack.orchestrator_address) as channel:
        nope: grpc.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary("/rlgate.v1.OrchestratorService/Nope")
        with pytest.raises(grpc.RpcError) as caught:
            nope(b"", timeout=10)
    assert caught.value.code() == grpc.StatusCode.UNIMPLEMENTED
    details = caught.value.details() or ""
    assert "is not a method of the orchestrator, which serves rlgate.v1.OrchestratorService" in details, details
