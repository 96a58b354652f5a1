# ruff: noqa: ASYNC109  -- `timeout=` is the gRPC deadline of a call, as in the client
"""`Episode` / `AsyncEpisode`: one episode holding both handles — the orchestrator (reset, step, state,
close) and the agent token (list_tools, call_tool) — that always closes its session.

`turn(text)` plays one assistant message through the real protocol: parse it (`rlgate.protocol`), call
each tool through the gateway, report the turn to the orchestrator and return the observations for the
model. The decisions (what to send, what the model sees, when a verifier failure is an error) are the
shared `_EpisodeBase` methods; the two classes only differ in blocking vs awaiting calls.

What the model wrote never raises out of `turn`: text no RPC can carry is a parse error (see
`rlgate.protocol`), a tool call the gateway refuses for its name or arguments (INVALID_ARGUMENT) and one
that outlives the per-call timeout (`tool_timeout_s`, else `RLGATE_TOOL_TIMEOUT_S`, else the client's
call_tool timeout) come back as `is_error` results the model sees, and the episode goes on. Failures of the
services themselves (UNAVAILABLE, an ended token, ...) still raise."""

from __future__ import annotations

import asyncio
import copy
import logging
import math
import os
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import grpc
from google.rpc import error_details_pb2

from rlgate import protocol
from rlgate._tracing import EpisodeTrace, new_trace_id
from rlgate.client import ENV_GATEWAY, ClientSettings, new_request_id
from rlgate.convert import json_text
from rlgate.errors import DeadlineExceeded, InvalidArgument, RlgateError, VerifierError
from rlgate.v1 import common_pb2, orchestrator_pb2, toolgateway_pb2

if TYPE_CHECKING:
    from rlgate.client import AsyncClient, Client

log = logging.getLogger("rlgate.episode")

ClientT = TypeVar("ClientT", "Client", "AsyncClient")

# Label on every session an Episode creates, so a Reset whose answer was lost can still be closed.
RESET_LABEL = "rlgate-reset"
_UNKNOWN_OUTCOME = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED}
_FAILED_VERIFICATION = {common_pb2.VERIFICATION_STATUS_ERROR, common_pb2.VERIFICATION_STATUS_TIMEOUT}
ENV_TOOL_TIMEOUT = "RLGATE_TOOL_TIMEOUT_S"
# The gateway's BadRequest fields that are what the model wrote (not the client's request id, say).
_MODEL_FIELDS = {
    "name": common_pb2.TOOL_ERROR_KIND_UNKNOWN_TOOL,
    "arguments_json": common_pb2.TOOL_ERROR_KIND_INVALID_ARGUMENTS,
    "arguments": common_pb2.TOOL_ERROR_KIND_INVALID_ARGUMENTS,
}


def tool_timeout_setting(value: float | str | None = None) -> float | None:
    """The per-tool-call timeout in seconds: `value`, else $RLGATE_TOOL_TIMEOUT_S, else None (the client's
    call_tool timeout applies). Strings are read as numbers (adapters' settings come from dataset rows and
    the environment). ValueError for anything but a positive finite number."""
    given = value not in (None, "")
    raw = value if given else os.environ.get(ENV_TOOL_TIMEOUT) or None
    if raw is None:
        return None
    try:
        seconds = float(raw)
    except (TypeError, ValueError):
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds > 0):
        source = (
            f"tool_timeout_s (None: ${ENV_TOOL_TIMEOUT}, else the client's Timeouts.call_tool)"
            if given
            else f"${ENV_TOOL_TIMEOUT}"
        )
        raise ValueError(f"tool timeout {source} must be a positive, finite number of seconds, not {raw!r}")
    return seconds


def verification_status_name(value: common_pb2.VerificationStatus) -> str:
    """`VERIFICATION_STATUS_TIMEOUT` -> "TIMEOUT": the short name trainers log and compare."""
    return common_pb2.VerificationStatus.Name(value).removeprefix("VERIFICATION_STATUS_")


def done_reason_name(value: orchestrator_pb2.DoneReason) -> str:
    """`DONE_REASON_MAX_TURNS` -> "MAX_TURNS": the short name trainers log and compare."""
    return orchestrator_pb2.DoneReason.Name(value).removeprefix("DONE_REASON_")


