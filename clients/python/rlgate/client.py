# ruff: noqa: ASYNC109  -- `timeout=` is the gRPC deadline of a call, as in grpc.aio itself
"""`Client` (blocking) and `AsyncClient` (asyncio) for the orchestrator and the toolgateway.

Both are thin shells over `_Core`, which owns everything they share: settings, channel options and
credentials, round-robin address pools, request building (request ids are always generated), metadata
(API key on the orchestrator, agent token on the gateway, the trace: `x-rlgate-trace-id` and, when an
OpenTelemetry span is current, its W3C `traceparent`; see `rlgate._tracing`) and the retry policy
(`rlgate.retry`). The shells differ only in how they call a stub and how they sleep.

Sync channels are thread-safe: one `Client` serves every thread of a process (the SkyRL adapter shares one).
grpc.aio channels belong to the event loop that created them: use an `AsyncClient` on one loop."""

from __future__ import annotations

import asyncio
import itertools
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import grpc

from rlgate._tracing import TRACE_HEADER, trace_metadata
from rlgate._tracing import new_trace_id as new_trace_id  # re-exported: part of this module's API
from rlgate.convert import InvalidJsonValue, json_text
from rlgate.errors import InvalidArgument
from rlgate.retry import RetryPolicy, RetryState
from rlgate.v1 import (
    common_pb2,
    orchestrator_pb2,
    orchestrator_pb2_grpc,
    toolgateway_pb2,
    toolgateway_pb2_grpc,
)

if TYPE_CHECKING:
    from rlgate.episode import AsyncEpisode, Episode

ENV_ORCHESTRATOR = "RLGATE_ORCHESTRATOR"
ENV_API_KEY = "RLGATE_API_KEY"
ENV_GATEWAY = "RLGATE_GATEWAY"
ENV_ROOT_CERTS = "RLGATE_TLS_ROOT_CERTS"
PAGE_SIZE = 1000

C = TypeVar("C")


def new_request_id() -> str:
    return uuid.uuid4().hex


def split_addresses(addresses: str | Iterable[str]) -> tuple[str, ...]:
    """`"a:1,b:2"` or `["a:1", "b:2"]` -> `("a:1", "b:2")`."""
    items = addresses.split(",") if isinstance(addresses, str) else list(addresses)
    out = tuple(a.strip() for a in items if a and a.strip())
    if not out:
        raise ValueError("at least one address (host:port) is required")
    return out


@dataclass(frozen=True)
class Timeouts:
    """Default deadline of each logical call (all attempts and backoff included), in seconds."""

    reset: float = 600.0  # provisioning may queue behind an instance limit
    step: float = 300.0  # the final step runs the verifier
    call_tool: float = 120.0
    other: float = 30.0


