"""RetryState decisions without a server: which codes each RPC retries, attempt and deadline bounds, and
a server's RetryInfo delay."""

from __future__ import annotations

import grpc
import pytest
from google.protobuf import any_pb2, duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2

import rlgate
from rlgate.core.backoff import Backoff
from rlgate.errors import rich_status_of
from rlgate.retry import RetryPolicy, RetryState


class FakeRpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, trailing: tuple[tuple[str, bytes], ...] = ()) -> None:
        self._code, self._trailing = code, trailing

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return f"fake {self._code.name}"

    # grpc's items are (key, value) namedtuples; the stubs' _Metadatum has the fields but is no tuple.
    def trailing_metadata(self) -> tuple[tuple[str, bytes], ...]:  # type: ignore[override]
        return self._trailing


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _state(method: str, *, timeout: float | None = 10.0, **policy: object) -> RetryState:
    return RetryState(method, RetryPolicy(jitter=0.0, **policy), timeout=timeout, clock=Clock())  # type: ignore[arg-type]


@pytest.mark.parametrize("method", ["Reset", "Step", "State", "Close", "ListTools", "CallTool"])
def test_unavailable_is_retried_everywhere(method: str) -> None:
    state = _state(method)
    state.attempt_timeout()
    assert state.on_error(FakeRpcError(grpc.StatusCode.UNAVAILABLE)) == pytest.approx(0.1)
    state.attempt_timeout()
    assert state.on_error(FakeRpcError(grpc.StatusCode.UNAVAILABLE)) == pytest.approx(0.2)


@pytest.mark.parametrize(("method", "retried"), [("Reset", True), ("Step", True), ("State", True), ("CallTool", False)])
def test_a_call_the_server_cancelled_is_retried_except_for_call_tool(method: str, retried: bool) -> None:
    """CANCELLED as a status is the server's doing (a caller's own cancel raises CancelledError instead):
    Reset and Step repeat under their request_id, reads and Close are safe; a CallTool may have run."""
    state = _state(method)
    state.attempt_timeout()
    error = FakeRpcError(grpc.StatusCode.CANCELLED)
    if retried:
        assert state.on_error(error) == pytest.approx(0.1)
    else:
        with pytest.raises(rlgate.Cancelled):
            state.on_error(error)


@pytest.mark.parametrize(("method", "retried"), [("Reset", True), ("Step", True), ("CallTool", False)])
def test_attempt_deadline_is_retried_except_for_call_tool(method: str, retried: bool) -> None:
    state = _state(method, attempt_timeout=1.0)
    assert state.attempt_timeout() == 1.0
    error = FakeRpcError(grpc.StatusCode.DEADLINE_EXCEEDED)
    if retried:
        assert state.on_error(error) > 0
    else:
        with pytest.raises(rlgate.DeadlineExceeded):
            state.on_error(error)


@pytest.mark.parametrize(
    "code",
    [grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED],
)
def test_caller_errors_are_never_retried(code: grpc.StatusCode) -> None:
    state = _state("Reset")
    state.attempt_timeout()
    with pytest.raises(rlgate.RlgateError) as info:
        state.on_error(FakeRpcError(code))
    assert info.value.code == code


def test_the_deadline_bounds_attempts_and_sleeps() -> None:
    clock = Clock()
    state = RetryState("Reset", RetryPolicy(jitter=0.0, initial_backoff=1.0), timeout=2.5, clock=clock)
    assert state.attempt_timeout() == 2.5
    clock.now = 1.0
    assert state.on_error(FakeRpcError(grpc.StatusCode.UNAVAILABLE)) == 1.0
    clock.now = 2.0
    assert state.attempt_timeout() == pytest.approx(0.5)
    with pytest.raises(rlgate.Unavailable):  # the next sleep (2 s) would pass the deadline
        state.on_error(FakeRpcError(grpc.StatusCode.UNAVAILABLE))


def test_server_retry_info_sets_a_minimum_delay() -> None:
    info = error_details_pb2.RetryInfo(retry_delay=duration_pb2.Duration(seconds=3))
    detail = any_pb2.Any()
    detail.Pack(info)
    status = status_pb2.Status(code=code_pb2.UNAVAILABLE, message="fake UNAVAILABLE", details=[detail])
    error = FakeRpcError(grpc.StatusCode.UNAVAILABLE, (("grpc-status-details-bin", status.SerializeToString()),))
    state = _state("Step", timeout=60.0)
    state.attempt_timeout()
    assert state.on_error(error) == pytest.approx(3.0)