@dataclass
class ToolCallRecord:
    """One tool call of a turn and what came back."""

    name: str
    arguments: dict[str, Any]
    request_id: str
    result: common_pb2.ToolResult
    text: str
    replayed: bool = False

    @property
    def is_error(self) -> bool:
        """The result is an error the model sees (unknown tool, bad arguments, a failing tool, ...)."""
        return self.result.is_error

    def summary(self) -> orchestrator_pb2.ToolCallSummary:
        """The call as Step reports it (the gateway keeps the authoritative log; this is the agent's view)."""
        return orchestrator_pb2.ToolCallSummary(
            name=self.name,
            arguments_json=json_text(self.arguments),  # exactly what was sent to the gateway
            request_id=self.request_id,
            is_error=self.result.is_error,
            error_kind=self.result.error_kind,
        )

    def as_dict(self) -> dict[str, Any]:
        """Plain JSON-able data for trajectories and metrics (the result rendered as the model saw it)."""
        return {
            "name": self.name,
            "arguments": self.arguments,
            "request_id": self.request_id,
            "is_error": self.result.is_error,
            "error_kind": common_pb2.ToolErrorKind.Name(self.result.error_kind),
            "text": self.text,
        }


@dataclass
class TurnResult:
    """The outcome of one assistant turn."""

    text: str
    parsed: protocol.ParsedTurn
    tool_calls: list[ToolCallRecord]
    step: orchestrator_pb2.StepResponse
    # Messages for the model's next turn (empty once the episode is done).
    observations: list[dict[str, str]] = field(default_factory=list)

    @property
    def done(self) -> bool:
        """The episode ended with this turn (final answer, done signal or the turn limit)."""
        return self.step.done

    @property
    def truncated(self) -> bool:
        """The episode ended because it reached max_turns."""
        return self.step.truncated

    @property
    def turn(self) -> int:
        """Turns counted in this episode, this one included."""
        return self.step.turn

    @property
    def reward(self) -> float | None:
        """The verifier's score; None until the episode is done, and when the verifier produced none."""
        return self.step.reward if self.step.HasField("reward") else None

    @property
    def done_reason(self) -> str:
        """Why the episode ended: "FINAL_ANSWER", "AGENT_DONE", "MAX_TURNS" ("UNSPECIFIED" while it runs)."""
        return done_reason_name(self.step.done_reason)

    @property
    def verification_status(self) -> str:
        """How verification went: "OK" (scored), "ERROR", "TIMEOUT", "SKIPPED" (no verifier), "UNSPECIFIED"."""
        return verification_status_name(self.step.verification.status)

    @property
    def error(self) -> str | None:
        """Parse problems of this turn, as the model was told (None when the turn parsed cleanly)."""
        return "\n".join(self.parsed.errors) or None


def _error_response(kind: int, message: str) -> toolgateway_pb2.CallToolResponse:
    return toolgateway_pb2.CallToolResponse(
        result=common_pb2.ToolResult(is_error=True, error_kind=kind, error_message=message)  # type: ignore[arg-type]
    )


def _field_violation(err: RlgateError) -> error_details_pb2.BadRequest.FieldViolation | None:
    """The first BadRequest field violation the server attached, or None."""
    for detail in err.rich_status.details if err.rich_status is not None else ():
        bad = error_details_pb2.BadRequest()
        if detail.Unpack(bad) and bad.field_violations:  # Unpack is False for a detail of another type
            return bad.field_violations[0]
    return None


