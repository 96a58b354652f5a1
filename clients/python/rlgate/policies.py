"""Policies for `rlgate rollout`: something that writes the next assistant message.

- `ReferencePolicy` replays a task's reference solution (`TaskInfo.reference_solution_json` =
  {"tool_calls": [{"name", "arguments"}], "final_answer"}) as model text — rendered `<tool_call>` blocks
  that the episode parses back like any model output, so the real protocol is exercised end to end. The
  solution is an answer key: only ListTasks with `include_reference_solution=True` returns it (Reset never
  does), so the policy reads the TaskInfo the rollout listed, not the episode's.
- `OpenAIPolicy` asks any OpenAI-compatible chat endpoint (`POST {base_url}/chat/completions`, httpx,
  key from OPENAI_API_KEY). Screens go to it as `image_url` parts (data URLs), so a vision model sees
  them; `images=False` (`--text-only`) sends each image as a short text placeholder instead, for an
  endpoint that takes text only. Native `tool_calls` in the reply are rendered to protocol text.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Protocol

from rlgate import protocol
from rlgate.core.convert import InvalidJsonValue, parse_json_object
from rlgate.messages import Message, to_openai, to_text_dicts
from rlgate.settings import ENV_OPENAI_API_KEY, read_env
from rlgate.v1 import common_pb2


@dataclass
class PolicyContext:
    """What a policy sees when it writes one turn.

    Args:
        task: the task as ListTasks returned it (with the reference solution when it was asked for).
        messages: the chat so far (system, task, earlier turns and observations), older screens already
            omitted.
        turn: the 0-based index of the turn to write.
        max_turns: the episode's turn limit.
    """

    task: common_pb2.TaskInfo
    messages: list[Message]
    turn: int
    max_turns: int


class Policy(Protocol):
    """Writes the next assistant message of an episode."""

    async def __call__(self, ctx: PolicyContext) -> str:
        """The assistant's text for turn `ctx.turn`."""
        ...

    async def aclose(self) -> None:
        """Release what the policy holds (an HTTP client); called once after the run."""
        ...


class PolicyError(RuntimeError):
    """The policy could not produce a message (no reference solution, endpoint failure)."""


def reference_solution(task: common_pb2.TaskInfo) -> dict[str, Any]:
    """The task's reference solution from `TaskInfo.reference_solution_json` (exact JSON).

    Args:
        task: the task, listed with `include_reference_solution=True`.

    Raises:
        PolicyError: the task carries no reference solution, or one that is not a JSON object.
    """
    if not task.reference_solution_json:
        raise PolicyError(
            f"task {task.key!r} carries no reference_solution_json: list tasks with "
            "include_reference_solution=True (Reset never returns it), or the task has no reference solution"
        )
    try:
        return parse_json_object(task.reference_solution_json, f"reference_solution_json of task {task.key!r}")
    except InvalidJsonValue as exc:
        raise PolicyError(str(exc)) from exc


def reference_turns(task: common_pb2.TaskInfo, max_turns: int) -> list[str]:
    """The reference solution as one model message per turn: one call per turn, then the answer.
    Calls are packed several per turn when the turn limit would not fit them otherwise.

    Args:
        task: the task, listed with `include_reference_solution=True`.
        max_turns: the episode's turn limit; 0 for none.

    Raises:
        PolicyError: as `reference_solution`.
    """
    solution = reference_solution(task)
    calls = [
        protocol.ToolCall(str(c.get("name", "")), dict(c.get("arguments") or {}))
        for c in solution.get("tool_calls") or []
    ]
    answer = solution.get("final_answer")
    final = protocol.render_assistant_turn((), None if answer is None else str(answer), done=answer is None)
    budget = max(1, (max_turns or len(calls) + 1) - 1)  # turns for calls, keeping the last for the answer
    per_turn = max(1, math.ceil(len(calls) / budget)) if calls else 1
    turns = [
        "I'll call the tool now.\n" + protocol.render_assistant_turn(calls[i : i + per_turn])
        for i in range(0, len(calls), per_turn)
    ]
    if len(turns) >= max(max_turns, 1) and max_turns:
        turns[-1] = turns[-1] + "\n" + final  # no turn left for the answer alone
    else:
        turns.append(final)
    return turns


class ReferencePolicy:
    """Replays the task's reference solution as model text (see the module docstring)."""

    async def __call__(self, ctx: PolicyContext) -> str:
        """Turn `ctx.turn` of the reference solution (the last one again past its end)."""
        turns = reference_turns(ctx.task, ctx.max_turns)
        return turns[min(ctx.turn, len(turns) - 1)]

    async def aclose(self) -> None:
        """Nothing to release."""
        return None


class OpenAIPolicy:
    """Any OpenAI-compatible chat completions endpoint.

    Args:
        base_url: the endpoint's base URL (`.../v1`); requests go to `{base_url}/chat/completions`.
        model: the model name sent with each request.
        api_key: the bearer key (default: OPENAI_API_KEY; none when unset).
        temperature: sampling temperature.
        max_tokens: the reply's token limit.
        timeout: seconds one request may take (connecting: at most 10).
        images: send images as `image_url` parts (a vision endpoint); False sends text placeholders.
    """

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        api_key: str | None = None,
        temperature: float = 0.0,
        max_tokens: int = 1024,
        timeout: float = 120.0,
        images: bool = True,
    ) -> None:
        import httpx

        headers = {}
        key = api_key if api_key is not None else read_env(ENV_OPENAI_API_KEY)
        if key:
            headers["Authorization"] = f"Bearer {key}"
        self.model = model
        self.temperature = temperature
        self.max_tokens = max_tokens
        self.images = images
        self._url = base_url.rstrip("/") + "/chat/completions"
        self._http = httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(timeout, connect=10.0))

    async def __call__(self, ctx: PolicyContext) -> str:
        """The endpoint's reply to the chat so far; PolicyError when it fails or answers nonsense."""
        import httpx

        body = {
            "model": self.model,
            "messages": to_openai(ctx.messages) if self.images else to_text_dicts(ctx.messages),
            "temperature": self.temperature,
            "max_tokens": self.max_tokens,
        }
        try:
            response = await self._http.post(self._url, json=body)
            response.raise_for_status()
            message = response.json()["choices"][0]["message"]
        except (httpx.HTTPError, KeyError, IndexError, TypeError, ValueError) as exc:
            raise PolicyError(f"chat endpoint {self._url}: {type(exc).__name__}: {exc}") from exc
        text = message.get("content") or ""
        for call in message.get("tool_calls") or []:  # a server that answers with native tool calls
            function = call.get("function") or {}
            arguments = function.get("arguments") or "{}"
            try:
                parsed = json.loads(arguments) if isinstance(arguments, str) else arguments
            except ValueError:
                parsed = {}
            text += "\n" + protocol.render_tool_call(protocol.ToolCall(str(function.get("name", "")), parsed))
        return text

    async def aclose(self) -> None:
        """Close the HTTP client."""
        await self._http.aclose()
