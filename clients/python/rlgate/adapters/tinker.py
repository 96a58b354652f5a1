"""Tinker cookbook adapter: rlgate episodes as cookbook environments.

- `RlgateMessageEnv` is a cookbook `MessageEnv`; `RlgateEnvGroupBuilder.make_envs` wraps each in
  `EnvFromMessageEnv`, so the renderer's own tool-call parsing, parse-error and context-overflow handling
  apply. Tool calls the renderer could not parse get a second, lenient chance (`rlgate.protocol`).
- Sessions open lazily, when an env first produces its observation — not in `make_envs`, which the
  cookbook's retry strategy calls again for one failed trajectory and then discards all envs but one —
  and every session ever opened by a builder is closed in its `cleanup` (also after errors and
  cancellation). A session is also closed as soon as its episode ends, to free the instance early.
- A verifier ERROR/TIMEOUT raises `rlgate.VerifierError` out of `step`, which the cookbook's rollout
  strategies count as a failed rollout (FailFast raises, RetryOnFailure / MinViableGroup retry or drop);
  it is never a reward of 0.
- What the model wrote never raises out of `step` (a retry would only meet it again): text no RPC can
  carry is a parse error, a tool call the gateway refuses or that outlives `tool_timeout_s` (else
  `RLGATE_TOOL_TIMEOUT_S`, else 120 s) an `is_error` tool message; the episode goes on.
- Screens reach a vision renderer (one with an image processor, such as `qwen3_vl_instruct`) as the
  cookbook's `ImagePart`s holding PIL images, in place within each tool message; the conversation keeps
  the last `keep_images` of them (older ones become `[earlier screenshot omitted]`, so the prompt stays
  bounded, at the price of the prompt no longer extending the previous one once a screen is dropped). A
  text-only renderer gets a text placeholder for each image; an image that cannot be decoded becomes a note.
- Fully async: one `AsyncClient` per event loop and settings; nothing blocks the loop.
- `RlgateEnvGroupBuilder` holds only plain settings and a renderer (pickle-safe via `get_renderer`), so it
  pickles for the cookbook's process/Ray rollout executors. `RlgateDatasetBuilder` (chz) builds an
  `RlgateDataset` over task keys ("all" lists them from the orchestrator)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import chz
from tinker_cookbook.image_processing_utils import get_image_processor
from tinker_cookbook.renderers import Renderer, get_renderer
from tinker_cookbook.renderers.base import (
    Content,
    ContentPart,
    ImagePart,
    Message,
    TextPart,
    ToolSpec,
    get_text_content,
)
from tinker_cookbook.rl.message_env import EnvFromMessageEnv, MessageEnv, MessageStepResult
from tinker_cookbook.rl.types import Env, EnvGroupBuilder, RLDataset, RLDatasetBuilder
from tinker_cookbook.tokenizer_utils import get_tokenizer

from rlgate import messages, protocol
from rlgate.adapters.loops import loop_client, orchestrator_address
from rlgate.client import ENV_API_KEY
from rlgate.episode import AsyncEpisode, TurnResult, tool_timeout_setting
from rlgate.results import InfraFaults
from rlgate.settings import read_env

log = logging.getLogger("rlgate.adapters.tinker")

FINISH_INSTRUCTIONS = (
    f"When the task is complete, give your final answer as {protocol.FINAL_OPEN}answer"
    f"{protocol.FINAL_CLOSE}; if the task needs no answer, reply <done/>."
)


def sees_images(renderer: Renderer) -> bool:
    """Whether `renderer` renders images: the cookbook's vision renderers hold an image processor.

    Args:
        renderer: the cookbook renderer.
    """
    return getattr(renderer, "image_processor", None) is not None


def cookbook_content(parts: Sequence[messages.Part], images: bool) -> Content:
    """The parts of an rlgate message as cookbook content: text, or parts with each image a PIL `ImagePart`.

    Args:
        parts: the parts, in reading order.
        images: the renderer shows images; False gives text, each image as its placeholder.
    """
    if not images or not any(isinstance(p, messages.ImagePart) for p in parts):
        return messages.Message.of("user", parts).text()
    content: list[ContentPart] = []
    for part in parts:
        if isinstance(part, messages.TextPart):
            content.append(TextPart(type="text", text=part.text))
            continue
        try:
            content.append(ImagePart(type="image", image=part.to_pil()))
        except messages.UnreadableImage as exc:  # a renderer would raise on it: the model reads why instead
            content.append(TextPart(type="text", text=f"[image unreadable: {exc}]"))
    return content


def keep_last_images(history: list[Message], keep: int) -> list[Message]:
    """`history` with only its last `keep` images (`rlgate.messages.keep_last_images` on cookbook messages).

    Args:
        history: the conversation, as cookbook messages.
        keep: how many of the most recent images to keep.
    """

    def images(message: Message) -> int:
        content = message["content"]
        return 0 if isinstance(content, str) else sum(p["type"] == "image" for p in content)

    omit = messages.images_to_omit([images(m) for m in history], keep)
    kept: list[Message] = []
    for message, count in zip(history, omit, strict=True):
        if count and not isinstance(message["content"], str):
            content: list[ContentPart] = []
            for part in message["content"]:
                if part["type"] == "image" and count:
                    content.append(TextPart(type="text", text=messages.IMAGE_OMITTED))
                    count -= 1
                else:
                    content.append(part)
            message = cast(Message, {**message, "content": content})
        kept.append(message)
    return kept


def tool_specs(episode: AsyncEpisode) -> list[ToolSpec]:
    """The episode's tools in the renderer's shape, for its own tool-calling prefix.

    Args:
        episode: an episode after its Reset.
    """
    return [ToolSpec(**protocol.tool_spec_dict(t)) for t in episode.tools]  # type: ignore[typeddict-item]


def parsed_turn(message: Message) -> tuple[str, protocol.ParsedTurn]:
    """The assistant's text and what it asks for: the renderer's tool calls, a lenient second parse of
    the calls it could not parse, and the final answer / done convention from the text.

    Args:
        message: the assistant's message as the renderer parsed it.

    Returns:
        The text to record (with every call it asks for as a `<tool_call>` block) and the parsed turn.
    """
    text = get_text_content(message)
    turn = protocol.parse_assistant_text(text)
    calls: list[protocol.ToolCall] = []
    errors: list[str] = []
    for call in message.get("tool_calls") or []:
        try:
            arguments = json.loads(call.function.arguments) if call.function.arguments.strip() else {}
        except (ValueError, RecursionError) as exc:
            errors.append(
                f"arguments of {call.function.name!r} are not JSON ({str(exc)[:200]}). {protocol.FORMAT_REMINDER}"
            )
            continue
        error = protocol.call_error(call.function.name, arguments)  # NaN, too deep, a lone surrogate: unsendable
        if error is not None:
            errors.append(f"{error}. {protocol.FORMAT_REMINDER}")
            continue
        calls.append(protocol.ToolCall(call.function.name, arguments))
    for unparsed in message.get("unparsed_tool_calls") or []:
        retry = protocol.parse_assistant_text(unparsed.raw_text)
        calls.extend(retry.tool_calls)
        errors.extend(retry.errors if retry.tool_calls or retry.errors else [unparsed.error])
    # Calls the renderer left in the text (formats it does not parse) are found by the lenient parse.
    calls.extend([c for c in turn.tool_calls if c not in calls])
    errors.extend(turn.errors)
    full_text = "\n".join([text, *(protocol.render_tool_call(c) for c in calls)]) if calls else text
    return full_text, protocol.ParsedTurn(
        tool_calls=calls, final_answer=turn.final_answer, done=turn.done, errors=errors
    )


class RlgateMessageEnv(MessageEnv):
    """One rlgate episode at the message level. The session opens on `initial_observation`.

    Args:
        builder: the group builder whose task and settings the episode uses (it closes the session in
            `cleanup`).
        renderer: the model's renderer (its tool prefix, and whether it sees images).
    """

    def __init__(self, builder: RlgateEnvGroupBuilder, renderer: Renderer) -> None:
        self.builder = builder
        self.renderer = renderer
        self.episode: AsyncEpisode | None = None
        self.history: list[Message] = []
        self.example_id = builder.task_key

    async def initial_observation(self) -> list[Message]:
        """Open the session (once) and return the chat: the renderer's tool prefix, then the task (for a
        `RlgateForkGroupBuilder`, one branch of the shared prefix, and the prefix's messages)."""
        if self.episode is None and isinstance(self.builder, RlgateForkGroupBuilder):
            self.episode, self.history = await self.builder.branch(self.renderer)
        if self.episode is None:
            self.episode, self.history = await self.builder.open_episode(self.renderer)
        return self.history

    async def step(self, message: Message) -> MessageStepResult:
        """Play the assistant `message` as one turn; the session closes when the episode ends or this raises.

        Args:
            message: the assistant's message as the renderer parsed it.

        Raises:
            RuntimeError: called before `initial_observation`.
        """
        episode = self.episode
        if episode is None:
            raise RuntimeError("step() before initial_observation()")
        self.history.append(message)
        text, parsed = parsed_turn(message)
        try:
            result = await episode.turn(text, parsed)
        except BaseException:
            await asyncio.shield(self._close())
            raise
        faults = result.step.infra_faults
        if faults.total and self.builder.fail_on_infra_fault:
            await asyncio.shield(self._close())
            raise InfraFaultError(faults)
        if result.done:
            await self._close()
        observed = self._observations(result, message, sees_images(self.renderer))
        self.history = keep_last_images([*self.history, *observed], self.builder.keep_images)
        return MessageStepResult(
            reward=(result.reward or 0.0) if result.done else 0.0,
            episode_done=result.done,
            next_messages=self.history,
            metrics=self._metrics(result),
            logs={"turn": result.turn, **({"parse_errors": result.error} if result.error else {})},
        )

    async def _close(self) -> None:
        if self.episode is not None:
            try:
                await self.episode.close()
            except Exception as err:  # cleanup() tries again; the server reaps what is left
                log.warning("closing rlgate session failed: %s", err)

    @staticmethod
    def _observations(result: TurnResult, message: Message, images: bool) -> list[Message]:
        if result.done:
            return []
        ids = [c.id for c in message.get("tool_calls") or []]
        out: list[Message] = []
        for i, record in enumerate(result.tool_calls):
            tool_message = Message(role="tool", content=cookbook_content(record.parts, images), name=record.name)
            call_id = ids[i] if i < len(ids) else None
            if call_id:
                tool_message["tool_call_id"] = call_id
            out.append(tool_message)
        if result.parsed.errors:
            out.append(Message(role="user", content="\n".join(result.parsed.errors)))
        elif not result.tool_calls and not result.parsed.done:
            out.append(Message(role="user", content=protocol.FORMAT_REMINDER))
        return out

    @staticmethod
    def _metrics(result: TurnResult) -> dict[str, float]:
        metrics: dict[str, float] = {
            "tool_calls": float(len(result.tool_calls)),
            "tool_errors": float(sum(r.is_error and not r.infra_fault for r in result.tool_calls)),
            # the episode's so far, apart from the model's tool_errors
            "infra_faults": float(result.step.infra_faults.total),
        }
        if result.parsed.errors:
            metrics["parse_error"] = 1.0
        if result.done:
            metrics["stop/max_turns" if result.truncated else "stop/completed"] = 1.0
            metrics["verification_ok"] = float(result.verification_status == "OK")
        return metrics


