"""The reference-solution policy: the solution comes from ListTasks (asked for it), exactly, never from Reset.
And what a policy is shown: a rollout's conversation keeps only its last screens."""

from __future__ import annotations

import json

import pytest

from rlgate import AsyncClient, RetryPolicy
from rlgate.messages import IMAGE_OMITTED, ImagePart, Message, to_openai
from rlgate.policies import PolicyContext, PolicyError, ReferencePolicy, reference_turns
from rlgate.protocol import ToolCall, render_tool_call
from rlgate.rollout import RolloutConfig, run_episode
from rlgate.v1 import common_pb2, orchestrator_pb2, toolgateway_pb2
from tests.client.images import image_block, noise
from tests.client.scripted import ScriptedServer

FAST = RetryPolicy(initial_backoff=0.01, max_backoff=0.05)
SOLUTION = {"tool_calls": [{"name": "echo", "arguments": {"id": 2**60 + 1, "n": 3}}], "final_answer": 42}


def _task(solution: dict | None = SOLUTION) -> common_pb2.TaskInfo:
    task = common_pb2.TaskInfo(key="t1", env_id="demo", version="v1", metadata_json='{"difficulty":"easy"}')
    if solution is not None:
        task.reference_solution_json = json.dumps(solution)
    return task


def test_reference_turns_replay_the_solution_exactly() -> None:
    first, last = reference_turns(_task(), max_turns=5)
    assert '"arguments": {"id": 1152921504606846977, "n": 3}' in first
    assert last == "<final_answer>42</final_answer>"


def test_a_task_listed_without_its_solution_says_how_to_get_it() -> None:
    with pytest.raises(PolicyError, match="include_reference_solution=True"):
        reference_turns(_task(None), max_turns=5)
    broken = _task()
    broken.reference_solution_json = "[1]"
    with pytest.raises(PolicyError, match="reference_solution_json of task 't1' must be a JSON object"):
        reference_turns(broken, max_turns=5)


async def test_rollout_episode_replays_the_listed_solution_not_resets_task(server: ScriptedServer) -> None:
    """Reset's TaskInfo never carries the solution (the scripted one has none): the policy must use the task
    the rollout listed."""
    config = RolloutConfig(orchestrator=server.address, progress=False)
    async with AsyncClient(server.address, retry=FAST) as client:
        record = await run_episode(client, _task(), 0, ReferencePolicy(), config)
    assert record.error is None and record.done and record.reward == 1.0
    (call,) = server.script.seen["CallTool"]
    assert json.loads(call.request.arguments_json) == {"id": 2**60 + 1, "n": 3}
    final = server.script.seen["Step"][-1].request
    assert isinstance(final, orchestrator_pb2.StepRequest) and final.final_answer == "42"


class _Recorder:
    """A policy that calls `screenshot` every turn until the last, recording what each turn saw."""

    def __init__(self, turns: int) -> None:
        self.turns = turns
        self.seen: list[list[Message]] = []

    async def __call__(self, ctx: PolicyContext) -> str:
        self.seen.append(ctx.messages)
        if ctx.turn == self.turns - 1:
            return "<final_answer>42</final_answer>"
        return render_tool_call(ToolCall("screenshot", {}))

    async def aclose(self) -> None:
        return None


async def test_a_fifty_turn_rollout_shows_the_policy_the_last_screens_only(server: ScriptedServer) -> None:
    """Every turn's tool answers with a new screen; the conversation the policy sees carries the last
    `keep_images` of them, so turn 50's prompt is as big as turn 4's give or take its text."""
    screen = noise(64, 48)
    server.script.defaults["CallTool"] = lambda req: toolgateway_pb2.CallToolResponse(
        result=common_pb2.ToolResult(content=[image_block(screen)])
    )
    policy = _Recorder(50)
    config = RolloutConfig(orchestrator=server.address, progress=False, keep_images=3)
    async with AsyncClient(server.address, retry=FAST) as client:
        record = await run_episode(client, _task(), 0, policy, config)
    assert record.error is None and record.done and len(policy.seen) == 50
    assert [sum(len(m.images) for m in seen) for seen in policy.seen[:5]] == [0, 1, 2, 3, 3]
    assert all(sum(len(m.images) for m in seen) == 3 for seen in policy.seen[3:])
    sizes = [len(json.dumps(to_openai(seen))) for seen in policy.seen]
    screen_url = len(ImagePart(screen, "image/png").data_url())
    assert screen_url > 9000 and sizes[-1] - sizes[3] < 46 * 400, sizes  # text grows, screens do not
    assert sum(m["content"].count(IMAGE_OMITTED) for m in record.messages) == 0  # trajectories: placeholders
    assert sum(m["content"].count("[image: image/png, ") for m in record.messages) == 49
