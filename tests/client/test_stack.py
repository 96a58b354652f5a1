"""The client, both adapters and `rlgate rollout` against the real local stack (localfleet + orchestrator +
toolgateway processes, SQLite store): reference solutions score 1.0 on every task, messy model text still
scores, wrong answers score 0.0 with verification OK, a failing verifier raises, and no session is left
open. Reference solutions come only from ListTasks when asked; tool schemas reach the prompt exactly."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

import rlgate
from rlgate.core.convert import parse_json_object
from rlgate.devtools.stack import LocalStack
from rlgate.policies import reference_solution, reference_turns
from rlgate.protocol import render_system_prompt
from rlgate.v1 import common_pb2
from tests.client.tinker_support import ScriptedPolicy, renderer
from tests.support.ports import free_port, wait_for_port
from tests.support.wait import wait_until

pytestmark = pytest.mark.slow

OPEN = {
    common_pb2.SESSION_STATUS_PROVISIONING,
    common_pb2.SESSION_STATUS_ACTIVE,
    common_pb2.SESSION_STATUS_DONE,
}


@pytest.fixture(scope="module")
def tasks(stack: LocalStack) -> dict[str, common_pb2.TaskInfo]:
    """Every task with its reference solution (the policies below replay them)."""
    with rlgate.Client(stack.orchestrator_address) as client:
        found = {t.key: t for t in client.list_tasks(include_reference_solution=True)}
    assert len(found) >= 3
    return found


def test_reference_solutions_only_on_request(stack: LocalStack, tasks: dict[str, common_pb2.TaskInfo]) -> None:
    assert all(t.reference_solution_json for t in tasks.values())
    with rlgate.Client(stack.orchestrator_address) as client:
        plain = client.list_tasks()
        with client.episode(task_key=next(iter(tasks))) as ep:
            reset_task = ep.reset_response.task  # type: ignore[union-attr]
    assert {t.key for t in plain} == set(tasks)
    for task in [*plain, reset_task]:
        assert task.reference_solution_json == ""
        assert "reference_solution" not in parse_json_object(task.metadata_json, "metadata_json")


_INTEGER_KEYWORDS = ("maxLength", "minLength", "maxItems", "minItems", "minimum", "maximum", "default")


def test_tool_schemas_reach_the_prompt_exactly(stack: LocalStack, tasks: dict[str, common_pb2.TaskInfo]) -> None:
    """Integer schema keywords stay integers from the MCP server through Reset, ListTools and the prompt."""
    with rlgate.Client(stack.orchestrator_address) as client:
        for task in {t.env_id: t for t in tasks.values()}.values():
            with client.episode(task_key=task.key) as ep:
                listed = ep.list_tools()
                assert [t.input_schema_json for t in listed] == [t.input_schema_json for t in ep.tools]
                prompt = render_system_prompt(ep.tools)
            assert re.search(rf'"({"|".join(_INTEGER_KEYWORDS)})": -?\d+\.0\b', prompt) is None, task.env_id
            assert re.search(r'"(maxLength|minimum|minItems)": \d+[,}]', prompt), task.env_id


def _open_sessions(address: str, run_id: str) -> list[str]:
    with rlgate.Client(address) as client:
        return [s.session_id for s in client.list_sessions(run_id=run_id) if s.status in OPEN]


def _skyrl_episode(
    address: str,
    task: common_pb2.TaskInfo,
    run_id: str,
    rewrite: Callable[[str], str] = str,
    trace: dict[str, Any] | None = None,
) -> dict:
    """Drive one env the way SkyRL's generator does: make, init, step until done, get_metrics, close; the
    last step's output. `trace`, when given, gets the session id, every step's output and the metrics."""
    import skyrl_gym

    from rlgate.adapters.skyrl import register

    register()
    env = skyrl_gym.make(
        "rlgate",
        env_config={},
        extras={"task_key": task.key, "max_turns": 12, "orchestrator": address, "run_id": run_id},
    )
    chat, meta = env.init([{"role": "user", "content": "(dataset prompt)"}])
    assert chat[0]["role"] == "system" and meta["task_key"] == task.key and meta["tools"]
    steps: list[dict] = []
    for text in reference_turns(task, env.max_turns):
        steps.append(dict(env.step(rewrite(text))))
        if steps[-1]["done"]:
            break
    metrics = env.get_metrics()
    env.close()
    if trace is not None:
        trace.update(session_id=meta["session_id"], steps=steps, metrics=metrics)
    return steps[-1] if steps else {}


def messy(text: str) -> str:
    """What models do: params for arguments, no closing tag, prose around, a code fence."""
    text = text.replace('"arguments":', '"params":').replace("</tool_call>", "")
    text = text.replace("<tool_call>\n", "<tool_call>\n```json\n", 1)
    return "Okay, let me think.\n" + text + "\nThat should do it."


def test_skyrl_reference_solutions_score_one_on_every_task_from_32_threads(
    stack: LocalStack, tasks: dict[str, common_pb2.TaskInfo]
) -> None:
    run_id = f"skyrl-{uuid.uuid4().hex[:8]}"
    with ThreadPoolExecutor(max_workers=32) as pool:  # SkyRL's default max_env_workers
        outs = dict(
            zip(
                tasks,
                pool.map(lambda t: _skyrl_episode(stack.orchestrator_address, t, run_id), tasks.values()),
                strict=True,
            )
        )
    rewards = {key: out["reward"] for key, out in outs.items()}
    assert rewards == dict.fromkeys(tasks, 1.0)
    assert all(out["metadata"]["verification_status"] == "OK" for out in outs.values())
    assert _open_sessions(stack.orchestrator_address, run_id) == []


def test_skyrl_messy_text_still_scores(stack: LocalStack, tasks: dict[str, common_pb2.TaskInfo]) -> None:
    run_id = f"messy-{uuid.uuid4().hex[:8]}"
    one_per_env = {t.env_id: t for t in tasks.values()}.values()
    for task in one_per_env:
        out = _skyrl_episode(stack.orchestrator_address, task, run_id, rewrite=messy)
        assert out["reward"] == 1.0, (task.key, out["metadata"])
    assert _open_sessions(stack.orchestrator_address, run_id) == []


def test_skyrl_wrong_final_answer_scores_zero_with_verification_ok(
    stack: LocalStack, tasks: dict[str, common_pb2.TaskInfo]
) -> None:
    with_answer = [t for t in tasks.values() if '"final_answer": null' not in json.dumps(reference_solution(t))]
    task = with_answer[0]

    def wrong(text: str) -> str:
        return re.sub(r"<final_answer>.*?</final_answer>", "<final_answer>no idea</final_answer>", text, flags=re.S)

    out = _skyrl_episode(stack.orchestrator_address, task, f"wrong-{uuid.uuid4().hex[:8]}", rewrite=wrong)
    assert out["done"] and out["reward"] == 0.0
    assert out["metadata"]["verification_status"] == "OK"


def test_faulted_verifier_raises_and_closes(stack_factory: Callable[..., LocalStack]) -> None:
    faulted = stack_factory(env={"RLGATE_VERIFY_TIMEOUT_S": "0.001", "RLGATE_VERIFY_RETRIES": "0"})
    with rlgate.Client(faulted.orchestrator_address) as client:
        task = client.list_tasks(include_reference_solution=True)[0]
    run_id = f"faulted-{uuid.uuid4().hex[:8]}"
    with pytest.raises(rlgate.VerifierError) as info:
        _skyrl_episode(faulted.orchestrator_address, task, run_id)
    assert info.value.status in ("ERROR", "TIMEOUT")
    assert _open_sessions(faulted.orchestrator_address, run_id) == []


# ----------------------------------------------------------------------------------------------- Tinker


def _reference_policy(tasks: dict[str, common_pb2.TaskInfo], fail_first: int = 0) -> ScriptedPolicy:
    failures = {"left": fail_first}

    def script(prompt: str, turn: int) -> str:
        task = next(t for t in tasks.values() if t.prompt in prompt)
        if turn == 0 and failures["left"] > 0:
            failures["left"] -= 1
            raise RuntimeError("sampler hiccup")
        turns = reference_turns(task, 12)
        return turns[min(turn, len(turns) - 1)]

    return ScriptedPolicy(script)


async def test_tinker_reference_solutions_through_the_cookbook(
    stack: LocalStack, tasks: dict[str, common_pb2.TaskInfo]
) -> None:
    from tinker_cookbook.rl.rollout_strategy import RetryOnFailure
    from tinker_cookbook.rl.rollouts import do_group_rollout

    from rlgate.adapters.tinker import RlgateEnvGroupBuilder

    run_id = f"tinker-{uuid.uuid4().hex[:8]}"
    one_per_env = list({t.env_id: t for t in tasks.values()}.values())
    builders = [
        RlgateEnvGroupBuilder(
            task_key=t.key,
            renderer=renderer(),
            group_size=2,
            orchestrator=stack.orchestrator_address,
            max_turns=12,
            run_id=run_id,
        )
        for t in one_per_env
    ]
    groups = await asyncio.gather(*(do_group_rollout(b, _reference_policy(tasks)) for b in builders))
    assert [g.get_total_rewards() for g in groups] == [[1.0, 1.0]] * len(builders)

    # A retried trajectory opens one new session (the retry's make_envs() builds a group, uses one env).
    retried = RlgateEnvGroupBuilder(
        task_key=one_per_env[0].key,
        renderer=renderer(),
        group_size=3,
        orchestrator=stack.orchestrator_address,
        run_id=run_id + "-retry",
        max_turns=12,
    )
    group = await do_group_rollout(retried, _reference_policy(tasks, fail_first=1), strategy=RetryOnFailure(2))
    assert group.get_total_rewards() == [1.0, 1.0, 1.0] and len(group.rollout_errors) == 1
    with rlgate.Client(stack.orchestrator_address) as client:
        assert len(client.list_sessions(run_id=run_id + "-retry")) == 4
    assert _open_sessions(stack.orchestrator_address, run_id) == []
    assert _open_sessions(stack.orchestrator_address, run_id + "-retry") == []


# ---------------------------------------------------------------------------------------------- rollout


def _rollout(stack: LocalStack, tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> dict:
    summary_path = tmp_path / "summary.json"
    out_path = tmp_path / "traj.jsonl"
    cmd = [sys.executable, "-m", "rlgate.cli", "rollout", "--orchestrator", stack.orchestrator_address,
           "--no-progress", "--summary-json", str(summary_path), "--out", str(out_path), *args]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=280, env=env)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    summary: dict[str, Any] = json.loads(summary_path.read_text())
    lines = [json.loads(line) for line in out_path.read_text().splitlines()]
    assert len(lines) == summary["episodes"]
    assert all(line["messages"][-1]["role"] == "assistant" for line in lines)
    return summary


def test_rollout_reference_all_tasks(stack: LocalStack, tasks: dict[str, common_pb2.TaskInfo], tmp_path: Path) -> None:
    summary = _rollout(stack, tmp_path, "--tasks", "all", "--concurrency", "16", "--policy", "reference")
    assert summary["episodes"] == len(tasks)
    assert summary["reward_mean"] == 1.0
    assert summary["errors"] == 0 and summary["verifier_errors"] == 0 and summary["truncated"] == 0
    assert summary["sessions_left_open"] == 0
    assert _open_sessions(stack.orchestrator_address, summary["run_id"]) == []
    assert set(summary["per_env"]) == {f"{t.env_id}:{t.version}" for t in tasks.values()}


@pytest.fixture
def openai_server(tasks: dict[str, common_pb2.TaskInfo]) -> Iterator[str]:
    """A tiny OpenAI-compatible chat endpoint on loopback that replays reference solutions."""
    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    async def chat(request: Request) -> JSONResponse:
        if request.headers.get("authorization") != "Bearer sk-test":
            return JSONResponse({"error": "bad key"}, status_code=401)
        body = await request.json()
        messages = body["messages"]
        user = next(m["content"] for m in messages if m["role"] == "user")
        task = next(t for t in tasks.values() if t.prompt in user)
        turn = sum(m["role"] == "assistant" for m in messages)
        turns = reference_turns(task, 12)
        text = turns[min(turn, len(turns) - 1)]
        return JSONResponse({"choices": [{"index": 0, "message": {"role": "assistant", "content": text}}],
                             "model": body["model"]})  # fmt: skip

    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(
            Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])]),
            host="127.0.0.1",
            port=port,
            log_level="warning",
        )
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_for_port(port)
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        server.should_exit = True
        thread.join(10)
    with socket.socket() as probe:  # the port is free again
        probe.bind(("127.0.0.1", port))


def test_rollout_openai_policy(
    stack: LocalStack, tasks: dict[str, common_pb2.TaskInfo], openai_server: str, tmp_path: Path
) -> None:
    import os

    keys = ",".join(list({t.env_id: t.key for t in tasks.values()}.values()))
    env = {**os.environ, "OPENAI_API_KEY": "sk-test"}
    summary = _rollout(stack, tmp_path, "--tasks", keys, "--policy", "openai", "--base-url", openai_server,
                       "--model", "replay", "--concurrency", "3", env=env)  # fmt: skip
    assert summary["episodes"] == 3 and summary["reward_mean"] == 1.0 and summary["errors"] == 0
    assert summary["sessions_left_open"] == 0


async def test_gateway_sigkill_during_rollout_loses_no_episode(
    stack_factory: Callable[..., LocalStack], tmp_path: Path
) -> None:
    """SIGKILL and restart the toolgateway mid-rollout: every episode still ends scored (none lost to an
    exception), and no tool call request runs twice (the gateway's log has each request_id once)."""
    from rlgate.rollout import RolloutConfig, run_rollout

    faults = tmp_path / "faults.json"
    faults.write_text(json.dumps({"environments": {"*": {"tool_latency_s": 0.4}}}))
    crashy = await asyncio.to_thread(stack_factory, env={"RLGATE_LOCALFLEET_FAULTS": str(faults)})
    config = RolloutConfig(
        orchestrator=crashy.orchestrator_address, tasks="all", concurrency=12, progress=False,
        out=tmp_path / "traj.jsonl",
    )  # fmt: skip
    rollout = asyncio.create_task(run_rollout(config))

    async def calling_tools() -> bool:
        async with httpx.AsyncClient(base_url=crashy.localfleet_url, timeout=10) as http:
            counters = (await http.get("/_admin/counters")).raise_for_status().json()
        return int(counters["tool_calls"]) >= config.concurrency

    # Mid-rollout: the episodes are calling tools through the gateway (as many calls as episodes at once).
    await wait_until(calling_tools, 120, "the rollout's tool calls under way")
    assert not rollout.done()
    await asyncio.to_thread(crashy.restart, "toolgateway")
    summary, records = await rollout
    assert summary["errors"] == 0, [r.error for r in records if r.error]
    assert summary["verifier_errors"] == 0
    assert all(r.done and r.reward is not None for r in records)
    assert summary["sessions_left_open"] == 0

    async with rlgate.AsyncClient(crashy.orchestrator_address) as client:
        logged: list[str] = []
        for record in records:
            state = await client.state(record.session_id, include_tool_calls=True)
            logged.extend(entry.request_id for entry in state.tool_calls)
    ours = [call["request_id"] for r in records for call in r.tool_calls]
    assert logged, "the gateway logged no tool calls"
    assert len(logged) == len(set(logged)), "a tool call request ran twice"
    assert set(logged) <= set(ours)
