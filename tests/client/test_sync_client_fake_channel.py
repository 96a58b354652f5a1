"""The blocking `Client` against grpc_testing's fake channel, no server: how it maps statuses (google.rpc details
included) onto rlgate.errors, which codes it retries per RPC (with the same request_id every attempt, and at
least the delay a RetryInfo asks for), and the metadata it sends (API key to the orchestrator, agent token to
the gateway, the trace id on every attempt).

The client runs in a thread; the test plays the server: `FakeServer.take` waits (bounded) for the client's
next RPC and answers it with `terminate`."""

from __future__ import annotations

import queue
import re
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import grpc
import grpc_testing
import pytest
from google.protobuf import any_pb2, duration_pb2
from google.rpc import error_details_pb2, status_pb2

import rlgate.errors as errors
from rlgate.client import Client
from rlgate.retry import RetryPolicy
from rlgate.v1 import orchestrator_pb2, toolgateway_pb2

ORCHESTRATOR = orchestrator_pb2.DESCRIPTOR.services_by_name["OrchestratorService"]
GATEWAY = toolgateway_pb2.DESCRIPTOR.services_by_name["ToolGatewayService"]
TRACE_HEADER = "x-rlgate-trace-id"
DETAILS_KEY = "grpc-status-details-bin"
WAIT_S = 10.0  # bound of every wait for the other side
FAST = RetryPolicy(max_attempts=5, initial_backoff=0.01, max_backoff=0.02, jitter=0.0)


@dataclass
class Rpc:
    """One attempt the client made: what it sent, and the handle to answer it."""

    metadata: dict[str, str]
    request: Any
    handle: grpc_testing.UnaryUnaryChannelRpc
    arrived: float

    def fail(self, code: grpc.StatusCode, message: str = "", *details: Any) -> None:
        """End the attempt with `code`; `details` (ErrorInfo, RetryInfo, ...) ride in a google.rpc.Status."""
        trailing: tuple[tuple[str, bytes], ...] = ()
        if details:
            status = status_pb2.Status(code=code.value[0], message=message)
            for detail in details:
                packed = any_pb2.Any()
                packed.Pack(detail)
                status.details.append(packed)
            trailing = ((DETAILS_KEY, status.SerializeToString()),)
        self.handle.terminate(None, trailing, code, message)

    def answer(self, response: Any) -> None:
        self.handle.terminate(response, (), grpc.StatusCode.OK, "")


class FakeServer:
    """The server side of one grpc_testing channel shared by both services."""

    def __init__(self) -> None:
        self.channel = grpc_testing.channel([ORCHESTRATOR, GATEWAY], grpc_testing.strict_real_time())

    def client(self, **settings: Any) -> Client:
        settings.setdefault("retry", FAST)
        return Client("orchestrator.invalid:1", gateway_addresses="gateway.invalid:2", channel=self.channel, **settings)

    @staticmethod
    def run(call: Callable[[], Any]) -> Future[Any]:
        """Run one client call in a thread of its own; its outcome in the future."""
        outcome: Future[Any] = Future()

        def target() -> None:
            try:
                outcome.set_result(call())
            except BaseException as exc:  # handed to the test
                outcome.set_exception(exc)

        threading.Thread(target=target, daemon=True).start()
        return outcome

    def take(self, service: Any, method: str, client: Future[Any]) -> Rpc:
        """The client's next attempt of `method` (AssertionError if the call ends or nothing comes in time)."""
        arrivals: queue.Queue[Any] = queue.Queue()
        descriptor = service.methods_by_name[method]
        # take_unary_unary blocks without a bound: a daemon thread waits for it, this one waits with one.
        threading.Thread(target=lambda: arrivals.put(self.channel.take_unary_unary(descriptor)), daemon=True).start()
        give_up = time.monotonic() + WAIT_S
        while time.monotonic() < give_up:
            try:
                metadata, request, handle = arrivals.get(timeout=0.01)
            except queue.Empty:
                if client.done():
                    raise AssertionError(
                        f"the call ended instead of sending {method}: {client.exception()!r}"
                    ) from None
                continue
            return Rpc(dict(metadata), request, handle, time.monotonic())
        raise AssertionError(f"no {method} within {WAIT_S}s")


