"""SkyRL, Tinker and VAGEN adapters against a scripted server: registration, construction, the env protocol,
verifier failures and session closing."""

from __future__ import annotations

import asyncio
import pickle
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import grpc
import pytest

import rlgate
from rlgate.v1 import common_pb2, orchestrator_pb2, toolgateway_pb2
from tests.client.scripted import ScriptedServer, close_when_done, default_responses
from tests.client.tinker_support import ScriptedPolicy, renderer

if TYPE_CHECKING:
    from tinker_cookbook.rl.types import EnvGroupBuilder

    from rlgate.adapters.tinker import RlgateEnvGroupBuilder


def _verifier_error(req: orchestrator_pb2.StepRequest) -> orchestrator_pb2.StepResponse:
    response = orchestrator_pb2.StepResponse(turn=1, done=True)
    response.verification.status = common_pb2.VERIFICATION_STATUS_ERROR
    response.verification.message = "verifier raised KeyError"
    return response


# ------------------------------------------------------------------------------------------------ SkyRL


@pytest.fixture
def skyrl_env(monkeypatch: pytest.MonkeyPatch, server: ScriptedServer) -> Callable[..., Any]:
    import skyrl_gym

    from rlgate.adapters.skyrl import register

    register()
    register()  # idempotent
    monkeypatch.setenv("RLGATE_ORCHESTRATOR", server.address)

    def make(**extras: object) -> Any:  # skyrl_gym is untyped
        return skyrl_gym.make("rlgate", env_config={}, extras={"task_key": "t1", "max_turns": 4, **extras})

    return make


def test_skyrl_registration_and_settings(skyrl_env: Callable[..., Any], monkeypatch: pytest.MonkeyPatch) -> None:
    from rlgate.adapters.skyrl import RlgateTextEnv

    env = skyrl_env(orchestrator="127.0.0.1:1", api_key="k")
    assert isinstance(env, RlgateTextEnv)
    assert env.orchestrator == "127.0.0.1:1" and env.api_key == "k" and env.max_turns == 4
    via_info = skyrl_env(task_key=None, extra_info={"task_key": "from-info"})
    assert via_info.task_key == "from-info"
    with pytest.raises(ValueError, match="on_verifier_error"):
        skyrl_env(on_verifier_error="ignore")
    monkeypatch.delenv("RLGATE_ORCHESTRATOR")
    with pytest.raises(ValueError, match="orchestrator"):
        skyrl_env()


def test_skyrl_episode_like_the_generator(skyrl_env: Callable[..., Any], server: ScriptedServer) -> None:
    env = skyrl_env()
    chat, meta = env.init([{"role": "user", "content": "ignored: the task comes from rlgate"}])
    assert [m["role"] for m in chat] == ["system", "user"] and chat[1]["content"] == "do it"
    assert meta["task_key"] == "t1" and meta["env_key"] == "demo:v1" and meta["modality"] == "tool_use"
    assert meta["tools"][0]["name"] == "echo"
    default = meta["tools"][0]["parameters"]["properties"]["x"]["default"]
    assert default == 3 and type(default) is int  # the schema exactly as the MCP server wrote it
    out = env.step('<tool_call>{"name": "echo", "arguments": {"x": 1}}</tool_call>')
    assert not out["done"] and out["reward"] == 0.0
    assert out["metadata"]["tool_call"][0]["name"] == "echo" and out["metadata"]["tool_result"] == ["echo ok"]
    assert out["observations"][0]["content"].startswith("<tool_response>")
    out = env.step("<final_answer>42</final_answer>")
    assert out["done"] and out["reward"] == 1.0 and out["observations"] == []
    assert out["metadata"]["verification_status"] == "OK" and out["metadata"]["done_reason"] == "FINAL_ANSWER"
    assert env.get_metrics()["tool_calls"] == 1
    env.close()
    env.close()
    assert server.script.count("Close") == 1
    assert server.script.seen["Reset"][0].request.max_turns == 4


def test_skyrl_asks_the_ending_step_to_close_and_then_sends_no_close(
    skyrl_env: Callable[..., Any], server: ScriptedServer
) -> None:
    close_when_done(server)
    env = skyrl_env()
    env.init([])
    assert not env.step("thinking")["done"]
    assert env.step("<final_answer>42</final_answer>")["done"]
    env.close()
    assert [s.request.close_when_done for s in server.script.seen["Step"]] == [True, True]
    assert server.script.count("Close") == 0  # the ending Step closed the session: one round trip fewer


