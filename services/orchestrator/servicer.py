"""gRPC handlers: check every request's ids (`limits.check_request`), translate requests into
`Episodes` calls and `RlgateError`s into statuses with google.rpc details, and name the caller whose
request ids a Reset or Step uses (the API key's hash). No orchestration logic lives here."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

import grpc
from google.protobuf.message import Message
from google.rpc import status_pb2
from grpc_status import rpc_status

from rlgate.core.errors import MAX_MESSAGE, RlgateError, clip
from rlgate.orchestrator.config import OrchestratorConfig
from rlgate.orchestrator.episodes import Episodes
from rlgate.orchestrator.forks import ForkParams
from rlgate.orchestrator.limits import check_request
from rlgate.orchestrator.resets import ResetParams
from rlgate.runtime.auth import bearer_token, token_hash
from rlgate.runtime.deadline import Deadline
from rlgate.store import StoreError
from rlgate.v1 import orchestrator_pb2, orchestrator_pb2_grpc

log = logging.getLogger(__name__)
T = TypeVar("T")


def error_status(exc: Exception) -> status_pb2.Status | None:
    """The status an RPC ends with for an expected exception (None: a bug, answered INTERNAL)."""
    if isinstance(exc, RlgateError):
        return exc.to_status()
    if isinstance(exc, StoreError):
        log.warning("store unavailable: %s", exc)
        return status_pb2.Status(
            code=grpc.StatusCode.UNAVAILABLE.value[0], message=clip(f"session store unavailable: {exc}", MAX_MESSAGE)
        )
    return None


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
    def __init__(self, config: OrchestratorConfig, episodes: Episodes) -> None:
        self._config = config
        self._episodes = episodes

    def _deadline(self, context: grpc.aio.ServicerContext) -> Deadline:
        default = self._config.provision_timeout_s + self._config.capacity_wait_s
        return Deadline.from_grpc(context.time_remaining(), default)

    def _caller(self, context: grpc.aio.ServicerContext) -> str:
        """Whose request ids these are: the hash of the API key that authenticated the call (the
        the ApiKeys layer checked it), or "" when no keys are configured (one anonymous caller)."""
        if not self._config.api_keys:
            return ""
        key = bearer_token(context.invocation_metadata())
        return token_hash(key) if key else ""

    async def Reset(
        self, request: orchestrator_pb2.ResetRequest, context: grpc.aio.ServicerContext
    ) -> orchestrator_pb2.ResetResponse:
        params = ResetParams(
            request_id=request.request_id,
            session_id=request.session_id,
            task_key=request.task_key,
            env_key=request.env_key,
            max_turns=request.max_turns,
            labels=dict(request.labels),
            run_id=request.run_id,
            caller=self._caller(context),
        )
        return await _answer(context, request, lambda: self._episodes.resets.reset(params, self._deadline(context)))

    async def Fork(
        self, request: orchestrator_pb2.ForkRequest, context: grpc.aio.ServicerContext
    ) -> orchestrator_pb2.ForkResponse:
        params = ForkParams(
            request_id=request.request_id,
            session_id=request.session_id,
            count=request.count,
            mechanism=request.mechanism,
            caller=self._caller(context),
        )
        return await _answer(context, request, lambda: self._episodes.forks.fork(params, self._deadline(context)))

    async def Step(
        self, request: orchestrator_pb2.StepRequest, context: grpc.aio.ServicerContext
    ) -> orchestrator_pb2.StepResponse:
        return await _answer(
            context, request, lambda: self._episodes.steps.step(request, self._deadline(context), self._caller(context))
        )

    async def State(
        self, request: orchestrator_pb2.StateRequest, context: grpc.aio.ServicerContext
    ) -> orchestrator_pb2.StateResponse:
        return await _answer(context, request, lambda: self._episodes.queries.state(request))

    async def Close(
        self, request: orchestrator_pb2.CloseRequest, context: grpc.aio.ServicerContext
    ) -> orchestrator_pb2.CloseResponse:
        return await _answer(context, request, lambda: self._episodes.closing.close(request.session_id))

    async def CloseSessions(
        self, request: orchestrator_pb2.CloseSessionsRequest, context: grpc.aio.ServicerContext
    ) -> orchestrator_pb2.CloseSessionsResponse:
        async def run() -> orchestrator_pb2.CloseSessionsResponse:
            ids = await self._episodes.closing.close_sessions(dict(request.labels), request.run_id)
            return orchestrator_pb2.CloseSessionsResponse(session_ids=ids)

        return await _answer(context, request, run)

    async def ListTasks(
        self, request: orchestrator_pb2.ListTasksRequest, context: grpc.aio.ServicerContext
    ) -> orchestrator_pb2.ListTasksResponse:
        async def run() -> orchestrator_pb2.ListTasksResponse:
            return self._episodes.queries.list_tasks(request)

        return await _answer(context, request, run)

    async def ListSessions(
        self, request: orchestrator_pb2.ListSessionsRequest, context: grpc.aio.ServicerContext
    ) -> orchestrator_pb2.ListSessionsResponse:
        return await _answer(context, request, lambda: self._episodes.queries.list_sessions(request))


__all__ = ["OrchestratorServicer"]
