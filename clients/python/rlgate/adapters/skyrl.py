"""SkyRL adapter: `RlgateTextEnv`, a skyrl_gym `BaseTextEnv` whose episodes run on rlgate.

    from rlgate.adapters.skyrl import register
    register()                                   # skyrl_gym id "rlgate"
    env = skyrl_gym.make("rlgate", env_config={}, extras={"task_key": "mail-001", "max_turns": 8})

Settings (SkyRL hands a custom env an empty `env_config`, so they come from the dataset row's `extras`,
then `env_config`, then environment variables):

| key in extras / env_config | variable                  | meaning                                       |
|----------------------------|---------------------------|-----------------------------------------------|
| `orchestrator`             | `RLGATE_ORCHESTRATOR`     | orchestrator address(es), "host:port[,...]"    |
| `api_key`                  | `RLGATE_API_KEY`          | orchestrator API key                          |
| `task_key` (or `env_key`)  | -                         | the task (also read from `extra_info`)        |
| `max_turns`                | -                         | turn limit passed to Reset (SkyRL always sets)|
| `on_verifier_error`        | `RLGATE_ON_VERIFIER_ERROR`| `raise` (default) or `zero`                   |
| `run_id`                   | `RLGATE_TRAINING_RUN_ID`  | labels the sessions of one training run       |
| `tool_timeout_s`           | `RLGATE_TOOL_TIMEOUT_S`   | bound of one tool call (default: 120 s)       |
| `instructions`             | -                         | text placed before the tool list              |

SkyRL calls `init`/`step`/`close` from a thread pool: the env uses the blocking client (one shared per
process and settings; gRPC sync channels are thread-safe) and never an event loop. SkyRL skips `close()`
when a step raises, so the env closes its session itself when the episode ends or a step fails; a second
`init` closes the first session before opening the next.

What the model wrote never raises out of `step` (see `rlgate.episode`): unsendable text is a parse error,
a refused or timed-out tool call an `is_error` result; both are observations and the episode goes on.

skyrl-gym's messages are `dict[str, str]`, text only: an image a tool returns (a screenshot) reaches the
model as a text placeholder, `[image: image/png, N bytes]`. Train on screens with the Tinker adapter or
the VAGEN env (`rlgate.adapters.vagen`)."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput, ConversationType

from rlgate import protocol
from rlgate.client import ENV_API_KEY, ENV_ORCHESTRATOR, Client, ClientSettings
from rlgate.episode import Episode, TurnResult, tool_timeout_setting
from rlgate.messages import to_text_dicts
from rlgate.results import InfraFaults
from rlgate.settings import ENV_ON_VERIFIER_ERROR, ENV_RUN_ID, read_env

ENV_ID = "rlgate"
ENTRY_POINT = "rlgate.adapters.skyrl:RlgateTextEnv"

log = logging.getLogger("rlgate.adapters.skyrl")

_clients: dict[tuple[str, str], Client] = {}
_clients_lock = threading.Lock()
# The close after done runs here, so the turn that ended the episode waits for it CLOSE_IN_STEP_S at most: a
# Close retried through a restarting orchestrator goes on in the background. Its threads are joined at exit.
_closer = ThreadPoolExecutor(max_workers=4, thread_name_prefix="rlgate-close")
CLOSE_IN_STEP_S = 1.0  # how long the step that ends an episode waits for its close
CLOSE_WAIT_S = 10.0  # how long close() waits for that close to finish before leaving it to run


def _close_quietly(episode: Episode) -> None:
    """Close an episode's session; a failure is logged and left to the server's reaper."""
    try:
        episode.close()
    except Exception as err:
        log.warning("closing rlgate session %s failed: %s", episode.session_id, err)


def register(env_id: str = ENV_ID) -> None:
    """Register `RlgateTextEnv` with skyrl_gym (idempotent; by import path, so Ray workers resolve it).

    Args:
        env_id: the skyrl_gym id to register it under.
    """
    import skyrl_gym

    with _clients_lock:
        if env_id not in skyrl_gym.registry:
            skyrl_gym.register(id=env_id, entry_point=ENTRY_POINT)


def shared_client(orchestrator: str, api_key: str | None) -> Client:
    """One blocking client per (addresses, key) in this process.

    Args:
        orchestrator: the orchestrator's address(es), "host:port[,...]".
        api_key: the orchestrator's API key; None for none.
    """
    key = (orchestrator, api_key or "")
    with _clients_lock:
        client = _clients.get(key)
        if client is None:
            client = _clients[key] = Client(orchestrator, settings=ClientSettings.from_env(api_key=api_key))
        return client


def _setting(name: str, *sources: Mapping[str, Any] | None, env: str | None = None, default: Any = None) -> Any:
    for source in sources:
        if source and source.get(name) not in (None, ""):
            return source[name]
    if env and read_env(env):
        return read_env(env)
    return default


class RlgateTextEnv(BaseTextEnv):
    """One rlgate episode per env instance (SkyRL makes one env per trajectory).

    Args:
        env_config: the env's config; settings not in `extras` are read here (the module's table).
        extras: the dataset row's extras: the task (`task_key` or `env_key`, also from `extra_info`) and
            settings.

    Raises:
        ValueError: no orchestrator address, no task or environment, or a bad `on_verifier_error`.
    """

    def __init__(self, env_config: Mapping[str, Any] | None = None, extras: Mapping[str, Any] | None = None):
        super().__init__()
        extras = dict(extras or {})
        config = dict(env_config or {})
        info = extras.get("extra_info") if isinstance(extras.get("extra_info"), Mapping) else None
        self.orchestrator: str | None = _setting("orchestrator", extras, config, env=ENV_ORCHESTRATOR)
        if not self.orchestrator:
            raise ValueError(f"no orchestrator address: set extras['orchestrator'] or {ENV_ORCHESTRATOR}")
        self.api_key: str | None = _setting("api_key", extras, config, env=ENV_API_KEY)
        self.task_key: str = str(_setting("task_key", extras, info, config, default=""))
        self.env_key: str = str(_setting("env_key", extras, info, config, default=""))
        if not self.task_key and not self.env_key:
            raise ValueError("extras must carry a task_key (or an env_key)")
        self.max_turns = int(_setting("max_turns", extras, config, default=0))
        mode = str(_setting("on_verifier_error", extras, config, env=ENV_ON_VERIFIER_ERROR, default="raise"))
        if mode not in ("raise", "zero"):
            raise ValueError(f"on_verifier_error must be 'raise' or 'zero', not {mode!r}")
        self.on_verifier_error = mode
        self.run_id = str(_setting("run_id", extras, config, env=ENV_RUN_ID, default=""))
        self.tool_timeout_s = tool_timeout_setting(_setting("tool_timeout_s", extras, config))  # else the variable
        self.instructions = str(_setting("instructions", extras, config, default=protocol.DEFAULT_INSTRUCTIONS))
        self.episode: Episode | None = None
        self._last: TurnResult | None = None
        self._closing: Future[None] | None = None  # the close after done, under way in `_closer`
        self._counts = {"tool_calls": 0, "tool_errors": 0, "parse_errors": 0}
        self._infra = InfraFaults()

    def init(self, prompt: ConversationType) -> tuple[ConversationType, dict[str, Any]]:
        """Open the session; the chat is the system prompt with tools, then the task. A second call closes
        the first session (and starts the metrics afresh) before opening the next.

        Args:
            prompt: the dataset's prompt: its system message goes before the instructions, and its user
                turns are kept when the session has no task prompt.

        Returns:
            The chat, and the episode's metadata (task, environment, tools, modality, session id).
        """
        if self.episode is not None:
            self.close()
            self.episode, self._last, self.turns = None, None, 0
            self._counts = dict.fromkeys(self._counts, 0)
            self._infra = InfraFaults()
        instructions = self.instructions
        for message in prompt or []:
            if message.get("role") == "system" and message.get("content"):
                instructions = f"{message['content']}\n\n{instructions}"
        assert self.orchestrator is not None
        episode = Episode(
            shared_client(self.orchestrator, self.api_key),
            task_key=self.task_key,
            env_key=self.env_key,
            max_turns=self.max_turns,
            run_id=self.run_id,
            instructions=instructions,
            raise_on_verifier_error=self.on_verifier_error == "raise",
            tool_timeout_s=self.tool_timeout_s,
            close_when_done=True,  # one episode per session: the Step that ends it closes it (no Close)
        )
        episode.reset()
        self.episode = episode
        self.task_key = episode.task_key or self.task_key
        if episode.max_turns:
            self.max_turns = episode.max_turns
        chat: ConversationType = to_text_dicts(episode.initial_messages())
        if len(chat) == 1:  # an env-only session has no task prompt: keep the dataset's user turns
            chat += [m for m in prompt or [] if m.get("role") != "system"]
        return chat, {
            "task_key": self.task_key,
            "env_key": episode.env_key,
            "tools": [protocol.tool_spec_dict(t) for t in episode.tools],
            "modality": episode.modality,
            "session_id": episode.session_id,
        }

    def step(self, action: str) -> BaseTextEnvStepOutput:
        """Play the model's text as one turn; the session closes when the episode ends or this raises.

        Args:
            action: the model's text.

        Raises:
            RuntimeError: called before `init`.
        """
        if self.episode is None:
            raise RuntimeError("step() before init()")
        try:
            result = self.episode.turn(action)
        except BaseException:
            self.close()  # SkyRL will not call close() after a failed step
            raise
        self._last = result
        self.turns = result.turn
        self._counts["tool_calls"] += len(result.tool_calls)
        self._counts["tool_errors"] += sum(r.is_error and not r.infra_fault for r in result.tool_calls)
        self._counts["parse_errors"] += len(result.parsed.errors)
        self._infra = result.step.infra_faults  # the episode's so far: not the model's, apart from tool_errors
        if result.done:
            self._closing = _closer.submit(_close_quietly, self.episode)
            with contextlib.suppress(TimeoutError):  # done here as a rule; a slow Close goes on in the background
                self._closing.result(timeout=CLOSE_IN_STEP_S)
        reward = result.reward if result.done and result.reward is not None else 0.0
        return BaseTextEnvStepOutput(
            observations=to_text_dicts(result.observations),  # images as placeholders: text only
            reward=reward,
            done=result.done,
            metadata={
                "task_key": self.task_key,
                "turn": result.turn,
                "tool_call": [r.as_dict() for r in result.tool_calls] or None,
                "tool_result": [r.text for r in result.tool_calls] or None,
                "error": result.error,
                "done_reason": result.done_reason if result.done else None,
                "verification_status": result.verification_status if result.done else None,
                "truncated": result.truncated,
                "infra_faults": result.step.infra_faults.as_dict(),
            },
        )

    def close(self) -> None:
        """Close the session (idempotent, never raises: a failed close is left to the server's reaper)."""
        if self._closing is not None:  # the close after done: waited for a while, then left to finish
            with contextlib.suppress(TimeoutError):
                self._closing.result(timeout=CLOSE_WAIT_S)
        if self.episode is not None:
            _close_quietly(self.episode)

    def get_metrics(self) -> dict[str, Any]:
        """The episode's counts for SkyRL's metrics (turns, tool calls and errors, reward, failures)."""
        last = self._last
        done = last is not None and last.done
        return {
            "turns": self.turns,
            **self._counts,
            "reward": (last.reward or 0.0) if done and last is not None else 0.0,
            "truncated": float(bool(done and last is not None and last.truncated)),
            # Infrastructure faults, apart from the model's tool_errors (a tool call cut by a dead gateway is
            # counted here, not there): a trainer can drop a trajectory with infra_faults > 0.
            "infra_faults": self._infra.total,
            **{f"infra_faults/{kind}": count for kind, count in self._infra.as_dict().items() if kind != "total"},
            "verifier_failed": float(
                bool(done and last is not None and last.verification_status in ("ERROR", "TIMEOUT"))
            ),
        }
