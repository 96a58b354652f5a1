"""What the session store keeps, one protocol per concern: sessions, the tool-call log, the request ledger's
records, provisioning intents, admission control for instance creation, process owners, leases, and the store's
own upkeep. `SessionStore`
(rlgate.store.base) is all of them at once, and what `open_store` returns; code that needs one concern says so
by asking for its protocol.

Every method is async and safe to call from many tasks and processes. Concurrency model: sessions are updated
by compare-and-set on `Session.version` (`update_session` raises `ConflictError` when the stored version moved
on); request records are claimed atomically (`claim_request`); leases are exclusive with a TTL
(`acquire_lease`). Nothing relies on process memory, so any replica can serve any session.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

from rlgate.store.admission import CreateGrant, CreateLimits
from rlgate.store.models import Intent, RequestRecord, Session, ToolCallEntry, Writes


class SessionRecords(Protocol):
    """Sessions: created, read, compare-and-set, listed, deleted."""

    @abc.abstractmethod
    async def create_session(self, session: Session) -> Session:
        """Insert a new session; returns it with version 1. `ConflictError` if the id exists or its
        `token_hash` is the current token of another session."""

    @abc.abstractmethod
    async def get_session(self, session_id: str) -> Session | None:
        """The session, or None."""

    @abc.abstractmethod
    async def update_session(self, session: Session) -> Session:
        """Write `session` if the stored version equals `session.version`; returns it with version + 1 and
        `updated_at` set. Keeps the token index in step with `token_hash`. `ConflictError` otherwise: the
        version moved on, the session does not exist, or `token_hash` is another session's current token.
        `last_active_at` never moves backwards (the stored value wins if a touch was newer)."""

    @abc.abstractmethod
    async def session_by_token(self, token_hash: str) -> Session | None:
        """The session whose *current* agent token hashes to `token_hash` (revoked tokens match nothing)."""

    @abc.abstractmethod
    async def touch_session(self, session_id: str, now: float) -> None:
        """Record activity (last_active_at) without a version bump; for idle reaping. Never moves it
        backwards; a no-op for an unknown session."""

    @abc.abstractmethod
    async def list_sessions(
        self,
        *,
        statuses: frozenset[str] | None = None,
        labels: Mapping[str, str] | None = None,
        run_id: str = "",
        limit: int = 100,
        cursor: str = "",
    ) -> tuple[list[Session], str]:
        """Sessions newest first (created_at, then id), filtered; returns (page, next_cursor or "").
        `labels` must all match; `limit` is clamped to 1..1000 (0 or less means 100). ValueError for a
        cursor the store did not produce."""

    @abc.abstractmethod
    async def sessions_open(self, session_ids: Sequence[str]) -> set[str]:
        """Which of `session_ids` are open sessions holding a current agent token, in one call (the gateway's
        janitor looks at many sessions at once; a backend may split a long list into a few round trips).
        Unknown ids are not open."""

    @abc.abstractmethod
    async def count_open_sessions(self) -> int:
        """Sessions in an open status (provisioning, active, done): the max-sessions check, O(1)-ish."""

    @abc.abstractmethod
    async def delete_session(self, session_id: str) -> None:
        """Remove a session with its tool-call log and token index entry (retention)."""


class ToolCallLog(Protocol):
    """Each session's log of tool calls, oldest first, per episode."""

    @abc.abstractmethod
    async def append_tool_call(self, entry: ToolCallEntry) -> int:
        """Append to the session's log; returns the number of entries for that episode. Idempotent per
        (session, episode, request_id) when request_id is not "": a repeated append is not logged twice."""

    @abc.abstractmethod
    async def list_tool_calls(self, session_id: str, episode: int | None = None) -> list[ToolCallEntry]:
        """The session's whole log, oldest first (one episode, or all). Bounded by the episode's call budget
        only; a reader that answers a caller pages with `tool_calls`."""

    @abc.abstractmethod
    async def tool_calls(
        self, session_id: str, *, episode: int | None = None, after: int = 0, limit: int
    ) -> tuple[list[ToolCallEntry], int | None]:
        """One page of the session's log, oldest first (one episode, or all): up to `limit` entries (clamped
        to 1..1000; 0 or less means 100) after position `after` (0: from the start). Returns (entries, the
        position to pass as `after` for the next page, or None when this page is the last). Positions are
        opaque ints that only grow; an empty or unknown log is ([], None)."""

    @abc.abstractmethod
    async def count_tool_calls(self, session_id: str, episode: int) -> int:
        """Entries logged for one episode (call budgets)."""


