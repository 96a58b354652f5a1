"""The typed episode surface against a scripted server: what Reset and Step return (`ResetResult`,
`StepResult`, `TurnResult`), terminated and truncated apart with `done` their union, a reward that is None
(never 0) without a score, and `.raw` keeping the protobuf reachable; sync and async alike."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from rlgate import (
    AsyncClient,
    Client,
    EpisodeSpec,
    InfraFaults,
    Message,
    ResetResult,
    RetryPolicy,
    StepResult,
    Verification,
)
from rlgate.results import Instance
from rlgate.v1 import common_pb2, orchestrator_pb2
from tests.client.scripted import ScriptedServer

FAST = RetryPolicy(initial_backoff=0.01, max_backoff=0.05)
Ending = Callable[[orchestrator_pb2.StepRequest], orchestrator_pb2.StepResponse]


def ending(
    reason: orchestrator_pb2.DoneReason, status: common_pb2.VerificationStatus, reward: float | None = None
) -> Ending:
    """A Step reply ending the episode as the orchestrator does (views.py: truncated iff MAX_TURNS)."""

    def reply(req: orchestrator_pb2.StepRequest) -> orchestrator_pb2.StepResponse:
        response = orchestrator_pb2.StepResponse(
            turn=3,
            done=True,
            truncated=reason == orchestrator_pb2.DONE_REASON_MAX_TURNS,
            done_reason=reason,
            status=common_pb2.SESSION_STATUS_DONE,
        )
        response.verification.status = status
        if status == common_pb2.VERIFICATION_STATUS_ERROR:
            response.verification.message = "the verifier raised KeyError"
            response.verification.attempts = 3
        if reward is not None:
            response.reward = reward
        return response

    return reply


def test_reset_returns_a_typed_result_with_the_protobuf_as_raw(server: ScriptedServer) -> None:
    with Client(server.address, retry=FAST) as client:
        episode = client.episode(EpisodeSpec(task_key="t1", max_turns=4))
        with episode:
            result = episode.reset_result
    assert isinstance(result, ResetResult)
    assert (result.session_id, result.episode, result.task_key, result.env_key) == ("s-1", 1, "t1", "demo:v1")
    assert (result.max_turns, result.modality, result.prompt) == (4, "tool_use", "do it")
    assert result.messages == (Message("user", "do it"),)
    assert [t.name for t in result.tools] == ["echo"]
    assert result.instance == Instance("fleet", "i-1", "demo:v1", "", ())
    assert isinstance(result.raw, orchestrator_pb2.ResetResponse) and result.raw.session_id == "s-1"
    assert episode.reset_response is result.raw
    assert "agent-token" not in repr(result) and result.agent_token == "agent-token"  # a secret is not shown
    (seen,) = server.script.seen["Reset"]
    assert (seen.request.task_key, seen.request.max_turns) == ("t1", 4)


def test_a_running_turn_is_neither_terminated_nor_truncated(server: ScriptedServer) -> None:
    with Client(server.address, retry=FAST) as client, client.episode(task_key="t") as ep:
        turn = ep.turn('<tool_call>{"name": "echo", "arguments": {}}</tool_call>')
    assert isinstance(turn.step, StepResult) and turn.raw is turn.step.raw
    assert (turn.terminated, turn.truncated, turn.done, turn.reward) == (False, False, False, None)
    assert turn.done_reason == "UNSPECIFIED" and turn.verification == Verification("UNSPECIFIED")
    assert all(isinstance(m, Message) for m in turn.observations)


@pytest.mark.parametrize(
    ("reply", "text", "expected"),
    [
        (
            ending(orchestrator_pb2.DONE_REASON_FINAL_ANSWER, common_pb2.VERIFICATION_STATUS_OK, 0.5),
            "<final_answer>42</final_answer>",
            (True, False, 0.5, "FINAL_ANSWER", "OK"),
        ),
        (
            ending(orchestrator_pb2.DONE_REASON_AGENT_DONE, common_pb2.VERIFICATION_STATUS_OK, 0.0),
            "<done/>",
            (True, False, 0.0, "AGENT_DONE", "OK"),
        ),
        (
            ending(orchestrator_pb2.DONE_REASON_MAX_TURNS, common_pb2.VERIFICATION_STATUS_OK, 0.0),
            "still thinking",
            (False, True, 0.0, "MAX_TURNS", "OK"),
        ),
        (
            ending(orchestrator_pb2.DONE_REASON_FINAL_ANSWER, common_pb2.VERIFICATION_STATUS_SKIPPED),
            "<final_answer>x</final_answer>",
            (True, False, None, "FINAL_ANSWER", "SKIPPED"),
        ),
    ],
    ids=["final-answer", "agent-done", "max-turns", "no-verifier"],
)
def test_terminated_and_truncated_apart_and_done_their_union(
    server: ScriptedServer, reply: Ending, text: str, expected: tuple[bool, bool, float | None, str, str]
) -> None:
    server.script.push("Step", reply)
    with Client(server.address, retry=FAST) as client, client.episode(task_key="t") as ep:
        turn = ep.turn(text)
        assert ep.done and ep.last_step is turn.step
    terminated, truncated, reward, reason, status = expected
    assert (turn.terminated, turn.truncated, turn.reward, turn.done_reason) == (terminated, truncated, reward, reason)
    assert turn.done is (terminated or truncated) is True
    assert turn.verification.status == status and turn.step.status == "DONE"
    assert turn.observations == []  # nothing more for the model once the episode is over


def test_a_verifier_error_is_a_reward_of_none_not_zero(server: ScriptedServer) -> None:
    server.script.push("Step", ending(orchestrator_pb2.DONE_REASON_FINAL_ANSWER, common_pb2.VERIFICATION_STATUS_ERROR))
    with (
        Client(server.address, retry=FAST) as client,
        client.episode(task_key="t", raise_on_verifier_error=False) as ep,
    ):
        turn = ep.turn("<final_answer>42</final_answer>")
    assert turn.terminated and turn.done and turn.reward is None
    assert turn.verification == Verification("ERROR", "the verifier raised KeyError", "", 3, 0.0)
    assert turn.verification.failed and not turn.raw.HasField("reward")


def test_episode_step_returns_the_typed_result(server: ScriptedServer) -> None:
    server.script.push("Step", ending(orchestrator_pb2.DONE_REASON_MAX_TURNS, common_pb2.VERIFICATION_STATUS_OK, 0.0))
    with Client(server.address, retry=FAST) as client, client.episode(task_key="t") as ep:
        step = ep.step(assistant_text="hm")
    assert isinstance(step, StepResult) and step.truncated and not step.terminated and step.done
    assert step.reward == 0.0 and isinstance(step.raw, orchestrator_pb2.StepResponse)


async def test_the_async_episode_returns_the_same_types(server: ScriptedServer) -> None:
    server.script.push("Step", ending(orchestrator_pb2.DONE_REASON_MAX_TURNS, common_pb2.VERIFICATION_STATUS_OK, 0.0))
    spec = EpisodeSpec(task_key="t", run_id="run-1")
    async with AsyncClient(server.address, retry=FAST) as client, client.episode(spec, max_turns=2) as ep:
        assert isinstance(ep.reset_result, ResetResult) and ep.max_turns == 2
        messages = ep.initial_messages()
        turn = await ep.turn("thinking")
    assert [m.role for m in messages] == ["system", "user"] and all(isinstance(m, Message) for m in messages)
    assert turn.truncated and turn.done and not turn.terminated
    (seen,) = server.script.seen["Reset"]
    assert (seen.request.run_id, seen.request.max_turns) == ("run-1", 2)


def test_a_next_episode_resets_the_same_session_with_the_spec_kept(server: ScriptedServer) -> None:
    spec = EpisodeSpec(task_key="t", max_turns=3, labels={"team": "rl"})
    with Client(server.address, retry=FAST) as client, client.episode(spec) as ep:
        ep.turn("<final_answer>1</final_answer>")
        again = ep.reset()
    assert again.session_id == "s-1"
    first, second = (s.request for s in server.script.seen["Reset"])
    assert (first.task_key, first.session_id) == ("t", "")
    assert (second.task_key, second.session_id, second.max_turns) == ("", "s-1", 3)
    assert second.labels["team"] == "rl" and first.request_id != second.request_id


def test_step_result_carries_the_episodes_infra_faults() -> None:
    response = orchestrator_pb2.StepResponse(
        turn=2, infra_faults=common_pb2.InfraFaults(total=3, tool_reruns=1, client_retries=2)
    )
    faults = StepResult.from_proto(response).infra_faults
    assert faults == InfraFaults(tool_reruns=1, client_retries=2) and faults.total == 3
    assert faults.as_dict() == {
        "outcome_unknown": 0, "tool_reruns": 1, "client_retries": 2, "verifier_errors": 0,
        "orchestrator_restarts": 0, "total": 3,
    }  # fmt: skip
    assert StepResult.from_proto(orchestrator_pb2.StepResponse()).infra_faults.total == 0