def test_skyrl_verifier_error_raises_and_closes(skyrl_env: Callable[..., Any], server: ScriptedServer) -> None:
    server.script.push("Step", _verifier_error)
    env = skyrl_env()
    env.init([])
    with pytest.raises(rlgate.VerifierError, match="ERROR"):
        env.step("<final_answer>x</final_answer>")
    assert server.script.count("Close") == 1  # SkyRL skips close() after a failed step


def test_skyrl_verifier_error_zero_mode(skyrl_env: Callable[..., Any], server: ScriptedServer) -> None:
    server.script.push("Step", _verifier_error)
    env = skyrl_env(on_verifier_error="zero")
    env.init([])
    out = env.step("<done/>")
    assert out["done"] and out["reward"] == 0.0 and out["metadata"]["verification_status"] == "ERROR"
    assert env.get_metrics()["verifier_failed"] == 1.0


def _faulted_step(req: orchestrator_pb2.StepRequest) -> orchestrator_pb2.StepResponse:
    """The orchestrator's answer to a turn whose tool call a dead gateway cut, as the client reported it."""
    faults = common_pb2.InfraFaults(outcome_unknown=1, client_retries=req.client_retries)
    faults.total = faults.outcome_unknown + faults.client_retries
    return orchestrator_pb2.StepResponse(turn=1, infra_faults=faults)


def _push_cut_tool_call(server: ScriptedServer) -> None:
    """A Reset whose agent token names its session (as the orchestrator mints them), a CallTool that fails
    UNAVAILABLE then answers OUTCOME_UNKNOWN on the retry, and the Step that counts both."""
    reset = default_responses(server.address)["Reset"](orchestrator_pb2.ResetRequest(task_key="t1", max_turns=4))
    reset.agent_token = "rlg1.s-1.secret"
    unknown = common_pb2.ToolResult(
        is_error=True, error_kind=common_pb2.TOOL_ERROR_KIND_OUTCOME_UNKNOWN, error_message="outcome unknown"
    )
    server.script.push("Reset", reset)
    server.script.push("CallTool", grpc.StatusCode.UNAVAILABLE, toolgateway_pb2.CallToolResponse(result=unknown))
    server.script.push("Step", _faulted_step)


def test_skyrl_infra_faults_are_apart_from_tool_errors(skyrl_env: Callable[..., Any], server: ScriptedServer) -> None:
    _push_cut_tool_call(server)
    env = skyrl_env()
    env.init([])
    out = env.step('<tool_call>{"name": "echo", "arguments": {"x": 1}}</tool_call>')
    assert server.script.seen["Step"][0].request.client_retries == 1  # the client reported its retry
    assert out["metadata"]["infra_faults"] == {
        "outcome_unknown": 1, "tool_reruns": 0, "client_retries": 1, "verifier_errors": 0,
        "orchestrator_restarts": 0, "total": 2,
    }  # fmt: skip
    metrics = env.get_metrics()
    assert metrics["tool_calls"] == 1 and metrics["tool_errors"] == 0  # not the model's mistake
    assert metrics["infra_faults"] == 2 and metrics["infra_faults/outcome_unknown"] == 1
    env.close()


# ----------------------------------------------------------------------------------------------- Tinker


@pytest.mark.parametrize("fail", [False, True])
async def test_tinker_infra_faults_in_metrics_or_failing_the_rollout(server: ScriptedServer, fail: bool) -> None:
    from tinker_cookbook.rl.rollout_strategy import RetryOnFailure
    from tinker_cookbook.rl.rollouts import do_group_rollout

    from rlgate.adapters.tinker import InfraFaultError

    _push_cut_tool_call(server)

    def script(prompt: str, turn: int) -> str:
        return '<tool_call>\n{"name": "echo", "arguments": {"x": 1}}\n</tool_call>' if turn == 0 else "<done/>"

    builder = _builder(server, fail_on_infra_fault=fail)
    group = await do_group_rollout(builder, ScriptedPolicy(script), strategy=RetryOnFailure(max_retries=1))
    (trajectory,) = group.trajectories_G
    first = trajectory.transitions[0].metrics
    if fail:  # the faulted trajectory was replaced by a fresh one
        assert [e.error_type for e in group.rollout_errors] == [InfraFaultError.__name__]
        assert server.script.count("Reset") == 2 and first["infra_faults"] == 0.0
    else:
        assert not group.rollout_errors and server.script.count("Reset") == 1
        assert first["infra_faults"] == 2.0 and first["tool_errors"] == 0.0
    await builder.cleanup()