class _EpisodeBase(Generic[ClientT]):
    """What both episode classes share: the constructor, what Reset returned, and every decision of a turn."""

    def __init__(
        self,
        client: ClientT,
        *,
        task_key: str = "",
        env_key: str = "",
        session_id: str = "",
        max_turns: int = 0,
        labels: Mapping[str, str] | None = None,
        run_id: str = "",
        trace_id: str | None = None,
        instructions: str = protocol.DEFAULT_INSTRUCTIONS,
        raise_on_verifier_error: bool = True,
        tool_timeout_s: float | None = None,
    ) -> None:
        self.client: ClientT = client
        self.task_key = task_key
        # Bound of one tool call made by `turn` (None: the client's call_tool timeout).
        self.tool_timeout_s = tool_timeout_setting(tool_timeout_s)
        # One trace per episode: the span "episode" when OpenTelemetry is there (see rlgate._tracing).
        self.trace_id = trace_id or new_trace_id()
        self._given_trace_id = bool(trace_id)
        self._trace = EpisodeTrace()
        self.instructions = instructions
        self.raise_on_verifier_error = raise_on_verifier_error
        self._reset_request_id = new_request_id()
        self._reset_fields: dict[str, Any] = {
            "task_key": task_key,
            "env_key": env_key,
            "session_id": session_id,
            "max_turns": max_turns,
            "labels": {**(labels or {}), RESET_LABEL: self._reset_request_id},
            "run_id": run_id,
            "request_id": self._reset_request_id,
        }
        self.reset_response: orchestrator_pb2.ResetResponse | None = None
        # A forked episode's chat so far (`fork(messages=...)`): the prefix it continues from.
        self.prefix_messages: list[dict[str, Any]] = []
        self.parent_session_id = ""
        self.branch_index = 0
        self.last_step: orchestrator_pb2.StepResponse | None = None
        self.closed = False
        self._close_lock = threading.Lock()

    def _begin_trace(self) -> None:
        """A new episode, a new trace: the span "episode" starts (its trace id is the episode's), or without
        one a next episode of the session gets a new trace id (unless the caller chose one)."""
        traced = self._trace.start(
            {"rlgate.task_key": self.task_key, "rlgate.env_key": str(self._reset_fields.get("env_key") or "")}
        )
        if traced:
            self.trace_id = traced
        elif self.reset_response is not None and not self._given_trace_id:
            self.trace_id = new_trace_id()

    def _reset_failed(self, err: BaseException) -> None:
        if self.reset_response is None:  # no episode started: its span ends here
            self._trace.end(err)

    # -- what Reset told us
    def _reset_done(self, response: orchestrator_pb2.ResetResponse) -> None:
        self._trace.set("rlgate.session_id", response.session_id)
        self.reset_response = response
        self.closed = False
        self.last_step = None
        if response.task.key:
            self.task_key = response.task.key

    def _fork_request(self, count: int) -> dict[str, Any]:
        """Fork's arguments; the episode must be running."""
        if self.done or self.closed:
            raise RuntimeError(f"session {self.session_id}: only a running episode can be forked")
        return {"session_id": self.session_id, "count": count, "trace_id": self.trace_id}

    def _branches(
        self, forked: orchestrator_pb2.ForkResponse, messages: Sequence[Mapping[str, Any]] | None
    ) -> list[Any]:
        """One episode per branch, as if its Reset had answered: the source's task and prompt, the branch's
        session, token, tools and instance, and a copy of `messages` (default: `initial_messages()`)."""
        source = self._reset
        prefix = [dict(m) for m in (messages if messages is not None else self.initial_messages())]
        out = []
        for branch in forked.branches:
            episode = type(self)(
                self.client,
                task_key=self.task_key,
                instructions=self.instructions,
                raise_on_verifier_error=self.raise_on_verifier_error,
                tool_timeout_s=self.tool_timeout_s,
            )
            episode._begin_trace()
            episode._reset_done(
                orchestrator_pb2.ResetResponse(
                    session_id=branch.session_id,
                    episode=branch.episode,
                    prompt=source.prompt,
                    messages=source.messages,
                    tools=branch.tools,
                    agent_token=branch.agent_token,
                    gateway_address=branch.gateway_address,
                    task=source.task,
                    max_turns=branch.max_turns,
                    modality=source.modality,
                    instance=branch.instance,
                )
            )
            episode.prefix_messages = copy.deepcopy(prefix)
            episode.parent_session_id = forked.parent_session_id
            episode.branch_index = branch.branch_index
            out.append(episode)
        return out

    def _subject(self) -> str:
        """What the episode runs, for messages: its task, environment or session."""
        for name in ("task_key", "env_key", "session_id"):
            if self._reset_fields[name]:
                return f"{name}={self._reset_fields[name]!r}"
        return "no task_key, env_key or session_id"

    @property
    def _reset(self) -> orchestrator_pb2.ResetResponse:
        if self.reset_response is None:
            raise RuntimeError(
                f"the episode ({self._subject()}) has not been reset, so it has no session yet: enter it "
                "(`with client.episode(...) as ep:`) or call reset() first"
            )
        return self.reset_response

    @property
    def session_id(self) -> str:
        """The session's id (stable across its episodes)."""
        return self._reset.session_id

    @property
    def agent_token(self) -> str:
        """This episode's bearer token for the gateway (a next episode gets a new one)."""
        return self._reset.agent_token

    @property
    def gateway_address(self) -> str:
        """The gateway serving the session, as Reset returned it ("host:port")."""
        return self._reset.gateway_address

    @property
    def instance(self) -> orchestrator_pb2.InstanceInfo:
        """The instance behind the session (provider, instance id, env key, root URL, MCP endpoints)."""
        return self._reset.instance

    def _gateway(self, settings: ClientSettings) -> str:
        """The gateway address for list_tools / call_tool: Reset's, unless the client overrides it."""
        if not self.gateway_address and not settings.gateway_addresses:
            raise ValueError(
                f"Reset of session {self.session_id} returned no gateway_address and the client has no "
                f"gateway_addresses (or {ENV_GATEWAY}) to use instead"
            )
        return self.gateway_address

    @property
    def tools(self) -> list[common_pb2.ToolSpec]:
        """The tools the agent sees, as Reset returned them (the same as list_tools())."""
        return list(self._reset.tools)

    @property
    def max_turns(self) -> int:
        """The episode's effective turn limit."""
        return self._reset.max_turns

    @property
    def modality(self) -> str:
        """The task's modality ("tool_use", "computer_use", "browser_use")."""
        return self._reset.modality

    @property
    def env_key(self) -> str:
        """The environment ("env_id" or "env_id:version") the session runs on."""
        task = self._reset.task
        if task.env_id:
            return f"{task.env_id}:{task.version}" if task.version else task.env_id
        return self._reset.instance.env_key or str(self._reset_fields.get("env_key") or "")

    @property
    def done(self) -> bool:
        """The current episode has ended (its last Step said done)."""
        return self.last_step is not None and self.last_step.done

    def initial_messages(self) -> list[dict[str, str]]:
        """The chat to start from: the system prompt with tools, then the task's messages."""
        reset = self._reset
        messages = [protocol.system_message(reset.tools, self.instructions)]
        task_messages = [{"role": m.role, "content": m.content} for m in reset.messages]
        if not task_messages and reset.prompt:
            task_messages = [{"role": "user", "content": reset.prompt}]
        return messages + task_messages

    # -- turn logic shared by both episode classes
    @staticmethod
    def _record(call: protocol.ToolCall, request_id: str, response: toolgateway_pb2.CallToolResponse) -> ToolCallRecord:
        return ToolCallRecord(
            name=call.name,
            arguments=call.arguments,
            request_id=request_id,
            result=response.result,
            text=protocol.render_tool_result(response.result),
            replayed=response.replayed,
        )

    def _call_refused(self, err: RlgateError, settings: ClientSettings) -> toolgateway_pb2.CallToolResponse:
        """The result the model sees for a call that failed because of what it wrote, or that ran out of time;
        re-raises anything else (the services' own failures are not the model's to see)."""
        if isinstance(err, DeadlineExceeded):
            limit = self.tool_timeout_s or settings.timeouts.call_tool
            # The gateway cancelled the upstream call and recorded its request_id as OUTCOME_UNKNOWN.
            return _error_response(
                common_pb2.TOOL_ERROR_KIND_OUTCOME_UNKNOWN,
                f"the tool did not answer within {limit:g} s; the call was cancelled and may have partly run",
            )
        violation = _field_violation(err) if isinstance(err, InvalidArgument) else None
        if violation is None or violation.field not in _MODEL_FIELDS:
            raise err
        return _error_response(_MODEL_FIELDS[violation.field], violation.description or err.message)

    @staticmethod
    def _step_fields(text: str, parsed: protocol.ParsedTurn, records: Sequence[ToolCallRecord]) -> dict[str, Any]:
        answer = parsed.final_answer
        return {
            # The parser refused every call and answer it could not send; the prose around them is kept
            # with U+FFFD in place of what UTF-8 cannot carry.
            "assistant_text": protocol.sendable_text(text),
            "tool_calls": [r.summary() for r in records],
            "final_answer": None if answer is None else protocol.sendable_text(answer),
            "done": parsed.done and answer is None,
        }

    def _finish(
        self, text: str, parsed: protocol.ParsedTurn, records: list[ToolCallRecord], step: orchestrator_pb2.StepResponse
    ) -> TurnResult:
        self.last_step = step
        observations: list[dict[str, str]] = []
        if not step.done:
            parts = [protocol.wrap_tool_response(r.text) for r in records]
            if parsed.errors:
                parts.extend(parsed.errors)
            elif not records and not parsed.done:
                parts.append(protocol.FORMAT_REMINDER)
            if parts:
                observations.append({"role": "user", "content": "\n".join(parts)})
        result = TurnResult(text=text, parsed=parsed, tool_calls=records, step=step, observations=observations)
        self._check_verification(step)
        return result

    def _check_verification(self, step: orchestrator_pb2.StepResponse) -> None:
        if step.done:
            self._trace.set("rlgate.done_reason", done_reason_name(step.done_reason))
            self._trace.set("rlgate.verification.status", verification_status_name(step.verification.status))
            if step.HasField("reward"):
                self._trace.set("rlgate.reward", step.reward)
        if step.done and step.verification.status in _FAILED_VERIFICATION and self.raise_on_verifier_error:
            raise VerifierError(
                step.verification.message or "the verifier produced no score",
                status=verification_status_name(step.verification.status),
                session_id=self.session_id,
                task_key=self.task_key,
                trace_id=self.trace_id,
            )

    def _start_close(self) -> str | None:
        """The session id to close, or None when there is nothing (left) to close."""
        with self._close_lock:
            if self.closed or self.reset_response is None:
                return None
            self.closed = True
            return self.reset_response.session_id

    def _lost_reset(self, err: BaseException) -> bool:
        return isinstance(err, RlgateError) and err.code in _UNKNOWN_OUTCOME


