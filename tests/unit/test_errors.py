"""One error hierarchy: what a service raises is the class, reason, metadata, field, subject and retry delay a
client reads back from the google.rpc.Status it sent (rlgate.core.errors, both sides)."""

from __future__ import annotations

import pickle

import grpc
import pytest

import rlgate
from rlgate import errors as public
from rlgate.core import errors
from rlgate.core.errors import RlgateError, error_class

SENT: list[RlgateError] = [
    errors.InvalidArgument("tool_calls[0].name", "required"),
    errors.NotFound("unknown session 's-1'", reason="SESSION_NOT_FOUND", metadata={"session_id": "s-1"}),
    errors.FailedPrecondition("session s-1 was closed", reason="SESSION_CLOSED", metadata={"session_id": "s-1"}),
    errors.ResourceExhausted("at most 4 sessions", subject="sessions", reason="MAX_SESSIONS", retry_after_s=1.5),
    errors.Unavailable("session store unavailable", reason="STORE_UNAVAILABLE", retry_after_s=0.25),
    errors.DeadlineExceeded("deadline exceeded while listing tools", retry_after_s=2.0),
    errors.DeadlineExceeded("deadline exceeded before listing tools"),
    errors.Unauthenticated("unknown agent token"),
    errors.Internal("a bug"),
]


@pytest.mark.parametrize("sent", SENT, ids=lambda e: f"{type(e).__name__}:{e.reason}")
def test_a_client_reads_back_what_a_service_raised(sent: RlgateError) -> None:
    status = sent.to_status()
    assert sent.code is not None and status.code == sent.code.value[0]
    received = error_class(sent.code).from_status(sent.message, code=sent.code, trace_id="t-1", rich_status=status)
    assert type(received) is type(sent)
    mine = {k: v for k, v in vars(sent).items() if k not in ("trace_id", "rich_status")}
    assert {k: v for k, v in vars(received).items() if k in mine} == mine
    assert received.trace_id == "t-1" and received.rich_status == status
    assert received.to_status() == status  # and would send the same status again
    back = pickle.loads(pickle.dumps(received))
    assert type(back) is type(sent) and vars(back) == vars(received)


def test_the_public_path_is_the_core_hierarchy() -> None:
    for name in public.__all__:
        assert getattr(public, name) is getattr(errors, name)
    assert rlgate.InvalidArgument is errors.InvalidArgument and issubclass(rlgate.DeadlineExceeded, TimeoutError)


def test_a_message_without_a_field_is_the_whole_message() -> None:
    refused = errors.InvalidArgument("call_tool(): arguments must be a mapping")
    assert refused.field == "" and refused.message == "call_tool(): arguments must be a mapping"
    assert len(refused.to_status().details) == 1  # ErrorInfo only: no BadRequest without a field


def test_a_status_without_details_gives_the_class_and_its_defaults() -> None:
    received = error_class(grpc.StatusCode.UNAVAILABLE).from_status("Reset: down", code=grpc.StatusCode.UNAVAILABLE)
    assert isinstance(received, errors.Unavailable) and received.retry_after_s is None
    other = error_class(grpc.StatusCode.ABORTED).from_status("Reset: aborted", code=grpc.StatusCode.ABORTED)
    assert type(other) is RlgateError and other.code is grpc.StatusCode.ABORTED and str(other).startswith("ABORTED:")


def test_a_url_key_never_leaves_in_an_error() -> None:
    error = errors.Unavailable("https://u:secret@mcp.example/mcp?token=k failed", metadata={"url": "http://h/?k=v"})
    assert "secret" not in error.message and "token" not in error.message and "k=v" not in error.metadata["url"]
