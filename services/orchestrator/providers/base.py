"""The provider interface: what the orchestrator needs from an instance platform, and its error vocabulary.

A provider creates, resets, health-checks, heartbeats, lists and deletes instances, loads tasks and runs
task verifiers. Every method takes an explicit timeout; providers raise only `ProviderError` subclasses so
the orchestrator can map them onto gRPC statuses without knowing the platform.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

INTENT_ENV_VAR = "RLGATE_INTENT_ID"  # rides in every instance's env_variables (crash recovery)
SCREEN_MODALITIES = frozenset({"computer_use", "browser_use"})  # tasks whose instance must have a screen


class ProviderError(Exception):
    """A provider call failed."""

    retryable = False


class Retryable(ProviderError):
    """Transient: timeouts, connection errors, 5xx, retryable placement failures, burst caps."""

    retryable = True


class RateLimited(Retryable):
    """The platform asked us to slow down (429: its rate limit or its cap on creates in flight), for
    `retry_after_s` seconds when it said (Retry-After)."""

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class StaleRequest(Retryable):
    """A create's idempotency key points at an instance that failed (Fleet's 409 duplicate_request_id on an
    instance in error or gone): retry as a new request, under a new key."""


class InstanceLimit(ProviderError):
    """The account's instance limit is reached; capacity frees when instances are deleted."""

    def __init__(self, message: str, running: int | None = None, limit: int | None = None) -> None:
        super().__init__(message)
        self.running = running
        self.limit = limit


class EnvNotFound(ProviderError):
    """Unknown environment or version."""


class InstanceGone(ProviderError):
    """The instance no longer exists (deleted, expired by TTL or heartbeat)."""


class ResetFailed(ProviderError):
    """The instance manager's reset failed or did not answer in time."""


class Unsupported(ProviderError):
    """The platform cannot create this kind of instance as it is set up (e.g. screens without a browser);
    retrying does not help until someone changes it."""


class SnapshotUnsupported(ProviderError):
    """The instance offers no snapshot (the message says why)."""


@dataclass
class InstanceHandle:
    """One instance as the orchestrator keeps it (serialised into `Session.instance`)."""

    instance_id: str
    env_key: str
    root_url: str = ""
    manager_url: str = ""
    endpoints: list[str] = field(default_factory=list)  # MCP URLs in precedence order
    status: str = "running"
    run_id: str = ""
    env_variables: dict[str, Any] = field(default_factory=dict)
    raw: dict[str, Any] = field(default_factory=dict)  # the provider's own record (rebuilds SDK objects)

    @property
    def intent_id(self) -> str:
        return str(self.env_variables.get(INTENT_ENV_VAR, ""))

    def to_record(self) -> dict[str, Any]:
        return {
            "instance_id": self.instance_id,
            "env_key": self.env_key,
            "root_url": self.root_url,
            "manager_url": self.manager_url,
            "endpoints": list(self.endpoints),
            "status": self.status,
            "run_id": self.run_id,
            "env_variables": dict(self.env_variables),
            "raw": self.raw,
        }

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> InstanceHandle:
        names = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in record.items() if k in names})


@dataclass
class TaskDef:
    """A task the orchestrator can run, normalised from Fleet's task JSON."""

    key: str
    env_id: str
    version: str
    prompt: str
    modality: str = "tool_use"
    max_turns: int = 0  # 0: the orchestrator's default
    metadata: dict[str, Any] = field(default_factory=dict)
    env_variables: dict[str, Any] = field(default_factory=dict)
    verifier_code: str = ""
    mcp_endpoints: list[str] = field(default_factory=list)  # mcp provider: the task's own endpoints
    expected_answer: Any = None  # an answer key the final answer is compared with (mcp provider)
    tool_filter: dict[str, list[str]] = field(default_factory=dict)  # the task's allow / deny tool patterns
    sdk_task: Any = None  # fleet.Task when loaded through the SDK

    @property
    def env_key(self) -> str:
        return f"{self.env_id}:{self.version}" if self.version else self.env_id


@dataclass
class VerifierRun:
    """What one verifier execution returned. `score` is None when none came back."""

    success: bool
    score: float | None = None
    message: str = ""
    stdout: str = ""


def score_of(result: Any) -> float | None:
    """A verifier's return value as a score, or None when it is not one (never a silent 0)."""
    if isinstance(result, bool):
        return 1.0 if result else 0.0
    if isinstance(result, int | float):
        return float(result)
    if isinstance(result, dict) and "score" in result:
        return score_of(result["score"])
    if isinstance(result, str):
        try:
            return float(result)
        except ValueError:
            return None
    return None