@pytest.fixture
def server() -> Iterator[FakeServer]:
    yield FakeServer()


def outcome(client: Future[Any]) -> Any:
    return client.result(timeout=WAIT_S)


def error_of(client: Future[Any]) -> errors.RlgateError:
    exc = client.exception(timeout=WAIT_S)
    assert isinstance(exc, errors.RlgateError), exc
    return exc


def reset(c: Client, **fields: Any) -> Callable[[], Any]:
    return lambda: c.reset(task_key="env/t1", **fields)


def step(c: Client, **fields: Any) -> Callable[[], Any]:
    return lambda: c.step("s-1", assistant_text="hi", **fields)


def call_tool(c: Client, **fields: Any) -> Callable[[], Any]:
    return lambda: c.call_tool("rlg1.s-1.secret", "echo", {"x": 1}, **fields)


def state(c: Client, **fields: Any) -> Callable[[], Any]:
    return lambda: c.state("s-1", **fields)


CALLS = {
    "Reset": (reset, ORCHESTRATOR, orchestrator_pb2.ResetResponse(session_id="s-1")),
    "Step": (step, ORCHESTRATOR, orchestrator_pb2.StepResponse(turn=1)),
    "State": (state, ORCHESTRATOR, orchestrator_pb2.StateResponse()),
    "CallTool": (call_tool, GATEWAY, toolgateway_pb2.CallToolResponse()),
}


# -- status mapping -------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("code", "cls"),
    [
        (grpc.StatusCode.INVALID_ARGUMENT, errors.InvalidArgument),
        (grpc.StatusCode.NOT_FOUND, errors.NotFound),
        (grpc.StatusCode.FAILED_PRECONDITION, errors.FailedPrecondition),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, errors.ResourceExhausted),
        (grpc.StatusCode.UNAUTHENTICATED, errors.Unauthenticated),
        (grpc.StatusCode.PERMISSION_DENIED, errors.PermissionDenied),
        (grpc.StatusCode.INTERNAL, errors.Internal),
        (grpc.StatusCode.CANCELLED, errors.Cancelled),
        (grpc.StatusCode.ABORTED, errors.RlgateError),  # no class of its own: the base, code kept
    ],
)
def test_a_status_is_its_error_class_with_message_trace_and_details(
    server: FakeServer, code: grpc.StatusCode, cls: type[errors.RlgateError]
) -> None:
    # One attempt: the mapping, not the retry policy (Reset retries CANCELLED), is what this checks.
    client = server.run(reset(server.client(retry=RetryPolicy(max_attempts=1)), trace_id="trace-1"))
    info = error_details_pb2.ErrorInfo(reason="SOME_REASON", domain="rlgate.dev", metadata={"k": "v"})
    server.take(ORCHESTRATOR, "Reset", client).fail(code, "what went wrong", info)
    err = error_of(client)
    assert type(err) is cls and err.code == code and err.trace_id == "trace-1"
    assert err.message == "Reset: what went wrong"
    assert err.rich_status is not None and err.rich_status.details[0].Unpack(error_details_pb2.ErrorInfo())


@pytest.mark.parametrize("method", ["Reset", "Step", "CallTool"])
def test_minted_ids_are_32_hex_digits_and_the_error_names_the_trace_id_sent(server: FakeServer, method: str) -> None:
    make, service, _ = CALLS[method]
    client = server.run(make(server.client(retry=RetryPolicy(max_attempts=1))))
    rpc = server.take(service, method, client)
    rpc.fail(grpc.StatusCode.NOT_FOUND, "gone")
    err = error_of(client)
    trace_id = rpc.metadata[TRACE_HEADER]
    assert re.fullmatch("[0-9a-f]{32}", trace_id) and err.trace_id == trace_id
    assert re.fullmatch("[0-9a-f]{32}", rpc.request.request_id)


