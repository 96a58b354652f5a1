# ruff: noqa: ASYNC109  -- `timeout=` is the gRPC deadline of a call, as in grpc.aio itself
"""`Client` (blocking) and `AsyncClient` (asyncio) for the orchestrator and the toolgateway.

Both are thin shells over `_Core`, which owns everything they share: settings, channel options and
credentials, round-robin address pools, request building (request ids are always generated), metadata
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
import itertools
import math
import os
import reprlib
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import grpc
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from rlgate._tracing import TRACE_HEADER, trace_metadata
from rlgate._tracing import new_trace_id as new_trace_id  # re-exported: part of this module's API
from rlgate.convert import InvalidJsonValue, json_text
from rlgate.errors import InvalidArgument
from rlgate.protocol import DEFAULT_INSTRUCTIONS
from rlgate.retry import RetryPolicy, RetryState
from rlgate.v1 import (
    common_pb2,
    orchestrator_pb2,
    orchestrator_pb2_grpc,
    toolgateway_pb2,
    toolgateway_pb2_grpc,
)

if TYPE_CHECKING:
    from google._upb._message import FieldDescriptor as UpbFieldDescriptor

    from rlgate.episode import AsyncEpisode, Episode

ENV_ORCHESTRATOR = "RLGATE_ORCHESTRATOR"
ENV_API_KEY = "RLGATE_API_KEY"
ENV_GATEWAY = "RLGATE_GATEWAY"
ENV_ROOT_CERTS = "RLGATE_TLS_ROOT_CERTS"
PAGE_SIZE = 1000

C = TypeVar("C")
R = TypeVar("R")
M = TypeVar("M", bound=Message)


def new_request_id() -> str:
    """A fresh request id (32 hex digits): every attempt of one call reuses it, so the server runs it once."""
    return uuid.uuid4().hex


def _shown(value: object) -> str:
    """A value as an error message shows it: its type and a bounded repr."""
    return f"{type(value).__name__} {reprlib.repr(value)}"


def split_addresses(addresses: str | Iterable[str]) -> tuple[str, ...]:
    """`"a:1,b:2"` or `["a:1", "b:2"]` -> `("a:1", "b:2")`; blanks are dropped, at least one must remain."""
    if isinstance(addresses, str):
        items: list[object] = list(addresses.split(","))
    elif isinstance(addresses, Iterable):
        items = list(addresses)
    else:
        raise TypeError(
            f"addresses must be 'host:port', 'host1:port1,host2:port2' or an iterable of 'host:port' strings, "
            f"not {_shown(addresses)}"
        )
    for item in items:
        if not isinstance(item, str):
            raise TypeError(f"each address must be a 'host:port' string, not {_shown(item)} (in {addresses!r})")
    out = tuple(a.strip() for a in items if isinstance(a, str) and a.strip())
    if not out:
        raise ValueError(
            f"no address in {addresses!r}: expected 'host:port', 'host1:port1,host2:port2' or a list of them"
        )
    return out


@dataclass(frozen=True)
class Timeouts:
    """Default deadline of each logical call (all attempts and backoff included), in seconds.

    A call's own `timeout=` replaces its default; `ClientSettings.timeouts` sets them for a client."""

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
    def from_env(
        cls,
        *,
        api_key: str | None = None,
        tls: bool | None = None,
        root_certificates: bytes | None = None,
        tls_server_name: str | None = None,
        gateway_addresses: str | Iterable[str] | None = None,
        keepalive_time_s: float | None = None,
        keepalive_timeout_s: float | None = None,
        max_send_message_bytes: int | None = None,
        max_receive_message_bytes: int | None = None,
        retry: RetryPolicy | None = None,
        timeouts: Timeouts | None = None,
    ) -> ClientSettings:
        """Settings from RLGATE_API_KEY, RLGATE_GATEWAY and RLGATE_TLS_ROOT_CERTS (a PEM file path).

        Each argument that is not None overrides what the environment says (a trainer's flag beats the
        variable)."""
        values: dict[str, Any] = {}
        if os.environ.get(ENV_API_KEY):
            values["api_key"] = os.environ[ENV_API_KEY]
        if os.environ.get(ENV_GATEWAY):
            values["gateway_addresses"] = split_addresses(os.environ[ENV_GATEWAY])
        certs = os.environ.get(ENV_ROOT_CERTS)
        if certs:
            try:
                with open(certs, "rb") as fh:
                    values["root_certificates"] = fh.read()
            except OSError as exc:
                raise ValueError(
                    f"{ENV_ROOT_CERTS}={certs!r} names no readable file ({exc.strerror or exc}): set it to the "
                    "path of a PEM file of root certificates, or unset it to use the system roots"
                ) from exc
            values["tls"] = True
        overrides = {
            "api_key": api_key,
            "tls": tls,
            "root_certificates": root_certificates,
            "tls_server_name": tls_server_name,
            "gateway_addresses": None if gateway_addresses is None else split_addresses(gateway_addresses),
            "keepalive_time_s": keepalive_time_s,
            "keepalive_timeout_s": keepalive_timeout_s,
            "max_send_message_bytes": max_send_message_bytes,
            "max_receive_message_bytes": max_receive_message_bytes,
            "retry": retry,
            "timeouts": timeouts,
        }
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)

    def channel_options(self) -> list[tuple[str, Any]]:
        """The gRPC channel arguments every channel of a client is made with."""
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
        """TLS channel credentials, or None for a plaintext channel (neither `tls` nor root certificates)."""
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
class _Call(Generic[C, R]):
    """One logical RPC, fully built: where it goes, what it sends, how long it may take. `R` is its response
    message (for the type checker: `_run` returns an `R`)."""

    pool: _Pool[C]
    stub: Any
    method: str
    request: Any
    metadata: list[tuple[str, str]]
    timeout: float

    def next_page(self, token: str) -> _Call[C, R]:
        request = type(self.request)()
        request.CopyFrom(self.request)
        request.page_token = token
        return replace(self, request=request)


