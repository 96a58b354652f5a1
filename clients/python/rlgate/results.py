"""Typed views of what Reset and Step return: `ResetResult`, `StepResult`, `Verification`, `Instance`.

An `Episode` hands these out (`Episode.reset()`, `Episode.step()`, `TurnResult.step`); each keeps the
protobuf it was read from as `.raw`. Enums are their short names ("OK", "MAX_TURNS"), messages are
`rlgate.messages.Message`.

A finished episode is either `terminated` (the agent ended it: a final answer, scored by the verifier, or
a done signal) or `truncated` (the orchestrator ended it: the turn limit), as in Gymnasium; `done` is their
union, the one flag SkyRL takes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, cast

from rlgate.core.faults import INFRA_FAULT_KINDS
from rlgate.messages import Message, Role
from rlgate.v1 import common_pb2, orchestrator_pb2

VerificationStatus = Literal["UNSPECIFIED", "OK", "ERROR", "TIMEOUT", "SKIPPED"]
DoneReason = Literal["UNSPECIFIED", "FINAL_ANSWER", "AGENT_DONE", "MAX_TURNS"]
_ROLES = ("system", "user", "assistant", "tool")


def verification_status_name(value: common_pb2.VerificationStatus) -> VerificationStatus:
    """`VERIFICATION_STATUS_TIMEOUT` -> "TIMEOUT": the short name trainers log and compare.

    Args:
        value: the protobuf enum value.
    """
    return cast(VerificationStatus, common_pb2.VerificationStatus.Name(value).removeprefix("VERIFICATION_STATUS_"))


def done_reason_name(value: orchestrator_pb2.DoneReason) -> DoneReason:
    """`DONE_REASON_MAX_TURNS` -> "MAX_TURNS": the short name trainers log and compare.

    Args:
        value: the protobuf enum value.
    """
    return cast(DoneReason, orchestrator_pb2.DoneReason.Name(value).removeprefix("DONE_REASON_"))


def chat_message(message: common_pb2.ChatMessage) -> Message:
    """A ChatMessage as a `Message` (a role outside the four is kept as a user turn: the text is not lost).

    Args:
        message: the protobuf message.
    """
    role = cast(Role, message.role if message.role in _ROLES else "user")
    return Message(role, message.content)


@dataclass(frozen=True)
class InfraFaults:
    """The infrastructure faults an episode met so far: events of rlgate, the network or the environment's
    hosting, never of the model. A trajectory with `total > 0` may hold a turn the model did not cause;
    a trainer can drop or down-weight it.

    Args:
        outcome_unknown: tool calls answered OUTCOME_UNKNOWN (connection lost, cut by a deadline or cancel,
            or a gateway that died under a call that may not run twice).
        tool_reruns: read-only or idempotent tool calls run a second time after the gateway running the
            first attempt died (the model saw the second run's result, after a stall).
        client_retries: calls the client retried after UNAVAILABLE.
        verifier_errors: verifications that failed for an infrastructure reason (no reward).
        orchestrator_restarts: Steps taken over after the orchestrator running them died.
    """

    outcome_unknown: int = 0
    tool_reruns: int = 0
    client_retries: int = 0
    verifier_errors: int = 0
    orchestrator_restarts: int = 0

    @property
    def total(self) -> int:
        """All of them."""
        return (
            self.outcome_unknown + self.tool_reruns + self.client_retries + self.verifier_errors
            + self.orchestrator_restarts
        )  # fmt: skip

    def as_dict(self) -> dict[str, int]:
        """The counts by kind, and `total`."""
        return {**{k: getattr(self, k) for k in INFRA_FAULT_KINDS}, "total": self.total}

    @classmethod
    def from_proto(cls, faults: common_pb2.InfraFaults) -> InfraFaults:
        """The typed view of an InfraFaults message.

        Args:
            faults: the protobuf message.
        """
        return cls(**{k: getattr(faults, k) for k in INFRA_FAULT_KINDS})


@dataclass(frozen=True)
class Verification:
    """How the verifier went at the end of an episode.

    Args:
        status: "OK" (scored), "ERROR", "TIMEOUT" (no score: an infrastructure failure, never a 0), "SKIPPED"
            (no verifier), "UNSPECIFIED" (the episode runs on).
        message: the error or timeout reason; empty when OK.
        stdout: the verifier's output, truncated to a few KiB.
        attempts: verifier runs made.
        elapsed_ms: wall time of the verification.
    """

    status: VerificationStatus
    message: str = ""
    stdout: str = ""
    attempts: int = 0
    elapsed_ms: float = 0.0

    @property
    def failed(self) -> bool:
        """The verifier ran but gave no score (ERROR or TIMEOUT)."""
        return self.status in ("ERROR", "TIMEOUT")

    @classmethod
    def from_proto(cls, value: common_pb2.Verification) -> Verification:
        """The typed view of a Verification message.

        Args:
            value: the protobuf message.
        """
        return cls(
            status=verification_status_name(value.status),
            message=value.message,
            stdout=value.stdout,
            attempts=value.attempts,
            elapsed_ms=value.elapsed_ms,
        )


@dataclass(frozen=True)
class Instance:
    """The environment instance behind a session.

    Args:
        provider: "fleet" or "mcp".
        instance_id: the provider's instance id; empty for the mcp provider.
        env_key: the environment, "env_id:version".
        root_url: the instance's root URL; empty for the mcp provider.
        mcp_endpoints: the MCP endpoints the gateway multiplexes, in precedence order.
    """

    provider: str
    instance_id: str
    env_key: str
    root_url: str
    mcp_endpoints: tuple[str, ...]

    @classmethod
    def from_proto(cls, value: orchestrator_pb2.InstanceInfo) -> Instance:
        """The typed view of an InstanceInfo message.

        Args:
            value: the protobuf message.
        """
        return cls(value.provider, value.instance_id, value.env_key, value.root_url, tuple(value.mcp_endpoints))


@dataclass(frozen=True)
class ResetResult:
    """A started episode: what Reset returned, typed.

    Args:
        session_id: the session (stable across its episodes).
        episode: the episode's number in the session, from 1.
        task_key: the task; empty for an env-only session.
        env_key: the environment, "env_id" or "env_id:version".
        prompt: the task's instruction; empty for an env-only session.
        messages: the task's opening conversation (the prompt as a user message when Reset sent none).
        tools: the tools the agent sees, as ListTools serves them.
        max_turns: the episode's effective turn limit.
        modality: "tool_use", "computer_use" or "browser_use".
        gateway_address: the toolgateway serving the session ("host:port").
        agent_token: the episode's bearer token for the gateway (left out of the repr).
        instance: the instance behind the session.
        raw: the ResetResponse itself (left out of the repr: it holds the token).
    """

    session_id: str
    episode: int
    task_key: str
    env_key: str
    prompt: str
    messages: tuple[Message, ...]
    tools: tuple[common_pb2.ToolSpec, ...]
    max_turns: int
    modality: str
    gateway_address: str
    agent_token: str = field(repr=False)
    instance: Instance
    raw: orchestrator_pb2.ResetResponse = field(repr=False)

    @classmethod
    def from_proto(cls, response: orchestrator_pb2.ResetResponse, *, env_key: str = "") -> ResetResult:
        """The typed view of a ResetResponse.

        Args:
            response: the protobuf message.
            env_key: the environment asked for, used when the response names none (an env-only session
                whose instance carries no key).
        """
        task = response.task
        messages = tuple(chat_message(m) for m in response.messages)
        if not messages and response.prompt:
            messages = (Message("user", response.prompt),)
        if task.env_id:
            env_key = f"{task.env_id}:{task.version}" if task.version else task.env_id
        else:
            env_key = response.instance.env_key or env_key
        return cls(
            session_id=response.session_id,
            episode=response.episode,
            task_key=task.key,
            env_key=env_key,
            prompt=response.prompt,
            messages=messages,
            tools=tuple(response.tools),
            max_turns=response.max_turns,
            modality=response.modality,
            gateway_address=response.gateway_address,
            agent_token=response.agent_token,
            instance=Instance.from_proto(response.instance),
            raw=response,
        )


@dataclass(frozen=True)
class StepResult:
    """The orchestrator's verdict on a turn, typed.

    Args:
        turn: turns counted in the episode, this one included.
        terminated: the agent ended the episode (a final answer, which the verifier scored, or a done signal).
        truncated: the orchestrator ended it at the turn limit.
        done_reason: "FINAL_ANSWER", "AGENT_DONE", "MAX_TURNS", or "UNSPECIFIED" while the episode runs.
        reward: the verifier's score; None while the episode runs and whenever the verifier gave none
            (ERROR, TIMEOUT, SKIPPED): a missing score is not a 0.
        verification: how the verifier went.
        status: the session's status after the turn ("ACTIVE", "DONE", ...).
        raw: the StepResponse itself.
        infra_faults: the infrastructure faults the episode met so far (not the model's mistakes).
    """

    turn: int
    terminated: bool
    truncated: bool
    done_reason: DoneReason
    reward: float | None
    verification: Verification
    status: str
    raw: orchestrator_pb2.StepResponse = field(repr=False)
    infra_faults: InfraFaults = field(default_factory=InfraFaults)

    @property
    def done(self) -> bool:
        """The episode ended with this turn: `terminated or truncated`."""
        return self.terminated or self.truncated

    @classmethod
    def from_proto(cls, response: orchestrator_pb2.StepResponse) -> StepResult:
        """The typed view of a StepResponse.

        Args:
            response: the protobuf message.
        """
        truncated = response.done and (
            response.truncated or response.done_reason == orchestrator_pb2.DONE_REASON_MAX_TURNS
        )
        return cls(
            turn=response.turn,
            terminated=response.done and not truncated,
            truncated=truncated,
            done_reason=done_reason_name(response.done_reason),
            reward=response.reward if response.HasField("reward") else None,
            verification=Verification.from_proto(response.verification),
            status=common_pb2.SessionStatus.Name(response.status).removeprefix("SESSION_STATUS_"),
            raw=response,
            infra_faults=InfraFaults.from_proto(response.infra_faults),
        )
