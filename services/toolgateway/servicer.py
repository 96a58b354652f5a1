"""The gRPC servicer: translates between `ToolGatewayService` and `ToolGateway` (no logic here)."""

from __future__ import annotations

import grpc

from rlgate.runtime.interceptors import bearer_token
from rlgate.toolgateway.service import GatewayError, ToolGateway
from rlgate.v1 import toolgateway_pb2, toolgateway_pb2_grpc


class ToolGatewayServicer(toolgateway_pb2_grpc.ToolGatewayServiceServicer):
    def __init__(self, gateway: ToolGateway) -> None:
        self._gateway = gateway

    async def ListTools(
        self, request: toolgateway_pb2.ListToolsRequest, context: grpc.aio.ServicerContext
    ) -> toolgateway_pb2.ListToolsResponse:
        try:
            return await self._gateway.list_tools(bearer_token(context.invocation_metadata()),
                                                  context.time_remaining())
        except GatewayError as exc:
            await context.abort(exc.code, exc.message)
            raise  # unreachable: abort raises

    async def CallTool(
        self, request: toolgateway_pb2.CallToolRequest, context: grpc.aio.ServicerContext
    ) -> toolgateway_pb2.CallToolResponse:
        try:
            return await self._gateway.call_tool(bearer_token(context.invocation_metadata()), request,
                                                 context.time_remaining())
        except GatewayError as exc:
            await context.abort(exc.code, exc.message)
            raise
