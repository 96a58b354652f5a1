# ruff: noqa: ASYNC109  -- `timeout=` is the gRPC deadline of a call, as in grpc.aio itself
"""`Client` (blocking) and `AsyncClient` (asyncio) for the orchestrator and the toolgateway.

Both are thin shells over `rlgate.calls.Core`, which owns everything they share: settings (`rlgate.settings`), the
round-robin channel pools (`rlgate.channels`), request building (`rlgate.requests`; request ids are always
generated), metadata
(API key on the orchestrator, agent token on the gateway, the trace: `x-rlgate-trace-id` and, when an
OpenTelemetry span is current, its W3C `traceparent`; see `rlgate._tracing`) and the retry policy
(`rlgate.retry`). The shells differ only in how they call a stub and how they sleep; their methods have the
same explicit, typed parameters (tests/client/test_signatures.py keeps them so), so a misspelt keyword is a
type-check error and a TypeError before anything is sent. A value a request cannot hold (a label that is
not a string, a timeout that is not a number) is a TypeError or ValueError naming the parameter, never a
protobuf message about "bad argument type".

Sync channels are thread-safe: one `Client` serves every thread of a process (the SkyRL adapter shares one).
grpc.aio channels belong to the event loop that created them: use an `AsyncClient` on one loop."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, TypeVar, Unpack

import grpc

from rlgate._tracing import TRACE_HEADER as TRACE_HEADER  # re-exported: part of this module's API
from rlgate._tracing import new_trace_id as new_trace_id
from rlgate.calls import Core
from rlgate.channels import aio_channel, sync_channel
from rlgate.inputs import EpisodeSpec, ResetFields
from rlgate.protocol import DEFAULT_INSTRUCTIONS
from rlgate.requests import Call
from rlgate.retry import RetryPolicy
from rlgate.settings import ENV_API_KEY as ENV_API_KEY  # re-exported, as the `X as X` below: older imports
from rlgate.settings import ENV_ORCHESTRATOR as ENV_ORCHESTRATOR
from rlgate.settings import ClientSettings as ClientSettings
from rlgate.settings import Timeouts as Timeouts
from rlgate.settings import shown, split_addresses
from rlgate.v1 import (
    common_pb2,
    orchestrator_pb2,
    toolgateway_pb2,
)

if TYPE_CHECKING:
    from rlgate.episode import AsyncEpisode, Episode

R = TypeVar("R")


def _settings(
    settings: ClientSettings | None,
    *,
    api_key: str | None,
    tls: bool | None,
    root_certificates: bytes | None,
    gateway_addresses: str | Iterable[str] | None,
    retry: RetryPolicy | None,
    timeouts: Timeouts | None,
) -> ClientSettings:
    """`settings` (default: ClientSettings()) with every constructor argument that is not None applied."""
    given: dict[str, Any] = {
        "api_key": api_key,
        "tls": tls,
        "root_certificates": root_certificates,
        "gateway_addresses": None if gateway_addresses is None else split_addresses(gateway_addresses),
        "retry": retry,
        "timeouts": timeouts,
    }
    overrides = {k: v for k, v in given.items() if v is not None}
    base = settings if settings is not None else ClientSettings()
    if not isinstance(base, ClientSettings):
        raise TypeError(f"settings must be a rlgate.ClientSettings or None, not {shown(base)}")
    return replace(base, **overrides) if overrides else base


class Client:
    """Blocking client of the orchestrator and the toolgateway (one per process: it is thread-safe).

    Every call is one unary RPC per attempt, retried as `rlgate.retry` says within its `timeout=` (default:
    `Timeouts`), and raises an `rlgate.errors.RlgateError` for a failed status. `reset` and `step` return the
    protobuf responses; an `Episode` (`episode()`) wraps them in typed results and always closes its session.

    Args:
        addresses: the orchestrator's: "host:port", "a:1,b:2" or a list, used round-robin, a retry moving to
            the next.
        api_key: overrides `settings.api_key`.
        tls: overrides `settings.tls`.
        root_certificates: overrides `settings.root_certificates`.
        gateway_addresses: overrides `settings.gateway_addresses`.
        retry: overrides `settings.retry`.
        timeouts: overrides `settings.timeouts`.
        settings: the client's settings (default `ClientSettings()`, which reads no environment variable:
            `ClientSettings.from_env()` does).
        channel: one channel carrying every call of both services instead of dialling (a test's fake channel).
    """

    def __init__(
        self,
        addresses: str | Iterable[str],
        *,
        api_key: str | None = None,
        tls: bool | None = None,
        root_certificates: bytes | None = None,
        gateway_addresses: str | Iterable[str] | None = None,
        retry: RetryPolicy | None = None,
        timeouts: Timeouts | None = None,
        settings: ClientSettings | None = None,
        channel: grpc.Channel | None = None,
    ) -> None:
        self.settings: ClientSettings = _settings(
            settings,
            api_key=api_key,
            tls=tls,
            root_certificates=root_certificates,
            gateway_addresses=gateway_addresses,
            retry=retry,
            timeouts=timeouts,
        )
        factory = sync_channel if channel is None else lambda *_: channel
        self._core: Core[grpc.Channel] = Core(addresses, self.settings, factory)

    def _run(self, call: Call[grpc.Channel, R]) -> R:
        state = self._core.retry_state(call)
        while True:
            attempt_timeout = state.attempt_timeout()
            stub = call.pool.next_stub(call.stub)
            try:
                response: R = getattr(stub, call.method)(call.request, timeout=attempt_timeout, metadata=call.metadata)
                return response
            except grpc.RpcError as err:
                delay = state.on_error(err)
                self._core.note_retry(call, err)
            time.sleep(delay)

    def _pages(self, call: Call[grpc.Channel, Any]) -> list[Any]:
        items: list[Any] = []
        page_call: Call[grpc.Channel, Any] | None = call
        while page_call is not None:
            page = self._run(page_call)
            items.extend(page_call.items(page))
            page_call = page_call.next_page(page)
        return items

    # -- orchestrator
    def reset(
        self,
        spec: EpisodeSpec | None = None,
        /,
        *,
        request_id: str | None = None,
        trace_id: str | None = None,
        timeout: float | None = None,
        **fields: Unpack[ResetFields],
    ) -> orchestrator_pb2.ResetResponse:
        """Start an episode (Reset). Prefer `episode()`, which also closes the session.

        Args:
            spec: what to start; its fields may instead (or also) be given as keyword arguments.
            request_id: the idempotency key every attempt reuses (generated when None).
            trace_id: the call's `x-rlgate-trace-id` (a new one when None).
            timeout: the call's deadline in seconds, retries included (None: `Timeouts.reset`).
            **fields: `EpisodeSpec` fields (task_key, env_key, session_id, max_turns, labels, run_id),
                replacing the spec's.

        Returns:
            The ResetResponse.
        """
        return self._run(self._core.reset(EpisodeSpec.of(spec, fields), request_id, trace_id, timeout))

    def fork(
        self,
        session_id: str,
        count: int,
        *,
        request_id: str | None = None,
        trace_id: str | None = None,
        timeout: float | None = None,
    ) -> orchestrator_pb2.ForkResponse:
        """Branch the running episode of `session_id` into `count` new sessions that share its state (its
        instance's state, turn, task, labels and tool-call log), each with its own agent token.

        Args:
            session_id: The source session; its episode must be running, with no tool call in flight.
            count: How many branches (1 to the orchestrator's maximum, 16 by default).
            request_id: Makes retries safe (generated when None): a retry returns the same branches.
            trace_id: Carried into the orchestrator's log lines.
            timeout: Deadline of the whole call in seconds (None: the client's Reset timeout).

        Returns:
            The branches (session ids, agent tokens, tools). Every branch must be closed on its own;
            prefer `Episode.fork`, which wraps each in an episode."""
        return self._run(self._core.fork(session_id, count, trace_id, timeout, request_id=request_id))

    def step(
        self,
        session_id: str,
        *,
        assistant_text: str = "",
        tool_calls: Sequence[orchestrator_pb2.ToolCallSummary] = (),
        final_answer: str | None = None,
        done: bool = False,
        close_when_done: bool = False,
        request_id: str | None = None,
        trace_id: str | None = None,
        timeout: float | None = None,
    ) -> orchestrator_pb2.StepResponse:
        """Report one turn (Step): what the assistant wrote and the tool calls it made through the gateway.

        Args:
            session_id: the session.
            assistant_text: the assistant's text of the turn.
            tool_calls: the calls it made, in order.
            final_answer: the answer that ends the episode and is scored (even ""); None: no answer.
            done: end the episode without an answer.
            close_when_done: if this turn ends the episode, close the session with it (after scoring): the
                Close round trip saved, for a session that runs no further episode; the reply's status is
                then CLOSED.
            request_id: the idempotency key every attempt reuses (generated when None).
            trace_id: the call's trace id (a new one when None).
            timeout: the call's deadline in seconds (None: `Timeouts.step`).

        Returns:
            The StepResponse: whether the episode is over and, then, its reward and verification.
        """
        call = self._core.step(
            session_id,
            trace_id,
            timeout,
            assistant_text=assistant_text,
            tool_calls=tool_calls,
            final_answer=final_answer,
            done=done,
            request_id=request_id,
            close_when_done=close_when_done,
        )
        try:
            return self._run(call)
        except BaseException:
            self._core.give_back(call)  # the retries it reported go with the next Step instead
            raise

    def state(
        self,
        session_id: str,
        *,
        include_tool_calls: bool = False,
        tool_calls_page_size: int = 0,
        tool_calls_page_token: str = "",
        trace_id: str | None = None,
        timeout: float | None = None,
    ) -> orchestrator_pb2.StateResponse:
        """A session's status, turn, reward and verification; with `include_tool_calls`, one page of the
        gateway's tool-call log (`next_tool_calls_page_token` names the next; `tool_calls()` reads them all).

        Args:
            session_id: The session.
            include_tool_calls: Include a page of the current episode's tool-call log.
            tool_calls_page_size: Entries per page, 1..1000; 0 means 100. A page ends earlier once its entries
                reach the server's byte bound (4 MiB for rlgate).
            tool_calls_page_token: A previous reply's `next_tool_calls_page_token`; "" for the first page.
            trace_id: Trace id carried into the server's logs.
            timeout: Deadline in seconds (the client's default when None).
        """
        call = self._core.state(
            session_id, include_tool_calls, trace_id, timeout, tool_calls_page_size, tool_calls_page_token
        )
        return self._run(call)

    def tool_calls(
        self,
        session_id: str,
        *,
        page_size: int = 0,
        trace_id: str | None = None,
        timeout: float | None = None,
    ) -> list[orchestrator_pb2.ToolCallLogEntry]:
        """Every entry of the current episode's tool-call log, oldest first: all State pages.

        Args:
            session_id: The session.
            page_size: Entries per State page, 1..1000; 0 means 100.
            trace_id: Trace id carried into the server's logs.
            timeout: Deadline in seconds of each State call (the client's default when None).
        """
        return self._pages(self._core.tool_calls(session_id, page_size, trace_id, timeout))

    def close_session(
        self, session_id: str, *, trace_id: str | None = None, timeout: float | None = None
    ) -> orchestrator_pb2.CloseResponse:
        """Close a session: revoke its agent token and release its instance (Close).

        Idempotent: closing a closed or expired session succeeds and says `already_closed`.

        Args:
            session_id: the session.
            trace_id: the call's trace id (a new one when None).
            timeout: the call's deadline in seconds (None: `Timeouts.other`).
        """
        return self._run(self._core.close(session_id, trace_id, timeout))

    def close_sessions(
        self,
        *,
        labels: Mapping[str, str] | None = None,
        run_id: str = "",
        trace_id: str | None = None,
        timeout: float | None = None,
    ) -> list[str]:
        """Close every open session with all of `labels` and `run_id` (a crashed run's leftovers).

        Args:
            labels: the labels a session must carry, all of them.
            run_id: the run a session must belong to.
            trace_id: the call's trace id (a new one when None).
            timeout: the call's deadline in seconds (None: `Timeouts.other`).

        Returns:
            The ids of the sessions it closed.
        """
        return list(self._run(self._core.close_sessions(labels, run_id, trace_id, timeout)).session_ids)

    def list_tasks(
        self,
        env_key: str = "",
        *,
        include_reference_solution: bool = False,
        trace_id: str | None = None,
        timeout: float | None = None,
    ) -> list[common_pb2.TaskInfo]:
        """Every task, all pages.

        Args:
            env_key: only this environment's tasks, when given.
            include_reference_solution: fill `TaskInfo.reference_solution_json` (an answer key: for tests,
                demos and the reference policy).
            trace_id: the calls' trace id (a new one when None).
            timeout: each page's deadline in seconds (None: `Timeouts.other`).
        """
        return self._pages(self._core.list_tasks(env_key, include_reference_solution, trace_id, timeout))

    def list_sessions(
        self,
        *,
        status: common_pb2.SessionStatus = common_pb2.SESSION_STATUS_UNSPECIFIED,
        labels: Mapping[str, str] | None = None,
        run_id: str = "",
        trace_id: str | None = None,
        timeout: float | None = None,
    ) -> list[orchestrator_pb2.SessionInfo]:
        """Every session matching the filters (each applies when given), newest first, all pages.

        Args:
            status: only sessions in this status (UNSPECIFIED: any).
            labels: only sessions carrying all of these labels.
            run_id: only sessions of this run.
            trace_id: the calls' trace id (a new one when None).
            timeout: each page's deadline in seconds (None: `Timeouts.other`).
        """
        return self._pages(self._core.list_sessions(status, labels, run_id, trace_id, timeout))

    # -- gateway
    def list_tools(
        self,
        agent_token: str,
        *,
        gateway: str | None = None,
        trace_id: str | None = None,
        timeout: float | None = None,
    ) -> list[common_pb2.ToolSpec]:
        """The tools `agent_token`'s session may call (ListTools).

        Args:
            agent_token: the agent token Reset returned.
            gateway: the gateway ("host:port", Reset's gateway_address), unless the client has
                `gateway_addresses`.
            trace_id: the call's trace id (a new one when None).
            timeout: the call's deadline in seconds (None: `Timeouts.other`).
        """
        return list(self._run(self._core.list_tools(agent_token, gateway, trace_id, timeout)).tools)

    def call_tool(
        self,
        agent_token: str,
        name: str,
        arguments: Mapping[str, Any] | None = None,
        *,
        request_id: str | None = None,
        gateway: str | None = None,
        trace_id: str | None = None,
        timeout: float | None = None,
    ) -> toolgateway_pb2.CallToolResponse:
        """Call a tool (CallTool). Agent mistakes come back as `result.is_error`, not exceptions.

        Args:
            agent_token: the agent token Reset returned.
            name: the tool.
            arguments: its arguments (sent as exact JSON text); None: none.
            request_id: the idempotency key every retry reuses, so the tool runs once (generated when None).
            gateway: the gateway, as for `list_tools`.
            trace_id: the call's trace id (a new one when None).
            timeout: the call's deadline in seconds (None: `Timeouts.call_tool`).
        """
        return self._run(self._core.call_tool(agent_token, name, arguments, request_id, gateway, trace_id, timeout))

    # -- episodes
    def episode(
        self,
        spec: EpisodeSpec | None = None,
        /,
        *,
        trace_id: str | None = None,
        instructions: str = DEFAULT_INSTRUCTIONS,
        raise_on_verifier_error: bool = True,
        tool_timeout_s: float | None = None,
        close_when_done: bool = False,
        **fields: Unpack[ResetFields],
    ) -> Episode:
        """An `Episode` (not yet reset): `with client.episode(task_key=...) as ep:` resets on enter, closes on exit.

        Args:
            spec: what to start; its fields may instead (or also) be given as keyword arguments.
            trace_id: see `Episode`.
            instructions: see `Episode`.
            raise_on_verifier_error: see `Episode`.
            tool_timeout_s: see `Episode`.
            close_when_done: see `Episode`.
            **fields: `EpisodeSpec` fields, replacing the spec's.
        """
        from rlgate.episode import Episode

        return Episode(
            self,
            EpisodeSpec.of(spec, fields),
            trace_id=trace_id,
            instructions=instructions,
            raise_on_verifier_error=raise_on_verifier_error,
            tool_timeout_s=tool_timeout_s,
            close_when_done=close_when_done,
        )

    def close(self) -> None:
        """Close every channel the client opened (calls still in flight are cancelled)."""
        for channel in self._core.all_channels():
            channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncClient:
    """asyncio client with the same methods and parameters as `Client` (coroutines); use it on one loop.

    grpc.aio channels belong to the event loop that made them: one `AsyncClient` per loop.

    Args:
        addresses: see `Client`.
        api_key: see `Client`.
        tls: see `Client`.
        root_certificates: see `Client`.
        gateway_addresses: see `Client`.
        retry: see `Client`.
        timeouts: see `Client`.
        settings: see `Client`.
        channel: see `Client` (a `grpc.aio.Channel`).
    """

    def __init__(
        self,
        addresses: str | Iterable[str],
        *,
        api_key: str | None = None,
        tls: bool | None = None,
        root_certificates: bytes | None = None,
        gateway_addresses: str | Iterable[str] | None = None,
        retry: RetryPolicy | None = None,
        timeouts: Timeouts | None = None,
        settings: ClientSettings | None = None,
        channel: grpc.aio.Channel | None = None,
    ) -> None:
        self.settings: ClientSettings = _settings(
            settings,
            api_key=api_key,
            tls=tls,
            root_certificates=root_certificates,
            gateway_addresses=gateway_addresses,
            retry=retry,
            timeouts=timeouts,
        )
        factory = aio_channel if channel is None else lambda *_: channel
        self._core: Core[grpc.aio.Channel] = Core(addresses, self.settings, factory)

    async def _run(self, call: Call[grpc.aio.Channel, R]) -> R:
        state = self._core.retry_state(call)
        while True:
            attempt_timeout = state.attempt_timeout()
            stub = call.pool.next_stub(call.stub)
            try:
                response: R = await getattr(stub, call.method)(
                    call.request, timeout=attempt_timeout, metadata=call.metadata
                )
                return response
            except grpc.RpcError as err:
                delay = state.on_error(err)
                self._core.note_retry(call, err)
            await asyncio.sleep(delay)

    async def _pages(self, call: Call[grpc.aio.Channel, Any]) -> list[Any]:
        items: list[Any] = []
        page_call: Call[grpc.aio.Channel, Any] | None = call
        while page_call is not None:
            page = await self._run(page_call)
            items.extend(page_call.items(page))
            page_call = page_call.next_page(page)
        return items

    async def reset(
        self,
        spec: EpisodeSpec | None = None,
        /,
        *,
        request_id: str | None = None,
        trace_id: str | None = None,
        timeout: float | None = None,
        **fields: Unpack[ResetFields],
    ) -> orchestrator_pb2.ResetResponse:
        """Start an episode; see `Client.reset`.

        Args:
            spec: see `Client.reset`.
            request_id: see `Client.reset`.
            trace_id: see `Client.reset`.
            timeout: see `Client.reset`.
            **fields: see `Client.reset`.
        """
        return await self._run(self._core.reset(EpisodeSpec.of(spec, fields), request_id, trace_id, timeout))

    async def fork(
        self,
        session_id: str,
        count: int,
        *,
        request_id: str | None = None,
        trace_id: str | None = None,
        timeout: float | None = None,
    ) -> orchestrator_pb2.ForkResponse:
        """Branch a running episode into `count` sessions; see `Client.fork`.

        Args:
            session_id: The source session.
            count: How many branches.
            request_id: Makes retries safe (generated when None).
            trace_id: Carried into the orchestrator's log lines.
            timeout: Deadline of the whole call in seconds.

        Returns:
            The branches."""
        return await self._run(self._core.fork(session_id, count, trace_id, timeout, request_id=request_id))

    async def step(
        self,
        session_id: str,
        *,
        assistant_text: str = "",
        tool_calls: Sequence[orchestrator_pb2.ToolCallSummary] = (),
        final_answer: str | None = None,
        done: bool = False,
        close_when_done: bool = False,
        request_id: str | None = None,
        trace_id: str | None = None,
        timeout: float | None = None,
    ) -> orchestrator_pb2.StepResponse:
        """Report one turn; see `Client.step`.

        Args:
            session_id: see `Client.step`.
            assistant_text: see `Client.step`.
            tool_calls: see `Client.step`.
            final_answer: see `Client.step`.
            done: see `Client.step`.
            close_when_done: see `Client.step`.
            request_id: see `Client.step`.
            trace_id: see `Client.step`.
            timeout: see `Client.step`.
        """
        call = self._core.step(
            session_id,
            trace_id,
            timeout,
            assistant_text=assistant_text,
            tool_calls=tool_calls,
            final_answer=final_answer,
            done=done,
            request_id=request_id,
            close_when_done=close_when_done,
        )
        try:
            return await self._run(call)
        except BaseException:
            self._core.give_back(call)  # the retries it reported go with the next Step instead
            raise

    async def state(
        self,
        session_id: str,
        *,
        include_tool_calls: bool = False,
        tool_calls_page_size: int = 0,
        tool_calls_page_token: str = "",
        trace_id: str | None = None,
        timeout: float | None = None,
    ) -> orchestrator_pb2.StateResponse:
        """A session's state and a page of its tool-call log; see `Client.state`.

        Args:
            session_id: The session.
            include_tool_calls: Include a page of the current episode's tool-call log.
            tool_calls_page_size: Entries per page, 1..1000; 0 means 100.
            tool_calls_page_token: A previous reply's `next_tool_calls_page_token`; "" for the first page.
            trace_id: Trace id carried into the server's logs.
            timeout: Deadline in seconds (the client's default when None).
        """
        call = self._core.state(
            session_id, include_tool_calls, trace_id, timeout, tool_calls_page_size, tool_calls_page_token
        )
        return await self._run(call)

    async def tool_calls(
        self,
        session_id: str,
        *,
        page_size: int = 0,
        trace_id: str | None = None,
        timeout: float | None = None,
    ) -> list[orchestrator_pb2.ToolCallLogEntry]:
        """Every entry of the current episode's tool-call log, oldest first; see `Client.tool_calls`.

        Args:
            session_id: The session.
            page_size: Entries per State page, 1..1000; 0 means 100.
            trace_id: Trace id carried into the server's logs.
            timeout: Deadline in seconds of each State call (the client's default when None).
        """
        return await self._pages(self._core.tool_calls(session_id, page_size, trace_id, timeout))

    async def close_session(
        self, session_id: str, *, trace_id: str | None = None, timeout: float | None = None
    ) -> orchestrator_pb2.CloseResponse:
        """Close a session (idempotent); see `Client.close_session`.

        Args:
            session_id: see `Client.close_session`.
            trace_id: see `Client.close_session`.
            timeout: see `Client.close_session`.
        """
        return await self._run(self._core.close(session_id, trace_id, timeout))

    async def close_sessions(
        self,
        *,
        labels: Mapping[str, str] | None = None,
        run_id: str = "",
        trace_id: str | None = None,
        timeout: float | None = None,
    ) -> list[str]:
        """Close every open session matching; see `Client.close_sessions`.

        Args:
            labels: see `Client.close_sessions`.
            run_id: see `Client.close_sessions`.
            trace_id: see `Client.close_sessions`.
            timeout: see `Client.close_sessions`.
        """
        return list((await self._run(self._core.close_sessions(labels, run_id, trace_id, timeout))).session_ids)

    async def list_tasks(
        self,
        env_key: str = "",
        *,
        include_reference_solution: bool = False,
        trace_id: str | None = None,
        timeout: float | None = None,
    ) -> list[common_pb2.TaskInfo]:
        """Every task; see `Client.list_tasks`.

        Args:
            env_key: see `Client.list_tasks`.
            include_reference_solution: see `Client.list_tasks`.
            trace_id: see `Client.list_tasks`.
            timeout: see `Client.list_tasks`.
        """
        call = self._core.list_tasks(env_key, include_reference_solution, trace_id, timeout)
        return await self._pages(call)

    async def list_sessions(
        self,
        *,
        status: common_pb2.SessionStatus = common_pb2.SESSION_STATUS_UNSPECIFIED,
        labels: Mapping[str, str] | None = None,
        run_id: str = "",
        trace_id: str | None = None,
        timeout: float | None = None,
    ) -> list[orchestrator_pb2.SessionInfo]:
        """Every session matching; see `Client.list_sessions`.

        Args:
            status: see `Client.list_sessions`.
            labels: see `Client.list_sessions`.
            run_id: see `Client.list_sessions`.
            trace_id: see `Client.list_sessions`.
            timeout: see `Client.list_sessions`.
        """
        return await self._pages(self._core.list_sessions(status, labels, run_id, trace_id, timeout))

    async def list_tools(
        self,
        agent_token: str,
        *,
        gateway: str | None = None,
        trace_id: str | None = None,
        timeout: float | None = None,
    ) -> list[common_pb2.ToolSpec]:
        """The session's tools; see `Client.list_tools`.

        Args:
            agent_token: see `Client.list_tools`.
            gateway: see `Client.list_tools`.
            trace_id: see `Client.list_tools`.
            timeout: see `Client.list_tools`.
        """
        return list((await self._run(self._core.list_tools(agent_token, gateway, trace_id, timeout))).tools)

    async def call_tool(
        self,
        agent_token: str,
        name: str,
        arguments: Mapping[str, Any] | None = None,
        *,
        request_id: str | None = None,
        gateway: str | None = None,
        trace_id: str | None = None,
        timeout: float | None = None,
    ) -> toolgateway_pb2.CallToolResponse:
        """Call a tool; see `Client.call_tool`.

        Args:
            agent_token: see `Client.call_tool`.
            name: see `Client.call_tool`.
            arguments: see `Client.call_tool`.
            request_id: see `Client.call_tool`.
            gateway: see `Client.call_tool`.
            trace_id: see `Client.call_tool`.
            timeout: see `Client.call_tool`.
        """
        return await self._run(
            self._core.call_tool(agent_token, name, arguments, request_id, gateway, trace_id, timeout)
        )

    def episode(
        self,
        spec: EpisodeSpec | None = None,
        /,
        *,
        trace_id: str | None = None,
        instructions: str = DEFAULT_INSTRUCTIONS,
        raise_on_verifier_error: bool = True,
        tool_timeout_s: float | None = None,
        close_when_done: bool = False,
        **fields: Unpack[ResetFields],
    ) -> AsyncEpisode:
        """An `AsyncEpisode` (not yet reset): `async with client.episode(task_key=...) as ep:`.

        It resets on enter and always closes, also when the task is cancelled.

        Args:
            spec: see `Client.episode`.
            trace_id: see `Episode`.
            instructions: see `Episode`.
            raise_on_verifier_error: see `Episode`.
            tool_timeout_s: see `Episode`.
            close_when_done: see `Episode`.
            **fields: see `Client.episode`.
        """
        from rlgate.episode import AsyncEpisode

        return AsyncEpisode(
            self,
            EpisodeSpec.of(spec, fields),
            trace_id=trace_id,
            instructions=instructions,
            raise_on_verifier_error=raise_on_verifier_error,
            tool_timeout_s=tool_timeout_s,
            close_when_done=close_when_done,
        )

    async def close(self) -> None:
        """Close every channel; see `Client.close`."""
        for channel in self._core.all_channels():
            await channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
