"""The reference-solution policy: the solution comes from ListTasks (asked for it), exactly, never from Reset."""

from __future__ import annotations

import json

import pytest

from rlgate import AsyncClient, RetryPolicy
from rlgate.policies import PolicyError, ReferencePolicy, reference_turns
from rlgate.rollout import RolloutConfig, run_episode
from rlgate.v1 import common_pb2, orchestrator_pb2
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