@dataclass(frozen=True)
class ClientSettings:
    """Everything a client needs besides its addresses. Immutable and picklable (adapters ship it)."""

    api_key: str | None = None
    # TLS: `tls=True` uses the system roots unless `root_certificates` (PEM bytes) is given.
    tls: bool = False
    root_certificates: bytes | None = None
    tls_server_name: str | None = None
    # Gateway addresses to use instead of the one Reset returns (e.g. a load-balanced name).
    gateway_addresses: tuple[str, ...] = ()
    keepalive_time_s: float = 30.0
    keepalive_timeout_s: float = 10.0
    max_send_message_bytes: int = 16 * 1024 * 1024
    max_receive_message_bytes: int = 64 * 1024 * 1024
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    timeouts: Timeouts = field(default_factory=Timeouts)

    @classmethod
    def from_env(cls, **overrides: Any) -> ClientSettings:
        """Settings from RLGATE_API_KEY, RLGATE_GATEWAY and RLGATE_TLS_ROOT_CERTS (a PEM file path)."""
        values: dict[str, Any] = {}
        if os.environ.get(ENV_API_KEY):
            values["api_key"] = os.environ[ENV_API_KEY]
        if os.environ.get(ENV_GATEWAY):
            values["gateway_addresses"] = split_addresses(os.environ[ENV_GATEWAY])
        certs = os.environ.get(ENV_ROOT_CERTS)
        if certs:
            with open(certs, "rb") as fh:
                values["root_certificates"] = fh.read()
            values["tls"] = True
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)

    def channel_options(self) -> list[tuple[str, Any]]:
        options: list[tuple[str, Any]] = [
            ("grpc.keepalive_time_ms", int(self.keepalive_time_s * 1000)),
            ("grpc.keepalive_timeout_ms", int(self.keepalive_timeout_s * 1000)),
            ("grpc.keepalive_permit_without_calls", 0),
            ("grpc.max_send_message_length", self.max_send_message_bytes),
            ("grpc.max_receive_message_length", self.max_receive_message_bytes),
            # Our own retry loop decides (with request ids); gRPC's transparent retries stay on.
            ("grpc.enable_retries", 1),
            # A DNS name with several addresses (a Kubernetes headless Service) spreads calls over all pods.
            ("grpc.lb_policy_name", "round_robin"),
            # By default gRPC shares connections, and their reconnect backoff, between every channel of the
            # process to one address: a client made after a server restarted on that address would inherit
            # an old channel's "connection refused" for up to a second without trying to connect.
            ("grpc.use_local_subchannel_pool", 1),
        ]
        if self.tls_server_name:
            options.append(("grpc.ssl_target_name_override", self.tls_server_name))
        return options

    def credentials(self) -> grpc.ChannelCredentials | None:
        if not self.tls and self.root_certificates is None:
            return None
        return grpc.ssl_channel_credentials(root_certificates=self.root_certificates)


class _Pool(Generic[C]):
    """Round-robin over one channel per address; channels (and their stubs) are made on first use."""

    def __init__(self, addresses: Sequence[str], factory: Callable[[str], C]) -> None:
        self.addresses = tuple(addresses)
        self._factory = factory
        self._channels: dict[str, C] = {}
        # A stub builds a callable per RPC of its service: built once per channel, not once per call.
        self._stubs: dict[tuple[str, type], Any] = {}
        self._counter = itertools.count()
        self._lock = threading.Lock()

    def _channel(self, address: str) -> C:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = self._factory(address)
        return channel

    def next_stub(self, stub_class: type) -> Any:
        """A `stub_class` stub on the next channel in turn (one stub per channel and class)."""
        with self._lock:
            address = self.addresses[next(self._counter) % len(self.addresses)]
            stub = self._stubs.get((address, stub_class))
            if stub is None:
                stub = self._stubs[(address, stub_class)] = stub_class(self._channel(address))
            return stub

    def take_channels(self) -> list[C]:
        with self._lock:
            channels, self._channels = list(self._channels.values()), {}
            self._stubs.clear()
            return channels


@dataclass(frozen=True)
class _Call(Generic[C]):
    """One logical RPC, fully built: where it goes, what it sends, how long it may take."""

    pool: _Pool[C]
    stub: Any
    method: str
    request: Any
    metadata: list[tuple[str, str]]
    timeout: float

    def next_page(self, token: str) -> _Call[C]:
        request = type(self.request)()
        request.CopyFrom(self.request)
        request.page_token = token
        return replace(self, request=request)