_PYTHON_TYPES = {
    FieldDescriptor.CPPTYPE_STRING: "str",
    FieldDescriptor.CPPTYPE_BOOL: "bool",
    FieldDescriptor.CPPTYPE_INT32: "int",
    FieldDescriptor.CPPTYPE_INT64: "int",
    FieldDescriptor.CPPTYPE_UINT32: "int",
    FieldDescriptor.CPPTYPE_UINT64: "int",
    FieldDescriptor.CPPTYPE_DOUBLE: "float",
    FieldDescriptor.CPPTYPE_FLOAT: "float",
}


def _kind(field: FieldDescriptor | UpbFieldDescriptor) -> str:
    if field.message_type is not None:
        return field.message_type.full_name
    if field.enum_type is not None:
        names = ", ".join(value.name for value in field.enum_type.values)
        return f"{field.enum_type.full_name} ({names})"
    return _PYTHON_TYPES.get(field.cpp_type, "value")


def _expected(field: FieldDescriptor | UpbFieldDescriptor) -> str:
    """What a request field holds, in Python terms (the parameter of the same name takes it). Either kind of
    descriptor: a message's DESCRIPTOR is protobuf's C (upb) one or the pure-Python one."""
    entry = field.message_type
    if entry is not None and entry.GetOptions().map_entry:
        return f"a mapping of {_kind(entry.fields_by_name['key'])} to {_kind(entry.fields_by_name['value'])}"
    if field.is_repeated:
        return f"a sequence of {_kind(field)}"
    kind = _kind(field)
    return f"{'an' if kind[0] in 'aeiou' else 'a'} {kind}"


def _request(cls: type[M], call: str, **fields: Any) -> M:
    """`cls(**fields)`; a value the message cannot hold is a TypeError naming the parameter it came from
    (protobuf's own message, "bad argument type for built-in operation", names nothing)."""
    try:
        return cls(**fields)
    except (TypeError, ValueError) as exc:
        for name, value in fields.items():
            try:
                cls(**{name: value})
            except UnicodeEncodeError as field_exc:  # a str, but one UTF-8 (and so gRPC) cannot carry
                raise ValueError(
                    f"{call}(): {name} must be valid Unicode text: {reprlib.repr(value)} contains "
                    f"{field_exc.object[field_exc.start : field_exc.end]!r}, a lone UTF-16 surrogate"
                ) from exc
            except (TypeError, ValueError):
                expected = _expected(cls.DESCRIPTOR.fields_by_name[name])
                raise TypeError(f"{call}(): {name} must be {expected}, not {_shown(value)}") from exc
        raise TypeError(f"{call}(): {exc}") from exc


