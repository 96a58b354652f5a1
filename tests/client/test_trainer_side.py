"""The trainer's side never crashes on what a model wrote (SkyRL and Tinker adapters, the protocol, episodes):
text no RPC can carry (a lone UTF-16 surrogate), a tool that hangs past the per-call timeout and a call the
gateway refuses for its name are observations for the model, and the episode goes on. Also: a second SkyRL
`init` closes the first session."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pytest

import rlgate
from rlgate import protocol
from rlgate.core import errors as service_errors  # the classes the gateway raises (the client's own)
from rlgate.episode import tool_timeout_setting
from rlgate.v1 import common_pb2, orchestrator_pb2
from tests.client.scripted import Rich, ScriptedServer, Sleep
from tests.client.tinker_support import ScriptedPolicy, renderer
from tests.support.wait import wait_until_sync

if TYPE_CHECKING:
    from rlgate.adapters.skyrl import RlgateTextEnv

ESCAPED = '<tool_call>{"name": "echo", "arguments": {"x": {"y": [1, "\\ud800"]}}}</tool_call>'  # JSON's escape
LITERAL = '<tool_call>{"name": "echo", "arguments": {"x": "a\ud800"}}</tool_call>'  # the character itself
HANG = Sleep(60)  # a tool that does not answer; the client's deadline cancels the handler


def _sendable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


# --------------------------------------------------------------------------------------------- protocol


@pytest.mark.parametrize("text", [ESCAPED, LITERAL], ids=["escaped", "literal"])
def test_a_lone_surrogate_in_arguments_is_a_parse_error_naming_the_place(text: str) -> None:
    turn = protocol.parse_assistant_text(text)
    assert turn.tool_calls == [] and len(turn.errors) == 1
    (error,) = turn.errors
    assert "lone UTF-16 surrogate" in error and "arguments of 'echo'" in error and _sendable(error)
    assert ("$.x.y[1]" if text == ESCAPED else "$.x") in error


def test_a_lone_surrogate_in_a_name_or_a_key_or_the_final_answer_is_a_parse_error() -> None:
    name = protocol.parse_assistant_text('<tool_call>{"name": "ec\\udc00ho", "arguments": {}}</tool_call>')
    assert name.tool_calls == [] and "the tool name" in name.errors[0] and _sendable(name.errors[0])
    key = protocol.parse_assistant_text('<tool_call>{"name": "echo", "arguments": {"\\ud800k": 1}}</tool_call>')
    assert key.tool_calls == [] and "the key $." in key.errors[0] and _sendable(key.errors[0])
    answer = protocol.parse_assistant_text("<final_answer>4\ud8002</final_answer>")
    # Refused, not sent with a replacement character the verifier would score: the model may answer again.
    assert answer.final_answer is None and not answer.done and "the final answer" in answer.errors[0]
    assert protocol.call_error("ec\udc00ho", {}) is not None and protocol.call_error("echo", {"x": 1}) is None


def test_surrogate_pairs_written_as_two_code_points_are_one_character() -> None:
    turn = protocol.parse_assistant_text("<final_answer>\ud83d\ude00</final_answer>")
    assert turn.final_answer == "\U0001f600" and turn.done and not turn.errors
    assert protocol.sendable_text("a\ud800b\ud83d\ude00") == "a\ufffdb\U0001f600"
    assert protocol.sendable_text("plain") == "plain"


def test_tool_timeout_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RLGATE_TOOL_TIMEOUT_S", raising=False)
    assert tool_timeout_setting() is None and tool_timeout_setting("2.5") == 2.5
    monkeypatch.setenv("RLGATE_TOOL_TIMEOUT_S", "7")
    assert tool_timeout_setting() == 7.0 and tool_timeout_setting(1) == 1.0
    for bad in ("0", "-1", "nan", "inf", "soon"):
        with pytest.raises(ValueError, match="RLGATE_TOOL_TIMEOUT_S"):
            tool_timeout_setting(bad)


# ------------------------------------------------------------------------------------------------ SkyRL


MakeEnv = Callable[..., "RlgateTextEnv"]


@pytest.fixture
def skyrl_env(monkeypatch: pytest.MonkeyPatch, server: ScriptedServer) -> MakeEnv:
    from rlgate.adapters.skyrl import RlgateTextEnv

    monkeypatch.setenv("RLGATE_ORCHESTRATOR", server.address)
    monkeypatch.delenv("RLGATE_TOOL_TIMEOUT_S", raising=False)

    def make(**extras: object) -> RlgateTextEnv:
        return RlgateTextEnv(env_config={}, extras={"task_key": "t1", "max_turns": 4, **extras})

    return make


@pytest.mark.parametrize("text", [ESCAPED, LITERAL], ids=["escaped", "literal"])
def test_skyrl_step_turns_a_lone_surrogate_into_an_observation(
    skyrl_env: MakeEnv, server: ScriptedServer, text: str
) -> None:
    env = skyrl_env()
    env.init([])
    out = env.step(f"Let me look. {text}")
    assert not out["done"] and out["reward"] == 0.0
    (observation,) = out["observations"]
    assert "lone UTF-16 surrogate" in observation["content"] and _sendable(observation["content"])
    assert server.script.count("CallTool") == 0  # nothing unsendable was sent
    (step,) = server.script.seen["Step"]
    assert step.request.tool_calls == [] and step.request.assistant_text.startswith("Let me look. ")
    assert env.get_metrics()["parse_errors"] == 1
    assert env.step("<final_answer>42</final_answer>")["reward"] == 1.0  # the episode goes on


def test_skyrl_step_stores_prose_with_a_lone_surrogate_as_replacement_characters(
    skyrl_env: MakeEnv, server: ScriptedServer
) -> None:
    env = skyrl_env()
    env.init([])
    out = env.step('hm \ud800 <tool_call>{"name": "echo", "arguments": {"x": 1}}</tool_call>')
    assert out["metadata"]["tool_result"] == ["echo ok"]  # the call itself was fine, and ran
    assert server.script.seen["Step"][0].request.assistant_text.startswith("hm \ufffd <tool_call>")
    final = env.step("Done \udfff. <final_answer>42</final_answer>")
    assert final["done"] and server.script.seen["Step"][1].request.final_answer == "42"


@pytest.mark.parametrize("via", ["extras", "variable"])
def test_skyrl_a_hung_tool_is_an_error_observation_after_the_tool_timeout(
    skyrl_env: MakeEnv, server: ScriptedServer, monkeypatch: pytest.MonkeyPatch, via: str
) -> None:
    server.script.push("CallTool", HANG)
    if via == "variable":
        monkeypatch.setenv("RLGATE_TOOL_TIMEOUT_S", "0.3")
        env = skyrl_env()
    else:
        env = skyrl_env(tool_timeout_s=0.3)
    assert env.tool_timeout_s == 0.3
    env.init([])
    started = time.monotonic()
    out = env.step('<tool_call>{"name": "echo", "arguments": {"x": 1}}</tool_call>')
    assert time.monotonic() - started < 10  # not the client's 120 s default
    assert out["metadata"]["tool_result"] == [
        "Error (outcome unknown): the tool did not answer within 0.3 s; the call was cancelled and may have partly run"
    ]
    assert out["metadata"]["tool_call"][0]["error_kind"] == "TOOL_ERROR_KIND_OUTCOME_UNKNOWN"
    (summary,) = server.script.seen["Step"][0].request.tool_calls
    assert summary.is_error and summary.error_kind == common_pb2.TOOL_ERROR_KIND_OUTCOME_UNKNOWN
    assert env.get_metrics()["tool_errors"] == 0  # a hung tool is the environment's fault, not the model's
    assert env.step("<final_answer>42</final_answer>")["reward"] == 1.0
    wait_until_sync(lambda: server.script.count("Close") == 1, 10, "the close after done")


def test_skyrl_rejects_a_bad_tool_timeout(skyrl_env: MakeEnv) -> None:
    with pytest.raises(ValueError, match="tool timeout"):
        skyrl_env(tool_timeout_s="-1")


def test_skyrl_a_tool_name_the_gateway_refuses_is_an_observation(skyrl_env: MakeEnv, server: ScriptedServer) -> None:
    refusal = service_errors.InvalidArgument("name", "'my tool' is not a tool name: 1-128 characters of [A-Za-z0-9._-]")
    server.script.push("CallTool", Rich(refusal.to_status()))
    env = skyrl_env()
    env.init([])
    out = env.step('<tool_call>{"name": "my tool", "arguments": {}}</tool_call>')
    assert not out["done"]
    (text,) = out["metadata"]["tool_result"]
    assert text.startswith("Error (unknown tool): name: 'my tool' is not a tool name")
    assert server.script.seen["Step"][0].request.tool_calls[0].error_kind == common_pb2.TOOL_ERROR_KIND_UNKNOWN_TOOL


def test_skyrl_failures_of_the_services_still_raise(skyrl_env: MakeEnv, server: ScriptedServer) -> None:
    """Only what the model wrote is its to see: an ended token (or a request id clash) is not."""
    ended = service_errors.FailedPrecondition("the episode of this token is over")
    clash = service_errors.InvalidArgument("request_id", "reused with other arguments")
    for error, expected in ((ended, rlgate.FailedPrecondition), (clash, rlgate.InvalidArgument)):
        server.script.push("CallTool", Rich(error.to_status()))
        env = skyrl_env()
        env.init([])
        with pytest.raises(expected):
            env.step('<tool_call>{"name": "echo", "arguments": {}}</tool_call>')
    assert server.script.count("Close") == 2  # each failed step closed its session


def test_skyrl_init_twice_closes_the_first_session(skyrl_env: MakeEnv, server: ScriptedServer) -> None:
    sessions = iter(["s-first", "s-second"])

    def reset(req: orchestrator_pb2.ResetRequest) -> orchestrator_pb2.ResetResponse:
        response: orchestrator_pb2.ResetResponse = server.script.defaults["Reset"](req)
        response.session_id = next(sessions)
        return response

    server.script.push("Reset", reset, reset)
    env = skyrl_env()
    env.init([])
    env.step('<tool_call>{"name": "echo", "arguments": {"x": 1}}</tool_call>')
    _, meta = env.init([])
    assert meta["session_id"] == "s-second"
    assert [s.request.session_id for s in server.script.seen["Close"]] == ["s-first"]
    assert env.get_metrics()["tool_calls"] == 0 and env.turns == 0  # the metrics are the new episode's
    assert env.step("<final_answer>42</final_answer>")["done"]
    env.close()  # waits for the close after done, which runs in the background
    assert [s.request.session_id for s in server.script.seen["Close"]] == ["s-first", "s-second"]


def test_skyrl_the_close_after_done_never_delays_the_turn(skyrl_env: MakeEnv, server: ScriptedServer) -> None:
    """A Close that hangs (an orchestrator restarting) holds the step that ended the episode only briefly."""
    from rlgate.adapters.skyrl import CLOSE_IN_STEP_S

    server.script.push("Close", Sleep(4))
    env = skyrl_env()
    env.init([])
    started = time.monotonic()
    assert env.step("<final_answer>42</final_answer>")["done"]
    assert time.monotonic() - started < CLOSE_IN_STEP_S + 1.5
    env.close()  # waits (bounded) for the close under way
    assert server.script.count("Close") == 1


# ----------------------------------------------------------------------------------------------- Tinker


def _builder(server: ScriptedServer, **kwargs: Any) -> Any:
    from rlgate.adapters.tinker import RlgateEnvGroupBuilder

    return RlgateEnvGroupBuilder(task_key="t1", renderer=renderer(), orchestrator=server.address, **kwargs)


def _call_then_answer(call: str, seen: list[str]) -> Callable[[str, int], str]:
    def script(prompt: str, turn: int) -> str:
        if turn == 0:
            return call
        seen.append(prompt)
        return "<final_answer>42</final_answer>"

    return script


async def test_tinker_a_lone_surrogate_from_the_renderer_is_an_observation(server: ScriptedServer) -> None:
    from tinker_cookbook.rl.rollouts import do_single_rollout

    prompts: list[str] = []
    builder = _builder(server)
    (env,) = await builder.make_envs()
    trajectory = await do_single_rollout(ScriptedPolicy(_call_then_answer(ESCAPED, prompts)), env)
    assert [t.reward for t in trajectory.transitions] == [0.0, 1.0]
    assert server.script.count("CallTool") == 0 and "lone UTF-16 surrogate" in prompts[0]
    assert all(_sendable(s.request.assistant_text) for s in server.script.seen["Step"])
    await builder.cleanup()


async def test_tinker_message_env_step_never_raises_on_unsendable_text(server: ScriptedServer) -> None:
    from tinker_cookbook.renderers.base import Message, ToolCall

    from rlgate.adapters.tinker import RlgateMessageEnv

    builder = _builder(server)
    env = RlgateMessageEnv(builder, builder.renderer)
    await env.initial_observation()
    bad_call = ToolCall(function=ToolCall.FunctionBody(name="ec\ud800ho", arguments='{"x": "\\udc00"}'))
    result = await env.step(Message(role="assistant", content="thinking \ud800", tool_calls=[bad_call]))
    assert not result.episode_done and result.metrics["parse_error"] == 1.0
    assert "lone UTF-16 surrogate" in result.next_messages[-1]["content"]
    assert server.script.count("CallTool") == 0
    assert server.script.seen["Step"][0].request.assistant_text.startswith("thinking \ufffd")
    await builder.cleanup()


async def test_tinker_a_hung_tool_is_an_error_tool_message(server: ScriptedServer) -> None:
    from tinker_cookbook.rl.rollouts import do_single_rollout

    server.script.push("CallTool", HANG)
    prompts: list[str] = []
    builder = _builder(server, tool_timeout_s=0.3)
    (env,) = await builder.make_envs()
    started = time.monotonic()
    call = '<tool_call>\n{"name": "echo", "arguments": {"x": 1}}\n</tool_call>'
    trajectory = await do_single_rollout(ScriptedPolicy(_call_then_answer(call, prompts)), env)
    assert time.monotonic() - started < 10
    assert [t.reward for t in trajectory.transitions] == [0.0, 1.0]
    assert "Error (outcome unknown): the tool did not answer within 0.3 s" in prompts[0]
    await builder.cleanup()


async def test_tinker_dataset_builder_checks_the_tool_timeout(server: ScriptedServer) -> None:
    from rlgate.adapters.tinker import RlgateDatasetBuilder, RlgateEnvGroupBuilder
    from tests.client.tinker_support import TOKENIZER_NAME

    renderer()  # registers the in-process tokenizer
    common: dict[str, Any] = {
        "renderer_name": "qwen3_instruct",
        "model_name_for_tokenizer": TOKENIZER_NAME,
        "orchestrator": server.address,
        "tasks": "a",
    }
    train, _ = await RlgateDatasetBuilder(**common, tool_timeout_s=2.0)()
    group = train.get_batch(0)[0]
    assert isinstance(group, RlgateEnvGroupBuilder) and group.tool_timeout_s == 2.0
    with pytest.raises(ValueError, match="tool timeout"):
        await RlgateDatasetBuilder(**common, tool_timeout_s=0.0)()