def _builder(server: ScriptedServer, **kwargs: object) -> RlgateEnvGroupBuilder:
    from rlgate.adapters.tinker import RlgateEnvGroupBuilder

    return RlgateEnvGroupBuilder(task_key="t1", renderer=renderer(), orchestrator=server.address, **kwargs)  # type: ignore[arg-type]


def _task_keys(batch: Sequence[EnvGroupBuilder]) -> list[str]:
    """The tasks of a batch of rlgate's group builders (the dataset's type names tinker's base class)."""
    from rlgate.adapters.tinker import RlgateEnvGroupBuilder

    assert all(isinstance(b, RlgateEnvGroupBuilder) for b in batch), batch
    return [b.task_key for b in batch if isinstance(b, RlgateEnvGroupBuilder)]


def _answer_on_turn_two(prompt: str, turn: int) -> str:
    if turn == 0:
        return '<tool_call>\n{"name": "echo", "arguments": {"x": 1}}\n</tool_call>'
    return "<final_answer>42</final_answer>"


async def test_tinker_builder_is_lazy_picklable_and_closes_in_cleanup(server: ScriptedServer) -> None:
    from tinker_cookbook.rl.rollouts import do_group_rollout

    builder = _builder(server, group_size=3, max_turns=5)
    envs = await builder.make_envs()
    assert len(envs) == 3 and server.script.count("Reset") == 0  # no session until the first observation
    clone = pickle.loads(pickle.dumps(builder))
    assert clone.task_key == "t1" and clone.sessions_opened == 0

    policy = ScriptedPolicy(_answer_on_turn_two)
    group = await do_group_rollout(builder, policy)
    assert group.get_total_rewards() == [1.0, 1.0, 1.0]
    assert server.script.count("Reset") == 3 and server.script.count("Close") == 3
    assert server.script.seen["Reset"][0].request.max_turns == 5
    await builder.cleanup()  # idempotent
    assert server.script.count("Close") == 3


async def test_tinker_sessions_close_with_their_ending_steps(server: ScriptedServer) -> None:
    from tinker_cookbook.rl.rollouts import do_group_rollout

    close_when_done(server)
    builder = _builder(server, group_size=2, max_turns=5)
    group = await do_group_rollout(builder, ScriptedPolicy(_answer_on_turn_two))
    assert group.get_total_rewards() == [1.0, 1.0]
    await builder.cleanup()
    assert all(s.request.close_when_done for s in server.script.seen["Step"])
    assert server.script.count("Reset") == 2 and server.script.count("Close") == 0


async def test_tinker_lenient_parse_of_calls_the_renderer_rejects(server: ScriptedServer) -> None:
    from tinker_cookbook.rl.rollouts import do_single_rollout

    def script(prompt: str, turn: int) -> str:
        if turn == 0:  # "tool"/"params": the Qwen3 renderer leaves it unparsed; rlgate's parser repairs it
            return '<tool_call>\n{"tool": "echo", "params": {"x": 1}}\n</tool_call>'
        assert "<tool_response>\necho ok\n</tool_response>" in prompt
        return "<final_answer>42</final_answer>"

    builder = _builder(server)
    (env,) = await builder.make_envs()
    trajectory = await do_single_rollout(ScriptedPolicy(script), env)
    assert [t.reward for t in trajectory.transitions] == [0.0, 1.0]
    assert server.script.count("CallTool") == 1
    await builder.cleanup()


async def test_tinker_verifier_error_fails_the_rollout_and_cleanup_closes(server: ScriptedServer) -> None:
    from tinker_cookbook.rl.rollout_strategy import RetryOnFailure
    from tinker_cookbook.rl.rollouts import do_group_rollout

    server.script.push("Step", _verifier_error)
    builder = _builder(server, group_size=2)
    group = await do_group_rollout(
        builder, ScriptedPolicy(lambda p, t: "<done/>"), strategy=RetryOnFailure(max_retries=2)
    )
    assert len(group.trajectories_G) == 2
    assert [e.error_type for e in group.rollout_errors] == ["VerifierError"]
    # One failed trajectory -> one new session (not a new group): 2 + 1 Resets, all closed.
    assert server.script.count("Reset") == 3 and server.script.count("Close") == 3


