"""gRPC handlers: check every request's ids (`limits.check_request`), translate requests into
`EpisodeManager` calls and `RlgateError`s into statuses with google.rpc details. No orchestration
logic lives here. StepStream serves Step calls over a stream (`runtime.multiplex`) through the same path."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc
from google.protobuf.message import Message
from google.rpc import status_pb2
from grpc_status import rpc_status

from rlgate.orchestrator.config import OrchestratorConfig
from rlgate.orchestrator.episodes import EpisodeManager, ResetParams
from rlgate.orchestrator.limits import check_request
from rlgate.runtime.deadline import Deadline
from rlgate.runtime.errors import MAX_MESSAGE, RlgateError, clip
from rlgate.runtime.interceptors import RpcMetrics
from rlgate.runtime.multiplex import Multiplexer, StreamedMethod
from rlgate.store import StoreError
from rlgate.v1 import common_pb2, orchestrator_pb2, orchestrator_pb2_grpc

log = logging.getLogger(__name__)
T = TypeVar("T")


def error_status(exc: Exception) -> status_pb2.Status | None:
    """The status an RPC ends with for an expected exception (None: a bug, answered INTERNAL)."""
    if isinstance(exc, RlgateError):
        return exc.to_status()
    if isinstance(exc, StoreError):
        log.warning("store unavailable: %s", exc)
        return status_pb2.Status(code=grpc.StatusCode.UNAVAILABLE.value[0],
                                 message=clip(f"session store unavailable: {exc}", MAX_MESSAGE))
    return None


def _streamed_status(exc: Exception) -> common_pb2.CallStatus | None:
    status = error_status(exc)
    return None if status is None else common_pb2.CallStatus.FromString(status.SerializeToString())


async def _answer(context: grpc.aio.ServicerContext, request: Message, call: Callable[[], Awaitable[T]]) -> T:
    """Check the request's ids before any work, run `call`, map errors to statuses."""
    try:
        check_request(request)
        return await call()
    except Exception as exc:
        status = error_status(exc)
        if status is None:
            raise
        await context.abort_with_status(rpc_status.to_status(status))
    raise AssertionError("unreachable")


class OrchestratorServicer(orchestrator_pb2_grpc.OrchestratorServiceServicer):
    def __init__(self, config: OrchestratorConfig, episodes: EpisodeManager,
                 metrics: RpcMetrics | None = None) -> None:
        self._config = config
        self._episodes = episodes
        self._step_stream = Multiplexer(StreamedMethod(
            name="Step", response=orchestrator_pb2.StepStreamResponse, handle=self._streamed_step,
            known_error=_streamed_status, observe=(metrics or RpcMetrics("orchestrator")).method("Step")))

    def _deadline(self, context: grpc.aio.ServicerContext) -> Deadline:
        return self._deadline_of(context.time_remaining())

    def _deadline_of(self, seconds_left: float | None) -> Deadline:
        default = self._config.provision_timeout_s + self._config.capacity_wait_s
        return Deadline.from_grpc(seconds_left, default)

    async def Reset(self, request: orchestrator_pb2.ResetRequest,
                    context: grpc.aio.ServicerContext) -> orchestrator_pb2.ResetResponse:
        params = ResetParams(request_id=request.request_id, session_id=request.session_id,
                             task_key=request.task_key, env_key=request.env_key, max_turns=request.max_turns,
                             labels=dict(request.labels), run_id=request.run_id)
        return await _answer(context, request, lambda: self._episodes.reset(params, self._deadline(context)))

    async def Step(self, request: orchestrator_pb2.StepRequest,
                   context: grpc.aio.ServicerContext) -> orchestrator_pb2.StepResponse:
        return await _answer(context, request, lambda: self._episodes.step(request, self._deadline(context)))

    async def StepStream(self, requests: AsyncIterator[orchestrator_pb2.StepStreamRequest],
                         context: grpc.aio.ServicerContext) -> None:
        await self._step_stream.serve(requests, context)

    async def _streamed_step(self, envelope: Any, seconds_left: float | None) -> orchestrator_pb2.StepResponse:
        check_request(envelope.step)
        return await self._episodes.step(envelope.step, self._deadline_of(seconds_left))

    async def State(self, request: orchestrator_pb2.StateRequest,
                    context: grpc.aio.ServicerContext) -> orchestrator_pb2.StateResponse:
        return await _answer(context, request,
                             lambda: self._episodes.state(request.session_id, request.include_tool_calls))

    async def Close(self, request: orchestrator_pb2.CloseRequest,
                    context: grpc.aio.ServicerContext) -> orchestrator_pb2.CloseResponse:
        return await _answer(context, request, lambda: self._episodes.close(request.session_id))

    async def CloseSessions(self, request: orchestrator_pb2.CloseSessionsRequest,
                            context: grpc.aio.ServicerContext) -> orchestrator_pb2.CloseSessionsResponse:
        async def run() -> orchestrator_pb2.CloseSessionsResponse:
            ids = await self._episodes.close_sessions(dict(request.labels), request.run_id)
            return orchestrator_pb2.CloseSessionsResponse(session_ids=ids)

        return await _answer(context, request, run)

    async def ListTasks(self, request: orchestrator_pb2.ListTasksRequest,
                        context: grpc.aio.ServicerContext) -> orchestrator_pb2.ListTasksResponse:
        async def run() -> orchestrator_pb2.ListTasksResponse:
            return self._episodes.list_tasks(request)

        return await _answer(context, request, run)

    async def ListSessions(self, request: orchestrator_pb2.ListSessionsRequest,
                           context: grpc.aio.ServicerContext) -> orchestrator_pb2.ListSessionsResponse:
        return await _answer(context, request, lambda: self._episodes.list_sessions(request))


__all__ = ["OrchestratorServicer"]