class Episode(_EpisodeBase["Client"]):
    """One episode on a blocking `Client`: `with client.episode(task_key=...) as ep: ep.turn(text) ...`.

    Reset starts `task_key` (or the bare environment `env_key`, or the next episode of `session_id`) with
    `max_turns` (0: the task's), `labels` and `run_id`; every call carries `trace_id` (default: a new one).
    `instructions` head the system prompt of `initial_messages()`. `raise_on_verifier_error=False` returns a
    verifier ERROR/TIMEOUT in the result instead of raising `VerifierError`. `tool_timeout_s` bounds each
    tool call `turn` makes (else $RLGATE_TOOL_TIMEOUT_S, else the client's call_tool timeout)."""

    def reset(self) -> orchestrator_pb2.ResetResponse:
        """Start the episode (or, after one ended, the next episode of the same session)."""
        fields = dict(self._reset_fields)
        if self.reset_response is not None:
            fields.update(session_id=self.session_id, task_key="", env_key="", request_id=new_request_id())
        self._begin_trace()
        try:
            with self._trace.active():
                response = self.client.reset(trace_id=self.trace_id, **fields)
        except RlgateError as err:
            if self._lost_reset(err) and self.reset_response is None:
                self._close_lost_reset()
            self._reset_failed(err)
            raise
        self._reset_done(response)
        return response

    def _close_lost_reset(self) -> None:
        try:
            with self._trace.active():
                self.client.close_sessions(
                    labels={RESET_LABEL: self._reset_request_id}, trace_id=self.trace_id, timeout=10.0
                )
        except RlgateError as err:
            log.warning("could not close the session of a failed Reset (%s); the server will reap it", err)

    def fork(self, count: int, messages: Sequence[Mapping[str, Any]] | None = None) -> list[Episode]:
        """Branch this running episode into `count` episodes that continue from its current state (Fork):
        each on its own session and instance, at this turn, carrying a copy of `messages`.

        Args:
            count: How many branches (1 to the orchestrator's maximum, 16 by default).
            messages: The chat so far, copied into each branch's `prefix_messages` (default:
                `initial_messages()`).

        Returns:
            The branch episodes, by branch index. Each is running already (no reset); close each (or use it
            as a context manager)."""
        fields = self._fork_request(count)
        with self._trace.active():
            forked = self.client.fork(fields.pop("session_id"), fields.pop("count"), **fields)
        branches: list[Episode] = self._branches(forked, messages)
        return branches

    def list_tools(self, *, timeout: float | None = None) -> list[common_pb2.ToolSpec]:
        """The tools the session may call, asked of the gateway now (`tools` is what Reset said)."""
        with self._trace.active():
            return self.client.list_tools(
                self.agent_token, gateway=self._gateway(self.client.settings), trace_id=self.trace_id, timeout=timeout
            )

    def call_tool(
        self,
        name: str,
        arguments: Mapping[str, Any] | None = None,
        *,
        request_id: str | None = None,
        timeout: float | None = None,
    ) -> toolgateway_pb2.CallToolResponse:
        """Call one tool with this episode's agent token (no parsing, no Step: `turn` does both)."""
        with self._trace.active():
            return self.client.call_tool(
                self.agent_token,
                name,
                arguments,
                request_id=request_id,
                gateway=self._gateway(self.client.settings),
                trace_id=self.trace_id,
                timeout=timeout,
            )

    def step(
        self,
        *,
        assistant_text: str = "",
        tool_calls: Sequence[orchestrator_pb2.ToolCallSummary] = (),
        final_answer: str | None = None,
        done: bool = False,
        request_id: str | None = None,
        timeout: float | None = None,
    ) -> orchestrator_pb2.StepResponse:
        """Report a turn yourself, for tool calls made with `call_tool` (see `Client.step`); `turn` does it
        for a model's text. Raises VerifierError as `turn` does."""
        with self._trace.active():
            step = self.client.step(
                self.session_id,
                assistant_text=assistant_text,
                tool_calls=tool_calls,
                final_answer=final_answer,
                done=done,
                request_id=request_id,
                trace_id=self.trace_id,
                timeout=timeout,
            )
        self.last_step = step
        self._check_verification(step)
        return step

    def state(
        self, *, include_tool_calls: bool = False, timeout: float | None = None
    ) -> orchestrator_pb2.StateResponse:
        """The session's state (see `Client.state`)."""
        with self._trace.active():
            return self.client.state(
                self.session_id, include_tool_calls=include_tool_calls, trace_id=self.trace_id, timeout=timeout
            )

    def turn(self, text: str, parsed: protocol.ParsedTurn | None = None) -> TurnResult:
        """Play one assistant message: parse (unless `parsed` is given), call its tools in order, step.

        Raises VerifierError when the episode ends without a score (unless raise_on_verifier_error=False)."""
        parsed = parsed if parsed is not None else protocol.parse_assistant_text(text)
        records = []
        for call in parsed.tool_calls:  # in order: later calls may depend on earlier ones
            request_id = new_request_id()
            try:
                response = self.call_tool(call.name, call.arguments, request_id=request_id, timeout=self.tool_timeout_s)
            except RlgateError as err:
                response = self._call_refused(err, self.client.settings)
            records.append(self._record(call, request_id, response))
        with self._trace.active():
            step = self.client.step(self.session_id, trace_id=self.trace_id, **self._step_fields(text, parsed, records))
        return self._finish(text, parsed, records, step)

    def close(self) -> None:
        """Close the session and release its instance (idempotent; the context manager calls it)."""
        session_id = self._start_close()
        if session_id is not None:
            try:
                with self._trace.active():
                    self.client.close_session(session_id, trace_id=self.trace_id)
            finally:
                self._trace.end()

    def __enter__(self) -> Episode:
        if self.reset_response is None:
            self.reset()
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        try:
            self.close()
        except RlgateError as err:
            if exc is None:
                raise
            log.warning("closing session failed while handling another error: %s", err)


