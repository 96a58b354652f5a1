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
import logging
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, TypeVar, Unpack

import grpc
from google.rpc import error_details_pb2

from rlgate import protocol
from rlgate._tracing import EpisodeTrace, new_trace_id
from rlgate.core.convert import json_text
from rlgate.errors import DeadlineExceeded, InvalidArgument, RlgateError, VerifierError
from rlgate.inputs import EpisodeSpec, ResetFields
from rlgate.messages import Message, Part
from rlgate.requests import new_request_id
from rlgate.results import (
    DoneReason,
    Instance,
    ResetResult,
    StepResult,
    Verification,
    VerificationStatus,
)
from rlgate.results import done_reason_name as done_reason_name  # re-exported: older imports
from rlgate.results import verification_status_name as verification_status_name
from rlgate.settings import ENV_GATEWAY, ClientSettings
from rlgate.settings import ENV_TOOL_TIMEOUT as ENV_TOOL_TIMEOUT
from rlgate.settings import tool_timeout_setting as tool_timeout_setting
from rlgate.v1 import common_pb2, orchestrator_pb2, toolgateway_pb2

if TYPE_CHECKING:
    from rlgate.client import AsyncClient, Client

log = logging.getLogger("rlgate.episode")

ClientT = TypeVar("ClientT", "Client", "AsyncClient")

# Label on every session an Episode creates, so a Reset whose answer was lost can still be closed.
RESET_LABEL = "rlgate-reset"
_UNKNOWN_OUTCOME = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED}
# The gateway's BadRequest fields that are what the model wrote (not the client's request id, say).
_MODEL_FIELDS = {
    "name": common_pb2.TOOL_ERROR_KIND_UNKNOWN_TOOL,
    "arguments_json": common_pb2.TOOL_ERROR_KIND_INVALID_ARGUMENTS,
    "arguments": common_pb2.TOOL_ERROR_KIND_INVALID_ARGUMENTS,
}


