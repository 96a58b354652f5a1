"""Every request input is bounded, through the real server: label counts and sizes on Reset, label filters
on CloseSessions and ListSessions, and ids far past their limits answer INVALID_ARGUMENT / NOT_FOUND with a
short status; nothing the server logs grows with the request."""

from __future__ import annotations

import logging
from typing import Any

import grpc
import pytest

from rlgate.orchestrator.limits import MAX_LABEL, MAX_LABELS
from rlgate.v1 import orchestrator_pb2
from tests.orchestrator.conftest import Running
from tests.support.statuses import rich_status

SC = grpc.StatusCode
HUGE = 1 << 20  # characters: far past every limit, well under the 16 MiB message limit
TASK = "mailbox-count-unread-from-kenji"


def labels(n: int, *, key_len: int = 8, value_len: int = 8) -> dict[str, str]:
    return {f"{i:0{key_len}d}"[-key_len:]: "v" * value_len for i in range(n)}


async def refused(call: Any) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call
    return err.value


def field_of(err: grpc.aio.AioRpcError) -> str:
    """The field the status's BadRequest names ("" without one)."""
    from google.rpc import error_details_pb2

    status = rich_status(err)
    for detail in status.details if status else ():
        bad = error_details_pb2.BadRequest()
        if detail.Unpack(bad):
            return bad.field_violations[0].field
    return ""


def small(err: grpc.aio.AioRpcError) -> bool:
    """The status (message and details) stays far below a client's 16 KiB metadata limit."""
    status = rich_status(err)
    return len(err.details() or "") < 1200 and (status is None or status.ByteSize() < 3000)


async def test_label_filters_are_bounded(orch: Running) -> None:
    """More label filters than MAX_LABELS is the caller's INVALID_ARGUMENT (it was UNAVAILABLE from the store
    past ~1,000), and MAX_LABELS filters work."""
    at_limit = labels(MAX_LABELS, key_len=MAX_LABEL, value_len=MAX_LABEL)
    listed = await orch.stub.ListSessions(orchestrator_pb2.ListSessionsRequest(labels=at_limit), timeout=30)
    assert list(listed.sessions) == []
    closed = await orch.stub.CloseSessions(orchestrator_pb2.CloseSessionsRequest(labels=at_limit), timeout=30)
    assert list(closed.session_ids) == []
    for n in (MAX_LABELS + 1, 1_001, 5_000):
        for call in (
            orch.stub.ListSessions(orchestrator_pb2.ListSessionsRequest(labels=labels(n)), timeout=30),
            orch.stub.CloseSessions(orchestrator_pb2.CloseSessionsRequest(labels=labels(n)), timeout=30),
        ):
            err = await refused(call)
            assert err.code() == SC.INVALID_ARGUMENT and field_of(err) == "labels", (n, err)
            assert f"at most {MAX_LABELS} labels" in (err.details() or "") and small(err)


async def test_reset_labels_are_bounded(orch: Running) -> None:
    for bad in (
        labels(MAX_LABELS + 1),
        {"k" * (MAX_LABEL + 1): "v"},
        {"k": "v" * (MAX_LABEL + 1)},
        {"": "v"},
        {"k" * HUGE: "v"},
        {"k": "v" * HUGE},
    ):
        err = await refused(orch.stub.Reset(orchestrator_pb2.ResetRequest(task_key=TASK, labels=bad), timeout=30))
        assert err.code() == SC.INVALID_ARGUMENT and field_of(err) == "labels" and small(err), err
    # MAX_LABELS labels of the longest key and value: a session carrying them all, found by all of them.
    most = labels(MAX_LABELS, key_len=MAX_LABEL, value_len=MAX_LABEL)
    reset = await orch.stub.Reset(orchestrator_pb2.ResetRequest(task_key=TASK, labels=most), timeout=60)
    try:
        found = await orch.stub.ListSessions(orchestrator_pb2.ListSessionsRequest(labels=most), timeout=30)
        assert [s.session_id for s in found.sessions] == [reset.session_id]
        assert dict(found.sessions[0].labels) == most
    finally:
        await orch.stub.Close(orchestrator_pb2.CloseRequest(session_id=reset.session_id), timeout=60)


@pytest.mark.parametrize(
    ("request_", "code", "field"),
    [
        (orchestrator_pb2.ResetRequest(run_id="r" * HUGE), SC.INVALID_ARGUMENT, "run_id"),
        (orchestrator_pb2.ResetRequest(request_id="r" * HUGE), SC.INVALID_ARGUMENT, "request_id"),
        (orchestrator_pb2.ResetRequest(env_key="e" * HUGE), SC.INVALID_ARGUMENT, "env_key"),
        (orchestrator_pb2.ResetRequest(task_key="t" * HUGE), SC.NOT_FOUND, ""),
        (orchestrator_pb2.ResetRequest(session_id="s" * HUGE), SC.NOT_FOUND, ""),
        (orchestrator_pb2.StepRequest(session_id="s" * HUGE), SC.NOT_FOUND, ""),
        (orchestrator_pb2.StateRequest(session_id="s" * HUGE), SC.NOT_FOUND, ""),
        (orchestrator_pb2.CloseRequest(session_id="s" * HUGE), SC.NOT_FOUND, ""),
        (orchestrator_pb2.CloseSessionsRequest(run_id="r" * HUGE), SC.INVALID_ARGUMENT, "run_id"),
        (orchestrator_pb2.ListSessionsRequest(run_id="r" * HUGE), SC.INVALID_ARGUMENT, "run_id"),
        (orchestrator_pb2.ListSessionsRequest(page_token="p" * HUGE), SC.INVALID_ARGUMENT, "page_token"),
        (orchestrator_pb2.ListTasksRequest(env_key="e" * HUGE), SC.INVALID_ARGUMENT, "env_key"),
        (orchestrator_pb2.ListTasksRequest(page_token="p" * HUGE), SC.INVALID_ARGUMENT, "page_token"),
    ],
    ids=lambda v: type(v).__name__ if hasattr(v, "DESCRIPTOR") else str(v),
)
async def test_huge_ids_answer_short_statuses_and_short_logs(
    orch: Running, caplog: pytest.LogCaptureFixture, request_: Any, code: grpc.StatusCode, field: str
) -> None:
    method = getattr(orch.stub, request_.DESCRIPTOR.name.removesuffix("Request"))
    with caplog.at_level(logging.DEBUG):
        err = await refused(method(request_, timeout=30))
    assert err.code() == code and small(err), err
    if field:
        assert field_of(err) == field
    longest = max((len(r.getMessage()) for r in caplog.records), default=0)
    assert longest < 4096, [r.getMessage()[:200] for r in caplog.records if len(r.getMessage()) >= 4096]
