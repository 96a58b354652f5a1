"""Records kept in the session store. Plain dataclasses, serialised as JSON by every backend."""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Self


class StoreError(Exception):
    """The store could not complete an operation (backend down, corrupt record)."""


class ConflictError(StoreError):
    """A compare-and-set lost: the record changed since it was read (or already exists)."""


class SessionStatus(StrEnum):
    PROVISIONING = "provisioning"
    ACTIVE = "active"
    DONE = "done"  # episode ended; Reset(session_id) starts the next one
    CLOSED = "closed"
    EXPIRED = "expired"
    FAILED = "failed"


OPEN_STATUSES = frozenset({SessionStatus.PROVISIONING, SessionStatus.ACTIVE, SessionStatus.DONE})


class RequestState(StrEnum):
    PENDING = "pending"
    DONE = "done"


class IntentState(StrEnum):
    CREATING = "creating"  # create call sent (or about to be); instance id may be unknown
    POOLED = "pooled"  # instance exists, idle in a warm pool
    BOUND = "bound"  # instance belongs to a session
    DELETING = "deleting"  # delete requested; removed from the store once the provider confirms


class _Json:
    """JSON round-trip for the dataclasses below (enums as values, unknown keys ignored)."""

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), separators=(",", ":"))  # type: ignore[call-overload]

    @classmethod
    def from_json(cls, raw: str | bytes) -> Self:
        data = json.loads(raw)
        names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        return cls(**{k: v for k, v in data.items() if k in names})


@dataclass
class Session(_Json):
    """One session: an instance, its current episode and who may reach it."""

    session_id: str
    env_key: str  # "env_id:version"
    task_key: str = ""  # "" for an env-only session
    status: str = SessionStatus.PROVISIONING
    run_id: str = ""  # the caller's run (CloseSessions)
    orchestrator_run: str = ""  # the orchestrator run that owns the instance (reconciliation)
    modality: str = "tool_use"
    episode: int = 1
    turn: int = 0
    max_turns: int = 0
    done_reason: str = ""  # "", "final_answer", "agent_done", "max_turns"
    reward: float | None = None
    # status, message, stdout, attempts, elapsed_ms
    verification: dict[str, Any] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)
    provider: str = "fleet"
    instance_id: str = ""
    intent_id: str = ""
    instance: dict[str, Any] = field(default_factory=dict)  # provider handle: root_url, manager_url, ...
    endpoints: list[str] = field(default_factory=list)  # MCP endpoint URLs in precedence order
    tool_filter: dict[str, Any] = field(default_factory=dict)  # modality, allow, deny
    token_hash: str = ""  # sha256 of the current episode's agent token; "" once revoked
    call_budget: int = 0  # tool calls allowed per episode; 0 = unlimited
    created_at: float = field(default_factory=time.time)
    updated_at: float = field(default_factory=time.time)
    last_active_at: float = field(default_factory=time.time)
    expires_at: float = 0.0  # absolute TTL deadline; 0 = none
    closed_at: float = 0.0
    version: int = 0  # bumped by every update_session (compare-and-set)

    @property
    def is_open(self) -> bool:
        return self.status in OPEN_STATUSES


@dataclass
class ToolCallEntry(_Json):
    """One tool call made through the gateway (the session's authoritative tool-call log)."""

    session_id: str
    episode: int
    request_id: str
    tool: str
    arguments: dict[str, Any] = field(default_factory=dict)
    is_error: bool = False
    error_kind: str = ""  # ToolErrorKind name without prefix, e.g. "UNKNOWN_TOOL"; "" for none
    result_summary: str = ""
    endpoint: str = ""
    duration_ms: float = 0.0
    finished_at: float = field(default_factory=time.time)


@dataclass
class RequestRecord(_Json):
    """Idempotency record for a request_id within a scope ("reset", "step:<sid>", "call:<sid>")."""

    scope: str
    request_id: str
    state: str = RequestState.PENDING
    owner: str = ""  # the process that runs it (see SessionStore.heartbeat_owner)
    result: str = ""  # recorded response (base64 protobuf or JSON), set when DONE
    created_at: float = field(default_factory=time.time)
    finished_at: float = 0.0


@dataclass
class Intent(_Json):
    """Written before an instance is created, so a crash at any point leaves a trace to reconcile."""

    intent_id: str
    run_id: str  # the orchestrator run (also the instance's run_id at the provider)
    env_key: str
    state: str = IntentState.CREATING
    instance_id: str = ""
    session_id: str = ""
    created_at: float = field(default_factory=time.time)
    updated_at: float = field(default_factory=time.time)
