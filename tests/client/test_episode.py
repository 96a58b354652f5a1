"""Episode / AsyncEpisode against a scripted server: the turn protocol, verifier failures, and closing
in every path (normal end, exceptions, cancellation, a Reset whose answer was lost)."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest

import rlgate
from rlgate import AsyncClient, Client, RetryPolicy
from rlgate.core.convert import arguments_of
from rlgate.episode import RESET_LABEL
from rlgate.messages import Message
from rlgate.v1 import common_pb2, orchestrator_pb2, toolgateway_pb2
from tests.client.scripted import ScriptedServer, Sleep, close_when_done
from tests.support.wait import wait_until

FAST = RetryPolicy(initial_backoff=0.01, max_backoff=0.05)


def _verifier_failed(req: orchestrator_pb2.StepRequest) -> orchestrator_pb2.StepResponse:
    response = orchestrator_pb2.StepResponse(turn=1, done=True)
    response.verification.status = common_pb2.VERIFICATION_STATUS_TIMEOUT
    response.verification.message = "verifier timed out after 30s"
    return response


def test_turns_call_tools_then_step_and_close(server: ScriptedServer) -> None:
    with Client(server.address, retry=FAST) as client, client.episode(task_key="t1", max_turns=4) as ep:
        messages = ep.initial_messages()
        assert messages[0].role == "system" and '"name": "echo"' in messages[0].text()
        assert '"default": 3}' in messages[0].text()  # the schema's integer, not 3.0
        assert ep.instance.instance_id == "i-1" and ep.env_key == "demo:v1"
        assert messages[1] == Message("user", "do it")
        first = ep.turn('Sure. <tool_call>{"name": "echo", "arguments": {"x": 1}}</tool_call>')
        assert not first.done and first.reward is None
        assert first.observations == [Message("user", "<tool_response>\necho ok\n</tool_response>")]
        last = ep.turn("<final_answer>42</final_answer>")
        assert last.done and last.reward == 1.0 and last.observations == []
        assert last.verification_status == "OK" and last.done_reason == "FINAL_ANSWER"
        assert last.terminated and not last.truncated and last.raw.done
    steps = server.script.seen["Step"]
    assert [s.request.HasField("final_answer") for s in steps] == [False, True]
    summary = steps[0].request.tool_calls[0]
    assert summary.name == "echo" and summary.request_id == server.script.seen["CallTool"][0].request.request_id
    assert server.script.seen["CallTool"][0].metadata["authorization"] == "Bearer agent-token"
    assert server.script.count("Close") == 1
    traces = {
        s.metadata["x-rlgate-trace-id"] for m in ("Reset", "Step", "CallTool", "Close") for s in server.script.seen[m]
    }
    assert len(traces) == 1  # one trace id for the whole episode


def test_a_turn_sends_the_models_arguments_exactly_to_the_gateway_and_the_step(server: ScriptedServer) -> None:
    text = '<tool_call>{"name": "echo", "arguments": {"id": 1152921504606846977, "n": 3, "r": 0.5}}</tool_call>'
    with Client(server.address, retry=FAST) as client, client.episode(task_key="t") as ep:
        (record,) = ep.turn(text).tool_calls
    expected = {"id": 2**60 + 1, "n": 3, "r": 0.5}
    assert record.arguments == expected
    (call,) = server.script.seen["CallTool"]
    (summary,) = server.script.seen["Step"][0].request.tool_calls
    for message in (call.request, summary):
        assert message.WhichOneof("args") == "arguments_json" and arguments_of(message) == expected
    assert json.loads(summary.arguments_json)["n"] == 3 and '"n":3' in summary.arguments_json


def test_a_reset_without_a_gateway_address_is_named(server: ScriptedServer) -> None:
    def no_gateway(req: orchestrator_pb2.ResetRequest) -> orchestrator_pb2.ResetResponse:
        response: orchestrator_pb2.ResetResponse = server.script.defaults["Reset"](req)
        response.gateway_address = ""
        return response

    server.script.push("Reset", no_gateway)
    with Client(server.address, retry=FAST) as client, client.episode(task_key="t") as ep:
        with pytest.raises(ValueError, match="Reset of session s-1 returned no gateway_address"):
            ep.call_tool("echo", {})
        with pytest.raises(ValueError, match="RLGATE_GATEWAY"):
            ep.list_tools()
    server.script.push("Reset", no_gateway)
    # The client's own gateway addresses serve instead.
    with Client(server.address, retry=FAST, gateway_addresses=server.address) as client, client.episode() as ep:
        assert ep.call_tool("echo", {}).result.content[0].text.text == "echo ok"


def test_unparseable_text_is_an_observation_and_the_turn_counts(server: ScriptedServer) -> None:
    with Client(server.address, retry=FAST) as client, client.episode(task_key="t") as ep:
        bad = ep.turn('<tool_call>{"name": "echo", "arguments": [}</tool_call>')
        assert not bad.done and bad.error and "not valid JSON" in bad.observations[0].text()
        prose = ep.turn("I am thinking about it.")
        assert "<tool_call>" in prose.observations[0].text()  # the format reminder
    assert server.script.count("Step") == 2 and server.script.count("CallTool") == 0


def test_outcome_unknown_reaches_the_model_and_is_not_retried(server: ScriptedServer) -> None:
    unknown = toolgateway_pb2.CallToolResponse(
        result=common_pb2.ToolResult(
            is_error=True,
            error_kind=common_pb2.TOOL_ERROR_KIND_OUTCOME_UNKNOWN,
            error_message="the first attempt's owner died; the tool may have run",
        ),
        replayed=True,
    )
    server.script.push("CallTool", grpc.StatusCode.UNAVAILABLE, unknown)
    with Client(server.address, retry=FAST) as client, client.episode(task_key="t") as ep:
        result = ep.turn('<tool_call>{"name": "echo", "arguments": {}}</tool_call>')
    assert "Error (outcome unknown)" in result.observations[0].text()
    assert result.tool_calls[0].is_error and result.tool_calls[0].replayed
    seen = server.script.seen["CallTool"]
    assert len(seen) == 2 and seen[0].request.request_id == seen[1].request.request_id


@pytest.mark.parametrize("server_closes", [True, False])
def test_close_when_done_saves_the_close_when_the_step_closed(server: ScriptedServer, server_closes: bool) -> None:
    if server_closes:
        close_when_done(server)
    with Client(server.address, retry=FAST) as client, client.episode(task_key="t", close_when_done=True) as ep:
        assert not ep.turn("thinking").done
        assert ep.turn("<final_answer>42</final_answer>").done
    assert [s.request.close_when_done for s in server.script.seen["Step"]] == [True, True]
    # A server that left the session open (status DONE) still gets its Close.
    assert server.script.count("Close") == (0 if server_closes else 1)


def test_a_session_its_step_closed_takes_no_next_episode(server: ScriptedServer) -> None:
    close_when_done(server)
    with Client(server.address, retry=FAST) as client, client.episode(task_key="t", close_when_done=True) as ep:
        ep.turn("<done/>")
        with pytest.raises(RuntimeError, match="closed by the Step that ended its episode"):
            ep.reset()
    assert server.script.count("Reset") == 1 and server.script.count("Close") == 0


async def test_async_close_when_done_saves_the_close(server: ScriptedServer) -> None:
    close_when_done(server)
    client = AsyncClient(server.address, retry=FAST)
    async with client, client.episode(task_key="t", close_when_done=True) as ep:
        step = await ep.step(done=True)
        assert step.done and step.raw.status == common_pb2.SESSION_STATUS_CLOSED
    assert server.script.seen["Step"][0].request.close_when_done and server.script.count("Close") == 0


def test_verifier_failure_raises_and_the_episode_still_closes(server: ScriptedServer) -> None:
    server.script.push("Step", _verifier_failed)
    with Client(server.address, retry=FAST) as client:
        with pytest.raises(rlgate.VerifierError, match="TIMEOUT") as info, client.episode(task_key="t9") as ep:
            ep.turn("<final_answer>x</final_answer>")
        assert info.value.task_key == "t" or info.value.task_key == "t9"
        assert info.value.session_id == "s-1"
    assert server.script.count("Close") == 1


def test_verifier_failure_can_be_returned_instead(server: ScriptedServer) -> None:
    server.script.push("Step", _verifier_failed)
    client = Client(server.address, retry=FAST)
    with client, client.episode(task_key="t", raise_on_verifier_error=False) as ep:
        result = ep.turn("<done/>")
    assert result.done and result.reward is None and result.verification_status == "TIMEOUT"


def test_exception_in_body_closes_once_and_close_is_idempotent(server: ScriptedServer) -> None:
    with Client(server.address, retry=FAST) as client:
        with pytest.raises(KeyError), client.episode(task_key="t") as ep:
            raise KeyError("trainer bug")
        ep.close()
        ep.close()
    assert server.script.count("Close") == 1


def test_close_failure_does_not_mask_the_original_error(server: ScriptedServer) -> None:
    server.script.push("Close", grpc.StatusCode.INTERNAL)
    with Client(server.address, retry=FAST) as client, pytest.raises(KeyError), client.episode(task_key="t"):
        raise KeyError("original")


def test_lost_reset_is_closed_by_label(server: ScriptedServer) -> None:
    server.script.push("Reset", *([grpc.StatusCode.UNAVAILABLE] * 3))
    client = Client(server.address, retry=RetryPolicy(max_attempts=3, initial_backoff=0.01))
    with client, pytest.raises(rlgate.Unavailable), client.episode(task_key="t"):
        pass
    reset_id = server.script.seen["Reset"][0].request.request_id
    assert server.script.seen["Reset"][0].request.labels[RESET_LABEL] == reset_id
    assert dict(server.script.seen["CloseSessions"][0].request.labels) == {RESET_LABEL: reset_id}
    assert server.script.count("Close") == 0


def test_rejected_reset_closes_nothing(server: ScriptedServer) -> None:
    server.script.push("Reset", grpc.StatusCode.NOT_FOUND)
    client = Client(server.address, retry=FAST)
    with client, pytest.raises(rlgate.NotFound), client.episode(task_key="missing"):
        pass
    assert server.script.count("CloseSessions") == 0 and server.script.count("Close") == 0


async def test_async_episode_turns_and_closes(server: ScriptedServer) -> None:
    async with AsyncClient(server.address, retry=FAST) as client, client.episode(task_key="t") as ep:
        first = await ep.turn('<tool_call>{"tool": "echo", "params": {"a": "b"}}')
        assert "echo ok" in first.observations[0].text()
        assert (await ep.list_tools())[0].name == "echo"
        last = await ep.turn("<final_answer>1</final_answer>")
        assert last.reward == 1.0
    assert server.script.count("Close") == 1


async def test_cancelled_async_episode_still_closes(server: ScriptedServer) -> None:
    server.script.push("Step", Sleep(5.0))
    async with AsyncClient(server.address, retry=FAST) as client:
        started = asyncio.Event()

        async def run() -> None:
            async with client.episode(task_key="t") as ep:
                started.set()
                await ep.turn("<done/>")

        task = asyncio.create_task(run())
        await started.wait()
        await wait_until(lambda: server.script.count("Step"), 5, "the Step at the server")  # cancelled mid-call
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await wait_until(lambda: server.script.count("Close"), 5, "the Close at the server")
    assert server.script.count("Close") == 1


async def test_async_verifier_error_closes(server: ScriptedServer) -> None:
    server.script.push("Step", _verifier_failed)
    async with AsyncClient(server.address, retry=FAST) as client:
        with pytest.raises(rlgate.VerifierError):
            async with client.episode(task_key="t") as ep:
                await ep.turn("<final_answer>x</final_answer>")
    assert server.script.count("Close") == 1