class RequestRecords(Protocol):
    """The request ledger's records (rlgate.ledger): PENDING claims, DONE results, and `commit`, which records
    a result with the session and log writes of the same request in one atomic step."""

    @abc.abstractmethod
    async def claim_request(self, scope: str, request_id: str, owner: str) -> tuple[RequestRecord, bool]:
        """Atomically create a PENDING record owned by `owner`, or return the existing one.
        Returns (record, created). If the caller is cancelled while the claim runs, a record the claim
        still created is released by the store (else every retry would wait on this live owner)."""

    @abc.abstractmethod
    async def complete_request(self, scope: str, request_id: str, result: str) -> None:
        """Mark DONE with its recorded result (creating the record if it is missing: a result is never
        dropped)."""

    @abc.abstractmethod
    async def release_request(self, scope: str, request_id: str) -> None:
        """Delete a PENDING record whose work provably never started, so a retry may run it."""

    @abc.abstractmethod
    async def take_over_request(
        self, scope: str, request_id: str, dead_owner: str, owner: str
    ) -> tuple[RequestRecord | None, bool]:
        """Atomically hand the PENDING record of `dead_owner` (a process whose heartbeat lapsed) to `owner`
        as a fresh claim (created_at now): returns (record, True). Otherwise nothing is written: (the record
        as it is, or None, False) — another repeat took it over first, or it was completed or released. Of
        repeats racing to take one record over, exactly one gets True, and the record exists throughout (a
        release and a new claim would leave a gap in which a retry claims it and runs the work again). If the
        caller is cancelled while it runs, a record it took is handed back to `dead_owner` (as `claim_request`
        releases an abandoned claim: it would stay PENDING under a live owner doing nothing with it)."""

    @abc.abstractmethod
    async def get_request(self, scope: str, request_id: str) -> RequestRecord | None:
        """The record, or None."""

    @abc.abstractmethod
    async def pending_requests(self, scope: str, limit: int) -> list[RequestRecord]:
        """Up to `limit` PENDING records of `scope`, in no particular order: the requests of one caller whose
        outcome is not recorded yet (in flight, or their owner died mid-request). Fork reads a session's
        (`call_scope`) to see that none of its tool calls is in flight."""

    @abc.abstractmethod
    async def commit(
        self,
        *,
        session: Session | None = None,
        request: tuple[str, str, str] | None = None,
        tool_call: ToolCallEntry | None = None,
        new_request: bool = False,
        held_by: str = "",
        new_session: bool = False,
    ) -> Session | None:
        """Several writes of one RPC in one round trip and one atomic step (one transaction / one script):

        - `session`: `update_session(session)`, with the same compare-and-set and the same `ConflictError`;
          with `new_session=True`, `create_session(session)` instead (stored with version 1), with its
          `ConflictError`: a new session registered together with its request's record;
        - `request` = (scope, request_id, result): `complete_request(scope, request_id, result)`; with
          `new_request=True` the record must not exist yet and is created DONE with `result` (owner "",
          created_at = finished_at = now): a request run without a prior `claim_request`. If any record
          (PENDING or DONE) exists for (scope, request_id), `RequestExists` carrying it is raised and
          nothing at all is written. That check comes before the session's compare-and-set.
          `new_request=True` without `request` is a ValueError. With `held_by` (an owner; not with
          `new_request`): the record is completed only while it is missing or PENDING under `held_by` (the
          attempt's own claim), or DONE with this very `result` already (this commit, retried); otherwise
          `RequestExists` carrying it is raised and nothing is written (another attempt took the record
          over, its answer stands);
        - `tool_call`: `append_tool_call(tool_call)`, plus `touch_session(tool_call.session_id,
          tool_call.finished_at)`: a logged call is activity on its session.

        All or nothing: when the session's compare-and-set loses (or its id exists), nothing is written (so a
        Step that loses the race records no result for its request_id and can retry). Returns the session as
        written, as `update_session` or `create_session` does, or None without `session`."""

    @abc.abstractmethod
    async def change_session(
        self, session_id: str, change: Callable[[Session], Writes | None]
    ) -> tuple[Session | None, bool]:
        """Read a session, let `change` edit it, and `commit` it with the `Writes` that `change` returns, as
        one step: (the session written, True); (the session as read and changed, False) when `change`
        returned None (nothing written); (None, False) when there is no such session. An exception from
        `change` writes nothing and propagates; so do `RequestExists` and store errors from the commit.

        Backends that can run `change` where the data is (SQLite: inside one transaction on the store's
        thread) make it one round trip; `change` must therefore be quick, and touch nothing but the session
        it is given and what it returns."""

    @abc.abstractmethod
    async def authorize_call(
        self, token_hash: str, request_id: str, owner: str
    ) -> tuple[Session | None, RequestRecord | None, bool]:
        """A CallTool's authentication and idempotency claim in one round trip and one atomic step:
        `session_by_token(token_hash)` and, when that session exists, holds a token, is ACTIVE and
        `request_id` is not "", `claim_request(call_scope(session.session_id), request_id, owner)`.

        Returns (session, record, created): (None, None, False) for an unknown or revoked token;
        (session, None, False) when nothing was claimed (no request_id, or the session is not ACTIVE);
        otherwise the claim's (record, created) exactly as `claim_request` returns them. A claim made after
        the caller was cancelled is released, as for `claim_request`."""