def _rich(code: int, message: str, *details: object) -> bytes:
    packed = []
    for detail in details:
        item = any_pb2.Any()
        item.Pack(detail)  # type: ignore[arg-type]
        packed.append(item)
    return status_pb2.Status(code=code, message=message, details=packed).SerializeToString()


def test_retry_info_counts_when_the_status_message_differs_from_the_call_details() -> None:
    """The call's details and the status message may differ (a proxy rewrites one, a server clips one):
    the details still count. grpc_status's from_call would drop them."""
    info = error_details_pb2.RetryInfo(retry_delay=duration_pb2.Duration(seconds=2, nanos=500_000_000))
    trailer = _rich(code_pb2.UNAVAILABLE, "another text than the call's details", info)
    state = _state("CallTool", timeout=60.0)
    state.attempt_timeout()
    error = FakeRpcError(grpc.StatusCode.UNAVAILABLE, (("grpc-status-details-bin", trailer),))
    assert state.on_error(error) == pytest.approx(2.5)


def test_a_status_of_another_code_or_garbage_is_not_this_calls() -> None:
    info = error_details_pb2.RetryInfo(retry_delay=duration_pb2.Duration(seconds=3))
    for trailer in (_rich(code_pb2.NOT_FOUND, "x", info), b"\xff\xff not a status"):
        error = FakeRpcError(grpc.StatusCode.UNAVAILABLE, (("grpc-status-details-bin", trailer),))
        assert rich_status_of(error) is None
        state = _state("Step", timeout=60.0)
        state.attempt_timeout()
        assert state.on_error(error) == pytest.approx(0.1)  # the policy's own backoff


@pytest.mark.parametrize("method", ["Reset", "Step", "State", "ListTools", "CallTool"])
def test_a_reply_budget_refusal_is_retried_by_every_rpc_after_its_retry_info(method: str) -> None:
    """RESOURCE_EXHAUSTED with reason REPLY_BUDGET was refused before any work (the connection left too
    many replies unread): safe to retry for every RPC, CallTool's too, once the RetryInfo's delay passed."""
    budget = error_details_pb2.ErrorInfo(reason="REPLY_BUDGET", domain="rlgate.dev")
    info = error_details_pb2.RetryInfo(retry_delay=duration_pb2.Duration(seconds=1))
    trailer = _rich(code_pb2.RESOURCE_EXHAUSTED, "replies unread", budget, info)
    state = _state(method, timeout=60.0)
    state.attempt_timeout()
    error = FakeRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, (("grpc-status-details-bin", trailer),))
    assert state.on_error(error) == pytest.approx(1.0)


def test_another_resource_exhausted_is_not_retried() -> None:
    quota = error_details_pb2.ErrorInfo(reason="SESSION_LIMIT", domain="rlgate.dev")
    trailer = _rich(code_pb2.RESOURCE_EXHAUSTED, "too many sessions", quota)
    state = _state("CallTool", timeout=60.0)
    state.attempt_timeout()
    with pytest.raises(rlgate.ResourceExhausted):
        state.on_error(FakeRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, (("grpc-status-details-bin", trailer),)))


def test_the_policy_draws_its_delays_from_the_one_backoff_schedule() -> None:
    policy = RetryPolicy(initial_backoff=0.2, max_backoff=3.0, multiplier=3.0, jitter=0.25)
    schedule = Backoff(initial=0.2, maximum=3.0, multiplier=3.0, jitter=0.25)
    for draw in (0.0, 0.3, 0.999):

        def rng(d: float = draw) -> float:
            return d

        assert [policy.backoff(i, rng) for i in range(8)] == [schedule.delay(i, rng) for i in range(8)]
    assert policy.backoff(10_000, rng=lambda: 0.5) == pytest.approx(3.0)  # capped, never an overflow


def test_a_spent_deadline_keeps_its_advice_after_a_long_last_error() -> None:
    state = _state("Step", max_attempts=5)
    state.errors.append("x" * 5000)
    state.clock.now = 11.0  # type: ignore[attr-defined]
    with pytest.raises(rlgate.DeadlineExceeded) as info:
        state.attempt_timeout()
    assert info.value.message.endswith("to wait longer, pass a larger timeout= or set ClientSettings.timeouts")
