"""Fork: a live episode branched into sessions that share its state, by snapshot and by replay, on a real
localfleet driven through the fleet SDK, the real orchestrator and the real toolgateway."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from fleet import Fleet
from google.rpc import error_details_pb2

from rlgate.core.convert import struct_from_dict
from rlgate.orchestrator.forks import BRANCH_LABEL, PARENT_LABEL
from rlgate.orchestrator.provisioning import default_run_id, store_identity
from rlgate.store.sqlite import SqliteStore
from rlgate.toolgateway.server import GatewayHandle
from rlgate.v1 import common_pb2, orchestrator_pb2, orchestrator_pb2_grpc
from tests.orchestrator.conftest import Running, call_tool, fast_config, instances_of, result_text
from tests.orchestrator.test_crash import CREATE_DELAY_S, OWNER_TTL_S, RECONCILE_S, OrchestratorProcess
from tests.support.localfleet import LocalfleetProcess, write_tiny_tasks
from tests.support.statuses import detail
from tests.support.wait import wait_until

TASK = "mailbox-clients-folder"
CREATE = ("create_folder", {"name": "Clients"})
SEARCH = ("search_messages", {"query": "Contract renewal", "folder": "Inbox", "limit": 50})
MOVED = [35, 46, 56, 89, 145, 165, 216, 238, 241, 302, 332, 333, 361, 411, 429]
MOVE = ("move_message", {"message_ids": MOVED, "folder": "Clients"})
DUMP = (
    "SELECT (SELECT group_concat(id || ':' || name, ',') FROM folders),"
    " (SELECT group_concat(id || ':' || folder_id || ':' || is_read || ':' || is_flagged, ',') FROM messages)"
)
IN_CLIENTS = "SELECT COUNT(*) FROM messages m JOIN folders f ON f.id = m.folder_id WHERE f.name = 'Clients'"


def _query(lf: LocalfleetProcess, instance_id: str, sql: str) -> list[list[Any]]:
    """A query on an instance's live database through the fleet SDK (`env.db().query`)."""
    fleet = Fleet(api_key="test", base_url=lf.base_url)
    env = fleet.instance(instance_id)
    env.instance.load()
    rows: list[list[Any]] = env.db("current").query(sql).rows
    return rows


def reason_of(err: grpc.aio.AioRpcError) -> str:
    return detail(err, error_details_pb2.ErrorInfo).reason


async def query(lf: LocalfleetProcess, instance_id: str, sql: str) -> list[list[Any]]:
    return await asyncio.to_thread(_query, lf, instance_id, sql)


async def turn(orch: Running, gateway: GatewayHandle, session_id: str, token: str, call: tuple[str, Any]) -> None:
    """One turn: the call through the gateway, then its Step."""
    name, arguments = call
    result = await call_tool(gateway.address, token, name, arguments)
    assert not result.is_error, result_text(result)
    await orch.stub.Step(
        orchestrator_pb2.StepRequest(
            session_id=session_id,
            tool_calls=[orchestrator_pb2.ToolCallSummary(name=name, arguments=struct_from_dict(arguments))],
        ),
        timeout=60,
    )


async def finish(orch: Running, session_id: str) -> orchestrator_pb2.StepResponse:
    step: orchestrator_pb2.StepResponse = await orch.stub.Step(
        orchestrator_pb2.StepRequest(session_id=session_id, done=True), timeout=60
    )
    assert step.done and step.verification.status == common_pb2.VERIFICATION_STATUS_OK, step.verification.message
    return step


