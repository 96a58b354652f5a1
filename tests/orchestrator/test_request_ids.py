"""Request ids through the orchestrator's gRPC API: scoped to the caller (the API key) and bound to the
request they were first used with. A reuse with other parameters is INVALID_ARGUMENT naming the field and
leaves the first request's session and agent token alone; the same id from another API key is another
request. Real localfleet, SQLite store, toolgateway and orchestrator."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2

from rlgate.core.convert import json_text, struct_from_dict
from rlgate.toolgateway.server import GatewayHandle
from rlgate.v1 import common_pb2, orchestrator_pb2
from tests.orchestrator.conftest import Running, fast_config, list_tools_code
from tests.support.localfleet import LocalfleetProcess
from tests.support.statuses import rich_status

TASK = "mailbox-count-unread-from-kenji"
OTHER_TASK = "tracker-assign-self"
KEY_A, KEY_B = "key-a-" + "a" * 20, "key-b-" + "b" * 20


def field_of(err: grpc.aio.AioRpcError) -> str:
    """The field an INVALID_ARGUMENT names (BadRequest), checked against its message."""
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err
    status = rich_status(err)
    assert status is not None
    bad = error_details_pb2.BadRequest()
    assert any(d.Unpack(bad) for d in status.details)
    (violation,) = bad.field_violations
    assert (err.details() or "").startswith(f"{violation.field}:")
    return violation.field


async def refused(call: Any) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call
    return field_of(err.value)


async def test_a_reset_request_id_reused_with_other_parameters_is_invalid_argument(
    lf: LocalfleetProcess,
    gateway: GatewayHandle,
    orchestrator_factory: Callable[..., Any],
) -> None:
    orch: Running = await orchestrator_factory(fast_config(lf, gateway_address=gateway.address))
    fields: dict[str, Any] = {
        "task_key": TASK,
        "request_id": "bound-1",
        "labels": {"team": "a"},
        "run_id": "run-1",
        "max_turns": 5,
    }
    first = await orch.stub.Reset(orchestrator_pb2.ResetRequest(**fields), timeout=60)
    assert await list_tools_code(gateway, first.agent_token) == grpc.StatusCode.OK
    changes: list[tuple[dict[str, Any], str]] = [
        ({"task_key": OTHER_TASK}, "task_key"),
        ({"labels": {"team": "b"}}, "labels"),
        ({"labels": {}}, "labels"),
        ({"run_id": "run-2"}, "run_id"),
        ({"max_turns": 6}, "max_turns"),
        ({"task_key": "", "env_key": "mailbox:v1"}, "task_key"),
        ({"task_key": "", "session_id": first.session_id}, "session_id"),
    ]
    for change, field in changes:
        request = orchestrator_pb2.ResetRequest(**{**fields, **change})
        assert await refused(orch.stub.Reset(request, timeout=60)) == field, change
        # Never the other session's, and its token was not rotated: it still reaches the gateway.
        assert await list_tools_code(gateway, first.agent_token) == grpc.StatusCode.OK, change
    sessions = await orch.stub.ListSessions(orchestrator_pb2.ListSessionsRequest(run_id="run-1"), timeout=10)
    assert [s.session_id for s in sessions.sessions] == [first.session_id]
    state = await orch.stub.State(orchestrator_pb2.StateRequest(session_id=first.session_id), timeout=10)
    assert (state.session.episode, state.session.max_turns, dict(state.session.labels)) == (1, 5, {"team": "a"})
    # The same request again is a retry: the same session and episode, a fresh token.
    again = await orch.stub.Reset(orchestrator_pb2.ResetRequest(**fields), timeout=60)
    assert (again.session_id, again.episode) == (first.session_id, 1) and again.agent_token != first.agent_token


async def test_concurrent_reuse_with_other_parameters_is_refused_while_the_first_runs(orch: Running) -> None:
    one = orchestrator_pb2.ResetRequest(task_key=TASK, request_id="race-1")
    other = orchestrator_pb2.ResetRequest(task_key=TASK, request_id="race-1", max_turns=3)
    results = await asyncio.gather(
        orch.stub.Reset(one, timeout=60), orch.stub.Reset(other, timeout=60), return_exceptions=True
    )
    answered = [r for r in results if isinstance(r, orchestrator_pb2.ResetResponse)]
    errors = [r for r in results if isinstance(r, grpc.aio.AioRpcError)]
    assert len(answered) == 1 and len(errors) == 1, results
    assert field_of(errors[0]) == "max_turns"


async def test_request_ids_are_scoped_to_the_api_key(
    lf: LocalfleetProcess,
    gateway: GatewayHandle,
    orchestrator_factory: Callable[..., Any],
) -> None:
    orch: Running = await orchestrator_factory(
        fast_config(lf, gateway_address=gateway.address, api_keys=[KEY_A, KEY_B])
    )
    as_a = [("authorization", f"Bearer {KEY_A}")]
    as_b = [("authorization", f"Bearer {KEY_B}")]
    request = orchestrator_pb2.ResetRequest(task_key=TASK, request_id="shared-1")
    a = await orch.stub.Reset(request, metadata=as_a, timeout=60)
    b = await orch.stub.Reset(request, metadata=as_b, timeout=60)
    assert a.session_id != b.session_id  # another caller's request_id is another request
    # B's same id with other parameters is B's own first use: no conflict with A's.
    b_other = await orch.stub.Reset(
        orchestrator_pb2.ResetRequest(task_key=OTHER_TASK, request_id="shared-2"), metadata=as_b, timeout=60
    )
    a_other = await orch.stub.Reset(
        orchestrator_pb2.ResetRequest(task_key=TASK, request_id="shared-2"), metadata=as_a, timeout=60
    )
    assert len({a.session_id, b.session_id, b_other.session_id, a_other.session_id}) == 4
    for reply in (a, b, b_other, a_other):
        assert await list_tools_code(gateway, reply.agent_token) == grpc.StatusCode.OK
    # A's retry rotates only A's token.
    a_again = await orch.stub.Reset(request, metadata=as_a, timeout=60)
    assert a_again.session_id == a.session_id
    assert await list_tools_code(gateway, a.agent_token) == grpc.StatusCode.FAILED_PRECONDITION  # replaced
    assert await list_tools_code(gateway, b.agent_token) == grpc.StatusCode.OK

    # Step ids too: the same id on each caller's own session is two requests; one caller reusing it for
    # another session is INVALID_ARGUMENT.
    turn_a = await orch.stub.Step(
        orchestrator_pb2.StepRequest(session_id=a.session_id, request_id="turn-1"), metadata=as_a, timeout=30
    )
    turn_b = await orch.stub.Step(
        orchestrator_pb2.StepRequest(session_id=b.session_id, request_id="turn-1"), metadata=as_b, timeout=30
    )
    assert (turn_a.turn, turn_b.turn) == (1, 1)
    misuse = orch.stub.Step(
        orchestrator_pb2.StepRequest(session_id=b.session_id, request_id="turn-1"), metadata=as_a, timeout=30
    )
    assert await refused(misuse) == "session_id"


async def test_a_step_request_id_reused_with_other_contents_is_invalid_argument(orch: Running) -> None:
    reset = await orch.stub.Reset(orchestrator_pb2.ResetRequest(env_key="mailbox:v1"), timeout=60)
    sid = reset.session_id
    other = await orch.stub.Reset(orchestrator_pb2.ResetRequest(env_key="mailbox:v1"), timeout=60)
    call = orchestrator_pb2.ToolCallSummary(
        name="search_messages", request_id="c1", arguments=struct_from_dict({"sender": "Kenji Brown", "limit": 1})
    )
    fields: dict[str, Any] = {"session_id": sid, "request_id": "t-1", "assistant_text": "looking", "tool_calls": [call]}
    first = await orch.stub.Step(orchestrator_pb2.StepRequest(**fields), timeout=30)
    # The same contents with the arguments as JSON text is the same request: a replay.
    as_text = orchestrator_pb2.ToolCallSummary(
        name="search_messages", request_id="c1", arguments_json=json_text({"limit": 1, "sender": "Kenji Brown"})
    )
    assert (
        await orch.stub.Step(orchestrator_pb2.StepRequest(**{**fields, "tool_calls": [as_text]}), timeout=30) == first
    )
    changed_call = orchestrator_pb2.ToolCallSummary(
        name="search_messages", request_id="c1", arguments_json=json_text({"sender": "Kenji Brown", "limit": 2})
    )
    changes: list[tuple[dict[str, Any], str]] = [
        ({"assistant_text": "other"}, "assistant_text"),
        ({"tool_calls": []}, "tool_calls"),
        ({"tool_calls": [changed_call]}, "tool_calls"),
        ({"final_answer": "3"}, "final_answer"),
        ({"done": True}, "done"),
        ({"session_id": other.session_id}, "session_id"),
    ]
    for change, field in changes:
        request = orchestrator_pb2.StepRequest(**{**fields, **change})
        assert await refused(orch.stub.Step(request, timeout=30)) == field, change
    for session_id, turn in ((sid, 1), (other.session_id, 0)):
        state = await orch.stub.State(orchestrator_pb2.StateRequest(session_id=session_id), timeout=10)
        assert (state.session.turn, state.session.status) == (turn, common_pb2.SESSION_STATUS_ACTIVE), session_id


async def test_tool_call_arguments_that_are_not_json_are_invalid_argument(orch: Running) -> None:
    reset = await orch.stub.Reset(orchestrator_pb2.ResetRequest(env_key="mailbox:v1"), timeout=60)
    bad = orchestrator_pb2.ToolCallSummary(name="search_messages", arguments_json="{not json")
    request = orchestrator_pb2.StepRequest(session_id=reset.session_id, request_id="t-bad", tool_calls=[bad])
    assert await refused(orch.stub.Step(request, timeout=30)) == "tool_calls[0].arguments_json"
