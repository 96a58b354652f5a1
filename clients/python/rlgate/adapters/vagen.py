"""VAGEN adapter: `RlgateImageEnv`, an env with VAGEN's `GymImageEnv` interface, its episodes on rlgate.

It does not import VAGEN (nothing here needs it); VAGEN's env registry loads it by its dotted path:

    env_registry:
      rlgate: rlgate.adapters.vagen.RlgateImageEnv

and makes one per rollout with the config dict as its only argument, then calls, all as coroutines,
`reset(seed)` -> `(obs, info)`, `system_prompt()` -> `obs`, `step(action_str)` -> `(obs, reward, done,
info)` and `close()`. An observation is `{"obs_str": "... <image> ...", "multi_modal_input": {"<image>":
[PIL.Image, ...]}}`: the tool responses as text with one `<image>` where each screen was, the images in the
same order (without an image, `{"obs_str": ...}` alone). A literal `<image>` a tool wrote is escaped
(`&lt;image&gt;`), so the placeholders and the images always match.

Config keys (as the SkyRL adapter's; the environment variables are the fallback):

| key               | variable                 | meaning                                             |
|-------------------|--------------------------|-----------------------------------------------------|
| `orchestrator`    | `RLGATE_ORCHESTRATOR`    | orchestrator address(es), "host:port[,...]"          |
| `api_key`         | `RLGATE_API_KEY`         | orchestrator API key                                |
| `task_key`        | -                        | the task (or `env_key` for a task-less session)      |
| `max_turns`       | -                        | turn limit passed to Reset (0: the task's)           |
| `run_id`          | `RLGATE_TRAINING_RUN_ID` | labels the sessions of one training run             |
| `tool_timeout_s`  | `RLGATE_TOOL_TIMEOUT_S`  | bound of one tool call (default: 120 s)             |
| `instructions`    | -                        | text placed before the tool list                    |
| `images`          | -                        | `false`: each image as a text placeholder           |

The seed is not used: a task's instance starts from its own seeded data. `reset` closes the previous
session before opening the next (a `system_prompt()` asked before any `reset`, as some loops do, opens the
session that `reset` then uses); the session also closes when the episode ends, and `close()` is
idempotent. A verifier ERROR/TIMEOUT raises `rlgate.VerifierError` out of `step` (never a reward of 0);
what the model wrote never raises (see `rlgate.episode`). How many screens stay in the context is the
agent loop's: each observation carries only the screens of its own turn. Needs Pillow."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from rlgate import protocol
from rlgate.adapters.loops import loop_client, orchestrator_address
from rlgate.client import ENV_API_KEY
from rlgate.episode import AsyncEpisode, TurnResult, tool_timeout_setting
from rlgate.messages import ImagePart, Message, UnreadableImage
from rlgate.settings import ENV_RUN_ID, read_env

IMAGE_PLACEHOLDER = "<image>"
_ESCAPED_PLACEHOLDER = "&lt;image&gt;"

log = logging.getLogger("rlgate.adapters.vagen")


def observation(messages: Sequence[Message], images: bool = True) -> dict[str, Any]:
    """Messages as one VAGEN observation: their text with `<image>` where each image was, and the images.

    Args:
        messages: the messages to show, in order (joined by a blank line).
        images: False gives text only, each image as its placeholder.
    """
    text: list[str] = []
    pictures: list[Any] = []
    for i, message in enumerate(messages):
        if i:
            text.append("\n\n")
        for part in message.parts:
            if not isinstance(part, ImagePart):
                text.append(part.text.replace(IMAGE_PLACEHOLDER, _ESCAPED_PLACEHOLDER))
            elif not images:
                text.append(part.placeholder())
            else:
                try:
                    pictures.append(part.to_pil())
                except UnreadableImage as exc:
                    text.append(f"[image unreadable: {exc}]")
                else:
                    text.append(IMAGE_PLACEHOLDER)
    obs: dict[str, Any] = {"obs_str": "".join(text)}
    if pictures:
        obs["multi_modal_input"] = {IMAGE_PLACEHOLDER: pictures}
    return obs


def _setting(config: Mapping[str, Any], name: str, env: str | None = None, default: Any = None) -> Any:
    value = config.get(name)
    if value not in (None, ""):
        return value
    if env and read_env(env):
        return read_env(env)
    return default


class RlgateImageEnv:
    """One rlgate episode per `reset`, with VAGEN's `GymImageEnv` interface (see the module docstring).

    Args:
        env_config: the settings (see the module docstring's table).
    """

    def __init__(self, env_config: Mapping[str, Any]) -> None:
        self.config = dict(env_config)
        self.orchestrator = orchestrator_address(str(_setting(self.config, "orchestrator", default="")))
        self.api_key: str | None = _setting(self.config, "api_key", env=ENV_API_KEY)
        self.task_key = str(_setting(self.config, "task_key", default=""))
        self.env_key = str(_setting(self.config, "env_key", default=""))
        if not self.task_key and not self.env_key:
            raise ValueError("env_config must carry a task_key (or an env_key)")
        self.max_turns = int(_setting(self.config, "max_turns", default=0))
        self.run_id = str(_setting(self.config, "run_id", env=ENV_RUN_ID, default=""))
        self.tool_timeout_s = tool_timeout_setting(_setting(self.config, "tool_timeout_s"))  # else the variable
        self.instructions = str(_setting(self.config, "instructions", default=protocol.DEFAULT_INSTRUCTIONS))
        self.images = str(_setting(self.config, "images", default=True)).lower() not in ("false", "0", "no")
        self.episode: AsyncEpisode | None = None
        self.last: TurnResult | None = None
        self._unplayed = False  # system_prompt() opened the session before reset(): reset() uses it

    async def reset(self, seed: int = 0) -> tuple[dict[str, Any], dict[str, Any]]:
        """Open a session (closing the previous one): the task's messages as the first observation.

        A session `system_prompt()` opened before any `reset` (some loops ask for the prompt first) is
        this episode's: it is used, not replaced.

        Args:
            seed: unused (a task's instance starts from its own seeded data).
        """
        if not self._unplayed:
            await self._open()
        self._unplayed = False
        episode = self._episode()
        task = episode.initial_messages()[1:]  # the system prompt is system_prompt()'s
        info = {
            "task_key": episode.task_key,
            "session_id": episode.session_id,
            "max_turns": episode.max_turns,
            "tools": [protocol.tool_spec_dict(t) for t in episode.tools],
        }
        return observation(task, self.images), info

    async def system_prompt(self) -> dict[str, Any]:
        """The system prompt: the instructions, the episode's tools and the call and finish conventions.

        Before any `reset` it opens the session (the tools are the session's), which `reset` then uses.
        """
        if self.episode is None:
            await self._open()
            self._unplayed = True
        return observation([protocol.system_message(self._episode().tools, self.instructions)], self.images)

    async def _open(self) -> None:
        await self.close()
        episode = AsyncEpisode(
            loop_client(self.orchestrator, self.api_key),
            task_key=self.task_key,
            env_key=self.env_key,
            max_turns=self.max_turns,
            run_id=self.run_id,
            labels={"rlgate-trainer": "vagen"},
            instructions=self.instructions,
            tool_timeout_s=self.tool_timeout_s,
            close_when_done=True,  # one episode per session: the Step that ends it closes it (no Close)
        )
        self.episode = episode  # before Reset: close() releases a session whose Reset answer was lost
        self.last = None
        await episode.reset()

    def _episode(self) -> AsyncEpisode:
        if self.episode is None:
            raise RuntimeError("step() before reset(), or after the episode ended: call reset()")
        return self.episode

    async def step(self, action_str: str) -> tuple[dict[str, Any], float, bool, dict[str, Any]]:
        """Play the model's text as one turn; the session closes when the episode ends or this raises.

        Args:
            action_str: the model's reply, tool calls in `<tool_call>` tags or a final answer.
        """
        episode = self._episode()
        self._unplayed = False
        try:
            result = await episode.turn(action_str)
        except BaseException:
            await self.close()
            raise
        self.last = result
        if result.done:
            await self.close()
        reward = (result.reward or 0.0) if result.done else 0.0
        info = {
            "turn": result.turn,
            "tool_calls": [r.as_dict() for r in result.tool_calls],
            "parse_errors": list(result.parsed.errors),
            "success": bool(result.done and result.verification_status == "OK" and reward >= 1.0),
        }
        if result.done:
            info.update(
                done_reason=result.done_reason,
                verification_status=result.verification_status,
                truncated=result.truncated,
            )
        return observation(result.observations, self.images), reward, result.done, info

    async def close(self) -> None:
        """Close the session (idempotent, never raises: a failed close is left to the server's reaper)."""
        episode, self.episode = self.episode, None
        self._unplayed = False
        if episode is None:
            return
        try:
            await episode.close()
        except Exception as err:
            sid = episode.reset_response.session_id if episode.reset_response else "?"
            log.warning("closing rlgate session %s failed: %s", sid, err)
