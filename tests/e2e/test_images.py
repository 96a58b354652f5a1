"""Screens reach the model, end to end: a real MCP server whose tools answer with images (an ImageContent
block, the `{"base64_image": ...}` text Fleet's screenshot tools write, and a null screenshot) behind the
stack as `rlgate up --mcp` runs it, then

- `rlgate rollout --policy openai` against a real OpenAI-compatible HTTP endpoint (aiohttp on loopback):
  the screens arrive as `image_url` parts, decodable, of the sizes the tools drew; `--text-only` sends
  placeholders; `--keep-images` bounds how many a request carries;
- the Tinker adapter with the cookbook's Qwen3-VL renderer (PIL `ImagePart`s, rendered to image chunks) and
  with a text renderer (placeholders);
- the VAGEN env (`<image>` placeholders and PIL images) and the SkyRL env (placeholders)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from rlgate import protocol
from rlgate.cli import cli
from rlgate.devtools.stack import LocalStack, StackSettings
from rlgate.messages import IMAGE_OMITTED
from tests.client.images import size_of_url
from tests.client.openai_stub import OpenAIStub, image_urls, turn_of
from tests.support.ports import free_port, wait_for_port

TASK = "screens-look"
LOOK = "\n".join(
    protocol.render_tool_call(protocol.ToolCall(name, args))
    for name, args in [
        ("screenshot", {"width": 64, "height": 48}),
        ("screenshot_json", {"width": 32, "height": 24}),
        ("screenshot_failed", {}),
    ]
)
ANSWER = "<final_answer>seen</final_answer>"


@pytest.fixture(scope="module")
def screens_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    log = (tmp_path_factory.mktemp("screens-server") / "server.log").open("wb")
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.client.image_mcp", "--port", str(port)], stdout=log, stderr=log, cwd=root
    )
    try:
        wait_for_port(port, timeout=30)
        yield f"http://127.0.0.1:{port}/mcp"
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()


@pytest.fixture(scope="module")
def stack(screens_server: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    tasks = tmp_path_factory.mktemp("tasks") / "tasks.json"
    solution = {"tool_calls": [{"name": "screenshot", "arguments": {}}], "final_answer": "seen"}
    tasks.write_text(
        json.dumps(
            {
                "envs": {"screens": {"modality": "tool_use"}},
                "tasks": [
                    {"key": TASK, "env": "screens", "prompt": "Look at the screen, then answer 'seen'.",
                     "expected_answer": "seen", "max_turns": 8, "metadata": {"reference_solution": solution}}
                ],
            }
        )
    )  # fmt: skip
    settings = StackSettings(
        data_dir=tmp_path_factory.mktemp("screens-stack"), mcp_envs=[f"screens={screens_server}"], tasks_file=str(tasks)
    )
    with LocalStack(settings) as running:
        yield running


def _rollout(stack: LocalStack, stub: OpenAIStub, tmp_path: Path, *options: str) -> dict[str, Any]:
    summary = tmp_path / "summary.json"
    result = CliRunner().invoke(
        cli,
        ["rollout", "--orchestrator", stack.orchestrator_address, "--tasks", TASK, "--policy", "openai",
         "--base-url", stub.base_url, "--model", "vision", "--no-progress", "--out", str(tmp_path / "traj.jsonl"),
         "--summary-json", str(summary), *options],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    loaded: dict[str, Any] = json.loads(summary.read_text())
    return loaded


def test_rollout_sends_screens_as_image_url_parts(stack: LocalStack, tmp_path: Path) -> None:
    with OpenAIStub(lambda body: LOOK if turn_of(body) == 0 else ANSWER) as stub:
        summary = _rollout(stack, stub, tmp_path)
    assert summary["reward_mean"] == 1.0 and summary["errors"] == 0
    first, second = stub.requests
    assert image_urls(first) == [] and first["model"] == "vision"
    urls = image_urls(second)
    assert [size_of_url(u) for u in urls] == [(64, 48), (32, 24)]  # the ImageContent one, then the JSON one
    observation = second["messages"][-1]
    assert observation["role"] == "user"
    texts = "".join(p["text"] for p in observation["content"] if p["type"] == "text")
    assert "screen 64x48" in texts and protocol.SCREENSHOT_FAILED in texts and texts.count("<tool_response>") == 3
    # Trajectories are text: placeholders, no base64.
    written = (tmp_path / "traj.jsonl").read_text()
    assert "[image: image/png, " in written and ";base64," not in written


def test_rollout_text_only_sends_placeholders(stack: LocalStack, tmp_path: Path) -> None:
    with OpenAIStub(lambda body: LOOK if turn_of(body) == 0 else ANSWER) as stub:
        summary = _rollout(stack, stub, tmp_path, "--text-only")
    assert summary["reward_mean"] == 1.0
    for body in stub.requests:
        assert all(isinstance(m["content"], str) for m in body["messages"])
    assert stub.requests[1]["messages"][-1]["content"].count("[image: image/png, ") == 2


def test_rollout_keeps_the_last_screens_only(stack: LocalStack, tmp_path: Path) -> None:
    def reply(body: dict[str, Any]) -> str:
        turn = turn_of(body)
        call = protocol.ToolCall("screenshot", {"width": 20 + turn, "height": 10})
        return protocol.render_tool_call(call) if turn < 4 else ANSWER

    with OpenAIStub(reply) as stub:
        summary = _rollout(stack, stub, tmp_path, "--keep-images", "2")
    assert summary["reward_mean"] == 1.0
    assert [len(image_urls(b)) for b in stub.requests] == [0, 1, 2, 2, 2]
    last = stub.requests[-1]
    assert [size_of_url(u) for u in image_urls(last)] == [(22, 10), (23, 10)]
    assert json.dumps(last["messages"]).count(IMAGE_OMITTED) == 2


# ----------------------------------------------------------------------------------------------- Tinker


def _vl_renderer() -> Any:
    from tinker_cookbook.renderers.qwen3 import Qwen3VLInstructRenderer
    from transformers import Qwen2VLImageProcessorPil

    from tests.client.tinker_support import make_tokenizer

    return Qwen3VLInstructRenderer(make_tokenizer(), image_processor=Qwen2VLImageProcessorPil())


async def test_tinker_vision_renderer_gets_pil_image_parts(stack: LocalStack) -> None:
    import tinker
    from PIL import Image
    from tinker_cookbook.renderers.base import Message

    from rlgate.adapters.tinker import RlgateEnvGroupBuilder, RlgateMessageEnv

    renderer = _vl_renderer()
    builder = RlgateEnvGroupBuilder(task_key=TASK, renderer=renderer, orchestrator=stack.orchestrator_address)
    env = RlgateMessageEnv(builder, renderer)
    try:
        await env.initial_observation()
        step = await env.step(Message(role="assistant", content=LOOK))
        assert not step.episode_done
        tool_messages = [m for m in step.next_messages if m["role"] == "tool"]
        assert [m["name"] for m in tool_messages] == ["screenshot", "screenshot_json", "screenshot_failed"]
        images = [p["image"] for m in tool_messages if isinstance(m["content"], list) for p in m["content"]
                  if p["type"] == "image"]  # fmt: skip
        assert [i.size if isinstance(i, Image.Image) else i for i in images] == [(64, 48), (32, 24)]
        assert tool_messages[2]["content"] == protocol.SCREENSHOT_FAILED
        prompt = renderer.build_generation_prompt(step.next_messages)
        assert sum(isinstance(c, tinker.types.ImageChunk) for c in prompt.chunks) == 2
        done = await env.step(Message(role="assistant", content=ANSWER))
        assert done.episode_done and done.reward == 1.0
    finally:
        await builder.cleanup()


async def test_tinker_keeps_the_last_screens_and_text_renderers_get_placeholders(stack: LocalStack) -> None:
    from PIL import Image
    from tinker_cookbook.renderers.base import Message

    from rlgate.adapters.tinker import RlgateEnvGroupBuilder, RlgateMessageEnv
    from tests.client.tinker_support import renderer

    vision = _vl_renderer()
    builder = RlgateEnvGroupBuilder(
        task_key=TASK, renderer=vision, orchestrator=stack.orchestrator_address, keep_images=1
    )
    env = RlgateMessageEnv(builder, vision)
    text = renderer()
    text_builder = RlgateEnvGroupBuilder(task_key=TASK, renderer=text, orchestrator=stack.orchestrator_address)
    text_env = RlgateMessageEnv(text_builder, text)
    try:
        await env.initial_observation()
        await env.step(Message(role="assistant", content=LOOK))
        step = await env.step(Message(role="assistant", content=LOOK))
        images = [p["image"] for m in step.next_messages if isinstance(m["content"], list) for p in m["content"]
                  if p["type"] == "image"]  # fmt: skip
        assert [i.size if isinstance(i, Image.Image) else i for i in images] == [(32, 24)]  # the newest only
        omitted = sum(
            p.get("text") == IMAGE_OMITTED for m in step.next_messages if isinstance(m["content"], list)
            for p in m["content"]
        )  # fmt: skip
        assert omitted == 3

        await text_env.initial_observation()
        text_step = await text_env.step(Message(role="assistant", content=LOOK))
        tool_texts = [m["content"] for m in text_step.next_messages if m["role"] == "tool"]
        assert all(isinstance(c, str) for c in tool_texts)
        assert "[image: image/png, " in tool_texts[0] and "[image: image/png, " in tool_texts[1]
        text.build_generation_prompt(text_step.next_messages)
    finally:
        await builder.cleanup()
        await text_builder.cleanup()


# ------------------------------------------------------------------------------------------ VAGEN, SkyRL


async def test_vagen_env_observations_carry_pil_images(stack: LocalStack) -> None:
    from PIL import Image

    from rlgate.adapters.vagen import RlgateImageEnv

    env = RlgateImageEnv({"orchestrator": stack.orchestrator_address, "task_key": TASK})
    try:
        obs, info = await env.reset(seed=0)
        assert "Look at the screen" in obs["obs_str"] and "multi_modal_input" not in obs
        assert info["task_key"] == TASK and info["session_id"]
        system = await env.system_prompt()
        assert "screenshot_json" in system["obs_str"]
        obs, reward, done, info = await env.step(LOOK)
        assert (reward, done, info["success"]) == (0.0, False, False)
        images = obs["multi_modal_input"]["<image>"]
        assert obs["obs_str"].count("<image>") == len(images) == 2
        assert all(isinstance(i, Image.Image) for i in images) and [i.size for i in images] == [(64, 48), (32, 24)]
        assert protocol.SCREENSHOT_FAILED in obs["obs_str"]
        obs, reward, done, info = await env.step(ANSWER)
        assert (reward, done, info["success"], info["verification_status"]) == (1.0, True, True, "OK")
    finally:
        await env.close()
        await env.close()  # idempotent


async def test_vagen_env_text_only_and_by_dotted_path(stack: LocalStack) -> None:
    import importlib

    module, _, name = "rlgate.adapters.vagen.RlgateImageEnv".rpartition(".")
    env_cls = getattr(importlib.import_module(module), name)  # as VAGEN's registry loads it
    env = env_cls({"orchestrator": stack.orchestrator_address, "task_key": TASK, "images": False})
    try:
        await env.reset(seed=1)
        obs, *_ = await env.step(LOOK)
        assert "multi_modal_input" not in obs and "<image>" not in obs["obs_str"]
        assert obs["obs_str"].count("[image: image/png, ") == 2
    finally:
        await env.close()


def test_skyrl_env_gets_placeholders(stack: LocalStack) -> None:
    from rlgate.adapters.skyrl import RlgateTextEnv

    env = RlgateTextEnv(extras={"orchestrator": stack.orchestrator_address, "task_key": TASK})
    try:
        chat, _ = env.init([])
        assert all(isinstance(m["content"], str) for m in chat)
        out = env.step(LOOK)
        (observation,) = out["observations"]
        assert isinstance(observation["content"], str) and observation["content"].count("[image: image/png, ") == 2
        assert out["metadata"]["tool_result"][0].startswith("screen 64x48\n[image: image/png, ")
        assert env.step(ANSWER)["reward"] == 1.0
    finally:
        env.close()
