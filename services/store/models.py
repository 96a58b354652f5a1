"""Records kept in the session store. Plain dataclasses, serialised as JSON by every backend."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, ClassVar, Self, TypeVar

from rlgate.core.faults import INFRA_FAULT_KINDS
from rlgate.runtime import jsoncodec


class StoreError(Exception):
    """The store could not complete an operation (backend down, corrupt record)."""


class StoreCorrupt(StoreError):
    """The store's data is damaged (SQLite: the file fails its integrity check or reads as malformed). Not
    retryable: a service refuses to start on it, and an operator recovers it (docs/operations.md)."""


class StoreFull(StoreError):
    """The store cannot take writes for lack of room (disk full, a page or memory limit reached). Writes
    fail until room is made; reads may still work."""


class ConflictError(StoreError):
    """A compare-and-set lost: the record changed since it was read (or already exists)."""


class RequestExists(ConflictError):
    """`commit(..., new_request=True)` found a record for the request_id already (PENDING or DONE):
    nothing was written. `record` is the existing record (a DONE one carries the result to replay)."""

    def __init__(self, record: RequestRecord) -> None:
        super().__init__(f"request {record.request_id!r} in scope {record.scope!r} already exists ({record.state})")
        self.record = record

    def __reduce__(self) -> tuple[type[RequestExists], tuple[RequestRecord]]:
        return type(self), (self.record,)  # picklable although __init__ takes the record, not a message


class SessionStatus(StrEnum):
    PROVISIONING = "provisioning"
    ACTIVE = "active"
    DONE = "done"  # episode ended; Reset(session_id) starts the next one
    CLOSED = "closed"
    EXPIRED = "expired"
    FAILED = "failed"


OPEN_STATUSES = frozenset({SessionStatus.PROVISIONING, SessionStatus.ACTIVE, SessionStatus.DONE})


class DoneReason(StrEnum):
    NONE = ""  # the episode has not ended
    FINAL_ANSWER = "final_answer"
    AGENT_DONE = "agent_done"
    MAX_TURNS = "max_turns"


class VerificationStatus(StrEnum):
    OK = "ok"  # the verifier returned a score: the session's reward
    ERROR = "error"  # it raised, or its execution failed after retries: no reward (never 0)
    TIMEOUT = "timeout"
    SKIPPED = "skipped"  # the task has no verifier


class RequestState(StrEnum):
    PENDING = "pending"
    DONE = "done"


class IntentState(StrEnum):
    CREATING = "creating"  # create call sent (or about to be); instance id may be unknown
    POOLED = "pooled"  # instance exists, idle in a warm pool
    BOUND = "bound"  # instance belongs to a session
    DELETING = "deleting"  # delete requested; removed from the store once the provider confirms


class _Json:
    """JSON round-trip for the dataclasses below (enums as values, unknown keys ignored).

    On the hot path (every Step and CallTool encodes a record), so no `dataclasses.asdict` (it deep-copies
    every field) and no per-call reflection: fields hold JSON-native values already, so a shallow
    {name: value} dict is what the encoder (`runtime.jsoncodec`) needs, and the field names are computed
    once per class.
    """

    _field_names: tuple[str, ...] = ()
    _field_set: frozenset[str] = frozenset()
    # Fields whose JSON value is not the field's value: name -> its reader (raising ValueError or TypeError
    # for a value this version cannot read: the backends report a corrupt record) and name -> its writer
    # (enums need none: the encoder writes their values).
    _readers: ClassVar[dict[str, Callable[[Any], Any]]] = {}
    _writers: ClassVar[dict[str, Callable[[Any], Any]]] = {}

    @classmethod
    def _init_fields(cls) -> None:
        """Cache the dataclass's field names (called once per class, after @dataclass ran)."""
        fields = dataclasses.fields(cls)  # type: ignore[arg-type]
        # from_json and copy() skip __init__: only sound while __init__ just assigns the fields.
        assert not hasattr(cls, "__post_init__") and all(f.init for f in fields), cls
        cls._field_names = tuple(f.name for f in fields)
        cls._field_set = frozenset(cls._field_names)

    def to_dict(self) -> dict[str, Any]:
        """The stored form: the fields as a new dict; values are shared, not copied (copy before mutating
        them). Enums stay members (the encoder writes their values)."""
        values = self.__dict__
        data = {name: values[name] for name in self._field_names}
        for name, write in self._writers.items():
            data[name] = write(data[name])
        return data

    def to_json(self) -> str:
        return jsoncodec.dumps(self.to_dict())

    @classmethod
    def from_json(cls, raw: str | bytes) -> Self:
        data = jsoncodec.loads(raw)
        if not isinstance(data, dict):
            raise TypeError(f"expected a JSON object, got {type(data).__name__}")
        if data.keys() == cls._field_set:  # the usual case: exactly our fields, so skip __init__
            record = object.__new__(cls)
            record.__dict__ = data
        else:
            # Written by another version: drop the keys this one lacks; __init__ fills defaults (or raises
            # TypeError when a required field is missing).
            record = cls(**{k: v for k, v in data.items() if k in cls._field_set})
        values = record.__dict__
        for name, read in cls._readers.items():
            values[name] = read(values[name])
        return record

    def copy(self, **changes: Any) -> Self:
        """A shallow copy with `changes` applied, like `dataclasses.replace` without re-running __init__
        (no field is init=False, and no __post_init__ exists to re-run). Containers are shared."""
        clone = object.__new__(type(self))
        clone.__dict__.update(self.__dict__)
        for name, value in changes.items():
            if name not in self._field_set:
                raise TypeError(f"{type(self).__name__} has no field {name!r}")
            clone.__dict__[name] = value
        return clone


E = TypeVar("E", bound=StrEnum)


