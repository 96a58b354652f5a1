"""What `Client` and `AsyncClient` share: every RPC's request built and checked (`rlgate.requests`), its
metadata (API key on the orchestrator, agent token on the gateway, the trace), its deadline and its retry
state (`rlgate.retry`), as one `Call` the shells then run, blocking or awaited. Not public API: use the
clients."""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any, Generic, TypeVar

import grpc

from rlgate._tracing import TRACE_HEADER as TRACE_HEADER  # re-exported: part of this module's API
from rlgate._tracing import new_trace_id as new_trace_id
from rlgate._tracing import trace_metadata
from rlgate.channels import Pool
from rlgate.core.convert import InvalidJsonValue, json_text
from rlgate.core.faults import MAX_CLIENT_RETRIES
from rlgate.errors import InvalidArgument
from rlgate.inputs import EpisodeSpec
from rlgate.requests import PAGE_SIZE, Call, Paging, build, new_request_id, optional_text
from rlgate.retry import RetryState
from rlgate.settings import ENV_API_KEY as ENV_API_KEY  # re-exported, as the `X as X` below: older imports
from rlgate.settings import ENV_GATEWAY, shown, split_addresses
from rlgate.settings import ENV_ORCHESTRATOR as ENV_ORCHESTRATOR
from rlgate.settings import ClientSettings as ClientSettings
from rlgate.settings import Timeouts as Timeouts
from rlgate.v1 import (
    common_pb2,
    orchestrator_pb2,
    orchestrator_pb2_grpc,
    toolgateway_pb2,
    toolgateway_pb2_grpc,
)

C = TypeVar("C")
R = TypeVar("R")


MAX_RETRIED_SESSIONS = 10_000  # sessions whose retries the client counts at once (the oldest drop out)


def _session_of_token(token: str) -> str:
    """The session id an agent token names ("rlg1.<session_id>.<secret>"), "" for another form."""
    _, _, rest = token.partition(".")
    session_id, dot, _ = rest.rpartition(".")
    return session_id if dot else ""