@pytest.mark.parametrize(
    "mechanism",
    [orchestrator_pb2.FORK_MECHANISM_SNAPSHOT, orchestrator_pb2.FORK_MECHANISM_REPLAY],
    ids=["snapshot", "replay"],
)
async def test_branches_share_the_source_state_and_diverge_alone(
    mechanism: orchestrator_pb2.ForkMechanism,
    lf: LocalfleetProcess,
    gateway: GatewayHandle,
    orchestrator_factory: Callable[..., Any],
) -> None:
    orch: Running = await orchestrator_factory(fast_config(lf, gateway_address=gateway.address))
    reset = await orch.stub.Reset(
        orchestrator_pb2.ResetRequest(task_key=TASK, request_id="src", labels={"group": "g1"}, run_id="trainer-1"),
        timeout=60,
    )
    await turn(orch, gateway, reset.session_id, reset.agent_token, CREATE)

    forked = await orch.stub.Fork(
        orchestrator_pb2.ForkRequest(session_id=reset.session_id, count=3, request_id="fork-1", mechanism=mechanism),
        timeout=120,
    )
    assert forked.mechanism == mechanism and forked.parent_session_id == reset.session_id and forked.turn == 1
    assert [b.branch_index for b in forked.branches] == [0, 1, 2]
    assert len({b.session_id for b in forked.branches}) == 3 and len({b.agent_token for b in forked.branches}) == 3
    source_dump = await query(lf, reset.instance.instance_id, DUMP)
    for branch in forked.branches:
        assert branch.turn == 1 and branch.max_turns == reset.max_turns and branch.episode == 1
        assert branch.instance.instance_id not in ("", reset.instance.instance_id)
        assert [t.name for t in branch.tools] == [t.name for t in reset.tools]
        state = await orch.stub.State(
            orchestrator_pb2.StateRequest(session_id=branch.session_id, include_tool_calls=True), timeout=30
        )
        info = state.session
        assert info.parent_session_id == reset.session_id and info.branch_index == branch.branch_index
        assert info.labels[PARENT_LABEL] == reset.session_id and info.labels[BRANCH_LABEL] == str(branch.branch_index)
        assert info.labels["group"] == "g1" and info.run_id == "trainer-1"
        assert info.task.key == TASK and info.turn == 1 and info.status == common_pb2.SESSION_STATUS_ACTIVE
        assert [c.tool for c in state.tool_calls] == ["create_folder"]
        # The branch's database is the source's at the fork, read through the fleet SDK.
        assert await query(lf, branch.instance.instance_id, DUMP) == source_dump

    # The source goes on unchanged: its token still works.
    source_state = await orch.stub.State(orchestrator_pb2.StateRequest(session_id=reset.session_id), timeout=30)
    assert source_state.session.turn == 1 and source_state.session.parent_session_id == ""
    assert not (await call_tool(gateway.address, reset.agent_token, "list_folders", {})).is_error

    # A retried Fork returns the same branches, with fresh tokens (the first ones no longer work).
    again = await orch.stub.Fork(
        orchestrator_pb2.ForkRequest(session_id=reset.session_id, count=3, request_id="fork-1", mechanism=mechanism),
        timeout=120,
    )
    assert [b.session_id for b in again.branches] == [b.session_id for b in forked.branches]
    assert all(a.agent_token != b.agent_token for a, b in zip(again.branches, forked.branches, strict=True))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await orch.stub.Fork(
            orchestrator_pb2.ForkRequest(session_id=reset.session_id, count=2, request_id="fork-1"), timeout=60
        )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "count" in (err.value.details() or "")
    branches = again.branches

    # Branch 0 finishes the reference solution (scores 1); branch 1 stops now (scores 0).
    await turn(orch, gateway, branches[0].session_id, branches[0].agent_token, SEARCH)
    await turn(orch, gateway, branches[0].session_id, branches[0].agent_token, MOVE)
    assert (await finish(orch, branches[0].session_id)).reward == 1.0
    assert (await finish(orch, branches[1].session_id)).reward == 0.0
    # Branch 0's moves are in branch 0 only.
    assert await query(lf, branches[0].instance.instance_id, IN_CLIENTS) == [[len(MOVED)]]
    for other in (branches[1].instance.instance_id, branches[2].instance.instance_id, reset.instance.instance_id):
        assert await query(lf, other, IN_CLIENTS) == [[0]]

    # Refusals: a count out of range; a done source.
    for count in (0, orch.config.max_fork_branches + 1):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await orch.stub.Fork(orchestrator_pb2.ForkRequest(session_id=reset.session_id, count=count), timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await orch.stub.Fork(orchestrator_pb2.ForkRequest(session_id=branches[0].session_id, count=1), timeout=30)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert reason_of(err.value) == "SESSION_NOT_FORKABLE"

    # Every branch closes, and with the source nothing is left.
    for sid in [reset.session_id, *(b.session_id for b in branches)]:
        closed = await orch.stub.Close(orchestrator_pb2.CloseRequest(session_id=sid), timeout=30)
        assert closed.status == common_pb2.SESSION_STATUS_CLOSED
    assert instances_of(lf, orch.config.run_id) == []


@pytest.fixture(scope="module")
def tiny_lf(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalfleetProcess]:
    tasks = write_tiny_tasks(tmp_path_factory.mktemp("tiny-tasks"))
    with LocalfleetProcess(environments="tests.support.localfleet:tiny_environments", tasks_dir=tasks) as lf:
        yield lf


async def test_a_nondeterministic_tool_fails_replay_naming_the_call(
    tiny_lf: LocalfleetProcess, gateway: GatewayHandle, orchestrator_factory: Callable[..., Any]
) -> None:
    orch: Running = await orchestrator_factory(fast_config(tiny_lf, gateway_address=gateway.address))
    reset = await orch.stub.Reset(orchestrator_pb2.ResetRequest(task_key="notes-star-7"), timeout=60)
    await turn(orch, gateway, reset.session_id, reset.agent_token, ("add_note", {"title": "t", "body": "b"}))
    result = await call_tool(gateway.address, reset.agent_token, "draw_ticket", {})
    assert not result.is_error
    state = await orch.stub.State(
        orchestrator_pb2.StateRequest(session_id=reset.session_id, include_tool_calls=True), timeout=30
    )
    drawn = state.tool_calls[-1]
    assert drawn.tool == "draw_ticket"

    with pytest.raises(grpc.aio.AioRpcError) as err:
        await orch.stub.Fork(
            orchestrator_pb2.ForkRequest(
                session_id=reset.session_id, count=2, mechanism=orchestrator_pb2.FORK_MECHANISM_REPLAY
            ),
            timeout=120,
        )
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert reason_of(err.value) == "REPLAY_MISMATCH"
    details = err.value.details() or ""
    assert "call #2" in details and "draw_ticket" in details and drawn.request_id in details, details
    # The failed fork closed what it made: only the source's instance is left.
    assert [i["instance_id"] for i in instances_of(tiny_lf, orch.config.run_id)] == [reset.instance.instance_id]

    # By snapshot the same episode forks (no call is re-run), and the branch has the source's note.
    forked = await orch.stub.Fork(orchestrator_pb2.ForkRequest(session_id=reset.session_id, count=1), timeout=120)
    assert forked.mechanism == orchestrator_pb2.FORK_MECHANISM_SNAPSHOT
    notes = "SELECT COUNT(*) FROM notes"
    assert await query(tiny_lf, forked.branches[0].instance.instance_id, notes) == [[51]]
    for sid in (reset.session_id, forked.branches[0].session_id):
        await orch.stub.Close(orchestrator_pb2.CloseRequest(session_id=sid), timeout=30)
    assert instances_of(tiny_lf, orch.config.run_id) == []


async def test_refusals_before_any_work(orch: Running) -> None:
    """Unknown session: NOT_FOUND; no session id: INVALID_ARGUMENT; an unknown mechanism: INVALID_ARGUMENT."""
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await orch.stub.Fork(orchestrator_pb2.ForkRequest(session_id="s-nope", count=1), timeout=30)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await orch.stub.Fork(orchestrator_pb2.ForkRequest(count=1), timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.aio.AioRpcError) as err:
        unknown = orchestrator_pb2.ForkRequest(session_id="s-x", count=1)
        unknown.mechanism = 7  # type: ignore[assignment]  # proto3 enums are open: any number arrives
        await orch.stub.Fork(unknown, timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.slow
async def test_sigkill_mid_fork_leaves_no_instance_after_a_restart(tmp_path: Path) -> None:
    """The orchestrator as a process, SIGKILLed while a Fork's creates wait inside localfleet: once restarted,
    reconciliation deletes every instance the dead fork made; only the source's remains, until it closes."""
    with LocalfleetProcess() as lf:
        orch = OrchestratorProcess(lf, tmp_path)
        orch.start()
        store = await SqliteStore.open(str(orch.store_path))
        run_id = default_run_id(await store_identity(store))
        try:
            async with grpc.aio.insecure_channel(orch.address) as channel:
                stub = orchestrator_pb2_grpc.OrchestratorServiceStub(channel)
                reset = await stub.Reset(orchestrator_pb2.ResetRequest(task_key=TASK, request_id="src"), timeout=120)
                lf.set_faults({"environments": {"mailbox": {"create_delay_s": CREATE_DELAY_S}}})
                fork = asyncio.ensure_future(
                    stub.Fork(orchestrator_pb2.ForkRequest(session_id=reset.session_id, count=4), timeout=120)
                )

                async def all_creating() -> bool:
                    listed = await asyncio.to_thread(instances_of, lf, run_id)
                    return sum(1 for i in listed if i["status"] == "pending") == 4

                await wait_until(all_creating, CREATE_DELAY_S, "the fork's 4 creates pending in localfleet")
                orch.signal(signal.SIGKILL)
                orch.wait(10)
                with pytest.raises(grpc.aio.AioRpcError):
                    await fork
            lf.set_faults({})
            orch.start()
            source = reset.instance.instance_id
            bound = CREATE_DELAY_S + OWNER_TTL_S + 2 * RECONCILE_S + 15

            async def only_the_source() -> bool:
                listed = await asyncio.to_thread(instances_of, lf, run_id)
                return [i["instance_id"] for i in listed] == [source]

            await wait_until(only_the_source, bound, f"only the source's instance left:\n{orch.log()}")
            assert lf.counters()["instances_created"] == 5
            async with grpc.aio.insecure_channel(orch.address) as channel:
                stub = orchestrator_pb2_grpc.OrchestratorServiceStub(channel)
                await stub.Close(orchestrator_pb2.CloseRequest(session_id=reset.session_id), timeout=60)
            assert instances_of(lf, run_id) == []
        finally:
            orch.stop()
            await store.close()


async def test_a_call_finishing_during_the_fork_refuses_it_and_undoes_it(
    lf: LocalfleetProcess, gateway: GatewayHandle, orchestrator_factory: Callable[..., Any]
) -> None:
    """Fork does not wait for a call in flight: one that finishes while the branches are made changes the fork
    point, so the Fork is refused (TOOL_CALL_IN_FLIGHT) and the instances it made are deleted."""
    orch: Running = await orchestrator_factory(fast_config(lf, gateway_address=gateway.address))
    reset = await orch.stub.Reset(orchestrator_pb2.ResetRequest(task_key=TASK), timeout=60)
    lf.set_faults({"environments": {"mailbox": {"tool_latency_s": 1.0, "create_delay_s": 2.5}}})
    slow = asyncio.ensure_future(call_tool(gateway.address, reset.agent_token, *CREATE))
    await asyncio.sleep(0.3)  # the call is running upstream
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await orch.stub.Fork(orchestrator_pb2.ForkRequest(session_id=reset.session_id, count=2), timeout=60)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert reason_of(err.value) == "TOOL_CALL_IN_FLIGHT"
    assert not (await slow).is_error
    lf.set_faults({})
    assert [i["instance_id"] for i in instances_of(lf, orch.config.run_id)] == [reset.instance.instance_id]
    # Between turns the same source forks.
    forked = await orch.stub.Fork(orchestrator_pb2.ForkRequest(session_id=reset.session_id, count=1), timeout=60)
    for sid in (reset.session_id, forked.branches[0].session_id):
        await orch.stub.Close(orchestrator_pb2.CloseRequest(session_id=sid), timeout=30)
    assert instances_of(lf, orch.config.run_id) == []


@pytest.mark.parametrize("started", ["before", "during"])
async def test_a_call_still_running_when_the_fork_ends_refuses_it(
    lf: LocalfleetProcess, gateway: GatewayHandle, orchestrator_factory: Callable[..., Any], started: str
) -> None:
    """A call that outlives the Fork is seen in flight (its PENDING ledger record; the call carries no
    request_id, so the gateway's own one is what Fork sees): started before Fork, it is refused at once;
    started while the branches are made, it is refused once they are ready, and they are deleted."""
    orch: Running = await orchestrator_factory(fast_config(lf, gateway_address=gateway.address))
    reset = await orch.stub.Reset(orchestrator_pb2.ResetRequest(task_key=TASK), timeout=60)
    lf.set_faults({"environments": {"mailbox": {"tool_latency_s": 4.0, "create_delay_s": 1.5}}})
    fork = orch.stub.Fork(orchestrator_pb2.ForkRequest(session_id=reset.session_id, count=2), timeout=60)
    if started == "before":
        slow = asyncio.ensure_future(call_tool(gateway.address, reset.agent_token, *CREATE))
        await asyncio.sleep(0.3)  # the call is running upstream
        forking = asyncio.ensure_future(fork)
    else:
        forking = asyncio.ensure_future(fork)
        await asyncio.sleep(0.3)  # the branches' instances are being created
        slow = asyncio.ensure_future(call_tool(gateway.address, reset.agent_token, *CREATE))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await forking
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert reason_of(err.value) == "TOOL_CALL_IN_FLIGHT"
    assert not slow.done()  # refused while the call still ran, not after it finished
    assert not (await slow).is_error
    lf.set_faults({})
    assert [i["instance_id"] for i in instances_of(lf, orch.config.run_id)] == [reset.instance.instance_id]
    await orch.stub.Close(orchestrator_pb2.CloseRequest(session_id=reset.session_id), timeout=30)