class InfraFaultError(RuntimeError):
    """A trajectory met an infrastructure fault and `fail_on_infra_fault` is set: its rollout fails, so the
    cookbook's `RetryOnFailure` or `MinViableGroup` strategy replaces it.

    Args:
        faults: the episode's faults.
    """

    def __init__(self, faults: InfraFaults) -> None:
        counts = ", ".join(f"{k}={v}" for k, v in faults.as_dict().items() if v and k != "total")
        super().__init__(f"the episode met {faults.total} infrastructure fault(s) ({counts}); rollout failed")
        self.faults = faults


@dataclass
class RlgateEnvGroupBuilder(EnvGroupBuilder):
    """`group_size` episodes of one task. Picklable: settings and a renderer only.

    Args:
        task_key: the task.
        renderer: the model's renderer.
        group_size: episodes in the group.
        orchestrator: the orchestrator's address(es); empty: RLGATE_ORCHESTRATOR.
        api_key: the orchestrator's API key; None: RLGATE_API_KEY.
        max_turns: the turn limit; 0 keeps the task's.
        run_id: the training run the sessions belong to.
        labels: the sessions' labels, as (key, value) pairs.
        instructions: text placed before the tool list.
        tool_timeout_s: the bound of one tool call; None: RLGATE_TOOL_TIMEOUT_S, else the client's
            call_tool timeout.
        keep_images: screens in the context: the last ones.
        failed_parse_reward: the reward of a structural parse failure (no stop sequence), as the
            cookbook's tool envs default it.
        terminate_on_parse_error: whether such a failure ends the episode.
        max_trajectory_tokens: the cookbook's bound on a trajectory's tokens; None for none.
        max_generation_tokens: the cookbook's bound on one generation's tokens; None for none.
        fail_on_infra_fault: a trajectory whose episode met an infrastructure fault (`InfraFaults`: a tool
            call cut by a dead gateway, a retried UNAVAILABLE, a verifier error, ...) fails its rollout
            (`InfraFaultError` out of `step`), so that the cookbook's `RetryOnFailure` or `MinViableGroup`
            rollout strategy replaces it rather than the group training on it. False: it is kept, and only
            counted in the metrics (`infra_faults`).
    """

    task_key: str
    renderer: Renderer
    group_size: int = 1
    orchestrator: str = ""
    api_key: str | None = None
    max_turns: int = 0
    run_id: str = ""
    labels: tuple[tuple[str, str], ...] = ()
    instructions: str = protocol.DEFAULT_INSTRUCTIONS
    tool_timeout_s: float | None = None
    keep_images: int = messages.DEFAULT_KEEP_IMAGES
    failed_parse_reward: float = -0.1
    terminate_on_parse_error: bool = True
    max_trajectory_tokens: int | None = None
    max_generation_tokens: int | None = None
    fail_on_infra_fault: bool = False
    _opened: list[AsyncEpisode] = field(default_factory=list, init=False, repr=False, compare=False)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_opened"] = []  # live sessions belong to the process that opened them
        return state

    async def open_episode(self, renderer: Renderer) -> tuple[AsyncEpisode, list[Message]]:
        """A new session of the task (tracked, so cleanup closes it) and its chat: the renderer's tool
        prefix, then the task."""
        episode = AsyncEpisode(
            loop_client(orchestrator_address(self.orchestrator), self.api_key or read_env(ENV_API_KEY)),
            task_key=self.task_key,
            max_turns=self.max_turns,
            run_id=self.run_id,
            labels=dict(self.labels),
            tool_timeout_s=self.tool_timeout_s,
            close_when_done=True,  # one episode per session: the Step that ends it closes it (no Close)
        )
        self.track(episode)  # before Reset: cleanup closes it even if this task dies mid-Reset
        await episode.reset()
        if not self.tracks(episode):
            # cleanup() ran while Reset was in flight (FailFast's gather leaves sibling rollouts running
            # after one fails): nobody will close this session later, so close it now.
            with contextlib.suppress(Exception):
                await episode.close()
            raise RuntimeError(f"rollout group of {self.task_key!r} was cleaned up during Reset")
        system = "\n\n".join(p for p in (self.instructions, FINISH_INSTRUCTIONS) if p)
        prefix = renderer.create_conversation_prefix_with_tools(tool_specs(episode), system)
        images = sees_images(renderer)
        task = [Message(role=m.role, content=cookbook_content(m.parts, images)) for m in episode.initial_messages()[1:]]
        return episode, keep_last_images([*prefix, *task], self.keep_images)

    def track(self, episode: AsyncEpisode) -> None:
        """Remember `episode` so cleanup() closes it (called before its Reset).

        Args:
            episode: the episode about to open its session.
        """
        self._opened.append(episode)

    def tracks(self, episode: AsyncEpisode) -> bool:
        """False once cleanup() has taken the episode (it closed it, possibly before Reset answered).

        Args:
            episode: an episode passed to `track`.
        """
        return any(e is episode for e in self._opened)

    @property
    def sessions_opened(self) -> int:
        """Sessions this builder opened and cleanup() has not taken yet."""
        return len(self._opened)

    async def make_envs(self) -> Sequence[Env]:
        """`group_size` envs of the task; cheap: no session is opened here (see the module docstring)."""
        return [
            EnvFromMessageEnv(
                self.renderer,
                RlgateMessageEnv(self, self.renderer),
                failed_parse_reward=self.failed_parse_reward,
                terminate_on_parse_error=self.terminate_on_parse_error,
                max_trajectory_tokens=self.max_trajectory_tokens,
                max_generation_tokens=self.max_generation_tokens,
            )
            for _ in range(self.group_size)
        ]

    async def cleanup(self) -> None:
        """Close every session this builder ever opened. Idempotent; never raises."""
        episodes, self._opened = self._opened, []
        results = await asyncio.gather(*(asyncio.shield(e.close()) for e in episodes), return_exceptions=True)
        for episode, outcome in zip(episodes, results, strict=True):
            if isinstance(outcome, BaseException):
                sid = episode.reset_response.session_id if episode.reset_response else "?"
                log.warning("closing rlgate session %s failed: %s", sid, outcome)

    def logging_tags(self) -> list[str]:
        """Tags for the cookbook's metrics: "rlgate" and the task's environment prefix."""
        return ["rlgate", self.task_key.split("-")[0] if "-" in self.task_key else self.task_key]