class IntentRecords(Protocol):
    """Provisioning intents: what the orchestrator is creating, pooling or deleting at the provider."""

    @abc.abstractmethod
    async def put_intent(self, intent: Intent) -> None:
        """Insert or overwrite an intent (updated_at set by the caller)."""

    @abc.abstractmethod
    async def get_intent(self, intent_id: str) -> Intent | None:
        """The intent, or None."""

    @abc.abstractmethod
    async def list_intents(self, run_id: str = "") -> list[Intent]:
        """All intents (of one orchestrator run), oldest first."""

    @abc.abstractmethod
    async def delete_intent(self, intent_id: str) -> None:
        """Remove an intent (its instance is gone)."""


class CreateAdmission(Protocol):
    """Admission control for instance creation, one record per provider account shared by every process on the
    store: creates in flight, a creation rate that a provider's throttling cuts (AIMD), turns between runs, and
    urgent requests before background ones (rlgate.store.admission says how). The store's clock decides
    (Redis: the server's), so replicas agree on it."""

    @abc.abstractmethod
    async def admit_create(
        self, account: str, slot_id: str, run: str, priority: str, limits: CreateLimits
    ) -> CreateGrant:
        """Take a slot (`slot_id`, until `release_create` or `limits.slot_ttl_s`) and a token for a create of
        `run` at `priority` ("urgent" or "background"), or say how long to wait before asking again."""

    @abc.abstractmethod
    async def release_create(self, account: str, slot_id: str) -> None:
        """The create of `slot_id` finished: free its slot (a no-op for one that lapsed)."""

    @abc.abstractmethod
    async def throttle_creates(self, account: str, retry_after_s: float, limits: CreateLimits) -> float:
        """The provider refused a create for its rate or burst cap: no admission for `retry_after_s`, and the
        rate is cut (once per `limits.cut_window_s`). Returns the account's rate now."""


class Owners(Protocol):
    """Process heartbeats: whether the owner of a PENDING request record is still alive."""

    @abc.abstractmethod
    async def heartbeat_owner(self, owner: str, ttl_s: float) -> None:
        """Declare process `owner` alive for `ttl_s` seconds (called periodically by its owner)."""

    @abc.abstractmethod
    async def owner_alive(self, owner: str) -> bool:
        """Whether `owner` heartbeated within its TTL. A SIGKILLed process stops being alive after its TTL."""


class Leases(Protocol):
    """Named exclusive leases with a TTL (one reconciler, one reaper at a time)."""

    @abc.abstractmethod
    async def acquire_lease(self, name: str, holder: str, ttl_s: float) -> bool:
        """Take or renew the named lease. True if `holder` now holds it; only one holder at a time."""

    @abc.abstractmethod
    async def release_lease(self, name: str, holder: str) -> None:
        """Give the lease up if `holder` holds it."""


class Upkeep(Protocol):
    """The store as a whole: retention, consistency, reachability, shutdown."""

    @abc.abstractmethod
    async def prune(self, closed_before: float, requests_before: float) -> int:
        """Retention: delete closed/expired/failed sessions closed before `closed_before` (closed_at, or
        updated_at when closed_at is 0; with their logs) and DONE request records finished before
        `requests_before`; expired heartbeats and leases go too. Returns the number of sessions plus request
        records removed."""

    @abc.abstractmethod
    async def check_invariants(self) -> list[str]:
        """Consistency problems (token index pointing at the wrong session, ACTIVE sessions without a
        token hash, closed/expired/failed sessions whose token is not revoked, secondary indexes out of
        step with the records, ...); empty when healthy. Used by the reliability suite."""

    @abc.abstractmethod
    async def ping(self) -> None:
        """Raise StoreError if the backend is unreachable."""

    @abc.abstractmethod
    async def health(self) -> None:
        """A cheap read + write probe of the backend, for a health check (e.g. grpc.health NOT_SERVING):
        returns when the store can serve reads and take writes, else raises `StoreCorrupt` (damaged data;
        stays so until an operator recovers the store), `StoreFull` (no room for a write) or `StoreError`
        (unreachable, closed, locked too long, ...). Leaves no record behind. Costs about one small write."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Release connections."""


__all__ = [
    "CreateAdmission",
    "IntentRecords",
    "Leases",
    "Owners",
    "RequestRecords",
    "SessionRecords",
    "ToolCallLog",
    "Upkeep",
]