class Core(Generic[C]):
    """State and logic shared by Client and AsyncClient: every public call is built here as a `Call`.

    `call` arguments name the public method (for error messages); the parameters are checked here, so both
    clients say the same thing about the same mistake."""

    def __init__(self, addresses: str | Iterable[str], settings: ClientSettings, factory: Callable[..., C]):
        self.settings = settings
        self._factory = factory
        self.orchestrator: Pool[C] = Pool(split_addresses(addresses), self._make_channel)
        self._gateways: dict[tuple[str, ...], Pool[C]] = {}
        self._lock = threading.Lock()
        # Session id -> calls of it retried after UNAVAILABLE since its last Step was built (an infrastructure
        # fault its next Step reports: StepRequest.client_retries). Bounded: the oldest sessions drop out.
        self._retried: dict[str, int] = {}

    def note_retry(self, call: Call[C, Any], err: grpc.RpcError) -> None:
        """A call is about to be retried after `err`: an UNAVAILABLE is counted for its session."""
        code = err.code() if callable(getattr(err, "code", None)) else None  # grpc.Call and AioRpcError
        if not call.session_id or code is not grpc.StatusCode.UNAVAILABLE:
            return
        with self._lock:
            self._retried[call.session_id] = self._retried.pop(call.session_id, 0) + 1
            if len(self._retried) > MAX_RETRIED_SESSIONS:
                del self._retried[next(iter(self._retried))]

    def give_back(self, call: Call[C, Any]) -> None:
        """A Step that failed: the retries it would have reported are counted for the next one (a Step that
        applied although its answer was lost makes them counted twice: more faults, never fewer)."""
        reported = call.request.client_retries
        if call.session_id and reported:
            with self._lock:
                self._retried[call.session_id] = self._retried.get(call.session_id, 0) + reported

    def take_retries(self, session_id: str) -> int:
        """The retries counted for `session_id` since the last call, reported once (capped at the proto's
        bound)."""
        with self._lock:
            return min(self._retried.pop(session_id, 0), MAX_CLIENT_RETRIES)

    def _make_channel(self, address: str) -> C:
        return self._factory(address, self.settings.credentials(), self.settings.channel_options())

    def gateway(self, address: str | None) -> Pool[C]:
        if self.settings.gateway_addresses:
            key = self.settings.gateway_addresses
        elif address:
            key = (address,)
        else:
            raise ValueError(
                "no toolgateway address: pass gateway='host:port' (the gateway_address Reset returned; an Episode "
                f"passes it for you) or set gateway_addresses (or {ENV_GATEWAY})"
            )
        with self._lock:
            pool = self._gateways.get(key)
            if pool is None:
                pool = self._gateways[key] = Pool(key, self._make_channel)
            return pool

    def all_channels(self) -> list[C]:
        channels = self.orchestrator.take_channels()
        with self._lock:
            pools, self._gateways = list(self._gateways.values()), {}
        for pool in pools:
            channels.extend(pool.take_channels())
        return channels

    def retry_state(self, call: Call[C, Any]) -> RetryState:
        return RetryState(method=call.method, policy=self.settings.retry, timeout=call.timeout, trace_id=call.trace_id)

    def _timeout(self, call: str, kind: str, given: float | None) -> float:
        default = float(getattr(self.settings.timeouts, kind))
        if given is None:
            return default
        if isinstance(given, bool) or not isinstance(given, int | float):
            raise TypeError(
                f"{call}(): timeout must be a number of seconds, or None for the client's default "
                f"(Timeouts.{kind} = {default:g} s), not {shown(given)}"
            )
        if not (math.isfinite(given) and given > 0):
            raise ValueError(
                f"{call}(): timeout must be a positive, finite number of seconds (the deadline of the whole call, "
                f"retries included), or None for the client's default (Timeouts.{kind} = {default:g} s), "
                f"not {given!r}"
            )
        return float(given)

    # -- orchestrator calls (API key as Bearer)
    def _orchestrator_call(
        self,
        call: str,
        method: str,
        request: Any,
        trace_id: str | None,
        timeout: float | None,
        kind: str = "other",
        session_id: str = "",
    ) -> Call[C, Any]:
        optional_text(call, "trace_id", trace_id)
        deadline = self._timeout(call, kind, timeout)
        trace_id, metadata = trace_metadata(trace_id)
        if self.settings.api_key:
            metadata.append(("authorization", f"Bearer {self.settings.api_key}"))
        return Call(
            self.orchestrator,
            orchestrator_pb2_grpc.OrchestratorServiceStub,
            method,
            request,
            metadata,
            deadline,
            trace_id,
            session_id=session_id,
        )

    def reset(
        self, spec: EpisodeSpec, request_id: str | None, trace_id: str | None, timeout: float | None
    ) -> Call[C, orchestrator_pb2.ResetResponse]:
        optional_text("reset", "request_id", request_id)
        request = build(
            orchestrator_pb2.ResetRequest,
            "reset",
            request_id=request_id or new_request_id(),
            **spec.request_fields(),
        )
        return self._orchestrator_call("reset", "Reset", request, trace_id, timeout, "reset")

    def fork(
        self, session_id: str, count: int, trace_id: str | None, timeout: float | None, *, request_id: str | None
    ) -> Call[C, orchestrator_pb2.ForkResponse]:
        request = build(
            orchestrator_pb2.ForkRequest,
            "fork",
            request_id=request_id or new_request_id(),
            session_id=session_id,
            count=count,
        )
        return self._orchestrator_call("fork", "Fork", request, trace_id, timeout, "reset")

    def step(
        self,
        session_id: str,
        trace_id: str | None,
        timeout: float | None,
        *,
        assistant_text: str,
        tool_calls: Sequence[orchestrator_pb2.ToolCallSummary],
        final_answer: str | None,
        done: bool,
        request_id: str | None,
        close_when_done: bool = False,
    ) -> Call[C, orchestrator_pb2.StepResponse]:
        request = build(
            orchestrator_pb2.StepRequest,
            "step",
            request_id=request_id or new_request_id(),
            session_id=session_id,
            assistant_text=assistant_text,
            tool_calls=tool_calls,
            final_answer=final_answer,  # None leaves it unset: no answer, the episode goes on
            done=done,
            close_when_done=close_when_done,
            client_retries=self.take_retries(session_id) if isinstance(session_id, str) else 0,
        )
        return self._orchestrator_call("step", "Step", request, trace_id, timeout, "step", session_id)

    def state(
        self,
        session_id: str,
        include_tool_calls: bool,
        trace_id: str | None,
        timeout: float | None,
        page_size: int = 0,
        page_token: str = "",
    ) -> Call[C, orchestrator_pb2.StateResponse]:
        request = build(
            orchestrator_pb2.StateRequest,
            "state",
            session_id=session_id,
            include_tool_calls=include_tool_calls,
            tool_calls_page_size=page_size,
            tool_calls_page_token=page_token,
        )
        return self._orchestrator_call("state", "State", request, trace_id, timeout, session_id=session_id)

    def tool_calls(
        self, session_id: str, page_size: int, trace_id: str | None, timeout: float | None
    ) -> Call[C, orchestrator_pb2.StateResponse]:
        """State read page by page for the current episode's tool-call log."""
        first = self.state(session_id, True, trace_id, timeout, page_size=page_size)
        return replace(first, paging=Paging("tool_calls", "tool_calls_page_token", "next_tool_calls_page_token"))

    def close(
        self, session_id: str, trace_id: str | None, timeout: float | None
    ) -> Call[C, orchestrator_pb2.CloseResponse]:
        request = build(orchestrator_pb2.CloseRequest, "close_session", session_id=session_id)
        return self._orchestrator_call("close_session", "Close", request, trace_id, timeout)

    def close_sessions(
        self, labels: Mapping[str, str] | None, run_id: str, trace_id: str | None, timeout: float | None
    ) -> Call[C, orchestrator_pb2.CloseSessionsResponse]:
        if not labels and not run_id:
            raise ValueError(
                "close_sessions(): pass labels= and/or run_id= to say which sessions to close; the orchestrator "
                "refuses a CloseSessions without a filter (INVALID_ARGUMENT)"
            )
        request = build(orchestrator_pb2.CloseSessionsRequest, "close_sessions", labels=labels, run_id=run_id)
        return self._orchestrator_call("close_sessions", "CloseSessions", request, trace_id, timeout)

    def list_tasks(
        self, env_key: str, include_reference_solution: bool, trace_id: str | None, timeout: float | None
    ) -> Call[C, orchestrator_pb2.ListTasksResponse]:
        request = build(
            orchestrator_pb2.ListTasksRequest,
            "list_tasks",
            env_key=env_key,
            page_size=PAGE_SIZE,
            include_reference_solution=include_reference_solution,
        )
        return replace(
            self._orchestrator_call("list_tasks", "ListTasks", request, trace_id, timeout), paging=Paging("tasks")
        )

    def list_sessions(
        self,
        status: common_pb2.SessionStatus,
        labels: Mapping[str, str] | None,
        run_id: str,
        trace_id: str | None,
        timeout: float | None,
    ) -> Call[C, orchestrator_pb2.ListSessionsResponse]:
        request = build(
            orchestrator_pb2.ListSessionsRequest,
            "list_sessions",
            status=status,
            labels=labels,
            run_id=run_id,
            page_size=PAGE_SIZE,
        )
        return replace(
            self._orchestrator_call("list_sessions", "ListSessions", request, trace_id, timeout),
            paging=Paging("sessions"),
        )

    # -- gateway calls (agent token as Bearer)
    def _gateway_call(
        self,
        call: str,
        gateway: str | None,
        agent_token: str,
        method: str,
        request: Any,
        trace_id: str | None,
        timeout: float,
    ) -> Call[C, Any]:
        if not isinstance(agent_token, str) or not agent_token:
            error = ValueError if isinstance(agent_token, str) else TypeError
            raise error(
                f"{call}(): agent_token must be the agent_token Reset returned (a non-empty str), "
                f"not {shown(agent_token)}"
            )
        optional_text(call, "gateway", gateway)
        optional_text(call, "trace_id", trace_id)
        trace_id, metadata = trace_metadata(trace_id)
        metadata.append(("authorization", f"Bearer {agent_token}"))
        return Call(
            self.gateway(gateway),
            toolgateway_pb2_grpc.ToolGatewayServiceStub,
            method,
            request,
            metadata,
            timeout,
            trace_id,
            session_id=_session_of_token(agent_token),
        )

    def list_tools(
        self, agent_token: str, gateway: str | None, trace_id: str | None, timeout: float | None
    ) -> Call[C, toolgateway_pb2.ListToolsResponse]:
        request = toolgateway_pb2.ListToolsRequest()
        deadline = self._timeout("list_tools", "other", timeout)
        return self._gateway_call("list_tools", gateway, agent_token, "ListTools", request, trace_id, deadline)

    def call_tool(
        self,
        agent_token: str,
        name: str,
        arguments: Mapping[str, Any] | None,
        request_id: str | None,
        gateway: str | None,
        trace_id: str | None,
        timeout: float | None,
    ) -> Call[C, toolgateway_pb2.CallToolResponse]:
        if arguments is not None and not isinstance(arguments, Mapping):
            raise InvalidArgument(
                f"call_tool(): arguments of tool {name!r} must be a mapping (a JSON object such as {{'x': 1}}) "
                f"or None for no arguments, not {shown(arguments)}"
            )
        try:
            # JSON text, not a Struct: integers reach the tool exactly (a Struct would make 3 a double).
            text = json_text(dict(arguments or {}))
        except InvalidJsonValue as exc:  # undeliverable arguments: the caller's mistake, not a crash
            raise InvalidArgument(
                f"call_tool(): arguments of tool {name!r} cannot be sent as JSON: {exc}; nothing was sent"
            ) from exc
        request = build(
            toolgateway_pb2.CallToolRequest,
            "call_tool",
            request_id=request_id or new_request_id(),
            name=name,
            arguments_json=text,
        )
        deadline = self._timeout("call_tool", "call_tool", timeout)
        return self._gateway_call("call_tool", gateway, agent_token, "CallTool", request, trace_id, deadline)