def test_details_whose_code_is_another_calls_are_ignored(server: FakeServer) -> None:
    client = server.run(reset(server.client()))
    rpc = server.take(ORCHESTRATOR, "Reset", client)
    foreign = status_pb2.Status(code=grpc.StatusCode.UNAVAILABLE.value[0], message="x")
    rpc.handle.terminate(None, ((DETAILS_KEY, foreign.SerializeToString()),), grpc.StatusCode.NOT_FOUND, "gone")
    err = error_of(client)
    assert isinstance(err, errors.NotFound) and err.rich_status is None


def test_a_malformed_details_trailer_keeps_the_calls_own_error(server: FakeServer) -> None:
    client = server.run(reset(server.client()))
    rpc = server.take(ORCHESTRATOR, "Reset", client)
    rpc.handle.terminate(None, ((DETAILS_KEY, b"\xff\x00not a status"),), grpc.StatusCode.NOT_FOUND, "gone")
    err = error_of(client)
    assert isinstance(err, errors.NotFound) and err.rich_status is None


# -- retries --------------------------------------------------------------------------------------------------
RETRIED = [
    ("Reset", grpc.StatusCode.UNAVAILABLE, True),
    ("Step", grpc.StatusCode.UNAVAILABLE, True),
    ("State", grpc.StatusCode.UNAVAILABLE, True),
    ("CallTool", grpc.StatusCode.UNAVAILABLE, True),
    ("Reset", grpc.StatusCode.CANCELLED, True),  # the server cancelled it: the request_id makes a repeat safe
    ("Step", grpc.StatusCode.CANCELLED, True),
    ("CallTool", grpc.StatusCode.CANCELLED, False),  # the tool may have run
    ("Reset", grpc.StatusCode.INTERNAL, False),
    ("Step", grpc.StatusCode.FAILED_PRECONDITION, False),
    ("CallTool", grpc.StatusCode.RESOURCE_EXHAUSTED, False),
    ("CallTool", grpc.StatusCode.INTERNAL, False),
]


@pytest.mark.parametrize(("method", "code", "retried"), RETRIED, ids=[f"{m}-{c.name}" for m, c, _ in RETRIED])
def test_which_codes_each_rpc_retries(server: FakeServer, method: str, code: grpc.StatusCode, retried: bool) -> None:
    make, service, response = CALLS[method]
    client = server.run(make(server.client()))
    first = server.take(service, method, client)
    first.fail(code, "first attempt")
    if not retried:
        assert error_of(client).code == code
        return
    second = server.take(service, method, client)
    second.answer(response)
    assert outcome(client) == response
    assert second.request == first.request  # the same request, request_id included
    assert second.metadata[TRACE_HEADER] == first.metadata[TRACE_HEADER]


@pytest.mark.parametrize("method", ["Reset", "Step", "CallTool"])
def test_every_attempt_carries_the_first_attempts_request_id(server: FakeServer, method: str) -> None:
    make, service, response = CALLS[method]
    client = server.run(make(server.client()))
    attempts = []
    for _ in range(3):
        attempts.append(server.take(service, method, client))
        attempts[-1].fail(grpc.StatusCode.UNAVAILABLE, "down")
    last = server.take(service, method, client)
    last.answer(response)
    outcome(client)
    ids = {a.request.request_id for a in [*attempts, last]}
    assert len(ids) == 1 and ids != {""}


def test_a_given_request_id_is_the_one_sent(server: FakeServer) -> None:
    client = server.run(call_tool(server.client(), request_id="mine-1"))
    server.take(GATEWAY, "CallTool", client).answer(toolgateway_pb2.CallToolResponse())
    outcome(client)
    client = server.run(step(server.client(), request_id="mine-2"))
    rpc = server.take(ORCHESTRATOR, "Step", client)
    rpc.answer(orchestrator_pb2.StepResponse())
    outcome(client)
    assert rpc.request.request_id == "mine-2"