def _optional_text(call: str, name: str, value: object) -> None:
    if value is not None and not isinstance(value, str):
        raise TypeError(f"{call}(): {name} must be a str or None, not {_shown(value)}")


class _Core(Generic[C]):
    """State and logic shared by Client and AsyncClient: every public call is built here as a `_Call`.

    `call` arguments name the public method (for error messages); the parameters are checked here, so both
    clients say the same thing about the same mistake."""

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

    def retry_state(self, call: _Call[C, Any]) -> RetryState:
        trace_id = dict(call.metadata).get(TRACE_HEADER)
        return RetryState(method=call.method, policy=self.settings.retry, timeout=call.timeout, trace_id=trace_id)

    def _timeout(self, call: str, kind: str, given: float | None) -> float:
        default = float(getattr(self.settings.timeouts, kind))
        if given is None:
            return default
        if isinstance(given, bool) or not isinstance(given, int | float):
            raise TypeError(
                f"{call}(): timeout must be a number of seconds, or None for the client's default "
                f"(Timeouts.{kind} = {default:g} s), not {_shown(given)}"
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
        self, call: str, method: str, request: Any, trace_id: str | None, timeout: float | None, kind: str = "other"
    ) -> _Call[C, Any]:
        _optional_text(call, "trace_id", trace_id)
        deadline = self._timeout(call, kind, timeout)
        metadata = trace_metadata(trace_id)
        if self.settings.api_key:
            metadata.append(("authorization", f"Bearer {self.settings.api_key}"))
        return _Call(
            self.orchestrator,
            orchestrator_pb2_grpc.OrchestratorServiceStub,
            method,
            request,
            metadata,
            deadline,
        )

    def reset(
        self,
        trace_id: str | None,
        timeout: float | None,
        *,
        task_key: str,
        env_key: str,
        session_id: str,
        max_turns: int,
        labels: Mapping[str, str] | None,
        run_id: str,
        request_id: str | None,
    ) -> _Call[C, orchestrator_pb2.ResetResponse]:
        request = _request(
            orchestrator_pb2.ResetRequest,
            "reset",
            request_id=request_id or new_request_id(),
            task_key=task_key,
            env_key=env_key,
            session_id=session_id,
            max_turns=max_turns,
            labels=labels,
            run_id=run_id,
        )
        return self._orchestrator_call("reset", "Reset", request, trace_id, timeout, "reset")

    def fork(
        self, session_id: str, count: int, trace_id: str | None, timeout: float | None, *, request_id: str | None
    ) -> _Call[C, orchestrator_pb2.ForkResponse]:
        request = _request(
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
    ) -> _Call[C, orchestrator_pb2.StepResponse]:
        request = _request(
            orchestrator_pb2.StepRequest,
            "step",
            request_id=request_id or new_request_id(),
            session_id=session_id,
            assistant_text=assistant_text,
            tool_calls=tool_calls,
            final_answer=final_answer,  # None leaves it unset: no answer, the episode goes on
            done=done,
        )
        return self._orchestrator_call("step", "Step", request, trace_id, timeout, "step")

    def state(
        self, session_id: str, include_tool_calls: bool, trace_id: str | None, timeout: float | None
    ) -> _Call[C, orchestrator_pb2.StateResponse]:
        request = _request(
            orchestrator_pb2.StateRequest, "state", session_id=session_id, include_tool_calls=include_tool_calls
        )
        return self._orchestrator_call("state", "State", request, trace_id, timeout)

    def close(
        self, session_id: str, trace_id: str | None, timeout: float | None
    ) -> _Call[C, orchestrator_pb2.CloseResponse]:
        request = _request(orchestrator_pb2.CloseRequest, "close_session", session_id=session_id)
        return self._orchestrator_call("close_session", "Close", request, trace_id, timeout)

    def close_sessions(
        self, labels: Mapping[str, str] | None, run_id: str, trace_id: str | None, timeout: float | None
    ) -> _Call[C, orchestrator_pb2.CloseSessionsResponse]:
        if not labels and not run_id:
            raise ValueError(
                "close_sessions(): pass labels= and/or run_id= to say which sessions to close; the orchestrator "
                "refuses a CloseSessions without a filter (INVALID_ARGUMENT)"
            )
        request = _request(orchestrator_pb2.CloseSessionsRequest, "close_sessions", labels=labels, run_id=run_id)
        return self._orchestrator_call("close_sessions", "CloseSessions", request, trace_id, timeout)

    def list_tasks(
        self, env_key: str, include_reference_solution: bool, trace_id: str | None, timeout: float | None
    ) -> _Call[C, orchestrator_pb2.ListTasksResponse]:
        request = _request(
            orchestrator_pb2.ListTasksRequest,
            "list_tasks",
            env_key=env_key,
            page_size=PAGE_SIZE,
            include_reference_solution=include_reference_solution,
        )
        return self._orchestrator_call("list_tasks", "ListTasks", request, trace_id, timeout)

    def list_sessions(
        self,
        status: common_pb2.SessionStatus,
        labels: Mapping[str, str] | None,
        run_id: str,
        trace_id: str | None,
        timeout: float | None,
    ) -> _Call[C, orchestrator_pb2.ListSessionsResponse]:
        request = _request(
            orchestrator_pb2.ListSessionsRequest,
            "list_sessions",
            status=status,
            labels=labels,
            run_id=run_id,
            page_size=PAGE_SIZE,
        )
        return self._orchestrator_call("list_sessions", "ListSessions", request, trace_id, timeout)

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
    ) -> _Call[C, Any]:
        if not isinstance(agent_token, str) or not agent_token:
            error = ValueError if isinstance(agent_token, str) else TypeError
            raise error(
                f"{call}(): agent_token must be the agent_token Reset returned (a non-empty str), "
                f"not {_shown(agent_token)}"
            )
        _optional_text(call, "gateway", gateway)
        _optional_text(call, "trace_id", trace_id)
        metadata = [*trace_metadata(trace_id), ("authorization", f"Bearer {agent_token}")]
        return _Call(
            self.gateway(gateway), toolgateway_pb2_grpc.ToolGatewayServiceStub, method, request, metadata, timeout
        )

    def list_tools(
        self, agent_token: str, gateway: str | None, trace_id: str | None, timeout: float | None
    ) -> _Call[C, toolgateway_pb2.ListToolsResponse]:
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
    ) -> _Call[C, toolgateway_pb2.CallToolResponse]:
        if arguments is not None and not isinstance(arguments, Mapping):
            raise InvalidArgument(
                f"call_tool(): arguments of tool {name!r} must be a mapping (a JSON object such as {{'x': 1}}) "
                f"or None for no arguments, not {_shown(arguments)}"
            )
        try:
            # JSON text, not a Struct: integers reach the tool exactly (a Struct would make 3 a double).
            text = json_text(dict(arguments or {}))
        except InvalidJsonValue as exc:  # undeliverable arguments: the caller's mistake, not a crash
            raise InvalidArgument(
                f"call_tool(): arguments of tool {name!r} cannot be sent as JSON: {exc}; nothing was sent"
            ) from exc
        request = _request(
            toolgateway_pb2.CallToolRequest,
            "call_tool",
            request_id=request_id or new_request_id(),
            name=name,
            arguments_json=text,
        )
        deadline = self._timeout("call_tool", "call_tool", timeout)
        return self._gateway_call("call_tool", gateway, agent_token, "CallTool", request, trace_id, deadline)