@dataclass
class ToolCallRecord:
    """One tool call of a turn and what came back.

    Args:
        name: the tool, as the model wrote it.
        arguments: its arguments, as sent.
        request_id: the CallTool request id (the gateway's log links to it).
        result: the ToolResult.
        text: the result as a text-only model reads it (images as placeholders).
        replayed: the gateway answered a retry with the recorded result.
        parts: the result as the model sees it, images in place (`protocol.tool_result_parts`).
    """

    name: str
    arguments: dict[str, Any]
    request_id: str
    result: common_pb2.ToolResult
    text: str
    replayed: bool = False
    parts: tuple[Part, ...] = ()

    @property
    def is_error(self) -> bool:
        """The result is an error the model sees (unknown tool, bad arguments, a failing tool, ...)."""
        return self.result.is_error

    @property
    def infra_fault(self) -> bool:
        """The error is the infrastructure's, not the model's: OUTCOME_UNKNOWN (the call was cut by a lost
        connection, a deadline or a gateway that died; the tool may or may not have run). Counted in the
        episode's `InfraFaults`, never among the model's tool errors."""
        return self.result.error_kind == common_pb2.TOOL_ERROR_KIND_OUTCOME_UNKNOWN

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
    """The outcome of one assistant turn: what was parsed, the tool calls made, the orchestrator's verdict.

    Args:
        text: the assistant's text.
        parsed: what the parser made of it.
        tool_calls: the tool calls made, in order, with their results.
        step: the orchestrator's verdict on the turn (`StepResult`; `.raw` is the StepResponse).
        observations: the messages for the model's next turn (empty once the episode is done).
    """

    text: str
    parsed: protocol.ParsedTurn
    tool_calls: list[ToolCallRecord]
    step: StepResult
    observations: list[Message] = field(default_factory=list)

    @property
    def terminated(self) -> bool:
        """The agent ended the episode with this turn (a final answer, scored, or a done signal)."""
        return self.step.terminated

    @property
    def truncated(self) -> bool:
        """The orchestrator ended the episode with this turn: it reached max_turns."""
        return self.step.truncated

    @property
    def done(self) -> bool:
        """The episode ended with this turn: `terminated or truncated` (SkyRL's one flag)."""
        return self.step.done

    @property
    def turn(self) -> int:
        """Turns counted in this episode, this one included."""
        return self.step.turn

    @property
    def reward(self) -> float | None:
        """The verifier's score; None until the episode is done, and when the verifier produced none."""
        return self.step.reward

    @property
    def done_reason(self) -> DoneReason:
        """Why the episode ended: "FINAL_ANSWER", "AGENT_DONE", "MAX_TURNS" ("UNSPECIFIED" while it runs)."""
        return self.step.done_reason

    @property
    def verification(self) -> Verification:
        """How the verifier went (status "UNSPECIFIED" while the episode runs)."""
        return self.step.verification

    @property
    def verification_status(self) -> VerificationStatus:
        """How verification went: "OK" (scored), "ERROR", "TIMEOUT", "SKIPPED" (no verifier), "UNSPECIFIED"."""
        return self.step.verification.status

    @property
    def raw(self) -> orchestrator_pb2.StepResponse:
        """The StepResponse of the turn."""
        return self.step.raw

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
        spec: EpisodeSpec | None = None,
        /,
        *,
        trace_id: str | None = None,
        instructions: str = protocol.DEFAULT_INSTRUCTIONS,
        raise_on_verifier_error: bool = True,
        tool_timeout_s: float | None = None,
        close_when_done: bool = False,
        **fields: Unpack[ResetFields],
    ) -> None:
        self.client: ClientT = client
        self.spec: EpisodeSpec = EpisodeSpec.of(spec, fields)
        self.task_key = self.spec.task_key
        # Bound of one tool call made by `turn` (None: the client's call_tool timeout).
        self.tool_timeout_s = tool_timeout_setting(tool_timeout_s)
        # One trace per episode: the span "episode" when OpenTelemetry is there (see rlgate._tracing).
        self.trace_id = trace_id or new_trace_id()
        self._given_trace_id = bool(trace_id)
        self._trace = EpisodeTrace()
        self.instructions = instructions
        self.raise_on_verifier_error = raise_on_verifier_error
        # Every Step asks the orchestrator to close the session with the turn that ends the episode.
        self.close_when_done = close_when_done
        self._reset_request_id = new_request_id()
        self.reset_result: ResetResult | None = None
        self.last_step: StepResult | None = None
        # A forked episode's chat so far (`fork(messages=...)`): the prefix it continues from.
        self.prefix_messages: list[Message] = []
        self.parent_session_id = ""
        self.branch_index = 0
        self.closed = False
        self._closed_by_step = False  # a Step with close_when_done ended the episode: `close` sends nothing
        self._close_lock = threading.Lock()

    def _next_reset(self) -> tuple[EpisodeSpec, str]:
        """The spec and request id of the next Reset: the first episode as asked, tagged so that a Reset whose
        answer was lost can still be closed; a next one of the same session."""
        if self.reset_result is None:
            labels = {**self.spec.labels, RESET_LABEL: self._reset_request_id}
            return EpisodeSpec.of(self.spec, {"labels": labels}), self._reset_request_id
        if self._closed_by_step:
            raise RuntimeError(
                f"session {self.session_id} was closed by the Step that ended its episode (close_when_done): "
                "it runs no next episode; start another Episode"
            )
        return self.spec.next_episode(self.session_id), new_request_id()

    def _begin_trace(self) -> None:
        """A new episode, a new trace: the span "episode" starts (its trace id is the episode's), or without
        one a next episode of the session gets a new trace id (unless the caller chose one)."""
        traced = self._trace.start({"rlgate.task_key": self.task_key, "rlgate.env_key": self.spec.env_key})
        if traced:
            self.trace_id = traced
        elif self.reset_result is not None and not self._given_trace_id:
            self.trace_id = new_trace_id()

    def _reset_failed(self, err: BaseException) -> None:
        if self.reset_result is None:  # no episode started: its span ends here
            self._trace.end(err)

    # -- what Reset told us
    def _reset_done(self, response: orchestrator_pb2.ResetResponse) -> ResetResult:
        self._trace.set("rlgate.session_id", response.session_id)
        result = ResetResult.from_proto(response, env_key=self.spec.env_key)
        self.reset_result = result
        self.closed = self._closed_by_step = False
        self.last_step = None
        if result.task_key:
            self.task_key = result.task_key
        return result

    def _fork_request(self, count: int) -> dict[str, Any]:
        """Fork's arguments; the episode must be running."""
        if self.done or self.closed:
            raise RuntimeError(f"session {self.session_id}: only a running episode can be forked")
        return {"session_id": self.session_id, "count": count, "trace_id": self.trace_id}

    def _branches(self, forked: orchestrator_pb2.ForkResponse, messages: Sequence[Message] | None) -> list[Any]:
        """One episode per branch, as if its Reset had answered: the source's task and prompt, the branch's
        session, token, tools and instance, and a copy of `messages` (default: `initial_messages()`)."""
        source = self._reset.raw
        prefix = list(messages if messages is not None else self.initial_messages())  # messages are frozen
        out = []
        for branch in forked.branches:
            episode = type(self)(
                self.client,
                self.spec,
                instructions=self.instructions,
                raise_on_verifier_error=self.raise_on_verifier_error,
                tool_timeout_s=self.tool_timeout_s,
                close_when_done=self.close_when_done,
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
            episode.prefix_messages = list(prefix)
            episode.parent_session_id = forked.parent_session_id
            episode.branch_index = branch.branch_index
            out.append(episode)
        return out

    @property
    def reset_response(self) -> orchestrator_pb2.ResetResponse | None:
        """The last ResetResponse (`reset_result.raw`), or None before the first Reset."""
        return None if self.reset_result is None else self.reset_result.raw

    @property
    def _reset(self) -> ResetResult:
        if self.reset_result is None:
            raise RuntimeError(
                f"the episode ({self.spec.subject()}) has not been reset, so it has no session yet: enter it "
                "(`with client.episode(...) as ep:`) or call reset() first"
            )
        return self.reset_result

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
    def instance(self) -> Instance:
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
        return self._reset.env_key

    @property
    def done(self) -> bool:
        """The current episode has ended (its last Step said done)."""
        return self.last_step is not None and self.last_step.done

    def initial_messages(self) -> list[Message]:
        """The chat to start from: the system prompt with tools, then the task's messages."""
        started: ResetResult = self._reset
        return [protocol.system_message(started.tools, self.instructions), *started.messages]

    # -- turn logic shared by both episode classes
    @staticmethod
    def _record(call: protocol.ToolCall, request_id: str, response: toolgateway_pb2.CallToolResponse) -> ToolCallRecord:
        parts = protocol.tool_result_parts(response.result)  # decoded once; `text` is its text form
        return ToolCallRecord(
            name=call.name,
            arguments=call.arguments,
            request_id=request_id,
            result=response.result,
            text=Message.of("tool", parts).text(),
            replayed=response.replayed,
            parts=parts,
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
        self,
        text: str,
        parsed: protocol.ParsedTurn,
        records: list[ToolCallRecord],
        response: orchestrator_pb2.StepResponse,
    ) -> TurnResult:
        step = self._stepped(response)
        observations: list[Message] = []
        if not step.done:
            notes = parsed.errors or ([protocol.FORMAT_REMINDER] if not records and not parsed.done else [])
            if records or notes:
                observations.append(protocol.tool_response_message([r.parts for r in records], notes))
        result = TurnResult(text=text, parsed=parsed, tool_calls=records, step=step, observations=observations)
        self._check_verification(step)
        return result

    def _stepped(self, response: orchestrator_pb2.StepResponse) -> StepResult:
        self.last_step = StepResult.from_proto(response)
        if response.status == common_pb2.SESSION_STATUS_CLOSED:
            self._closed_by_step = True
        return self.last_step

    def _check_verification(self, step: StepResult) -> None:
        if step.done:
            self._trace.set("rlgate.done_reason", step.done_reason)
            self._trace.set("rlgate.verification.status", step.verification.status)
            if step.reward is not None:
                self._trace.set("rlgate.reward", step.reward)
        if step.done and step.verification.failed and self.raise_on_verifier_error:
            raise VerifierError(
                step.verification.message or "the verifier produced no score",
                status=step.verification.status,
                session_id=self.session_id,
                task_key=self.task_key,
                trace_id=self.trace_id,
            )

    def _start_close(self) -> str | None:
        """The session id to close, or None when there is nothing (left) to close."""
        with self._close_lock:
            if self.closed or self.reset_result is None:
                return None
            self.closed = True
            return self.reset_result.session_id

    def _lost_reset(self, err: BaseException) -> bool:
        return isinstance(err, RlgateError) and err.code in _UNKNOWN_OUTCOME


class Episode(_EpisodeBase["Client"]):
    """One episode on a blocking `Client`: `with client.episode(task_key=...) as ep: ep.turn(text) ...`.

    Entering resets (unless `reset()` was called), leaving closes the session, also on an error.

    Args:
        client: the client whose calls the episode makes.
        spec: what Reset starts; its fields may instead (or also) be given as keyword arguments.
        trace_id: the trace every call of the episode carries (default: a new one per episode).
        instructions: the text heading the system prompt of `initial_messages()`.
        raise_on_verifier_error: raise `VerifierError` when the episode ends without a score (the verifier's
            ERROR or TIMEOUT); False returns it in the result (`reward` None).
        tool_timeout_s: the bound of each tool call `turn` makes (else $RLGATE_TOOL_TIMEOUT_S, else the
            client's call_tool timeout).
        close_when_done: one episode per session: each Step asks the orchestrator to close the session
            with the turn that ends the episode (`Client.step`), and `close()` then sends nothing.
        **fields: `EpisodeSpec` fields, replacing the spec's.
    """

    def reset(self) -> ResetResult:
        """Start the episode (or, after one ended, the next episode of the same session).

        Returns:
            The started episode, typed (`.raw` is the ResetResponse).
        """
        spec, request_id = self._next_reset()
        self._begin_trace()
        try:
            with self._trace.active():
                response = self.client.reset(spec, request_id=request_id, trace_id=self.trace_id)
        except RlgateError as err:
            if self._lost_reset(err) and self.reset_result is None:
                self._close_lost_reset()
            self._reset_failed(err)
            raise
        return self._reset_done(response)

    def _close_lost_reset(self) -> None:
        try:
            with self._trace.active():
                self.client.close_sessions(
                    labels={RESET_LABEL: self._reset_request_id}, trace_id=self.trace_id, timeout=10.0
                )
        except RlgateError as err:
            log.warning("could not close the session of a failed Reset (%s); the server will reap it", err)

    def fork(self, count: int, messages: Sequence[Message] | None = None) -> list[Episode]:
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
        """The tools the session may call, asked of the gateway now (`tools` is what Reset said).

        Args:
            timeout: the call's deadline in seconds (None: the client's `Timeouts.other`).
        """
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
        """Call one tool with this episode's agent token (no parsing, no Step: `turn` does both).

        Args:
            name: the tool.
            arguments: its arguments (sent as exact JSON text); None: none.
            request_id: the idempotency key every retry reuses (generated when None).
            timeout: the call's deadline in seconds (None: the client's `Timeouts.call_tool`).
        """
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
    ) -> StepResult:
        """Report a turn yourself, for tool calls made with `call_tool`; `turn` does it for a model's text.

        Raises VerifierError as `turn` does.

        Args:
            assistant_text: see `Client.step`.
            tool_calls: see `Client.step`.
            final_answer: see `Client.step`.
            done: see `Client.step`.
            request_id: see `Client.step`.
            timeout: see `Client.step`.

        Returns:
            The orchestrator's verdict, typed (`.raw` is the StepResponse).
        """
        with self._trace.active():
            response = self.client.step(
                self.session_id,
                assistant_text=assistant_text,
                tool_calls=tool_calls,
                final_answer=final_answer,
                done=done,
                close_when_done=self.close_when_done,
                request_id=request_id,
                trace_id=self.trace_id,
                timeout=timeout,
            )
        step = self._stepped(response)
        self._check_verification(step)
        return step

    def state(
        self,
        *,
        include_tool_calls: bool = False,
        tool_calls_page_size: int = 0,
        tool_calls_page_token: str = "",
        timeout: float | None = None,
    ) -> orchestrator_pb2.StateResponse:
        """The session's state and a page of its tool-call log (see `Client.state`; `tool_calls()` reads
        every page).

        Args:
            include_tool_calls: Include a page of the current episode's tool-call log.
            tool_calls_page_size: Entries per page, 1..1000; 0 means 100.
            tool_calls_page_token: A previous reply's `next_tool_calls_page_token`; "" for the first page.
            timeout: Deadline in seconds (the client's default when None).
        """
        with self._trace.active():
            return self.client.state(
                self.session_id,
                include_tool_calls=include_tool_calls,
                tool_calls_page_size=tool_calls_page_size,
                tool_calls_page_token=tool_calls_page_token,
                trace_id=self.trace_id,
                timeout=timeout,
            )

    def tool_calls(self, *, timeout: float | None = None) -> list[orchestrator_pb2.ToolCallLogEntry]:
        """Every entry of this episode's tool-call log, oldest first, read page by page.

        Args:
            timeout: Deadline in seconds of each State call (the client's default when None).
        """
        with self._trace.active():
            return self.client.tool_calls(self.session_id, trace_id=self.trace_id, timeout=timeout)

    def turn(self, text: str, parsed: protocol.ParsedTurn | None = None) -> TurnResult:
        """Play one assistant message: parse (unless `parsed` is given), call its tools in order, step.

        What the model wrote never raises: a refused or timed-out tool call is an `is_error` result the model
        sees in `observations`.

        Args:
            text: the assistant's text.
            parsed: `protocol.parse_assistant_text(text)`, when the caller parsed it already.

        Returns:
            The turn's calls, the orchestrator's verdict and the messages for the model's next turn.

        Raises:
            VerifierError: the episode ended without a score (unless raise_on_verifier_error=False).
        """
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
            step = self.client.step(
                self.session_id,
                trace_id=self.trace_id,
                close_when_done=self.close_when_done,
                **self._step_fields(text, parsed, records),
            )
        return self._finish(text, parsed, records, step)

    def close(self) -> None:
        """Close the session and release its instance (idempotent; the context manager calls it). Nothing is
        sent when a Step already closed it (`close_when_done`)."""
        session_id = self._start_close()
        if session_id is not None:
            try:
                if not self._closed_by_step:
                    with self._trace.active():
                        self.client.close_session(session_id, trace_id=self.trace_id)
            finally:
                self._trace.end()

    def __enter__(self) -> Episode:
        if self.reset_result is None:
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
    when the task is cancelled.

    Args:
        client: the client whose calls the episode makes.
        spec: see `Episode`.
        trace_id: see `Episode`.
        instructions: see `Episode`.
        raise_on_verifier_error: see `Episode`.
        tool_timeout_s: see `Episode`.
        close_when_done: see `Episode`.
        **fields: see `Episode`.
    """

    async def reset(self) -> ResetResult:
        """Start the episode; see `Episode.reset`."""
        spec, request_id = self._next_reset()
        self._begin_trace()
        try:
            with self._trace.active():
                response = await self.client.reset(spec, request_id=request_id, trace_id=self.trace_id)
        except RlgateError as err:
            if self._lost_reset(err) and self.reset_result is None:
                await self._close_lost_reset()
            self._reset_failed(err)
            raise
        except asyncio.CancelledError as err:
            if self.reset_result is None:
                await asyncio.shield(self._close_lost_reset())
            self._reset_failed(err)
            raise
        return self._reset_done(response)

    async def _close_lost_reset(self) -> None:
        try:
            with self._trace.active():
                await self.client.close_sessions(
                    labels={RESET_LABEL: self._reset_request_id}, trace_id=self.trace_id, timeout=10.0
                )
        except RlgateError as err:
            log.warning("could not close the session of a failed Reset (%s); the server will reap it", err)

    async def fork(self, count: int, messages: Sequence[Message] | None = None) -> list[AsyncEpisode]:
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
        """The session's tools from the gateway; see `Episode.list_tools`.

        Args:
            timeout: see `Episode.list_tools`.
        """
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
        """Call one tool; see `Episode.call_tool`.

        Args:
            name: see `Episode.call_tool`.
            arguments: see `Episode.call_tool`.
            request_id: see `Episode.call_tool`.
            timeout: see `Episode.call_tool`.
        """
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
    ) -> StepResult:
        """Report a turn yourself; see `Episode.step`.

        Args:
            assistant_text: see `Client.step`.
            tool_calls: see `Client.step`.
            final_answer: see `Client.step`.
            done: see `Client.step`.
            request_id: see `Client.step`.
            timeout: see `Client.step`.
        """
        with self._trace.active():
            response = await self.client.step(
                self.session_id,
                assistant_text=assistant_text,
                tool_calls=tool_calls,
                final_answer=final_answer,
                done=done,
                close_when_done=self.close_when_done,
                request_id=request_id,
                trace_id=self.trace_id,
                timeout=timeout,
            )
        step = self._stepped(response)
        self._check_verification(step)
        return step

    async def state(
        self,
        *,
        include_tool_calls: bool = False,
        tool_calls_page_size: int = 0,
        tool_calls_page_token: str = "",
        timeout: float | None = None,
    ) -> orchestrator_pb2.StateResponse:
        """The session's state; see `Episode.state`.

        Args:
            include_tool_calls: Include a page of the current episode's tool-call log.
            tool_calls_page_size: Entries per page, 1..1000; 0 means 100.
            tool_calls_page_token: A previous reply's `next_tool_calls_page_token`; "" for the first page.
            timeout: Deadline in seconds (the client's default when None).
        """
        with self._trace.active():
            return await self.client.state(
                self.session_id,
                include_tool_calls=include_tool_calls,
                tool_calls_page_size=tool_calls_page_size,
                tool_calls_page_token=tool_calls_page_token,
                trace_id=self.trace_id,
                timeout=timeout,
            )

    async def tool_calls(self, *, timeout: float | None = None) -> list[orchestrator_pb2.ToolCallLogEntry]:
        """Every entry of this episode's tool-call log, oldest first; see `Episode.tool_calls`.

        Args:
            timeout: Deadline in seconds of each State call (the client's default when None).
        """
        with self._trace.active():
            return await self.client.tool_calls(self.session_id, trace_id=self.trace_id, timeout=timeout)

    async def turn(self, text: str, parsed: protocol.ParsedTurn | None = None) -> TurnResult:
        """Play one assistant message; see `Episode.turn`.

        Args:
            text: see `Episode.turn`.
            parsed: see `Episode.turn`.
        """
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
                self.session_id,
                trace_id=self.trace_id,
                close_when_done=self.close_when_done,
                **self._step_fields(text, parsed, records),
            )
        return self._finish(text, parsed, records, step)

    async def close(self) -> None:
        """Close the session (idempotent); see `Episode.close`."""
        session_id = self._start_close()
        if session_id is not None:
            try:
                if not self._closed_by_step:
                    with self._trace.active():
                        await self.client.close_session(session_id, trace_id=self.trace_id)
            finally:
                self._trace.end()

    async def __aenter__(self) -> AsyncEpisode:
        if self.reset_result is None:
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
