"""The gRPC servicer: translates between `ToolGatewayService` and `ToolGateway` (no logic here).

An `RlgateError` becomes its `google.rpc.Status` with details (ErrorInfo, BadRequest, RetryInfo), as on the
orchestrator, so a client handles both planes' errors the same way."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

import grpc
from grpc_status import rpc_status

from rlgate.core.errors import RlgateError
from rlgate.runtime.auth import bearer_token
from rlgate.runtime.deadline import Deadline
from rlgate.toolgateway.service import DEADLINE_MARGIN_S, ToolGateway
from rlgate.v1 import toolgateway_pb2, toolgateway_pb2_grpc

T = TypeVar("T")


async def _answer(context: grpc.aio.ServicerContext, call: Callable[[], Awaitable[T]]) -> T:
    try:
        return await call()
    except RlgateError as exc:
        await context.abort_with_status(rpc_status.to_status(exc.to_status()))
    raise AssertionError("unreachable: abort_with_status raises")


class ToolGatewayServicer(toolgateway_pb2_grpc.ToolGatewayServiceServicer):
    def __init__(self, gateway: ToolGateway) -> None:
        self._gateway = gateway

    def _deadline(self, context: grpc.aio.ServicerContext, default_s: float) -> Deadline:
        return Deadline.from_grpc(context.time_remaining(), default_s, DEADLINE_MARGIN_S)

    async def ListTools(
        self, request: toolgateway_pb2.ListToolsRequest, context: grpc.aio.ServicerContext
    ) -> toolgateway_pb2.ListToolsResponse:
        token = bearer_token(context.invocation_metadata())
        deadline = self._deadline(context, self._gateway.settings.upstream_timeout_s)
        return await _answer(context, lambda: self._gateway.list_tools(token, deadline))

    async def CallTool(
        self, request: toolgateway_pb2.CallToolRequest, context: grpc.aio.ServicerContext
    ) -> toolgateway_pb2.CallToolResponse:
        token = bearer_token(context.invocation_metadata())
        deadline = self._deadline(context, self._gateway.settings.call_timeout_s)
        return await _answer(context, lambda: self._gateway.call_tool(token, request, deadline))