class _Core(Generic[C]):
    """State and logic shared by Client and AsyncClient: every public call is built here as a `_Call`."""

    def __init__(self, addresses: str | Iterable[str], settings: ClientSettings, factory: Callable[..., C]):
        self.settings = settings
        self._factory = factory
        self.orchestrator: _Pool[C] = _Pool(split_addresses(addresses), self._make_channel)
        self._gateways: dict[tuple[str, ...], _Pool[C]] = {}
        self._lock = threading.Lock()

    def _make_channel(self, address: str) -> C:
        return self._factory(address, self.settings.credentials(), self.settings.channel_options())

    def gateway(self, address: str | None) -> _Pool[C]:
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
                pool = self._gateways[key] = _Pool(key, self._make_channel)
            return pool

    def all_channels(self) -> list[C]:
        channels = self.orchestrator.take_channels()
        with self._lock:
            pools, self._gateways = list(self._gateways.values()), {}
        for pool in pools:
            channels.extend(pool.take_channels())
        return channels

    def retry_state(self, call: _Call[C]) -> RetryState:
        trace_id = dict(call.metadata).get(TRACE_HEADER)
        return RetryState(method=call.method, policy=self.settings.retry, timeout=call.timeout, trace_id=trace_id)

    def _timeout(self, kind: str, given: float | None) -> float:
        if given is not None:
            return given
        return float(getattr(self.settings.timeouts, kind))

    # -- orchestrator calls (API key as Bearer)
    def _orchestrator_call(
        self, method: str, request: Any, trace_id: str | None, timeout: float | None, kind: str = "other"
    ) -> _Call[C]:
        metadata = trace_metadata(trace_id)
        if self.settings.api_key:
            metadata.append(("authorization", f"Bearer {self.settings.api_key}"))
        return _Call(
            self.orchestrator,
            orchestrator_pb2_grpc.OrchestratorServiceStub,
            method,
            request,
            metadata,
            self._timeout(kind, timeout),
        )

    def reset(
        self,
        trace_id: str | None,
        timeout: float | None,
        *,
        task_key: str = "",
        env_key: str = "",
        session_id: str = "",
        max_turns: int = 0,
        labels: Mapping[str, str] | None = None,
        run_id: str = "",
        request_id: str | None = None,
    ) -> _Call[C]:
        request = orchestrator_pb2.ResetRequest(
            request_id=request_id or new_request_id(),
            task_key=task_key or "",
            env_key=env_key or "",
            session_id=session_id or "",
            max_turns=int(max_turns or 0),
            labels=dict(labels or {}),
            run_id=run_id or "",
        )
        return self._orchestrator_call("Reset", request, trace_id, timeout, "reset")

    def step(
        self,
        session_id: str,
        trace_id: str | None,
        timeout: float | None,
        *,
        assistant_text: str = "",
        tool_calls: Sequence[orchestrator_pb2.ToolCallSummary] = (),
        final_answer: str | None = None,
        done: bool = False,
        request_id: str | None = None,
    ) -> _Call[C]:
        request = orchestrator_pb2.StepRequest(
            request_id=request_id or new_request_id(),
            session_id=session_id,
            assistant_text=assistant_text,
            tool_calls=list(tool_calls),
            done=done,
        )
        if final_answer is not None:
            request.final_answer = final_answer
        return self._orchestrator_call("Step", request, trace_id, timeout, "step")

    def state(self, session_id: str, include_tool_calls: bool, trace_id: str | None, timeout: float | None) -> _Call[C]:
        request = orchestrator_pb2.StateRequest(session_id=session_id, include_tool_calls=include_tool_calls)
        return self._orchestrator_call("State", request, trace_id, timeout)

    def close(self, session_id: str, trace_id: str | None, timeout: float | None) -> _Call[C]:
        return self._orchestrator_call("Close", orchestrator_pb2.CloseRequest(session_id=session_id), trace_id, timeout)

    def close_sessions(self, labels: Mapping[str, str] | None, run_id: str, timeout: float | None) -> _Call[C]:
        request = orchestrator_pb2.CloseSessionsRequest(labels=dict(labels or {}), run_id=run_id)
        return self._orchestrator_call("CloseSessions", request, None, timeout)

    def list_tasks(self, env_key: str, include_reference_solution: bool, timeout: float | None) -> _Call[C]:
        request = orchestrator_pb2.ListTasksRequest(
            env_key=env_key, page_size=PAGE_SIZE, include_reference_solution=include_reference_solution
        )
        return self._orchestrator_call("ListTasks", request, None, timeout)

    def list_sessions(
        self, status: int, labels: Mapping[str, str] | None, run_id: str, timeout: float | None
    ) -> _Call[C]:
        request = orchestrator_pb2.ListSessionsRequest(
            status=status, labels=dict(labels or {}), run_id=run_id, page_size=PAGE_SIZE
        )
        return self._orchestrator_call("ListSessions", request, None, timeout)

    # -- gateway calls (agent token as Bearer)
    def _gateway_call(
        self, gateway: str | None, agent_token: str, method: str, request: Any, trace_id: str | None, timeout: float
    ) -> _Call[C]:
        metadata = [*trace_metadata(trace_id), ("authorization", f"Bearer {agent_token}")]
        return _Call(
            self.gateway(gateway), toolgateway_pb2_grpc.ToolGatewayServiceStub, method, request, metadata, timeout
        )

    def list_tools(
        self, agent_token: str, gateway: str | None, trace_id: str | None, timeout: float | None
    ) -> _Call[C]:
        request = toolgateway_pb2.ListToolsRequest()
        return self._gateway_call(gateway, agent_token, "ListTools", request, trace_id, self._timeout("other", timeout))

    def call_tool(
        self,
        agent_token: str,
        name: str,
        arguments: Mapping[str, Any] | None,
        request_id: str | None,
        gateway: str | None,
        trace_id: str | None,
        timeout: float | None,
    ) -> _Call[C]:
        if arguments is not None and not isinstance(arguments, Mapping):
            raise InvalidArgument(
                f"arguments of {name!r} must be a mapping (a JSON object), not {type(arguments).__name__}"
            )
        try:
            # JSON text, not a Struct: integers reach the tool exactly (a Struct would make 3 a double).
            text = json_text(dict(arguments or {}))
        except InvalidJsonValue as exc:  # undeliverable arguments: the caller's mistake, not a crash
            raise InvalidArgument(f"arguments of {name!r}: {exc}") from exc
        request = toolgateway_pb2.CallToolRequest(
            request_id=request_id or new_request_id(), name=name, arguments_json=text
        )
        return self._gateway_call(
            gateway, agent_token, "CallTool", request, trace_id, self._timeout("call_tool", timeout)
        )


