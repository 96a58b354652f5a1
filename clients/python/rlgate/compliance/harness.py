"""What every compliance class shares: what a subclass provides, the channels and stubs built from it, and
helpers for the calls and the statuses the proto documents.

Only the wire contract is used here (rlgate.v1 stubs, grpc, grpcio-status, rlgate.core.convert), so the classes
test any implementation of the two services, not rlgate's internals.
"""

from __future__ import annotations

import abc
import contextlib
import time
import unittest
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn, TypeVar

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from rlgate.core.convert import json_text, parse_json_text, struct_from_dict
from rlgate.v1 import (
    common_pb2,
    orchestrator_pb2,
    orchestrator_pb2_grpc,
    toolgateway_pb2,
    toolgateway_pb2_grpc,
)

T = TypeVar("T")
Metadata = tuple[tuple[str, str], ...]
POLL_INTERVAL_S = 0.2  # between State polls while waiting for a server-side transition (expiry)


@dataclass(frozen=True)
class ToolCall:
    """A call of one of the task's tools that succeeds on a fresh episode (is_error false).

    Args:
        name: the tool's name.
        arguments: the call's arguments.
    """

    name: str
    arguments: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ExactJsonCall:
    """A call whose structured result repeats integers it was given, to show JSON passes through exactly.

    Args:
        name: the tool's name.
        arguments: the call's arguments, with at least one integer.
        expect: JSON Pointers (RFC 6901, e.g. "/number") into the parsed structured result, each mapped to
            the exact JSON value expected there (an int must come back an int, not 25.0).
    """

    name: str
    arguments: Mapping[str, Any]
    expect: Mapping[str, Any]


def skip(reason: str) -> NoReturn:
    """Skip the running test. unittest's exception, which pytest reports as a skip too (pytest's own would be
    an error under a unittest runner).

    Args:
        reason: why, as the test report shows it.
    """
    raise unittest.SkipTest(reason)