async def test_tinker_env_raising_still_closes_every_session(server: ScriptedServer) -> None:
    from tinker_cookbook.rl.rollouts import do_group_rollout

    def script(prompt: str, turn: int) -> str:
        raise RuntimeError("policy crashed")

    builder = _builder(server, group_size=2)
    with pytest.raises(RuntimeError, match="policy crashed"):
        await do_group_rollout(builder, ScriptedPolicy(script))
    # FailFast's gather leaves the sibling rollout running after cleanup(); its session is closed too.
    for _ in range(100):
        if server.script.count("Close") + server.script.count("CloseSessions") >= 2:
            break
        await asyncio.sleep(0.05)
    assert server.script.count("Reset") == 2
    assert server.script.count("Close") + server.script.count("CloseSessions") == 2


def test_tinker_renderer_calls_the_client_could_not_send_are_observations() -> None:
    """Arguments the renderer parsed but JSON text cannot carry (NaN) become an error the model sees,
    not an InvalidArgument from call_tool that would end the rollout."""
    from tinker_cookbook.renderers.base import Message, ToolCall

    from rlgate.adapters.tinker import parsed_turn

    def call(arguments: str) -> ToolCall:
        return ToolCall(function=ToolCall.FunctionBody(name="echo", arguments=arguments))

    message = Message(
        role="assistant", content="", tool_calls=[call('{"x": NaN}'), call('{"x": 12345678901234567890}')]
    )
    _, turn = parsed_turn(message)
    assert [c.arguments for c in turn.tool_calls] == [{"x": 12345678901234567890}]
    assert len(turn.errors) == 1 and "arguments of 'echo'" in turn.errors[0] and "nan" in turn.errors[0]


async def test_tinker_tool_specs_carry_the_exact_schema(server: ScriptedServer) -> None:
    from rlgate.adapters.tinker import tool_specs

    async with rlgate.AsyncClient(server.address) as client, client.episode(task_key="t") as ep:
        (spec,) = tool_specs(ep)
    assert spec["parameters"]["properties"]["x"] == {"type": "integer", "default": 3}


async def test_tinker_dataset_builder(server: ScriptedServer, monkeypatch: pytest.MonkeyPatch) -> None:
    from rlgate.adapters.tinker import RlgateDatasetBuilder
    from tests.client.tinker_support import TOKENIZER_NAME

    renderer()  # registers the in-process tokenizer
    builder = RlgateDatasetBuilder(
        renderer_name="qwen3_instruct",
        model_name_for_tokenizer=TOKENIZER_NAME,
        orchestrator=server.address,
        tasks="a,b,c",
        test_tasks="c",
        batch_size=2,
        group_size=4,
        epochs=2,
    )
    train, test = await builder()
    assert len(train) == 2 and _task_keys(train.get_batch(0)) == ["a", "b"]
    assert _task_keys(train.get_batch(1)) == ["a", "b"]
    assert test is not None and _task_keys(test.get_batch(0)) == ["c"]
    batch = train.get_batch(0)
    assert pickle.loads(pickle.dumps(batch[0])).group_size == 4