class Provider(abc.ABC):
    """An instance platform."""

    name: str = ""
    manages_instances: bool = True  # False: no create/delete (mcp)

    @abc.abstractmethod
    async def load_tasks(self, *, timeout_s: float) -> list[TaskDef]:
        """Tasks the platform serves (used when no task file is configured)."""

    @abc.abstractmethod
    async def create(
        self,
        env_key: str,
        *,
        env_variables: dict[str, Any],
        run_id: str,
        ttl_s: int,
        heartbeat_interval_s: int,
        timeout_s: float,
        modality: str = "tool_use",
    ) -> InstanceHandle:
        """Create an instance and return it running, of the kind `modality` needs (a screen for
        `SCREEN_MODALITIES`). `ttl_s` 0: the provider's default for the modality. Never retried here: the
        caller owns retry policy."""

    @abc.abstractmethod
    async def reset(self, handle: InstanceHandle, *, timeout_s: float) -> None:
        """Restore seed state. `ResetFailed` on failure or timeout."""

    @abc.abstractmethod
    async def health(self, handle: InstanceHandle, *, timeout_s: float) -> bool:
        """Whether the instance answers (warm-pool hand-out check)."""

    @abc.abstractmethod
    async def delete(self, instance_id: str, *, timeout_s: float) -> None:
        """Delete; an instance that is already gone counts as deleted."""

    @abc.abstractmethod
    async def heartbeat(self, instance_id: str, *, timeout_s: float) -> None:
        """Keep the instance alive. `InstanceGone` when it no longer exists."""

    @abc.abstractmethod
    async def list_instances(self, run_id: str, *, timeout_s: float) -> list[InstanceHandle]:
        """Live instances tagged with `run_id` (reconciliation)."""

    @abc.abstractmethod
    async def verify(
        self,
        task: TaskDef,
        handle: InstanceHandle,
        final_answer: str | None,
        *,
        timeout_s: float,
        tool_calls: Sequence[Any] | None = None,
    ) -> VerifierRun:
        """Run the task's verifier once. Raises `Retryable` for infrastructure failures. `tool_calls`: the
        episode's tool-call log (`store.ToolCallEntry`s), given when `wants_tool_calls(task)`."""

    async def parse_task(self, obj: dict[str, Any]) -> TaskDef:
        """One task of a task file, in Fleet's format (providers may attach their own objects)."""
        from rlgate.orchestrator.tasks import task_from_json

        return task_from_json(obj)

    async def parse_task_file(self, text: str) -> list[TaskDef]:
        """Every task of a task file (`tasks.parse_task_file`); `envs` is the mcp provider's."""
        from rlgate.orchestrator.tasks import parse_task_file

        return [await self.parse_task(entry) for entry in parse_task_file(text).entries]

    def session_filter(self, env_key: str, task: TaskDef | None) -> dict[str, Any]:
        """The tool filter a new session gets (`Session.tool_filter`, applied by Reset's list and the
        gateway): the modality, and the task's allow / deny patterns."""
        return {"modality": task.modality if task else "tool_use", **(task.tool_filter if task else {})}

    def wants_tool_calls(self, task: TaskDef) -> bool:
        """Whether `verify` reads the episode's tool-call log (the caller fetches it only then)."""
        return False

    def can_verify(self, task: TaskDef) -> bool:
        """Whether the task defines scoring this provider can run (else verification is SKIPPED)."""
        return bool(task.verifier_code)

    # -- forks (optional) --------------------------------------------------------------------------------
    def snapshot_unsupported(self, handle: InstanceHandle) -> str:
        """Why `snapshot` cannot serve this instance ("" when it can)."""
        return f"the {self.name or 'configured'} provider takes no snapshots"

    async def snapshot(self, handle: InstanceHandle, *, timeout_s: float) -> str:
        """A snapshot of the instance's live state, by id. `SnapshotUnsupported` when it offers none."""
        raise SnapshotUnsupported(self.snapshot_unsupported(handle))

    async def create_from_snapshot(
        self,
        env_key: str,
        snapshot_id: str,
        *,
        env_variables: dict[str, Any],
        run_id: str,
        ttl_s: int,
        heartbeat_interval_s: int,
        timeout_s: float,
        modality: str = "tool_use",
    ) -> InstanceHandle:
        """As `create`, the instance's live state being the snapshot's (its seed state the environment's)."""
        raise SnapshotUnsupported(f"the {self.name or 'configured'} provider creates no instances from snapshots")

    def endpoints_for(self, env_key: str, task: TaskDef | None) -> list[str]:
        """MCP endpoints of an instance-less session (mcp provider); empty otherwise."""
        return []

    async def close(self) -> None:  # noqa: B027 (optional hook)
        """Release clients."""