class AsyncEpisode(_EpisodeBase["AsyncClient"]):
    """One episode on an `AsyncClient`: `async with client.episode(task_key=...) as ep: await ep.turn(text)`.

    The same parameters and methods as `Episode`, as coroutines; leaving the block closes the session even
    when the task is cancelled."""

    async def reset(self) -> orchestrator_pb2.ResetResponse:
        """Start the episode; see `Episode.reset`."""
        fields = dict(self._reset_fields)
        if self.reset_response is not None:
            fields.update(session_id=self.session_id, task_key="", env_key="", request_id=new_request_id())
        self._begin_trace()
        try:
            with self._trace.active():
                response = await self.client.reset(trace_id=self.trace_id, **fields)
        except RlgateError as err:
            if self._lost_reset(err) and self.reset_response is None:
                await self._close_lost_reset()
            self._reset_failed(err)
            raise
        except asyncio.CancelledError as err:
            if self.reset_response is None:
                await asyncio.shield(self._close_lost_reset())
            self._reset_failed(err)
            raise
        self._reset_done(response)
        return response

    async def _close_lost_reset(self) -> None:
        try:
            with self._trace.active():
                await self.client.close_sessions(
                    labels={RESET_LABEL: self._reset_request_id}, trace_id=self.trace_id, timeout=10.0
                )
        except RlgateError as err:
            log.warning("could not close the session of a failed Reset (%s); the server will reap it", err)

    async def fork(self, count: int, messages: Sequence[Mapping[str, Any]] | None = None) -> list[AsyncEpisode]:
        """Branch this running episode into `count` episodes; see `Episode.fork`.

        Args:
            count: How many branches.
            messages: The chat so far, copied into each branch (default: `initial_messages()`).

        Returns:
            The branch episodes, by branch index; close each."""
        fields = self._fork_request(count)
        with self._trace.active():
            forked = await self.client.fork(fields.pop("session_id"), fields.pop("count"), **fields)
        branches: list[AsyncEpisode] = self._branches(forked, messages)
        return branches

    async def list_tools(self, *, timeout: float | None = None) -> list[common_pb2.ToolSpec]:
        """The session's tools from the gateway; see `Episode.list_tools`."""
        with self._trace.active():
            return await self.client.list_tools(
                self.agent_token, gateway=self._gateway(self.client.settings), trace_id=self.trace_id, timeout=timeout
            )

    async def call_tool(
        self,
        name: str,
        arguments: Mapping[str, Any] | None = None,
        *,
        request_id: str | None = None,
        timeout: float | None = None,
    ) -> toolgateway_pb2.CallToolResponse:
        """Call one tool; see `Episode.call_tool`."""
        with self._trace.active():
            return await self.client.call_tool(
                self.agent_token,
                name,
                arguments,
                request_id=request_id,
                gateway=self._gateway(self.client.settings),
                trace_id=self.trace_id,
                timeout=timeout,
            )

    async def step(
        self,
        *,
        assistant_text: str = "",
        tool_calls: Sequence[orchestrator_pb2.ToolCallSummary] = (),
        final_answer: str | None = None,
        done: bool = False,
        request_id: str | None = None,
        timeout: float | None = None,
    ) -> orchestrator_pb2.StepResponse:
        """Report a turn yourself; see `Episode.step`."""
        with self._trace.active():
            step = await self.client.step(
                self.session_id,
                assistant_text=assistant_text,
                tool_calls=tool_calls,
                final_answer=final_answer,
                done=done,
                request_id=request_id,
                trace_id=self.trace_id,
                timeout=timeout,
            )
        self.last_step = step
        self._check_verification(step)
        return step

    async def state(
        self,
        *,
        include_tool_calls: bool = False,
        timeout: float | None = None,
    ) -> orchestrator_pb2.StateResponse:
        """The session's state; see `Episode.state`."""
        with self._trace.active():
            return await self.client.state(
                self.session_id, include_tool_calls=include_tool_calls, trace_id=self.trace_id, timeout=timeout
            )

    async def turn(self, text: str, parsed: protocol.ParsedTurn | None = None) -> TurnResult:
        """Play one assistant message; see `Episode.turn`."""
        parsed = parsed if parsed is not None else protocol.parse_assistant_text(text)
        records = []
        for call in parsed.tool_calls:  # in order: later calls may depend on earlier ones
            request_id = new_request_id()
            try:
                response = await self.call_tool(
                    call.name, call.arguments, request_id=request_id, timeout=self.tool_timeout_s
                )
            except RlgateError as err:
                response = self._call_refused(err, self.client.settings)
            records.append(self._record(call, request_id, response))
        with self._trace.active():
            step = await self.client.step(
                self.session_id, trace_id=self.trace_id, **self._step_fields(text, parsed, records)
            )
        return self._finish(text, parsed, records, step)

    async def close(self) -> None:
        """Close the session (idempotent); see `Episode.close`."""
        session_id = self._start_close()
        if session_id is not None:
            try:
                with self._trace.active():
                    await self.client.close_session(session_id, trace_id=self.trace_id)
            finally:
                self._trace.end()

    async def __aenter__(self) -> AsyncEpisode:
        if self.reset_response is None:
            await self.reset()
        return self

    async def __aexit__(self, exc_type: object, exc: object, tb: object) -> None:
        try:
            # Shielded: a cancelled rollout still releases its instance.
            await asyncio.shield(self.close())
        except RlgateError as err:
            if exc is None:
                raise
            log.warning("closing session failed while handling another error: %s", err)