@dataclass
class RlgateForkGroupBuilder(RlgateEnvGroupBuilder):
    """A group whose episodes share a prefix (GRPO on continuations): one session of the task plays the
    assistant messages of `prefix` (k turns, e.g. a reference solution's first steps), then is forked
    (`AsyncEpisode.fork`) into `group_size` branches that continue from turn k, one per env. Each env's
    observation is the prefix's chat. The source session stays open (a retried env forks it again) until
    `cleanup`, which closes it with every branch. Picklable like its base (live state is not pickled)."""

    prefix: tuple[str, ...] = ()
    _source: AsyncEpisode | None = field(default=None, init=False, repr=False, compare=False)
    _source_chat: list[Message] = field(default_factory=list, init=False, repr=False, compare=False)
    _unclaimed: list[AsyncEpisode] = field(default_factory=list, init=False, repr=False, compare=False)
    _lock: asyncio.Lock | None = field(default=None, init=False, repr=False, compare=False)

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state.update(_source=None, _source_chat=[], _unclaimed=[], _lock=None)
        return state

    async def branch(self, renderer: Renderer) -> tuple[AsyncEpisode, list[Message]]:
        """An unclaimed branch and its chat; the first call plays the prefix and forks `group_size` ways."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self._source is None:
                self._source, self._source_chat = await self._play_prefix(renderer)
            if not self._unclaimed:
                wanted = max(1, self.group_size)
                # The chat lives here, in the renderer's terms; the branches carry none of their own.
                branches = await self._source.fork(wanted)
                for episode in branches:
                    self.track(episode)
                self._unclaimed = list(branches)
            episode = self._unclaimed.pop(0)
        return episode, list(self._source_chat)

    async def cleanup(self) -> None:
        """Close the source and every branch (see the base class); a later make_envs plays the prefix again."""
        self._source, self._source_chat, self._unclaimed = None, [], []
        await super().cleanup()

    async def _play_prefix(self, renderer: Renderer) -> tuple[AsyncEpisode, list[Message]]:
        source, chat = await self.open_episode(renderer)
        for text in self.prefix:
            message = Message(role="assistant", content=text)
            result = await source.turn(*parsed_turn(message))
            chat.append(message)
            if result.done:
                raise RuntimeError(
                    f"the shared prefix of {self.task_key!r} ended the episode at turn {result.turn}; "
                    "a prefix must leave it running"
                )
            chat = keep_last_images(
                [*chat, *RlgateMessageEnv._observations(result, message, sees_images(renderer))], self.keep_images
            )
        return source, chat


class RlgateDataset(RLDataset):
    """Batches of `batch_size` group builders cycling over the task keys for `epochs` passes.

    Args:
        task_keys: the tasks, at least one.
        batch_size: group builders per batch.
        make: `task_key -> EnvGroupBuilder` (picklable, for process executors).
        epochs: passes over the tasks.

    Raises:
        ValueError: no tasks.
    """

    def __init__(self, task_keys: Sequence[str], batch_size: int, make: Any, epochs: int = 1) -> None:
        if not task_keys:
            raise ValueError("no tasks")
        self.task_keys = list(task_keys)
        self.batch_size = batch_size
        self.epochs = epochs
        self._make = make

    def __len__(self) -> int:
        return math.ceil(len(self.task_keys) * self.epochs / self.batch_size)

    def get_batch(self, index: int) -> Sequence[EnvGroupBuilder]:
        """The `index`-th batch of group builders.

        Args:
            index: the batch's index (0-based).
        """
        start = index * self.batch_size
        stop = min(start + self.batch_size, len(self.task_keys) * self.epochs)
        return [self._make(self.task_keys[i % len(self.task_keys)]) for i in range(start, stop)]


@dataclass(frozen=True)
class _BuilderFactory:
    """Picklable `task_key -> RlgateEnvGroupBuilder` (no closures, for process executors)."""

    renderer: Renderer
    group_size: int
    orchestrator: str
    max_turns: int
    run_id: str
    instructions: str
    tool_timeout_s: float | None
    keep_images: int
    fail_on_infra_fault: bool = False

    def __call__(self, task_key: str) -> RlgateEnvGroupBuilder:
        return RlgateEnvGroupBuilder(
            task_key=task_key,
            renderer=self.renderer,
            group_size=self.group_size,
            orchestrator=self.orchestrator,
            max_turns=self.max_turns,
            run_id=self.run_id,
            instructions=self.instructions,
            tool_timeout_s=self.tool_timeout_s,
            keep_images=self.keep_images,
            fail_on_infra_fault=self.fail_on_infra_fault,
        )


@chz.chz
class RlgateDatasetBuilder(RLDatasetBuilder):
    """RL dataset over rlgate tasks. The API key comes from RLGATE_API_KEY (kept out of configs)."""

    renderer_name: str
    model_name_for_tokenizer: str
    batch_size: int = 8
    group_size: int = 4
    orchestrator: str = ""  # empty: RLGATE_ORCHESTRATOR
    tasks: str = "all"  # "all" or comma-separated task keys
    test_tasks: str = ""  # comma-separated task keys for a test set; empty for none
    epochs: int = 1
    max_turns: int = 0
    run_id: str = ""
    instructions: str = protocol.DEFAULT_INSTRUCTIONS
    tool_timeout_s: float | None = None  # None: RLGATE_TOOL_TIMEOUT_S, else the client's call_tool timeout
    keep_images: int = messages.DEFAULT_KEEP_IMAGES  # screens in the context: the last ones
    # A trajectory that met an infrastructure fault fails its rollout, for RetryOnFailure / MinViableGroup.
    fail_on_infra_fault: bool = False
    # Screens as images: the renderer gets the model's image processor (a vision renderer such as
    # qwen3_vl_instruct needs it); False: every image a text placeholder.
    images: bool = False

    async def __call__(self) -> tuple[RLDataset, RLDataset | None]:
        """The train dataset and the test dataset (None without test_tasks); lists tasks for "all"."""
        model = self.model_name_for_tokenizer
        processor = get_image_processor(model) if self.images else None
        renderer = get_renderer(self.renderer_name, get_tokenizer(model), processor, model_name=model)
        orchestrator = orchestrator_address(self.orchestrator)
        if self.keep_images < 0:
            raise ValueError(f"keep_images must be 0 or more, not {self.keep_images}")
        if self.tasks.strip() == "all":
            client = loop_client(orchestrator, read_env(ENV_API_KEY) or None)
            keys = [t.key for t in await client.list_tasks()]
        else:
            keys = [k.strip() for k in self.tasks.split(",") if k.strip()]
        test_keys = [k.strip() for k in self.test_tasks.split(",") if k.strip()]
        keys = [k for k in keys if k not in test_keys]
        make = _BuilderFactory(
            renderer,
            self.group_size,
            orchestrator,
            self.max_turns,
            self.run_id,
            self.instructions,
            tool_timeout_setting(self.tool_timeout_s),  # a bad value fails here, not in every rollout
            self.keep_images,
            self.fail_on_infra_fault,
        )
        train = RlgateDataset(keys, self.batch_size, make, epochs=self.epochs)
        test = RlgateDataset(test_keys, len(test_keys), make) if test_keys else None
        return train, test