def _member_of(enum: type[E]) -> Callable[[Any], E]:
    """Stored value -> enum member (a dict lookup: a tenth of calling the enum), ValueError for an unknown one.
    A member maps to itself, so defaults filled in by __init__ pass through."""
    members: dict[Any, E] = {member.value: member for member in enum}

    def member(value: Any) -> E:
        try:
            return members[value]
        except (KeyError, TypeError):
            raise ValueError(f"{value!r} is not a {enum.__name__}") from None

    return member


@dataclass(frozen=True)
class Verification:
    """The outcome of scoring an ended episode (the reward itself is `Session.reward`, set only when OK)."""

    status: VerificationStatus
    message: str = ""
    stdout: str = ""  # the verifier's output, its tail when long
    attempts: int = 0
    elapsed_ms: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    @classmethod
    def from_dict(cls, data: Any) -> Self:
        if not isinstance(data, dict):
            raise TypeError(f"expected a verification object, got {type(data).__name__}")
        known = {k: v for k, v in data.items() if k in _VERIFICATION_FIELDS}
        return cls(**{**known, "status": _verification_status(known.get("status"))})


_VERIFICATION_FIELDS = frozenset(f.name for f in dataclasses.fields(Verification))
_verification_status = _member_of(VerificationStatus)


def _stored_verification(verification: Verification | None) -> dict[str, Any]:
    return {} if verification is None else verification.to_dict()  # {}: not scored (the form every version reads)


def _loaded_verification(stored: Any) -> Verification | None:
    return None if not stored else Verification.from_dict(stored)


@dataclass
class Session(_Json):
    """One session: an instance, its current episode and who may reach it."""

    session_id: str
    env_key: str  # "env_id:version"
    task_key: str = ""  # "" for an env-only session
    status: SessionStatus = SessionStatus.PROVISIONING
    run_id: str = ""  # the caller's run (CloseSessions)
    orchestrator_run: str = ""  # the orchestrator run that owns the instance (reconciliation)
    modality: str = "tool_use"
    episode: int = 1
    turn: int = 0
    max_turns: int = 0
    done_reason: DoneReason = DoneReason.NONE
    reward: float | None = None
    verification: Verification | None = None  # None until the ended episode is scored
    labels: dict[str, str] = field(default_factory=dict)
    provider: str = "fleet"
    instance_id: str = ""
    intent_id: str = ""
    instance: dict[str, Any] = field(default_factory=dict)  # provider handle: root_url, manager_url, ...
    endpoints: list[str] = field(default_factory=list)  # MCP endpoint URLs in precedence order
    tool_filter: dict[str, Any] = field(default_factory=dict)  # modality, allow, deny
    token_hash: str = ""  # sha256 of the current episode's agent token; "" once revoked
    # Recently revoked token hashes -> the episode each belonged to (oldest first, bounded): lets the gateway
    # tell a finished episode's token from one never issued (rlgate.runtime.auth.revoke_agent_token).
    revoked_tokens: dict[str, int] = field(default_factory=dict)
    call_budget: int = 0  # tool calls allowed per episode; 0 = unlimited
    created_at: float = field(default_factory=time.time)
    updated_at: float = field(default_factory=time.time)
    last_active_at: float = field(default_factory=time.time)
    expires_at: float = 0.0  # absolute TTL deadline; 0 = none
    closed_at: float = 0.0
    parent_session_id: str = ""  # the session this one was forked from ("" when not a branch)
    branch_index: int = 0  # its index among that Fork's branches (0-based; with parent_session_id)
    # The infrastructure faults the current episode met: InfraFaults' field name -> count (absent = 0).
    # Emptied when an episode starts; changed only through `add_infra_fault`.
    infra_faults: dict[str, int] = field(default_factory=dict)
    version: int = 0  # bumped by every update_session (compare-and-set)

    @property
    def is_open(self) -> bool:
        return self.status in OPEN_STATUSES


def add_infra_fault(session: Session, kind: str, count: int = 1) -> None:
    """Count `count` faults of `kind` (one of INFRA_FAULT_KINDS) into the session's current episode. A new
    dict, never an edit in place: `Session.copy` shares containers, and a copy taken before must stay as read."""
    if kind not in INFRA_FAULT_KINDS:
        raise ValueError(f"unknown infrastructure fault kind {kind!r}")
    if count > 0:
        session.infra_faults = {**session.infra_faults, kind: session.infra_faults.get(kind, 0) + count}


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
    # The infrastructure fault this call met, as an InfraFaults field name ("outcome_unknown", "tool_reruns");
    # "" for none. Counted into the session's `infra_faults` by the same write that logs the entry.
    infra_fault: str = ""


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


@dataclass(frozen=True)
class Writes:
    """What a `SessionStore.commit` writes besides the session (see `commit` for each field's meaning),
    as `SessionStore.change_session`'s `change` returns it."""

    request: tuple[str, str, str] | None = None  # (scope, request_id, result)
    tool_call: ToolCallEntry | None = None
    new_request: bool = False
    held_by: str = ""

    def __post_init__(self) -> None:
        if (self.new_request or self.held_by) and self.request is None:
            raise ValueError("new_request=True or held_by=... needs a request")
        if self.new_request and self.held_by:
            raise ValueError("new_request=True creates the record: no owner holds it")


CALL_SCOPE_PREFIX = "call:"


def call_scope(session_id: str) -> str:
    """The scope of the gateway's CallTool request records for one session."""
    return CALL_SCOPE_PREFIX + session_id


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


for _record in (Session, ToolCallEntry, RequestRecord, Intent):
    _record._init_fields()
Session._readers = {
    "status": _member_of(SessionStatus),
    "done_reason": _member_of(DoneReason),
    "verification": _loaded_verification,
}
Session._writers = {"verification": _stored_verification}