@pytest.mark.parametrize("method", ["Step", "CallTool"])
def test_a_deadline_exceeded_attempt_is_retried_only_by_step(server: FakeServer, method: str) -> None:
    """With an attempt timeout, a DEADLINE_EXCEEDED attempt of Step is retried (its request_id replays); a
    CallTool's is not: the tool may still be running."""
    make, service, response = CALLS[method]
    c = server.client(retry=RetryPolicy(max_attempts=3, initial_backoff=0.01, jitter=0.0, attempt_timeout=5.0))
    client = server.run(make(c))
    server.take(service, method, client).fail(grpc.StatusCode.DEADLINE_EXCEEDED, "attempt timed out")
    if method == "CallTool":
        assert isinstance(error_of(client), errors.DeadlineExceeded)
        return
    server.take(service, method, client).answer(response)
    assert outcome(client) == response


def test_attempts_stop_at_max_attempts(server: FakeServer) -> None:
    client = server.run(reset(server.client(retry=RetryPolicy(max_attempts=3, initial_backoff=0.01, jitter=0.0))))
    for _ in range(3):
        server.take(ORCHESTRATOR, "Reset", client).fail(grpc.StatusCode.UNAVAILABLE, "down")
    err = error_of(client)
    assert isinstance(err, errors.Unavailable) and "after 3 attempts" in err.message


def test_retry_info_sets_the_least_delay_before_the_retry(server: FakeServer) -> None:
    client = server.run(reset(server.client()))
    first = server.take(ORCHESTRATOR, "Reset", client)
    answered = time.monotonic()
    first.fail(
        grpc.StatusCode.UNAVAILABLE,
        "shutting down",
        error_details_pb2.RetryInfo(retry_delay=duration_pb2.Duration(nanos=300_000_000)),
    )
    second = server.take(ORCHESTRATOR, "Reset", client)
    assert second.arrived - answered >= 0.3  # the backoff alone would be 0.01 s
    second.answer(orchestrator_pb2.ResetResponse(session_id="s-1"))
    assert outcome(client).session_id == "s-1"


def test_a_retry_info_longer_than_the_time_left_ends_the_call_now(server: FakeServer) -> None:
    client = server.run(reset(server.client(), timeout=1.0))
    started = time.monotonic()
    server.take(ORCHESTRATOR, "Reset", client).fail(
        grpc.StatusCode.UNAVAILABLE, "busy", error_details_pb2.RetryInfo(retry_delay=duration_pb2.Duration(seconds=30))
    )
    assert isinstance(error_of(client), errors.Unavailable)
    assert time.monotonic() - started < 1.0  # it did not sleep into a deadline it could not meet


# -- metadata -------------------------------------------------------------------------------------------------
def test_orchestrator_calls_carry_the_api_key_and_a_trace_id(server: FakeServer) -> None:
    client = server.run(reset(server.client(api_key="key-1")))
    rpc = server.take(ORCHESTRATOR, "Reset", client)
    rpc.answer(orchestrator_pb2.ResetResponse())
    outcome(client)
    assert rpc.metadata["authorization"] == "Bearer key-1"
    assert rpc.metadata[TRACE_HEADER]


def test_without_an_api_key_no_authorization_is_sent(server: FakeServer) -> None:
    client = server.run(reset(server.client()))
    rpc = server.take(ORCHESTRATOR, "Reset", client)
    rpc.answer(orchestrator_pb2.ResetResponse())
    outcome(client)
    assert "authorization" not in rpc.metadata


def test_gateway_calls_carry_the_agent_token_not_the_api_key(server: FakeServer) -> None:
    client = server.run(call_tool(server.client(api_key="key-1"), trace_id="t-42"))
    rpc = server.take(GATEWAY, "CallTool", client)
    rpc.answer(toolgateway_pb2.CallToolResponse())
    outcome(client)
    assert rpc.metadata["authorization"] == "Bearer rlg1.s-1.secret"
    assert rpc.metadata[TRACE_HEADER] == "t-42"
    assert rpc.request.arguments_json == '{"x":1}' and rpc.request.name == "echo"


def test_each_call_has_its_own_trace_id_unless_given(server: FakeServer) -> None:
    c = server.client()
    seen = []
    for _ in range(2):
        client = server.run(state(c))
        rpc = server.take(ORCHESTRATOR, "State", client)
        rpc.answer(orchestrator_pb2.StateResponse())
        outcome(client)
        seen.append(rpc.metadata[TRACE_HEADER])
    assert len(set(seen)) == 2
