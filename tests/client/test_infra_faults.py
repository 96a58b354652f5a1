"""An infrastructure fault never poses as the model's mistake, on the real stack (localfleet, toolgateway and
orchestrator processes): a toolgateway SIGKILLed mid-call and restarted. A read-only tool call is run again
under the same request_id and the model sees its result; any other tool answers OUTCOME_UNKNOWN and never
runs twice. Either way the episode says so, in Step and State (`InfraFaults`) and in the gateway's log."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

import rlgate
from rlgate.devtools.stack import LocalStack
from rlgate.v1 import common_pb2, orchestrator_pb2, toolgateway_pb2
from tests.support.wait import wait_until

TOOL_LATENCY_S = 3.0  # every tool call is in flight this long: time to SIGKILL the gateway under it


@pytest.fixture
def slow_stack(stack_factory: Callable[..., LocalStack], tmp_path: Path) -> LocalStack:
    faults = tmp_path / "faults.json"
    faults.write_text(json.dumps({"environments": {"*": {"tool_latency_s": TOOL_LATENCY_S}}}))
    return stack_factory(env={"RLGATE_LOCALFLEET_FAULTS": str(faults), "RLGATE_OWNER_TTL_S": "2"})


async def _tool_calls(stack: LocalStack) -> int:
    async with httpx.AsyncClient(base_url=stack.localfleet_url, timeout=10) as http:
        return int((await http.get("/_admin/counters")).raise_for_status().json()["tool_calls"])


async def _cut_call(
    stack: LocalStack, tool: str, arguments: dict[str, Any]
) -> tuple[toolgateway_pb2.CallToolResponse, orchestrator_pb2.StepResponse, orchestrator_pb2.StateResponse, int]:
    """One mailbox episode whose call of `tool` is in flight when the gateway is SIGKILLed and restarted:
    (the call's answer after the client's retries, the Step reporting it, State with the log, the tool calls
    localfleet ran)."""
    async with rlgate.AsyncClient(stack.orchestrator_address) as client:
        task = next(t for t in await client.list_tasks() if t.env_id == "mailbox")
        reset = await client.reset(task_key=task.key)
        before = await _tool_calls(stack)
        call = asyncio.create_task(
            client.call_tool(reset.agent_token, tool, arguments, request_id="cut-1", gateway=reset.gateway_address,
                             timeout=90)
        )  # fmt: skip

        async def in_flight() -> bool:
            return await _tool_calls(stack) > before

        await wait_until(in_flight, 60, f"{tool} in flight at localfleet")
        assert not call.done()
        await asyncio.to_thread(stack.restart, "toolgateway")
        response = await call
        summary = orchestrator_pb2.ToolCallSummary(
            name=tool, arguments_json=json.dumps(arguments), request_id="cut-1", is_error=response.result.is_error,
            error_kind=response.result.error_kind,
        )  # fmt: skip
        step = await client.step(reset.session_id, assistant_text="", tool_calls=[summary])
        state = await client.state(reset.session_id, include_tool_calls=True)
        ran = await _tool_calls(stack) - before
        await client.close_session(reset.session_id)
    return response, step, state, ran


async def test_a_read_only_call_cut_by_a_dead_gateway_runs_again_and_is_marked(slow_stack: LocalStack) -> None:
    response, step, state, ran = await _cut_call(slow_stack, "list_folders", {})
    result = response.result
    assert not result.is_error, result.error_message  # the model sees the tool's answer, not OUTCOME_UNKNOWN
    assert result.error_kind != common_pb2.TOOL_ERROR_KIND_OUTCOME_UNKNOWN
    assert ran == 2  # run again, once, under the same request_id
    faults = step.infra_faults
    assert (faults.tool_reruns, faults.outcome_unknown) == (1, 0)
    assert faults.client_retries >= 1  # the client's retries of the call after UNAVAILABLE, reported on Step
    assert faults.total == faults.tool_reruns + faults.client_retries
    assert state.session.infra_faults == faults
    [entry] = state.tool_calls
    assert (entry.request_id, entry.infra_fault, entry.is_error) == ("cut-1", "tool_reruns", False)


async def test_a_writing_call_cut_by_a_dead_gateway_stays_unknown_and_is_marked(slow_stack: LocalStack) -> None:
    response, step, state, ran = await _cut_call(slow_stack, "create_folder", {"name": "Cut"})
    assert response.result.error_kind == common_pb2.TOOL_ERROR_KIND_OUTCOME_UNKNOWN
    assert ran == 1  # at most once
    faults = step.infra_faults
    assert (faults.outcome_unknown, faults.tool_reruns) == (1, 0)
    assert state.session.infra_faults == faults
    [entry] = state.tool_calls
    assert (entry.infra_fault, entry.error_kind) == ("outcome_unknown", common_pb2.TOOL_ERROR_KIND_OUTCOME_UNKNOWN)


async def test_a_rollout_through_a_gateway_sigkill_marks_every_cut_episode(
    stack_factory: Callable[..., LocalStack], tmp_path: Path
) -> None:
    """A rollout whose gateway is SIGKILLed and restarted mid-run: every episode ends scored; no read-only
    call reaches the policy as OUTCOME_UNKNOWN; and each episode's infra_faults (from its last Step) agree
    with the gateway's log of its calls, kind by kind, with at least one episode cut."""
    from rlgate.rollout import RolloutConfig, run_rollout

    faults = tmp_path / "faults.json"
    faults.write_text(json.dumps({"environments": {"*": {"tool_latency_s": 1.0}}}))
    stack = await asyncio.to_thread(
        stack_factory, env={"RLGATE_LOCALFLEET_FAULTS": str(faults), "RLGATE_OWNER_TTL_S": "2"}
    )
    async with rlgate.AsyncClient(stack.orchestrator_address) as client:
        listed = await client.list_tasks()
    keys = [t.key for t in listed if t.env_id in ("mailbox", "booking")][:8]
    config = RolloutConfig(orchestrator=stack.orchestrator_address, tasks=",".join(keys), concurrency=8,
                           progress=False, out=tmp_path / "traj.jsonl")  # fmt: skip
    rollout = asyncio.create_task(run_rollout(config))

    async def calling_tools() -> bool:
        return await _tool_calls(stack) >= config.concurrency

    await wait_until(calling_tools, 120, "the rollout's tool calls under way")
    await asyncio.to_thread(stack.restart, "toolgateway")
    summary, records = await rollout
    assert summary["errors"] == 0, [r.error for r in records if r.error]
    assert all(r.done and r.reward is not None for r in records)

    read_only = {
        *("list_folders", "list_messages", "search_messages", "read_message", "lookup_contact"),  # mailbox
        *("search_flights", "search_hotels", "get_offer", "list_bookings", "get_profile", "get_loyalty"),  # booking
    }
    cut = 0
    async with rlgate.AsyncClient(stack.orchestrator_address) as client:
        for record in records:
            for call in record.tool_calls:
                if call["name"] in read_only:
                    assert call["error_kind"] != "TOOL_ERROR_KIND_OUTCOME_UNKNOWN", call
            state = await client.state(record.session_id, include_tool_calls=True)
            logged = [e.infra_fault for e in state.tool_calls if e.infra_fault]
            for kind in ("outcome_unknown", "tool_reruns"):
                assert record.infra_faults.get(kind, 0) == logged.count(kind), (record.session_id, logged)
            cut += bool(logged)
    assert cut >= 1, "no episode had a call in flight when the gateway died"
    assert summary["infra_faults"] >= cut and summary["episodes_with_infra_faults"] >= cut