def _sync_channel(address: str, creds: grpc.ChannelCredentials | None, options: list[Any]) -> grpc.Channel:
    if creds is None:
        return grpc.insecure_channel(address, options=options)
    return grpc.secure_channel(address, creds, options=options)


def _aio_channel(address: str, creds: grpc.ChannelCredentials | None, options: list[Any]) -> grpc.aio.Channel:
    if creds is None:
        return grpc.aio.insecure_channel(address, options=options)
    return grpc.aio.secure_channel(address, creds, options=options)


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
        raise TypeError(f"settings must be a rlgate.ClientSettings or None, not {_shown(base)}")
    return replace(base, **overrides) if overrides else base


class Client:
    """Blocking client of the orchestrator and the toolgateway (one per process: it is thread-safe).

    `addresses` are the orchestrator's: "host:port", "a:1,b:2" or a list, used round-robin, a retry moving
    to the next. The keyword arguments override the same fields of `settings` (default `ClientSettings()`);
    `channel` carries every call of both services instead (a test's fake channel). Every call is one unary
    RPC per attempt, retried as `rlgate.retry` says within `timeout=` (default: `Timeouts`), and raises an
    `rlgate.errors.RlgateError` for a failed status."""

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
        # `channel`: every call of both services on this one channel instead of dialling (a test's fake channel).
        factory = _sync_channel if channel is None else lambda *_: channel
        self._core: _Core[grpc.Channel] = _Core(addresses, self.settings, factory)

    def _run(self, call: _Call[grpc.Channel, R]) -> R:
        state = self._core.retry_state(call)
        while True:
            attempt_timeout = state.attempt_timeout()
            stub = call.pool.next_stub(call.stub)
            try:
                response: R = getattr(stub, call.method)(call.request, timeout=attempt_timeout, metadata=call.metadata)
                return response
            except grpc.RpcError as err:
                delay = state.on_error(err)
            time.sleep(delay)

    def _pages(self, call: _Call[grpc.Channel, Any], field: str) -> list[Any]:
        items: list[Any] = []
        while True:
            page = self._run(call)
            items.extend(getattr(page, field))
            if not page.next_page_token:
                return items
            call = call.next_page(page.next_page_token)

    # -- orchestrator
    def reset(
        self,
        *,
        task_key: str = "",
        env_key: str = "",
        session_id: str = "",
        max_turns: int = 0,
        labels: Mapping[str, str] | None = None,
        run_id: str = "",
        request_id: str | None = None,
        trace_id: str | None = None,
        timeout: float | None = None,
    ) -> orchestrator_pb2.ResetResponse:
        """Start an episode of `task_key` (or of the bare environment `env_key`, or the next episode of the
        existing `session_id`). `max_turns` 0 keeps the task's limit; `labels` and `run_id` tag the session
        for ListSessions / CloseSessions. `request_id` (generated when None) makes retries safe.

        Prefer `episode()`, which also closes the session."""
        return self._run(
            self._core.reset(
                trace_id,
                timeout,
                task_key=task_key,
                env_key=env_key,
                session_id=session_id,
                max_turns=max_turns,
                labels=labels,
                run_id=run_id,
                request_id=request_id,
            )
        )

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
        request_id: str | None = None,
        trace_id: str | None = None,
        timeout: float | None = None,
    ) -> orchestrator_pb2.StepResponse:
        """Report one turn: what the assistant wrote and the tool calls it made through the gateway.

        A `final_answer` (even "") ends the episode and is scored; `done=True` ends it without one. The
        response says whether the episode is over and, then, its reward and verification."""
        return self._run(
            self._core.step(
                session_id,
                trace_id,
                timeout,
                assistant_text=assistant_text,
                tool_calls=tool_calls,
                final_answer=final_answer,
                done=done,
                request_id=request_id,
            )
        )

    def state(
        self,
        session_id: str,
        *,
        include_tool_calls: bool = False,
        trace_id: str | None = None,
        timeout: float | None = None,
    ) -> orchestrator_pb2.StateResponse:
        """A session's status, turn, reward and verification; with `include_tool_calls`, the gateway's log."""
        return self._run(self._core.state(session_id, include_tool_calls, trace_id, timeout))

    def close_session(
        self, session_id: str, *, trace_id: str | None = None, timeout: float | None = None
    ) -> orchestrator_pb2.CloseResponse:
        """Close a session: revoke its agent token and release its instance. Idempotent: closing a closed or
        expired session succeeds and says `already_closed`."""
        return self._run(self._core.close(session_id, trace_id, timeout))

    def close_sessions(
        self,
        *,
        labels: Mapping[str, str] | None = None,
        run_id: str = "",
        trace_id: str | None = None,
        timeout: float | None = None,
    ) -> list[str]:
        """Close every open session with all of `labels` and `run_id` (a crashed run's leftovers); the ids
        of the sessions it closed."""
        return list(self._run(self._core.close_sessions(labels, run_id, trace_id, timeout)).session_ids)

    def list_tasks(
        self,
        env_key: str = "",
        *,
        include_reference_solution: bool = False,
        trace_id: str | None = None,
        timeout: float | None = None,
    ) -> list[common_pb2.TaskInfo]:
        """Every task (of `env_key`, when given), all pages. `include_reference_solution` fills
        `TaskInfo.reference_solution_json` (an answer key: for tests, demos and the reference policy)."""
        return self._pages(self._core.list_tasks(env_key, include_reference_solution, trace_id, timeout), "tasks")

    def list_sessions(
        self,
        *,
        status: common_pb2.SessionStatus = common_pb2.SESSION_STATUS_UNSPECIFIED,
        labels: Mapping[str, str] | None = None,
        run_id: str = "",
        trace_id: str | None = None,
        timeout: float | None = None,
    ) -> list[orchestrator_pb2.SessionInfo]:
        """Every session (newest first, all pages) in `status` (UNSPECIFIED: any) with all of `labels` and
        `run_id` (each filter applies when given)."""
        return self._pages(self._core.list_sessions(status, labels, run_id, trace_id, timeout), "sessions")

    # -- gateway
    def list_tools(
        self,
        agent_token: str,
        *,
        gateway: str | None = None,
        trace_id: str | None = None,
        timeout: float | None = None,
    ) -> list[common_pb2.ToolSpec]:
        """The tools `agent_token`'s session may call, from the gateway at `gateway` (Reset's
        gateway_address) unless the client has `gateway_addresses`."""
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
        """Call a tool with `arguments` (sent as exact JSON text). Agent mistakes come back as
        `result.is_error`, not exceptions; every retry reuses one `request_id`, so the tool runs once."""
        return self._run(self._core.call_tool(agent_token, name, arguments, request_id, gateway, trace_id, timeout))

    # -- episodes
    def episode(
        self,
        *,
        task_key: str = "",
        env_key: str = "",
        session_id: str = "",
        max_turns: int = 0,
        labels: Mapping[str, str] | None = None,
        run_id: str = "",
        trace_id: str | None = None,
        instructions: str = DEFAULT_INSTRUCTIONS,
        raise_on_verifier_error: bool = True,
        tool_timeout_s: float | None = None,
    ) -> Episode:
        """An `Episode` (not yet reset): `with client.episode(task_key=...) as ep:` resets on enter and
        always closes. The arguments are `Episode`'s."""
        from rlgate.episode import Episode

        return Episode(
            self,
            task_key=task_key,
            env_key=env_key,
            session_id=session_id,
            max_turns=max_turns,
            labels=labels,
            run_id=run_id,
            trace_id=trace_id,
            instructions=instructions,
            raise_on_verifier_error=raise_on_verifier_error,
            tool_timeout_s=tool_timeout_s,
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

    grpc.aio channels belong to the event loop that made them: one `AsyncClient` per loop."""

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
        # `channel`: every call of both services on this one channel instead of dialling (a test's fake channel).
        factory = _aio_channel if channel is None else lambda *_: channel
        self._core: _Core[grpc.aio.Channel] = _Core(addresses, self.settings, factory)

    async def _run(self, call: _Call[grpc.aio.Channel, R]) -> R:
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
            await asyncio.sleep(delay)

    async def _pages(self, call: _Call[grpc.aio.Channel, Any], field: str) -> list[Any]:
        items: list[Any] = []
        while True:
            page = await self._run(call)
            items.extend(getattr(page, field))
            if not page.next_page_token:
                return items
            call = call.next_page(page.next_page_token)

    async def reset(
        self,
        *,
        task_key: str = "",
        env_key: str = "",
        session_id: str = "",
        max_turns: int = 0,
        labels: Mapping[str, str] | None = None,
        run_id: str = "",
        request_id: str | None = None,
        trace_id: str | None = None,
        timeout: float | None = None,
    ) -> orchestrator_pb2.ResetResponse:
        """Start an episode; see `Client.reset`."""
        return await self._run(
            self._core.reset(
                trace_id,
                timeout,
                task_key=task_key,
                env_key=env_key,
                session_id=session_id,
                max_turns=max_turns,
                labels=labels,
                run_id=run_id,
                request_id=request_id,
            )
        )

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
        request_id: str | None = None,
        trace_id: str | None = None,
        timeout: float | None = None,
    ) -> orchestrator_pb2.StepResponse:
        """Report one turn; see `Client.step`."""
        return await self._run(
            self._core.step(
                session_id,
                trace_id,
                timeout,
                assistant_text=assistant_text,
                tool_calls=tool_calls,
                final_answer=final_answer,
                done=done,
                request_id=request_id,
            )
        )

    async def state(
        self,
        session_id: str,
        *,
        include_tool_calls: bool = False,
        trace_id: str | None = None,
        timeout: float | None = None,
    ) -> orchestrator_pb2.StateResponse:
        """A session's state; see `Client.state`."""
        return await self._run(self._core.state(session_id, include_tool_calls, trace_id, timeout))

    async def close_session(
        self, session_id: str, *, trace_id: str | None = None, timeout: float | None = None
    ) -> orchestrator_pb2.CloseResponse:
        """Close a session (idempotent); see `Client.close_session`."""
        return await self._run(self._core.close(session_id, trace_id, timeout))

    async def close_sessions(
        self,
        *,
        labels: Mapping[str, str] | None = None,
        run_id: str = "",
        trace_id: str | None = None,
        timeout: float | None = None,
    ) -> list[str]:
        """Close every open session matching; see `Client.close_sessions`."""
        return list((await self._run(self._core.close_sessions(labels, run_id, trace_id, timeout))).session_ids)

    async def list_tasks(
        self,
        env_key: str = "",
        *,
        include_reference_solution: bool = False,
        trace_id: str | None = None,
        timeout: float | None = None,
    ) -> list[common_pb2.TaskInfo]:
        """Every task; see `Client.list_tasks`."""
        call = self._core.list_tasks(env_key, include_reference_solution, trace_id, timeout)
        return await self._pages(call, "tasks")

    async def list_sessions(
        self,
        *,
        status: common_pb2.SessionStatus = common_pb2.SESSION_STATUS_UNSPECIFIED,
        labels: Mapping[str, str] | None = None,
        run_id: str = "",
        trace_id: str | None = None,
        timeout: float | None = None,
    ) -> list[orchestrator_pb2.SessionInfo]:
        """Every session matching; see `Client.list_sessions`."""
        return await self._pages(self._core.list_sessions(status, labels, run_id, trace_id, timeout), "sessions")

    async def list_tools(
        self,
        agent_token: str,
        *,
        gateway: str | None = None,
        trace_id: str | None = None,
        timeout: float | None = None,
    ) -> list[common_pb2.ToolSpec]:
        """The session's tools; see `Client.list_tools`."""
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
        """Call a tool; see `Client.call_tool`."""
        return await self._run(
            self._core.call_tool(agent_token, name, arguments, request_id, gateway, trace_id, timeout)
        )

    def episode(
        self,
        *,
        task_key: str = "",
        env_key: str = "",
        session_id: str = "",
        max_turns: int = 0,
        labels: Mapping[str, str] | None = None,
        run_id: str = "",
        trace_id: str | None = None,
        instructions: str = DEFAULT_INSTRUCTIONS,
        raise_on_verifier_error: bool = True,
        tool_timeout_s: float | None = None,
    ) -> AsyncEpisode:
        """An `AsyncEpisode` (not yet reset): `async with client.episode(task_key=...) as ep:` resets on
        enter and always closes, also when the task is cancelled."""
        from rlgate.episode import AsyncEpisode

        return AsyncEpisode(
            self,
            task_key=task_key,
            env_key=env_key,
            session_id=session_id,
            max_turns=max_turns,
            labels=labels,
            run_id=run_id,
            trace_id=trace_id,
            instructions=instructions,
            raise_on_verifier_error=raise_on_verifier_error,
            tool_timeout_s=tool_timeout_s,
        )

    async def close(self) -> None:
        """Close every channel; see `Client.close`."""
        for channel in self._core.all_channels():
            await channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