async def test_tinker_dataset_builder_with_images_gives_the_renderer_an_image_processor(
    server: ScriptedServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`images=True` builds the renderer with the model's image processor (a real one; only the download
    that `get_image_processor` would make for a hosted model's name is replaced)."""
    from transformers import Qwen2VLImageProcessorPil

    from rlgate.adapters import tinker
    from tests.client.tinker_support import TOKENIZER_NAME

    renderer()  # registers the in-process tokenizer
    loaded: list[str] = []

    def processor(model: str) -> Any:
        loaded.append(model)
        return Qwen2VLImageProcessorPil()

    monkeypatch.setattr(tinker, "get_image_processor", processor)

    def dataset(name: str, images: bool = False, keep_images: int = 3) -> tinker.RlgateDatasetBuilder:
        return tinker.RlgateDatasetBuilder(
            renderer_name=name,
            model_name_for_tokenizer=TOKENIZER_NAME,
            orchestrator=server.address,
            tasks="a",
            images=images,
            keep_images=keep_images,
        )

    train, _ = await dataset("qwen3_vl_instruct", images=True)()
    (vision,) = train.get_batch(0)
    assert isinstance(vision, tinker.RlgateEnvGroupBuilder) and tinker.sees_images(vision.renderer)
    assert loaded == [TOKENIZER_NAME] and vision.keep_images == 3
    train, _ = await dataset("qwen3_vl_instruct")()
    (text,) = train.get_batch(0)
    assert isinstance(text, tinker.RlgateEnvGroupBuilder) and not tinker.sees_images(text.renderer)
    with pytest.raises(ValueError, match="keep_images must be 0 or more"):
        await dataset("qwen3_instruct", keep_images=-1)()


# ------------------------------------------------------------------------------------------------ VAGEN


async def test_vagen_settings_and_misuse(server: ScriptedServer, monkeypatch: pytest.MonkeyPatch) -> None:
    from rlgate.adapters.vagen import RlgateImageEnv

    monkeypatch.delenv("RLGATE_ORCHESTRATOR", raising=False)
    with pytest.raises(ValueError, match="RLGATE_ORCHESTRATOR"):
        RlgateImageEnv({"task_key": "t1"})
    with pytest.raises(ValueError, match="task_key"):
        RlgateImageEnv({"orchestrator": server.address})
    with pytest.raises(ValueError, match="tool timeout"):
        RlgateImageEnv({"orchestrator": server.address, "task_key": "t1", "tool_timeout_s": "soon"})
    monkeypatch.setenv("RLGATE_ORCHESTRATOR", server.address)
    env = RlgateImageEnv({"task_key": "t1", "max_turns": "4", "run_id": "run-7"})
    with pytest.raises(RuntimeError, match="before reset"):
        await env.step("<done/>")
    # Asked first (as some loops do), the system prompt opens the session the first reset then uses.
    system = await env.system_prompt()
    assert '"name": "echo"' in system["obs_str"] and "multi_modal_input" not in system
    obs, info = await env.reset(seed=3)
    assert obs == {"obs_str": "do it"} and info["session_id"] == "s-1"
    (reset,) = server.script.seen["Reset"]
    assert reset.request.max_turns == 4 and reset.request.run_id == "run-7" and reset.request.task_key == "t1"
    await env.system_prompt()  # after reset: the same session
    await env.reset(seed=4)  # a second reset closes the first session
    assert server.script.count("Close") == 1 and server.script.count("Reset") == 2
    await env.close()
    await env.close()
    assert server.script.count("Close") == 2


async def test_vagen_sessions_close_with_their_ending_steps(server: ScriptedServer) -> None:
    from rlgate.adapters.vagen import RlgateImageEnv

    close_when_done(server)
    env = RlgateImageEnv({"orchestrator": server.address, "task_key": "t1"})
    await env.reset()
    _obs, _reward, done, _info = await env.step("<done/>")
    assert done and env.episode is None
    await env.close()
    assert server.script.seen["Step"][0].request.close_when_done and server.script.count("Close") == 0


async def test_vagen_verifier_error_raises_and_closes(server: ScriptedServer) -> None:
    from rlgate.adapters.vagen import RlgateImageEnv

    server.script.push("Step", _verifier_error)
    env = RlgateImageEnv({"orchestrator": server.address, "task_key": "t1"})
    await env.reset()
    with pytest.raises(rlgate.VerifierError, match="verifier raised KeyError"):
        await env.step("<done/>")
    assert server.script.count("Close") == 1 and env.episode is None
    await env.close()
    assert server.script.count("Close") == 1


async def test_vagen_a_literal_image_tag_is_escaped(server: ScriptedServer) -> None:
    """Placeholders and images always match: a tool writing `<image>` does not add a placeholder."""
    from rlgate.adapters.vagen import RlgateImageEnv
    from tests.client.images import image_block, png, text_block

    server.script.push(
        "CallTool",
        lambda req: toolgateway_pb2.CallToolResponse(
            result=common_pb2.ToolResult(content=[text_block("see <image> below"), image_block(png(8, 6))])
        ),
    )
    env = RlgateImageEnv({"orchestrator": server.address, "task_key": "t1"})
    try:
        await env.reset()
        obs, reward, done, info = await env.step('<tool_call>{"name": "echo", "arguments": {}}</tool_call>')
        assert obs["obs_str"].count("<image>") == 1 == len(obs["multi_modal_input"]["<image>"])
        assert "see &lt;image&gt; below" in obs["obs_str"] and obs["multi_modal_input"]["<image>"][0].size == (8, 6)
        assert (reward, done, info["success"]) == (0.0, False, False) and info["tool_calls"][0]["name"] == "echo"
        obs, reward, done, info = await env.step("<final_answer>42</final_answer>")
        assert (reward, done, info["success"], info["done_reason"]) == (1.0, True, True, "FINAL_ANSWER")
    finally:
        await env.close()
