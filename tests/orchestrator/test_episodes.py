"""Episodes end to end: localfleet through the real fleet-python SDK, the real SQLite store, the real
toolgateway in-process, the orchestrator over gRPC."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import grpc
import pytest
from google.rpc import error_details_pb2
from prometheus_client import REGISTRY

from rlgate.core.convert import parse_json_object, parse_json_text, struct_from_dict
from rlgate.ledger import decode_result, scope
from rlgate.runtime.auth import session_of_token, token_hash
from rlgate.store import SessionStore
from rlgate.toolgateway.server import GatewayHandle
from rlgate.v1 import common_pb2, orchestrator_pb2, toolgateway_pb2, toolgateway_pb2_grpc
from tests.orchestrator.conftest import (
    Running,
    bundled_task,
    bundled_tasks,
    call_tool,
    fast_config,
    instances_of,
    list_tools_code,
    result_text,
)
from tests.support.localfleet import LocalfleetProcess
from tests.support.statuses import detail, rich_status

# One task per bundled environment whose reference solution needs nothing from earlier results.
REFERENCE_TASKS = {
    "mailbox": "mailbox-count-unread-from-kenji",
    "tracker": "tracker-assign-self",
    "booking": "booking-cancel-tokyo-hotel",
}


def test_reference_tasks_cover_every_bundled_environment() -> None:
    """A task renamed or removed, or a new environment, fails here (and its episode test) instead of the
    episode tests silently running fewer tasks."""
    envs = {t["env_id"] for t in bundled_tasks()}
    assert set(REFERENCE_TASKS) == envs, (
        f"bundled environments {sorted(envs)}; REFERENCE_TASKS names {sorted(REFERENCE_TASKS)}"
    )
    for env_id, key in REFERENCE_TASKS.items():
        assert bundled_task(key)["env_id"] == env_id, key


@pytest.mark.parametrize("env_id", sorted(REFERENCE_TASKS))
async def test_full_episode_with_reference_solution_scores_1(
    env_id: str,
    lf: LocalfleetProcess,
    gateway: GatewayHandle,
    orchestrator_factory: Callable[..., Any],
) -> None:
    task = bundled_task(REFERENCE_TASKS[env_id])
    orch: Running = await orchestrator_factory(fast_config(lf, gateway_address=gateway.address))
    reset = await orch.stub.Reset(orchestrator_pb2.ResetRequest(task_key=task["key"], request_id="ep-1"), timeout=60)
    assert reset.episode == 1 and reset.agent_token and reset.gateway_address == gateway.address
    assert reset.prompt == task["prompt"] and reset.messages[0].content == task["prompt"]
    assert reset.task.reference_solution_json == ""  # an answer key: never in Reset
    metadata = parse_json_object(reset.task.metadata_json)
    assert "reference_solution" not in metadata  # the rest of the task's metadata travels as JSON text
    assert metadata.items() >= {k: v for k, v in task["metadata"].items() if k != "reference_solution"}.items()
    names = {t.name for t in reset.tools}
    assert "computer" not in names  # tool_use modality filter
    # The gateway serves exactly the tools Reset announced.
    async with grpc.aio.insecure_channel(gateway.address) as channel:
        listed = await toolgateway_pb2_grpc.ToolGatewayServiceStub(channel).ListTools(
            toolgateway_pb2.ListToolsRequest(), metadata=[("authorization", f"Bearer {reset.agent_token}")], timeout=30
        )
    assert [t.name for t in listed.tools] == [t.name for t in reset.tools]

    solution = task["metadata"]["reference_solution"]
    for i, call in enumerate(solution["tool_calls"]):
        result = await call_tool(gateway.address, reset.agent_token, call["name"], call["arguments"])
        assert not result.is_error, result_text(result)
        step = await orch.stub.Step(
            orchestrator_pb2.StepRequest(
                session_id=reset.session_id,
                request_id=f"turn-{i}",
                assistant_text=f"calling {call['name']}",
                tool_calls=[
                    orchestrator_pb2.ToolCallSummary(name=call["name"], arguments=struct_from_dict(call["arguments"]))
                ],
            ),
            timeout=60,
        )
        assert not step.done and step.turn == i + 1
    final: dict[str, Any] = {}
    if solution.get("final_answer") is not None:
        final["final_answer"] = solution["final_answer"]
    else:
        final["done"] = True
    step = await orch.stub.Step(orchestrator_pb2.StepRequest(session_id=reset.session_id, **final), timeout=60)
    assert step.done and not step.truncated
    assert step.verification.status == common_pb2.VERIFICATION_STATUS_OK, step.verification.message
    assert step.HasField("reward") and step.reward == 1.0
    state = await orch.stub.State(
        orchestrator_pb2.StateRequest(session_id=reset.session_id, include_tool_calls=True), timeout=30
    )
    assert state.session.status == common_pb2.SESSION_STATUS_DONE and state.session.reward == 1.0
    assert [c.tool for c in state.tool_calls] == [c["name"] for c in solution["tool_calls"]]
    closed = await orch.stub.Close(orchestrator_pb2.CloseRequest(session_id=reset.session_id), timeout=30)
    assert closed.status == common_pb2.SESSION_STATUS_CLOSED and not closed.already_closed
    assert instances_of(lf, orch.config.run_id) == []
    # The token died with the session (and the gateway can say so).
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call_tool(gateway.address, reset.agent_token, "list_folders", {})
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION


async def test_wrong_answer_is_verified_zero(orch: Running) -> None:
    reset = await orch.stub.Reset(orchestrator_pb2.ResetRequest(task_key="mailbox-count-unread-from-kenji"), timeout=60)
    step = await orch.stub.Step(
        orchestrator_pb2.StepRequest(session_id=reset.session_id, final_answer="9999"), timeout=60
    )
    assert step.done and step.done_reason == orchestrator_pb2.DONE_REASON_FINAL_ANSWER
    assert step.verification.status == common_pb2.VERIFICATION_STATUS_OK
    assert step.HasField("reward") and step.reward == 0.0
    assert "expected" in step.verification.stdout  # the verifier's own output travels
    ok = REGISTRY.get_sample_value("rlgate_orchestrator_verifications_total", {"status": "ok"})
    assert ok is not None and ok >= 1


def _broken_tasks(path: Path) -> str:
    base = dict(bundled_task("mailbox-count-unread-from-kenji"))
    raising = dict(
        base,
        key="broken-raises",
        verifier_code="def verify(env, final_answer=None):\n    raise RuntimeError('verifier bug 42')\n",
    )
    hanging = dict(
        base,
        key="broken-hangs",
        verifier_code="def verify(env, final_answer=None):\n    import time\n    time.sleep(120)\n    return 1.0\n",
    )
    none = dict(base, key="broken-none", verifier_code="def verify(env, final_answer=None):\n    return None\n")
    path.write_text(json.dumps({"tasks": [base, raising, hanging, none]}))
    return str(path)


async def test_verifier_failures_are_never_reward_zero(
    lf: LocalfleetProcess,
    orchestrator_factory: Callable[..., Any],
    tmp_path: Path,
) -> None:
    orch: Running = await orchestrator_factory(
        fast_config(lf, tasks_file=_broken_tasks(tmp_path / "t.json"), verify_timeout_s=3.0)
    )
    listed = await orch.stub.ListTasks(orchestrator_pb2.ListTasksRequest(), timeout=10)
    assert {t.key for t in listed.tasks} >= {"broken-raises", "broken-hangs", "broken-none"}

    async def finish(key: str) -> tuple[orchestrator_pb2.StepResponse, float]:
        reset = await orch.stub.Reset(orchestrator_pb2.ResetRequest(task_key=key), timeout=60)
        start = time.monotonic()
        step = await orch.stub.Step(
            orchestrator_pb2.StepRequest(session_id=reset.session_id, final_answer="3"), timeout=60
        )
        return step, time.monotonic() - start

    (raised, _), (hung, hung_s), (none, _) = await asyncio.gather(
        finish("broken-raises"), finish("broken-hangs"), finish("broken-none")
    )
    assert raised.verification.status == common_pb2.VERIFICATION_STATUS_ERROR
    assert "verifier bug 42" in raised.verification.message
    assert not raised.HasField("reward")
    assert hung.verification.status == common_pb2.VERIFICATION_STATUS_TIMEOUT
    assert not hung.HasField("reward")
    assert hung_s < 3.0 + 5.0  # rlgate's timeout bounds it, not the SDK's 30 s or localfleet's
    assert none.verification.status == common_pb2.VERIFICATION_STATUS_ERROR and not none.HasField("reward")
    for step in (raised, hung, none):  # no reward for a reason that is not the model's: the episode says so
        assert (step.infra_faults.verifier_errors, step.infra_faults.total) == (1, 1)


async def test_env_only_session_is_skipped(orch: Running) -> None:
    reset = await orch.stub.Reset(orchestrator_pb2.ResetRequest(env_key="mailbox:v1", max_turns=3), timeout=60)
    assert reset.prompt == "" and reset.task.key == "" and reset.max_turns == 3 and reset.tools
    step = await orch.stub.Step(orchestrator_pb2.StepRequest(session_id=reset.session_id, done=True), timeout=30)
    assert step.done_reason == orchestrator_pb2.DONE_REASON_AGENT_DONE
    assert step.verification.status == common_pb2.VERIFICATION_STATUS_SKIPPED and not step.HasField("reward")


async def test_reset_with_session_id_restores_seed_and_rotates_token(
    lf: LocalfleetProcess,
    gateway: GatewayHandle,
    orchestrator_factory: Callable[..., Any],
) -> None:
    orch: Running = await orchestrator_factory(fast_config(lf, gateway_address=gateway.address))
    first = await orch.stub.Reset(orchestrator_pb2.ResetRequest(task_key="mailbox-count-unread-from-kenji"), timeout=60)
    made = await call_tool(gateway.address, first.agent_token, "create_folder", {"name": "Scratch-42"})
    assert not made.is_error, result_text(made)
    folders = await call_tool(gateway.address, first.agent_token, "list_folders", {})
    assert "Scratch-42" in result_text(folders)

    second = await orch.stub.Reset(orchestrator_pb2.ResetRequest(session_id=first.session_id, max_turns=4), timeout=60)
    assert second.session_id == first.session_id and second.episode == 2 and second.max_turns == 4
    assert second.agent_token != first.agent_token
    assert second.instance == first.instance and second.instance.instance_id
    folders = await call_tool(gateway.address, second.agent_token, "list_folders", {})
    assert "Scratch-42" not in result_text(folders)  # seed state restored
    with pytest.raises(grpc.aio.AioRpcError) as err:  # the old episode's token is dead, and said to be
        await call_tool(gateway.address, first.agent_token, "list_folders", {})
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION


async def test_hung_reset_on_reused_instance_replaces_it(
    lf: LocalfleetProcess,
    gateway: GatewayHandle,
    orchestrator_factory: Callable[..., Any],
) -> None:
    orch: Running = await orchestrator_factory(fast_config(lf, gateway_address=gateway.address, reset_timeout_s=2.0))
    first = await orch.stub.Reset(orchestrator_pb2.ResetRequest(task_key="mailbox-count-unread-from-kenji"), timeout=60)
    old_id = first.instance.instance_id
    assert not (await call_tool(gateway.address, first.agent_token, "create_folder", {"name": "Dirty"})).is_error
    lf.set_faults({"environments": {"mailbox": {"reset_hang": True}}})
    start = time.monotonic()
    second = await orch.stub.Reset(orchestrator_pb2.ResetRequest(session_id=first.session_id), timeout=60)
    elapsed = time.monotonic() - start
    lf.set_faults({})
    new_id = second.instance.instance_id
    assert new_id != old_id and second.episode == 2
    assert elapsed < 2.0 + 30.0  # the reset timeout, then a fresh create; never the SDK's 300 s
    live = {i["instance_id"] for i in instances_of(lf, orch.config.run_id)}
    assert live == {new_id}  # the dirty instance is gone
    folders = await call_tool(gateway.address, second.agent_token, "list_folders", {})
    assert "Dirty" not in result_text(folders)


async def test_hung_reset_on_fresh_instance_is_not_fatal(
    lf: LocalfleetProcess, orchestrator_factory: Callable[..., Any]
) -> None:
    orch: Running = await orchestrator_factory(fast_config(lf, reset_timeout_s=1.5))
    lf.set_faults({"environments": {"mailbox": {"reset_hang": True}}})
    start = time.monotonic()
    reset = await orch.stub.Reset(orchestrator_pb2.ResetRequest(task_key="mailbox-count-unread-from-kenji"), timeout=60)
    assert reset.session_id and time.monotonic() - start < 1.5 + 20
    assert lf.counters()["reset_hangs"] >= 1


async def test_max_turns_truncates_and_verifies_then_step_after_done(orch: Running) -> None:
    reset = await orch.stub.Reset(
        orchestrator_pb2.ResetRequest(task_key="mailbox-count-unread-from-kenji", max_turns=2), timeout=60
    )
    assert reset.max_turns == 2
    one = await orch.stub.Step(
        orchestrator_pb2.StepRequest(session_id=reset.session_id, assistant_text="hm"), timeout=30
    )
    assert (one.turn, one.done, one.status) == (1, False, common_pb2.SESSION_STATUS_ACTIVE)
    assert one.verification.status == common_pb2.VERIFICATION_STATUS_UNSPECIFIED
    two = await orch.stub.Step(orchestrator_pb2.StepRequest(session_id=reset.session_id), timeout=60)
    assert (two.turn, two.done, two.truncated) == (2, True, True)
    assert two.done_reason == orchestrator_pb2.DONE_REASON_MAX_TURNS
    assert two.verification.status == common_pb2.VERIFICATION_STATUS_OK and two.reward == 0.0  # verified
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await orch.stub.Step(orchestrator_pb2.StepRequest(session_id=reset.session_id, final_answer="3"), timeout=30)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def error_info(err: grpc.aio.AioRpcError) -> error_details_pb2.ErrorInfo:
    return detail(err, error_details_pb2.ErrorInfo)


async def test_duplicate_request_ids_on_reset_and_step(
    lf: LocalfleetProcess, orch: Running, gateway: GatewayHandle
) -> None:
    created_before = lf.counters()["instances_created"]
    req = orchestrator_pb2.ResetRequest(task_key="mailbox-count-unread-from-kenji", request_id="dup-reset")
    a, b = await asyncio.gather(orch.stub.Reset(req, timeout=60), orch.stub.Reset(req, timeout=60))
    c = await orch.stub.Reset(req, timeout=60)
    assert a.session_id == b.session_id == c.session_id and a.episode == b.episode == c.episode == 1
    # Each reply carries its own token (the record keeps none); only the latest one works.
    assert len({a.agent_token, b.agent_token, c.agent_token}) == 3
    assert [await list_tools_code(gateway, r.agent_token) for r in (a, b, c)] == [
        grpc.StatusCode.FAILED_PRECONDITION,  # replaced by a later reply's token
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.OK,
    ]
    assert lf.counters()["instances_created"] - created_before == 1
    assert len(instances_of(lf, orch.config.run_id)) == 1

    step = orchestrator_pb2.StepRequest(session_id=a.session_id, request_id="dup-step", assistant_text="x")
    s1, s2 = await asyncio.gather(orch.stub.Step(step, timeout=30), orch.stub.Step(step, timeout=30))
    s3 = await orch.stub.Step(step, timeout=30)
    assert s1.turn == s2.turn == s3.turn == 1
    other = await orch.stub.Step(orchestrator_pb2.StepRequest(session_id=a.session_id, request_id="step-2"), timeout=30)
    assert other.turn == 2


async def test_reset_replay_mints_a_new_token_and_the_record_keeps_none(
    orch: Running,
    store: SessionStore,
    gateway: GatewayHandle,
) -> None:
    """Tokens are stored only as hashes: Reset's request record has no token, a repeat of the request_id
    gets a fresh one (revoking the earlier reply's), concurrent repeats converge on one valid token, and a
    repeat after the episode is over is FAILED_PRECONDITION naming the session."""
    req = orchestrator_pb2.ResetRequest(task_key="mailbox-count-unread-from-kenji", request_id="replay-1")
    first = await orch.stub.Reset(req, timeout=60)
    record = await store.get_request(scope("reset", ""), "replay-1")
    assert record is not None
    kept = orchestrator_pb2.ResetResponse.FromString(decode_result(record.result)[1])
    assert kept.session_id == first.session_id and kept.tools and kept.agent_token == ""

    again = await orch.stub.Reset(req, timeout=60)
    assert (again.session_id, again.episode, list(again.tools)) == (first.session_id, 1, list(first.tools))
    assert again.agent_token and again.agent_token != first.agent_token
    assert await list_tools_code(gateway, first.agent_token) == grpc.StatusCode.FAILED_PRECONDITION
    assert await list_tools_code(gateway, again.agent_token) == grpc.StatusCode.OK

    # Concurrent repeats: every one answers; the session holds exactly one of their tokens.
    replies = await asyncio.gather(*(orch.stub.Reset(req, timeout=60) for _ in range(6)))
    assert {r.session_id for r in replies} == {first.session_id}
    session = await store.get_session(first.session_id)
    assert session is not None
    valid = [r.agent_token for r in replies if token_hash(r.agent_token) == session.token_hash]
    assert len(valid) == 1 and len({r.agent_token for r in replies}) == 6
    assert await list_tools_code(gateway, valid[0]) == grpc.StatusCode.OK

    # The episode is over: the repeat cannot hand out a token for it.
    await orch.stub.Step(orchestrator_pb2.StepRequest(session_id=first.session_id, done=True), timeout=60)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await orch.stub.Reset(req, timeout=60)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    info = error_info(err.value)
    assert info.reason == "SESSION_NOT_RESUMABLE" and info.metadata["session_id"] == first.session_id

    # A next-episode Reset replays the same way, until a later Reset or Close moves the session on.
    next_req = orchestrator_pb2.ResetRequest(session_id=first.session_id, request_id="replay-next")
    started = await orch.stub.Reset(next_req, timeout=60)
    repeat = await orch.stub.Reset(next_req, timeout=60)
    assert (repeat.episode, started.episode) == (2, 2) and repeat.agent_token != started.agent_token
    assert await list_tools_code(gateway, repeat.agent_token) == grpc.StatusCode.OK
    await orch.stub.Reset(orchestrator_pb2.ResetRequest(session_id=first.session_id), timeout=60)  # episode 3
    await orch.stub.Close(orchestrator_pb2.CloseRequest(session_id=first.session_id), timeout=60)
    for moved_on in (next_req, req):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await orch.stub.Reset(moved_on, timeout=60)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert await list_tools_code(gateway, repeat.agent_token) == grpc.StatusCode.FAILED_PRECONDITION
    record = await store.get_request(scope("reset", ""), "replay-next")
    assert record is not None and repeat.agent_token.encode() not in record.result.encode()
    assert repeat.agent_token.encode() not in decode_result(record.result)[1]


async def test_errors_are_precise_statuses(orch: Running) -> None:
    async def code(call: Any) -> tuple[grpc.StatusCode, str]:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call
        return err.value.code(), err.value.details() or ""

    stub = orch.stub
    assert (await code(stub.Reset(orchestrator_pb2.ResetRequest(task_key="nope"), timeout=10)))[
        0
    ] == grpc.StatusCode.NOT_FOUND
    assert (await code(stub.Reset(orchestrator_pb2.ResetRequest(env_key="no-such-env:v9"), timeout=30)))[
        0
    ] == grpc.StatusCode.NOT_FOUND
    assert (await code(stub.Reset(orchestrator_pb2.ResetRequest(session_id="s-missing"), timeout=10)))[
        0
    ] == grpc.StatusCode.NOT_FOUND
    c, msg = await code(stub.Reset(orchestrator_pb2.ResetRequest(), timeout=10))
    assert c == grpc.StatusCode.INVALID_ARGUMENT and "task_key" in msg
    c, msg = await code(stub.Reset(orchestrator_pb2.ResetRequest(session_id="x", task_key="y"), timeout=10))
    assert c == grpc.StatusCode.INVALID_ARGUMENT and "session_id" in msg
    c, msg = await code(stub.Reset(orchestrator_pb2.ResetRequest(task_key="x", request_id="r" * 200), timeout=10))
    assert c == grpc.StatusCode.INVALID_ARGUMENT and "request_id" in msg
    c, msg = await code(stub.Reset(orchestrator_pb2.ResetRequest(task_key="x", labels={"k": "v" * 64}), timeout=10))
    assert c == grpc.StatusCode.INVALID_ARGUMENT and "labels" in msg
    assert (await code(stub.Step(orchestrator_pb2.StepRequest(session_id="s-missing"), timeout=10)))[
        0
    ] == grpc.StatusCode.NOT_FOUND
    assert (await code(stub.Step(orchestrator_pb2.StepRequest(), timeout=10)))[0] == grpc.StatusCode.INVALID_ARGUMENT
    assert (await code(stub.State(orchestrator_pb2.StateRequest(session_id="s-missing"), timeout=10)))[
        0
    ] == grpc.StatusCode.NOT_FOUND
    assert (await code(stub.Close(orchestrator_pb2.CloseRequest(session_id="s-missing"), timeout=10)))[
        0
    ] == grpc.StatusCode.NOT_FOUND
    assert (await code(stub.CloseSessions(orchestrator_pb2.CloseSessionsRequest(), timeout=10)))[
        0
    ] == grpc.StatusCode.INVALID_ARGUMENT
    for bad in (
        orchestrator_pb2.ListTasksRequest(page_token="garbage!!"),
        orchestrator_pb2.ListTasksRequest(page_size=5000),
    ):
        assert (await code(stub.ListTasks(bad, timeout=10)))[0] == grpc.StatusCode.INVALID_ARGUMENT
    assert (await code(stub.ListSessions(orchestrator_pb2.ListSessionsRequest(page_token="%%%"), timeout=10)))[
        0
    ] == grpc.StatusCode.INVALID_ARGUMENT
    # An enum number the proto does not define (proto3 enums are open) is the caller's mistake.
    unknown = orchestrator_pb2.ListSessionsRequest(status=cast(common_pb2.SessionStatus, 99))
    c, msg = await code(stub.ListSessions(unknown, timeout=10))
    assert c == grpc.StatusCode.INVALID_ARGUMENT and msg.startswith("status:")
    # Ids past their limits: named INVALID_ARGUMENT, or NOT_FOUND for names; never echoed whole.
    huge = "s-" + "x" * 20_000
    for call in (
        stub.State(orchestrator_pb2.StateRequest(session_id=huge), timeout=10),
        stub.Close(orchestrator_pb2.CloseRequest(session_id=huge), timeout=10),
        stub.Step(orchestrator_pb2.StepRequest(session_id=huge, request_id="huge-1"), timeout=10),
        stub.Reset(orchestrator_pb2.ResetRequest(session_id=huge, request_id="huge-2"), timeout=10),
        stub.Reset(orchestrator_pb2.ResetRequest(task_key=huge), timeout=10),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call
        status = rich_status(err.value)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND and status is not None
        assert len(err.value.details() or "") < 256 and status.ByteSize() < 1024
    for call, field in (
        (stub.ListSessions(orchestrator_pb2.ListSessionsRequest(run_id=huge), timeout=10), "run_id"),
        (stub.CloseSessions(orchestrator_pb2.CloseSessionsRequest(run_id=huge), timeout=10), "run_id"),
        (stub.ListTasks(orchestrator_pb2.ListTasksRequest(env_key=huge), timeout=10), "env_key"),
        (stub.ListTasks(orchestrator_pb2.ListTasksRequest(page_token=huge), timeout=10), "page_token"),
        (stub.Reset(orchestrator_pb2.ResetRequest(env_key=huge), timeout=10), "env_key"),
    ):
        c, msg = await code(call)
        assert c == grpc.StatusCode.INVALID_ARGUMENT and msg.startswith(f"{field}:") and len(msg) < 256
    # Details ride in google.rpc.Status.
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.Reset(orchestrator_pb2.ResetRequest(task_key="nope"), timeout=10)
    status = rich_status(err.value)
    assert status is not None and status.details


async def test_list_tasks_and_sessions_page(orch: Running) -> None:
    first = await orch.stub.ListTasks(orchestrator_pb2.ListTasksRequest(page_size=3), timeout=10)
    assert len(first.tasks) == 3 and first.next_page_token and first.total >= 3
    keys = [t.key for t in first.tasks]
    token = first.next_page_token
    while token:
        page = await orch.stub.ListTasks(orchestrator_pb2.ListTasksRequest(page_size=3, page_token=token), timeout=10)
        keys += [t.key for t in page.tasks]
        token = page.next_page_token
    assert keys == sorted(keys) and len(keys) == first.total == len(set(keys))
    only = await orch.stub.ListTasks(orchestrator_pb2.ListTasksRequest(env_key="tracker"), timeout=10)
    assert only.tasks and all(t.env_id == "tracker" for t in only.tasks)
    # A token from one filter is refused for another.
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await orch.stub.ListTasks(
            orchestrator_pb2.ListTasksRequest(env_key="tracker", page_token=first.next_page_token), timeout=10
        )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    ids = []
    for i in range(3):
        r = await orch.stub.Reset(
            orchestrator_pb2.ResetRequest(
                env_key="mailbox:v1", labels={"batch": "b1"}, run_id="trainer-7", request_id=f"ls-{i}"
            ),
            timeout=60,
        )
        ids.append(r.session_id)
    page1 = await orch.stub.ListSessions(
        orchestrator_pb2.ListSessionsRequest(labels={"batch": "b1"}, page_size=2), timeout=10
    )
    page2 = await orch.stub.ListSessions(
        orchestrator_pb2.ListSessionsRequest(labels={"batch": "b1"}, page_size=2, page_token=page1.next_page_token),
        timeout=10,
    )
    got = [s.session_id for s in page1.sessions] + [s.session_id for s in page2.sessions]
    assert sorted(got) == sorted(ids) and not page2.next_page_token
    assert got == list(reversed(ids))  # newest first
    assert all(s.run_id == "trainer-7" for s in page1.sessions)
    closed = await orch.stub.CloseSessions(orchestrator_pb2.CloseSessionsRequest(labels={"batch": "b1"}), timeout=60)
    assert sorted(closed.session_ids) == sorted(ids)
    again = await orch.stub.CloseSessions(orchestrator_pb2.CloseSessionsRequest(run_id="trainer-7"), timeout=60)
    assert list(again.session_ids) == []
    active = await orch.stub.ListSessions(
        orchestrator_pb2.ListSessionsRequest(status=common_pb2.SESSION_STATUS_ACTIVE, run_id="trainer-7"), timeout=10
    )
    assert list(active.sessions) == []
    c = await orch.stub.Close(orchestrator_pb2.CloseRequest(session_id=ids[0]), timeout=10)
    assert c.already_closed and c.status == common_pb2.SESSION_STATUS_CLOSED


async def test_retry_after_the_request_record_is_gone_converges_on_the_session(
    lf: LocalfleetProcess,
    orch: Running,
    store: SessionStore,
) -> None:
    req = orchestrator_pb2.ResetRequest(task_key="mailbox-count-unread-from-kenji", request_id="pruned-1")
    first = await orch.stub.Reset(req, timeout=60)
    assert await store.prune(0.0, time.time() + 1) >= 1  # retention dropped the DONE request record
    again = await orch.stub.Reset(req, timeout=60)
    assert again.session_id == first.session_id  # derived from the request id: no second instance
    assert again.agent_token != first.agent_token  # the first token was never delivered: rotate it
    assert len(instances_of(lf, orch.config.run_id)) == 1


async def test_retries_taken_over_from_a_dead_owner_converge(orch: Running, store: SessionStore) -> None:
    """A replica died after applying a Step/Reset but before recording the answer: the retry (on another
    replica, after the owner's TTL) returns what happened instead of FAILED_PRECONDITION or a 2nd episode."""
    reset = await orch.stub.Reset(orchestrator_pb2.ResetRequest(task_key="mailbox-count-unread-from-kenji"), timeout=60)
    sid = reset.session_id
    await store.claim_request(scope("step", ""), "final-1", "dead-replica")  # claimed, then its owner died
    applied = await orch.stub.Step(orchestrator_pb2.StepRequest(session_id=sid, final_answer="3"), timeout=60)
    assert applied.reward == 1.0
    retried = await orch.stub.Step(
        orchestrator_pb2.StepRequest(session_id=sid, final_answer="3", request_id="final-1"), timeout=60
    )
    assert (retried.done, retried.turn, retried.reward) == (True, 1, 1.0)

    await store.claim_request(scope("reset", ""), "next-1", "dead-replica")
    started = await orch.stub.Reset(orchestrator_pb2.ResetRequest(session_id=sid), timeout=60)
    assert started.episode == 2
    again = await orch.stub.Reset(orchestrator_pb2.ResetRequest(session_id=sid, request_id="next-1"), timeout=60)
    assert again.episode == 2 and again.agent_token != started.agent_token  # same episode, fresh token


async def test_infra_faults_count_client_retries_and_a_step_taken_over(orch: Running, store: SessionStore) -> None:
    """The episode's infrastructure faults: the retries a client reports, a Step whose orchestrator died under
    it; answered by Step and State, emptied by the next episode."""
    reset = await orch.stub.Reset(orchestrator_pb2.ResetRequest(task_key="mailbox-count-unread-from-kenji"), timeout=60)
    sid = reset.session_id
    first = await orch.stub.Step(
        orchestrator_pb2.StepRequest(session_id=sid, request_id="turn-1", client_retries=2), timeout=60
    )
    assert (first.infra_faults.client_retries, first.infra_faults.total) == (2, 2)
    repeated = await orch.stub.Step(  # a repeat that counted more retries meanwhile: the recorded answer
        orchestrator_pb2.StepRequest(session_id=sid, request_id="turn-1", client_retries=5), timeout=60
    )
    assert repeated == first
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await orch.stub.Step(orchestrator_pb2.StepRequest(session_id=sid, client_retries=1001), timeout=60)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "client_retries" in (err.value.details() or "")
    await store.claim_request(scope("step", ""), "turn-2", "dead-replica")  # claimed, then its owner died
    taken = await orch.stub.Step(orchestrator_pb2.StepRequest(session_id=sid, request_id="turn-2"), timeout=60)
    assert (taken.turn, taken.infra_faults.orchestrator_restarts, taken.infra_faults.total) == (2, 1, 3)
    state = await orch.stub.State(orchestrator_pb2.StateRequest(session_id=sid), timeout=10)
    assert state.session.infra_faults == taken.infra_faults
    await orch.stub.Step(orchestrator_pb2.StepRequest(session_id=sid, done=True), timeout=60)
    await orch.stub.Reset(orchestrator_pb2.ResetRequest(session_id=sid), timeout=60)
    state = await orch.stub.State(orchestrator_pb2.StateRequest(session_id=sid), timeout=10)
    assert state.session.episode == 2 and state.session.infra_faults.total == 0


async def test_reference_solutions_only_on_request(orch: Running) -> None:
    key = "mailbox-count-unread-from-kenji"
    expected = bundled_task(key)["metadata"]["reference_solution"]
    plain = await orch.stub.ListTasks(orchestrator_pb2.ListTasksRequest(env_key="mailbox"), timeout=10)
    asked = await orch.stub.ListTasks(
        orchestrator_pb2.ListTasksRequest(env_key="mailbox", include_reference_solution=True), timeout=10
    )
    assert plain.tasks and [t.key for t in plain.tasks] == [t.key for t in asked.tasks]
    for without, with_solution in zip(plain.tasks, asked.tasks, strict=True):
        assert without.reference_solution_json == ""
        assert "reference_solution" not in parse_json_object(without.metadata_json)
        assert with_solution.metadata_json == without.metadata_json  # the answer key rides only in its field
    by_key = {t.key: t for t in asked.tasks}
    assert parse_json_text(by_key[key].reference_solution_json) == expected

    reset = await orch.stub.Reset(orchestrator_pb2.ResetRequest(task_key=key), timeout=60)
    state = await orch.stub.State(orchestrator_pb2.StateRequest(session_id=reset.session_id), timeout=10)
    for task in (reset.task, state.session.task):
        assert task.key == key and task.reference_solution_json == ""
        assert "reference_solution" not in parse_json_object(task.metadata_json)


async def test_state_shows_tool_call_arguments_exactly(
    lf: LocalfleetProcess,
    gateway: GatewayHandle,
    orchestrator_factory: Callable[..., Any],
) -> None:
    """The gateway's log as it recorded the calls: a whole number stays an integer (`"limit":1`), whether the
    agent sent JSON text or a Struct (which carries every number as a double)."""
    orch: Running = await orchestrator_factory(fast_config(lf, gateway_address=gateway.address))
    reset = await orch.stub.Reset(orchestrator_pb2.ResetRequest(task_key="mailbox-count-unread-from-kenji"), timeout=60)
    arguments = {"sender": "Kenji Brown", "limit": 1}
    assert not (await call_tool(gateway.address, reset.agent_token, "search_messages", arguments)).is_error
    async with grpc.aio.insecure_channel(gateway.address) as channel:
        response = await toolgateway_pb2_grpc.ToolGatewayServiceStub(channel).CallTool(
            toolgateway_pb2.CallToolRequest(name="search_messages", arguments=struct_from_dict(arguments)),
            metadata=[("authorization", f"Bearer {reset.agent_token}")],
            timeout=30,
        )
    assert not response.result.is_error, result_text(response.result)
    state = await orch.stub.State(
        orchestrator_pb2.StateRequest(session_id=reset.session_id, include_tool_calls=True), timeout=10
    )
    assert [c.tool for c in state.tool_calls] == ["search_messages", "search_messages"]
    for entry in state.tool_calls:
        logged = parse_json_object(entry.arguments_json)
        assert logged == arguments and type(logged["limit"]) is int, entry.arguments_json
        assert '"limit":1' in entry.arguments_json.replace(" ", "")


async def test_every_revoked_token_is_remembered_so_the_gateway_can_say_why(
    lf: LocalfleetProcess,
    gateway: GatewayHandle,
    store: SessionStore,
    orchestrator_factory: Callable[..., Any],
) -> None:
    """Tokens name their session; wherever one is revoked or replaced (a repeated Reset, the next episode,
    Close, expiry) its hash joins the session's revoked list, so the gateway answers FAILED_PRECONDITION
    with the reason, while a token never issued stays UNAUTHENTICATED."""
    orch: Running = await orchestrator_factory(fast_config(lf, gateway_address=gateway.address))
    req = orchestrator_pb2.ResetRequest(task_key="mailbox-count-unread-from-kenji", request_id="revoke-1")
    first = await orch.stub.Reset(req, timeout=60)
    sid = first.session_id
    assert session_of_token(first.agent_token) == sid
    replaced = await orch.stub.Reset(req, timeout=60)  # a repeat: a fresh token for episode 1
    second = await orch.stub.Reset(orchestrator_pb2.ResetRequest(session_id=sid), timeout=60)  # episode 2
    await orch.stub.Close(orchestrator_pb2.CloseRequest(session_id=sid), timeout=60)
    session = await store.get_session(sid)
    assert session is not None and session.token_hash == ""
    assert session.revoked_tokens == {
        token_hash(first.agent_token): 1,
        token_hash(replaced.agent_token): 1,
        token_hash(second.agent_token): 2,
    }
    for token in (first.agent_token, replaced.agent_token, second.agent_token):
        assert await list_tools_code(gateway, token) == grpc.StatusCode.FAILED_PRECONDITION
    forged = first.agent_token.rsplit(".", 1)[0] + ".never-issued"
    assert await list_tools_code(gateway, forged) == grpc.StatusCode.UNAUTHENTICATED

    reaped = await orch.stub.Reset(orchestrator_pb2.ResetRequest(env_key="mailbox:v1"), timeout=60)
    assert await orch.handle.orchestrator.episodes.closing.expire(reaped.session_id, "test: idle")
    session = await store.get_session(reaped.session_id)
    assert session is not None and session.revoked_tokens == {token_hash(reaped.agent_token): 1}
    assert await list_tools_code(gateway, reaped.agent_token) == grpc.StatusCode.FAILED_PRECONDITION