def same_json(a: Any, b: Any) -> bool:
    """Equal as JSON values *and* of the same JSON types (1 is not 1.0, True is not 1).

    Args:
        a: a JSON value.
        b: another.
    """
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same_json(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(same_json(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def json_pointer(document: Any, pointer: str) -> Any:
    """The value at an RFC 6901 JSON Pointer.

    Args:
        document: a JSON value.
        pointer: the pointer; "" is the whole document.

    Raises:
        KeyError: nothing is at `pointer`.
        ValueError: `pointer` is not empty and does not start with "/".
    """
    if pointer == "":
        return document
    if not pointer.startswith("/"):
        raise ValueError(f"a JSON Pointer starts with '/': {pointer!r}")
    value = document
    for raw in pointer[1:].split("/"):
        token = raw.replace("~1", "/").replace("~0", "~")
        if isinstance(value, list):
            if not token.isdigit() or int(token) >= len(value):
                raise KeyError(pointer)
            value = value[int(token)]
        elif isinstance(value, dict) and token in value:
            value = value[token]
        else:
            raise KeyError(pointer)
    return value


def named_fields(err: grpc.RpcError) -> tuple[set[str], str]:
    """The fields an error names: its google.rpc.BadRequest field violations, and its message.

    Args:
        err: a failed call.
    """
    fields: set[str] = set()
    status = rpc_status.from_call(err)  # type: ignore[arg-type]
    if status is not None:
        for detail in status.details:
            bad = error_details_pb2.BadRequest()
            if detail.Unpack(bad):  # False for a detail of another type
                fields.update(v.field for v in bad.field_violations)
    return fields, err.details() or ""


def describe(err: grpc.RpcError) -> str:
    """A failed call as an assertion message shows it: its code and details.

    Args:
        err: a failed call.
    """
    return f"{err.code().name}: {err.details()}"


class ComplianceHarness(abc.ABC):
    """The part of a compliance class a subclass configures.

    Required: `orchestrator_channel()` and the class attributes `task_key` and `tool_call`. Optional:
    `gateway_channel()`, `expiring_orchestrator_channel()`, `api_key`, `other_api_key`, `exact_json_call`,
    the timeouts. Tests needing an option that is not given skip with the reason.

    Each test runs on a fresh instance (as pytest and unittest make them): channels and sessions it opens
    are closed by `teardown_method` (pytest) / `tearDown` (unittest). A subclass that defines its own
    teardown calls this one too.
    """

    # -- what a subclass provides -------------------------------------------------------------------------
    #: A task (see ListTasks) whose tool list contains `tool_call.name`.
    task_key: str = ""
    #: A call that succeeds on a fresh episode of `task_key`.
    tool_call: ToolCall | None = None
    #: A call that echoes integers into its structured result; None skips the exact-JSON tests.
    exact_json_call: ExactJsonCall | None = None
    #: The API key the orchestrator requires (sent as `authorization: Bearer`); None: it requires none,
    #: and the tests of authentication skip.
    api_key: str | None = None
    #: A second accepted API key, for request ids scoped to the caller; None skips that test.
    other_api_key: str | None = None
    #: Deadline of every RPC the tests make.
    rpc_timeout_s: float = 60.0
    #: How long a session of `expiring_orchestrator_channel()` may take to expire.
    expiry_timeout_s: float = 60.0

    @abc.abstractmethod
    def orchestrator_channel(self) -> grpc.Channel:
        """A new channel to the OrchestratorService under test (closed by the harness)."""

    def gateway_channel(self, address: str) -> grpc.Channel:
        """A new channel to the toolgateway at `address` (ResetResponse.gateway_address). Override for TLS or
        an address the test host reaches differently."""
        return grpc.insecure_channel(address)

    def expiring_orchestrator_channel(self) -> grpc.Channel | None:
        """A new channel to an orchestrator of the same implementation (same tasks, same API key) whose
        sessions expire by TTL within `expiry_timeout_s`; None (the default) skips the expiry test."""
        return None

    # -- channels and stubs -------------------------------------------------------------------------------
    def _state(self) -> dict[str, Any]:
        """Per-test resources, created on first use (no setup hook needed, whatever the runner)."""
        state: dict[str, Any] | None = self.__dict__.get("_compliance")
        if state is None:
            state = {"channels": [], "gateways": {}, "sessions": [], "orchestrator": None}
            self.__dict__["_compliance"] = state
        return state

    def _keep(self, channel: grpc.Channel) -> grpc.Channel:
        self._state()["channels"].append(channel)
        return channel

    @property
    def orchestrator(self) -> orchestrator_pb2_grpc.OrchestratorServiceStub:
        state = self._state()
        if state["orchestrator"] is None:
            state["orchestrator"] = orchestrator_pb2_grpc.OrchestratorServiceStub(
                self._keep(self.orchestrator_channel())
            )
        stub: orchestrator_pb2_grpc.OrchestratorServiceStub = state["orchestrator"]
        return stub

    def new_orchestrator_stub(self, channel: grpc.Channel) -> orchestrator_pb2_grpc.OrchestratorServiceStub:
        return orchestrator_pb2_grpc.OrchestratorServiceStub(self._keep(channel))

    def gateway(self, address: str) -> toolgateway_pb2_grpc.ToolGatewayServiceStub:
        gateways: dict[str, toolgateway_pb2_grpc.ToolGatewayServiceStub] = self._state()["gateways"]
        if address not in gateways:
            gateways[address] = toolgateway_pb2_grpc.ToolGatewayServiceStub(self._keep(self.gateway_channel(address)))
        return gateways[address]

    def gateway_raw_channel(self, address: str) -> grpc.Channel:
        """A channel of its own to the gateway, for calls by method path."""
        return self._keep(self.gateway_channel(address))

    @staticmethod
    def bearer(token: str | None) -> Metadata:
        return (("authorization", f"Bearer {token}"),) if token else ()

    @property
    def orchestrator_metadata(self) -> Metadata:
        return self.bearer(self.api_key)

    # -- orchestration calls ------------------------------------------------------------------------------
    @staticmethod
    def new_request_id(length: int = 0) -> str:
        """A request_id never used before (padded to `length` characters): runs against a long-lived server
        must not replay each other."""
        return f"compliance-{uuid.uuid4().hex}".ljust(length, "-")

    def reset(
        self,
        *,
        stub: orchestrator_pb2_grpc.OrchestratorServiceStub | None = None,
        metadata: Metadata | None = None,
        **fields: Any,
    ) -> orchestrator_pb2.ResetResponse:
        """Reset with a fresh request_id and `task_key` unless given; the session is closed at teardown."""
        fields.setdefault("request_id", self.new_request_id())
        if not any(fields.get(k) for k in ("session_id", "task_key", "env_key")):
            fields["task_key"] = self.task_key
        stub = stub or self.orchestrator
        metadata = self.orchestrator_metadata if metadata is None else metadata
        response: orchestrator_pb2.ResetResponse = stub.Reset(
            orchestrator_pb2.ResetRequest(**fields), metadata=metadata, timeout=self.rpc_timeout_s
        )
        self._state()["sessions"].append((stub, metadata, response.session_id))
        return response

    def fork(
        self, session_id: str, count: int, *, metadata: Metadata | None = None, **fields: Any
    ) -> orchestrator_pb2.ForkResponse:
        """Fork with a fresh request_id unless given; every branch is closed at teardown."""
        fields.setdefault("request_id", self.new_request_id())
        metadata = self.orchestrator_metadata if metadata is None else metadata
        response: orchestrator_pb2.ForkResponse = self.orchestrator.Fork(
            orchestrator_pb2.ForkRequest(session_id=session_id, count=count, **fields),
            metadata=metadata,
            timeout=self.rpc_timeout_s,
        )
        for branch in response.branches:
            self._state()["sessions"].append((self.orchestrator, metadata, branch.session_id))
        return response

    def step(self, session_id: str, **fields: Any) -> orchestrator_pb2.StepResponse:
        fields.setdefault("request_id", self.new_request_id())
        response: orchestrator_pb2.StepResponse = self.orchestrator.Step(
            orchestrator_pb2.StepRequest(session_id=session_id, **fields),
            metadata=self.orchestrator_metadata,
            timeout=self.rpc_timeout_s,
        )
        return response

    def state(
        self,
        session_id: str,
        include_tool_calls: bool = False,
        stub: orchestrator_pb2_grpc.OrchestratorServiceStub | None = None,
    ) -> orchestrator_pb2.StateResponse:
        response: orchestrator_pb2.StateResponse = (stub or self.orchestrator).State(
            orchestrator_pb2.StateRequest(session_id=session_id, include_tool_calls=include_tool_calls),
            metadata=self.orchestrator_metadata,
            timeout=self.rpc_timeout_s,
        )
        return response

    def close(
        self, session_id: str, stub: orchestrator_pb2_grpc.OrchestratorServiceStub | None = None
    ) -> orchestrator_pb2.CloseResponse:
        response: orchestrator_pb2.CloseResponse = (stub or self.orchestrator).Close(
            orchestrator_pb2.CloseRequest(session_id=session_id),
            metadata=self.orchestrator_metadata,
            timeout=self.rpc_timeout_s,
        )
        return response

    def wait_for_status(
        self,
        session_id: str,
        statuses: Iterable[int],
        timeout_s: float,
        stub: orchestrator_pb2_grpc.OrchestratorServiceStub | None = None,
    ) -> orchestrator_pb2.SessionInfo:
        """Poll State until the session is in one of `statuses` (bounded by `timeout_s`)."""
        wanted = set(statuses)
        deadline = time.monotonic() + timeout_s
        while True:
            session = self.state(session_id, stub=stub).session
            if session.status in wanted:
                return session
            if time.monotonic() >= deadline:
                raise AssertionError(
                    f"session {session_id} still {common_pb2.SessionStatus.Name(session.status)} after {timeout_s}s"
                )
            time.sleep(POLL_INTERVAL_S)

    # -- agent calls --------------------------------------------------------------------------------------
    def list_tools(
        self, episode: orchestrator_pb2.ResetResponse | orchestrator_pb2.ForkBranch, token: str | None = None
    ) -> Sequence[Any]:
        response = self.gateway(episode.gateway_address).ListTools(
            toolgateway_pb2.ListToolsRequest(),
            metadata=self.bearer(episode.agent_token if token is None else token),
            timeout=self.rpc_timeout_s,
        )
        return list(response.tools)

    def call_tool(
        self,
        episode: orchestrator_pb2.ResetResponse | orchestrator_pb2.ForkBranch,
        name: str,
        arguments: Mapping[str, Any] | None = None,
        *,
        request_id: str = "",
        token: str | None = None,
        arguments_json: str | None = None,
        as_struct: bool = False,
    ) -> toolgateway_pb2.CallToolResponse:
        """CallTool with `arguments` as JSON text (or a Struct with `as_struct`), or `arguments_json` verbatim."""
        request = toolgateway_pb2.CallToolRequest(name=name, request_id=request_id)
        if arguments_json is not None:
            request.arguments_json = arguments_json
        elif as_struct:
            request.arguments.CopyFrom(struct_from_dict(dict(arguments or {})))
        else:
            request.arguments_json = json_text(dict(arguments or {}))
        response: toolgateway_pb2.CallToolResponse = self.gateway(episode.gateway_address).CallTool(
            request,
            metadata=self.bearer(episode.agent_token if token is None else token),
            timeout=self.rpc_timeout_s,
        )
        return response

    def the_tool_call(self) -> ToolCall:
        if self.tool_call is None:
            raise AssertionError(f"{type(self).__name__} must set tool_call (a call that succeeds on task_key)")
        return self.tool_call

    # -- statuses -----------------------------------------------------------------------------------------
    def expect_status(
        self,
        code: grpc.StatusCode,
        call: Callable[[], object],
        *,
        field: str | Sequence[str] | None = None,
        mentions: str | None = None,
        what: str = "",
    ) -> grpc.RpcError:
        """Run `call`; it must fail with `code`. `field`: the error must name that field (or one of several
        the proto allows) in a BadRequest field violation (a nested one such as "tool_calls[0].name" names
        "tool_calls"; "arguments_json" names "arguments"), or in its message when it has no BadRequest.
        `mentions`: a word the message must contain (case-insensitive), where the proto says the message
        tells why."""
        label = f"{what}: " if what else ""
        try:
            call()
        except grpc.RpcError as caught:
            err = caught
        else:
            raise AssertionError(f"{label}expected {code.name}, the call succeeded")
        if err.code() != code:
            raise AssertionError(f"{label}expected {code.name}, got {describe(err)}")
        if field is not None:
            wanted = [field] if isinstance(field, str) else list(field)
            fields, message = named_fields(err)

            def names(f: str) -> bool:
                if not fields:  # no BadRequest detail: the message must name it
                    return f in message
                return any(v == f or v.startswith((f"{f}.", f"{f}[", f"{f}_")) for v in fields)

            if not any(names(f) for f in wanted):
                raise AssertionError(
                    f"{label}{code.name} must name the field {' or '.join(wanted)}; it names {sorted(fields)} "
                    f"with message {message!r}"
                )
        if mentions is not None and mentions.lower() not in (err.details() or "").lower():
            raise AssertionError(f"{label}{code.name} message must say {mentions!r}: {describe(err)}")
        return err

    def expect_statuses(self, cases: Iterable[tuple[str, grpc.StatusCode, Callable[[], object], Any]]) -> None:
        """Several `(what, code, call, field)` expectations, all run, failures reported together."""
        failures = []
        for what, code, call, field_name in cases:
            try:
                self.expect_status(code, call, field=field_name, what=what)
            except AssertionError as exc:
                failures.append(str(exc))
        if failures:
            raise AssertionError("\n".join(failures))

    # -- checks -------------------------------------------------------------------------------------------
    @staticmethod
    def json_of(text: str, what: str) -> Any:
        try:
            return parse_json_text(text, what)
        except ValueError as exc:
            raise AssertionError(f"{what} is not JSON text: {exc}") from None

    # -- cleanup ------------------------------------------------------------------------------------------
    def teardown_method(self, method: object = None) -> None:
        state = self.__dict__.pop("_compliance", None)
        if state is None:
            return
        for stub, metadata, session_id in state["sessions"]:
            # already gone, or the test made the server refuse it: nothing left to release
            with contextlib.suppress(grpc.RpcError):
                stub.Close(orchestrator_pb2.CloseRequest(session_id=session_id), metadata=metadata, timeout=30)
        for channel in state["channels"]:
            channel.close()

    def tearDown(self) -> None:  # unittest.TestCase subclasses
        self.teardown_method()