def _sync_channel(address: str, creds: grpc.ChannelCredentials | None, options: list[Any]) -> grpc.Channel:
    if creds is None:
        return grpc.insecure_channel(address, options=options)
    return grpc.secure_channel(address, creds, options=options)


def _aio_channel(address: str, creds: grpc.ChannelCredentials | None, options: list[Any]) -> grpc.aio.Channel:
    if creds is None:
        return grpc.aio.insecure_channel(address, options=options)
    return grpc.aio.secure_channel(address, creds, options=options)


def _settings(settings: ClientSettings | None, overrides: dict[str, Any]) -> ClientSettings:
    base = settings or ClientSettings()
    given = {k: v for k, v in overrides.items() if v is not None}
    if "gateway_addresses" in given:
        given["gateway_addresses"] = split_addresses(given["gateway_addresses"])
    return replace(base, **given) if given else base


_COMMON_ARGS = ("api_key", "tls", "root_certificates", "gateway_addresses", "retry", "timeouts")


class Client:
    """Blocking client. `addresses`: "host:port", "a:1,b:2" or a list (round-robin, failover on retry)."""

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
        given = (api_key, tls, root_certificates, gateway_addresses, retry, timeouts)
        self.settings = _settings(settings, dict(zip(_COMMON_ARGS, given, strict=True)))
        # `channel`: every call of both services on this one channel instead of dialling (a test's fake channel).
        factory = _sync_channel if channel is None else lambda *_: channel
        self._core: _Core[grpc.Channel] = _Core(addresses, self.settings, factory)

    def _run(self, call: _Call[grpc.Channel]) -> Any:
        state = self._core.retry_state(call)
        while True:
            attempt_timeout = state.attempt_timeout()
            stub = call.pool.next_stub(call.stub)
            try:
                return getattr(stub, call.method)(call.request, timeout=attempt_timeout, metadata=call.metadata)
            except grpc.RpcError as err:
                delay = state.on_error(err)
            time.sleep(delay)

    def _pages(self, call: _Call[grpc.Channel], field: str) -> list[Any]:
        items: list[Any] = []
        while True:
            page = self._run(call)
            items.extend(getattr(page, field))
            if not page.next_page_token:
                return items
            call = call.next_page(page.next_page_token)

    # -- orchestrator
    def reset(
        self, *, trace_id: str | None = None, timeout: float | None = None, **fields: Any
    ) -> orchestrator_pb2.ResetResponse:
        """Start an episode: task_key= (or env_key=, or session_id=), max_turns=, labels=, run_id=."""
        return self._run(self._core.reset(trace_id, timeout, **fields))

    def step(
        self, session_id: str, *, trace_id: str | None = None, timeout: float | None = None, **fields: Any
    ) -> orchestrator_pb2.StepResponse:
        """Record a turn: assistant_text=, tool_calls=[ToolCallSummary], final_answer=, done=."""
        return self._run(self._core.step(session_id, trace_id, timeout, **fields))

    def state(
        self, session_id: str, *, include_tool_calls: bool = False, trace_id: str | None = None,
        timeout: float | None = None,
    ) -> orchestrator_pb2.StateResponse:  # fmt: skip
        return self._run(self._core.state(session_id, include_tool_calls, trace_id, timeout))

    def close_session(
        self, session_id: str, *, trace_id: str | None = None, timeout: float | None = None
    ) -> orchestrator_pb2.CloseResponse:
        return self._run(self._core.close(session_id, trace_id, timeout))

    def close_sessions(
        self, *, labels: Mapping[str, str] | None = None, run_id: str = "", timeout: float | None = None
    ) -> list[str]:
        return list(self._run(self._core.close_sessions(labels, run_id, timeout)).session_ids)

    def list_tasks(
        self, env_key: str = "", *, include_reference_solution: bool = False, timeout: float | None = None
    ) -> list[common_pb2.TaskInfo]:
        """Every task (of `env_key`, when given). `include_reference_solution` fills
        `TaskInfo.reference_solution_json` (an answer key: for tests, demos and the reference policy)."""
        return self._pages(self._core.list_tasks(env_key, include_reference_solution, timeout), "tasks")

    def list_sessions(
        self, *, status: int = 0, labels: Mapping[str, str] | None = None, run_id: str = "",
        timeout: float | None = None,
    ) -> list[orchestrator_pb2.SessionInfo]:  # fmt: skip
        return self._pages(self._core.list_sessions(status, labels, run_id, timeout), "sessions")

    # -- gateway
    def list_tools(
        self, agent_token: str, *, gateway: str | None = None, trace_id: str | None = None,
        timeout: float | None = None,
    ) -> list[common_pb2.ToolSpec]:  # fmt: skip
        return list(self._run(self._core.list_tools(agent_token, gateway, trace_id, timeout)).tools)

    def call_tool(
        self, agent_token: str, name: str, arguments: Mapping[str, Any] | None = None, *,
        request_id: str | None = None, gateway: str | None = None, trace_id: str | None = None,
        timeout: float | None = None,
    ) -> toolgateway_pb2.CallToolResponse:  # fmt: skip
        """Call a tool. Agent mistakes come back as `result.is_error`; retries reuse one request_id."""
        return self._run(self._core.call_tool(agent_token, name, arguments, request_id, gateway, trace_id, timeout))

    # -- episodes
    def episode(self, **reset_fields: Any) -> Episode:
        """An Episode: `with client.episode(task_key=...) as ep:` resets on enter and always closes."""
        from rlgate.episode import Episode

        return Episode(self, **reset_fields)

    def close(self) -> None:
        for channel in self._core.all_channels():
            channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncClient:
    """asyncio client with the same API as `Client` (coroutines). Use it on one event loop."""

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
    ) -> None:
        given = (api_key, tls, root_certificates, gateway_addresses, retry, timeouts)
        self.settings = _settings(settings, dict(zip(_COMMON_ARGS, given, strict=True)))
        self._core: _Core[grpc.aio.Channel] = _Core(addresses, self.settings, _aio_channel)

    async def _run(self, call: _Call[grpc.aio.Channel]) -> Any:
        state = self._core.retry_state(call)
        while True:
            attempt_timeout = state.attempt_timeout()
            stub = call.pool.next_stub(call.stub)
            try:
                return await getattr(stub, call.method)(call.request, timeout=attempt_timeout, metadata=call.metadata)
            except grpc.RpcError as err:
                delay = state.on_error(err)
            await asyncio.sleep(delay)

    async def _pages(self, call: _Call[grpc.aio.Channel], field: str) -> list[Any]:
        items: list[Any] = []
        while True:
            page = await self._run(call)
            items.extend(getattr(page, field))
            if not page.next_page_token:
                return items
            call = call.next_page(page.next_page_token)

    async def reset(
        self, *, trace_id: str | None = None, timeout: float | None = None, **fields: Any
    ) -> orchestrator_pb2.ResetResponse:
        return await self._run(self._core.reset(trace_id, timeout, **fields))

    async def step(
        self, session_id: str, *, trace_id: str | None = None, timeout: float | None = None, **fields: Any
    ) -> orchestrator_pb2.StepResponse:
        return await self._run(self._core.step(session_id, trace_id, timeout, **fields))

    async def state(
        self, session_id: str, *, include_tool_calls: bool = False, trace_id: str | None = None,
        timeout: float | None = None,
    ) -> orchestrator_pb2.StateResponse:  # fmt: skip
        return await self._run(self._core.state(session_id, include_tool_calls, trace_id, timeout))

    async def close_session(
        self, session_id: str, *, trace_id: str | None = None, timeout: float | None = None
    ) -> orchestrator_pb2.CloseResponse:
        return await self._run(self._core.close(session_id, trace_id, timeout))

    async def close_sessions(
        self, *, labels: Mapping[str, str] | None = None, run_id: str = "", timeout: float | None = None
    ) -> list[str]:
        return list((await self._run(self._core.close_sessions(labels, run_id, timeout))).session_ids)

    async def list_tasks(
        self, env_key: str = "", *, include_reference_solution: bool = False, timeout: float | None = None
    ) -> list[common_pb2.TaskInfo]:
        return await self._pages(self._core.list_tasks(env_key, include_reference_solution, timeout), "tasks")

    async def list_sessions(
        self, *, status: int = 0, labels: Mapping[str, str] | None = None, run_id: str = "",
        timeout: float | None = None,
    ) -> list[orchestrator_pb2.SessionInfo]:  # fmt: skip
        return await self._pages(self._core.list_sessions(status, labels, run_id, timeout), "sessions")

    async def list_tools(
        self, agent_token: str, *, gateway: str | None = None, trace_id: str | None = None,
        timeout: float | None = None,
    ) -> list[common_pb2.ToolSpec]:  # fmt: skip
        return list((await self._run(self._core.list_tools(agent_token, gateway, trace_id, timeout))).tools)

    async def call_tool(
        self, agent_token: str, name: str, arguments: Mapping[str, Any] | None = None, *,
        request_id: str | None = None, gateway: str | None = None, trace_id: str | None = None,
        timeout: float | None = None,
    ) -> toolgateway_pb2.CallToolResponse:  # fmt: skip
        return await self._run(
            self._core.call_tool(agent_token, name, arguments, request_id, gateway, trace_id, timeout)
        )

    def episode(self, **reset_fields: Any) -> AsyncEpisode:
        """`async with client.episode(task_key=...) as ep:` resets on enter and always closes."""
        from rlgate.episode import AsyncEpisode

        return AsyncEpisode(self, **reset_fields)

    async def close(self) -> None:
        for channel in self._core.all_channels():
            await channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
