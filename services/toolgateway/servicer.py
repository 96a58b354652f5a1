"""The gRPC servicer: translates between `ToolGatewayService` and `ToolGateway` (no logic here).

CallToolStream serves CallTool calls over a stream (`runtime.multiplex`): each call goes through the same
`ToolGateway.call_tool` as a unary CallTool, with the token its request carries."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc

from rlgate.runtime.auth import bearer_token
from rlgate.runtime.interceptors import RpcMetrics
from rlgate.runtime.multiplex import Multiplexer, StreamedMethod, call_status
from rlgate.toolgateway.service import GatewayError, ToolGateway
from rlgate.v1 import common_pb2, toolgateway_pb2, toolgateway_pb2_grpc


def _streamed_status(exc: Exception) -> common_pb2.CallStatus | None:
    return call_status(exc.code, exc.message) if isinstance(exc, GatewayError) else None


class ToolGatewayServicer(toolgateway_pb2_grpc.ToolGatewayServiceServicer):
    def __init__(self, gateway: ToolGateway, metrics: RpcMetrics | None = None) -> None:
        self._gateway = gateway
        self._call_stream = Multiplexer(StreamedMethod(
            name="CallTool", response=toolgateway_pb2.CallToolStreamResponse, handle=self._streamed_call,
            known_error=_streamed_status, observe=(metrics or RpcMetrics("toolgateway")).method("CallTool")))

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

    async def CallToolStream(
        self, requests: AsyncIterator[toolgateway_pb2.CallToolStreamRequest], context: grpc.aio.ServicerContext
    ) -> None:
        await self._call_stream.serve(requests, context)

    async def _streamed_call(self, envelope: Any, seconds_left: float | None) -> toolgateway_pb2.CallToolResponse:
        return await self._gateway.call_tool(envelope.token or None, envelope.call, seconds_left)
