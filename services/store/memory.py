"""In-memory backend: the `SessionStore` contract with nothing behind it but dicts, for logic tests without a
file or a server (and as the executable spec: tests/store runs the whole store suite against it too).

Single process only. `memory://` opens a private store; `memory://NAME` opens a view of the data named NAME,
shared by every store object opened with that URL in this process (a second "replica" in tests), and kept
while any of them is referenced. Nothing survives the process.

Same semantics as the SQLite and Redis backends: records are kept as JSON text (a caller never shares an
object with the store, and what cannot be encoded fails as it would there), sessions are compare-and-set on
their version, request records are claimed atomically, and `commit` checks everything before it writes
anything. Concurrency: every call first yields to the event loop once (as a real backend's round trip does,
so racing tasks interleave between calls), then runs to completion without awaiting, under a lock (so it is
atomic for tasks and for threads). A caller cancelled before its call ran wrote nothing, so the store has no
abandoned claims to release.

Test hooks, for failures the real backends only produce under load or damage: `fail(method, error, times=,
after=)` makes calls of a method raise before they touch anything; `paused()` holds every call until it exits (a store
busy elsewhere); `data` is the shared state, for tests that damage it behind the store's back.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from rlgate.store import _common
from rlgate.store.base import SessionStore
from rlgate.store.models import (
    OPEN_STATUSES,
    ConflictError,
    Intent,
    RequestExists,
    RequestRecord,
    RequestState,
    Session,
    SessionStatus,
    StoreError,
    ToolCallEntry,
    Writes,
    call_scope,
)

T = TypeVar("T")

URL_PREFIX = "memory://"
_named: weakref.WeakValueDictionary[str, MemoryData] = weakref.WeakValueDictionary()
_named_lock = threading.Lock()


@dataclass
class _Logged:
    episode: int
    request_id: str
    data: str  # ToolCallEntry JSON


@dataclass(eq=False)
class MemoryData:
    """Everything one in-memory store holds; shared by the store objects opened on one name."""

    name: str = ""
    sessions: dict[str, str] = field(default_factory=dict)  # id -> Session JSON (version and activity included)
    tokens: dict[str, str] = field(default_factory=dict)  # current token hash -> session id
    tool_calls: dict[str, list[_Logged]] = field(default_factory=dict)  # session id -> log, oldest first
    requests: dict[tuple[str, str], RequestRecord] = field(default_factory=dict)
    owners: dict[str, float] = field(default_factory=dict)  # owner -> heartbeat expiry (time.time())
    intents: dict[str, str] = field(default_factory=dict)  # id -> Intent JSON
    leases: dict[str, tuple[str, float]] = field(default_factory=dict)  # name -> (holder, expiry)
    lock: threading.RLock = field(default_factory=threading.RLock)
    # `MemoryStore.paused()`: calls wait while this is set (one waiter event per pause).
    pause: asyncio.Event | None = None
    # `MemoryStore.fail()`: method -> [error, calls left (None: until healed), calls spared before the first]
    faults: dict[str, list[Any]] = field(default_factory=dict)


def _session(raw: str) -> Session:
    return _common.decode(Session, raw)


class MemoryStore(SessionStore):
    """The in-memory `SessionStore` (see the module docstring). `await MemoryStore.open(name)`, or
    `MemoryStore()` for a private one; `await close()` when done."""

    def __init__(self, data: MemoryData | None = None) -> None:
        self.data = data if data is not None else MemoryData()
        self._closed = False

    @classmethod
    async def open(cls, name: str = "") -> MemoryStore:
        """A view of the data named `name` in this process (created if new); "" for private data."""
        if not name:
            return cls()
        with _named_lock:
            data = _named.get(name)
            if data is None:
                data = _named[name] = MemoryData(name)
        return cls(data)

    def __repr__(self) -> str:
        return f"MemoryStore({URL_PREFIX}{self.data.name})"

    # -- test hooks -------------------------------------------------------------------------------------
    def fail(self, method: str, error: BaseException | None = None, *, times: int | None = 1, after: int = 0) -> None:
        """After `after` more calls of `method` (a `SessionStore` method name) succeed, the next `times` calls
        (None: every call until `heal`) raise `error` (default: StoreError) before touching anything. Shared
        with every view of the data."""
        if not callable(getattr(SessionStore, method, None)):
            raise ValueError(f"SessionStore has no method {method!r}")
        error = error or StoreError(f"memory store: injected failure of {method}")
        self.data.faults[method] = [error, times, after]

    def heal(self, method: str | None = None) -> None:
        """Stop failing `method` (every method when None)."""
        if method is None:
            self.data.faults.clear()
        else:
            self.data.faults.pop(method, None)

    @contextlib.asynccontextmanager
    async def paused(self) -> AsyncIterator[None]:
        """Every call on this data waits until the block exits (as behind another process's write lock)."""
        if self.data.pause is not None:
            raise RuntimeError("the memory store is paused already")
        self.data.pause = asyncio.Event()
        try:
            yield
        finally:
            pause, self.data.pause = self.data.pause, None
            pause.set()

    # -- plumbing ---------------------------------------------------------------------------------------
    async def _call(self, method: str, op: Callable[[], T]) -> T:
        """Run `op` as one atomic store call (see the module docstring)."""
        self._open()
        await asyncio.sleep(0)  # a real backend's round trip: other tasks run between calls
        while (pause := self.data.pause) is not None:
            await pause.wait()
        self._open()
        fault = self.data.faults.get(method)
        if fault is not None:
            error, left, spared = fault
            if spared > 0:
                fault[2] = spared - 1
            else:
                if left is not None:
                    if left <= 1:
                        self.data.faults.pop(method, None)
                    else:
                        fault[1] = left - 1
                raise error
        with self.data.lock:
            return op()

    def _open(self) -> None:
        if self._closed:
            raise StoreError("store is closed")

    # -- sessions ---------------------------------------------------------------------------------------
    def _token_taken(self, token_hash: str, session_id: str) -> bool:
        owner = self.data.tokens.get(token_hash) if token_hash else None
        return owner is not None and owner != session_id

    def _store_session(self, session: Session, previous_token: str) -> None:
        data = self.data
        data.sessions[session.session_id] = session.to_json()
        if previous_token != session.token_hash and data.tokens.get(previous_token) == session.session_id:
            del data.tokens[previous_token]
        if session.token_hash:
            data.tokens[session.token_hash] = session.session_id

    async def create_session(self, session: Session) -> Session:
        stored = session.copy(version=1)

        def create() -> None:
            if stored.session_id in self.data.sessions:
                raise ConflictError(f"session {stored.session_id} already exists")
            if self._token_taken(stored.token_hash, stored.session_id):
                raise ConflictError(f"agent token of session {stored.session_id} is already in use")
            self._store_session(stored, "")

        await self._call("create_session", create)
        return stored

    async def get_session(self, session_id: str) -> Session | None:
        def get() -> Session | None:
            raw = self.data.sessions.get(session_id)
            return _session(raw) if raw is not None else None

        return await self._call("get_session", get)

    def _check_update(self, stored: Session) -> Session:
        """The stored session `stored` (version already bumped) replaces; ConflictError if it may not."""
        sid = stored.session_id
        raw = self.data.sessions.get(sid)
        if raw is None:
            raise ConflictError(f"session {sid} does not exist")
        current = _session(raw)
        if current.version != stored.version - 1:
            raise ConflictError(f"session {sid} changed (version {current.version}, expected {stored.version - 1})")
        if stored.token_hash != current.token_hash and self._token_taken(stored.token_hash, sid):
            raise ConflictError(f"agent token of session {sid} is already in use")
        return current

    def _apply_update(self, stored: Session, current: Session) -> None:
        stored.last_active_at = max(current.last_active_at, stored.last_active_at)  # never backwards
        self._store_session(stored, current.token_hash)

    @staticmethod
    def _next_version(session: Session) -> Session:
        return session.copy(version=session.version + 1, updated_at=time.time())

    async def update_session(self, session: Session) -> Session:
        stored = self._next_version(session)

        def update() -> None:
            self._apply_update(stored, self._check_update(stored))

        await self._call("update_session", update)
        return stored

    def _by_token(self, token_hash: str) -> Session | None:
        sid = self.data.tokens.get(token_hash) if token_hash else None
        raw = self.data.sessions.get(sid) if sid is not None else None
        return _session(raw) if raw is not None else None

    async def session_by_token(self, token_hash: str) -> Session | None:
        return await self._call("session_by_token", lambda: self._by_token(token_hash))

    def _touch(self, session_id: str, now: float) -> None:
        raw = self.data.sessions.get(session_id)
        if raw is None:
            return
        session = _session(raw)
        if now > session.last_active_at:
            session.last_active_at = now
            self.data.sessions[session_id] = session.to_json()

    async def touch_session(self, session_id: str, now: float) -> None:
        await self._call("touch_session", lambda: self._touch(session_id, now))

    async def list_sessions(
        self,
        *,
        statuses: frozenset[str] | None = None,
        labels: Mapping[str, str] | None = None,
        run_id: str = "",
        limit: int = 100,
        cursor: str = "",
    ) -> tuple[list[Session], str]:
        limit = _common.page_limit(limit)
        position = _common.decode_cursor(cursor)

        def page() -> list[Session]:
            found = [
                s
                for s in map(_session, self.data.sessions.values())
                if _common.matches(s, statuses, labels, run_id) and _common.after_cursor(s, position)
            ]
            found.sort(key=lambda s: (s.created_at, s.session_id), reverse=True)
            return found[: limit + 1]

        sessions = await self._call("list_sessions", page)
        if len(sessions) > limit:
            sessions = sessions[:limit]
            return sessions, _common.encode_cursor(sessions[-1])
        return sessions, ""

    async def sessions_open(self, session_ids: Sequence[str]) -> set[str]:
        def which() -> set[str]:
            found = set()
            for sid in session_ids:
                raw = self.data.sessions.get(sid)
                if raw is not None and (s := _session(raw)).is_open and s.token_hash:
                    found.add(sid)
            return found

        return await self._call("sessions_open", which)

    async def count_open_sessions(self) -> int:
        def count() -> int:
            return sum(_session(raw).status in OPEN_STATUSES for raw in self.data.sessions.values())

        return await self._call("count_open_sessions", count)

    def _delete_session(self, session_id: str) -> int:
        data = self.data
        raw = data.sessions.pop(session_id, None)
        data.tool_calls.pop(session_id, None)
        if raw is None:
            return 0
        token = _current_token(raw)
        if token and data.tokens.get(token) == session_id:
            del data.tokens[token]
        return 1

    async def delete_session(self, session_id: str) -> None:
        await self._call("delete_session", lambda: self._delete_session(session_id))

    # -- tool-call log ----------------------------------------------------------------------------------
    def _append(self, entry: ToolCallEntry) -> None:
        log = self.data.tool_calls.setdefault(entry.session_id, [])
        if entry.request_id and any(e.episode == entry.episode and e.request_id == entry.request_id for e in log):
            return  # logged once per (session, episode, request_id): a retried append is not counted twice
        log.append(_Logged(entry.episode, entry.request_id, entry.to_json()))

    def _count_calls(self, session_id: str, episode: int) -> int:
        return sum(e.episode == episode for e in self.data.tool_calls.get(session_id, ()))

    async def append_tool_call(self, entry: ToolCallEntry) -> int:
        def append() -> int:
            self._append(entry)
            return self._count_calls(entry.session_id, entry.episode)

        return await self._call("append_tool_call", append)

    async def list_tool_calls(self, session_id: str, episode: int | None = None) -> list[ToolCallEntry]:
        def list_calls() -> list[ToolCallEntry]:
            return [
                _common.decode(ToolCallEntry, e.data)
                for e in self.data.tool_calls.get(session_id, ())
                if episode is None or e.episode == episode
            ]

        return await self._call("list_tool_calls", list_calls)

    async def count_tool_calls(self, session_id: str, episode: int) -> int:
        return await self._call("count_tool_calls", lambda: self._count_calls(session_id, episode))

    # -- composite --------------------------------------------------------------------------------------
    async def _commit_writes(self, session: Session | None, writes: Writes) -> Session | None:
        request, tool_call, new_request, held_by = writes.request, writes.tool_call, writes.new_request, writes.held_by
        stored = self._next_version(session) if session is not None else None
        now = time.time()

        def commit() -> None:
            # Every check before any write: all or nothing.
            if (new_request or held_by) and request is not None:
                existing = self.data.requests.get((request[0], request[1]))
                if existing is not None and (new_request or _common.held_elsewhere(existing, held_by, request[2])):
                    raise RequestExists(existing.copy())
            current = self._check_update(stored) if stored is not None else None
            if stored is not None and current is not None:
                self._apply_update(stored, current)
            if request is not None:
                self._complete(*request, now)
            if tool_call is not None:
                self._append(tool_call)
                self._touch(tool_call.session_id, tool_call.finished_at)

        await self._call("commit", commit)
        return stored

    # -- request records --------------------------------------------------------------------------------
    def _claim(self, scope: str, request_id: str, owner: str) -> tuple[RequestRecord, bool]:
        existing = self.data.requests.get((scope, request_id))
        if existing is not None:
            return existing.copy(), False
        record = RequestRecord(scope, request_id, RequestState.PENDING.value, owner, "", time.time(), 0.0)
        self.data.requests[(scope, request_id)] = record
        return record.copy(), True

    async def claim_request(self, scope: str, request_id: str, owner: str) -> tuple[RequestRecord, bool]:
        return await self._call("claim_request", lambda: self._claim(scope, request_id, owner))

    async def authorize_call(
        self, token_hash: str, request_id: str, owner: str
    ) -> tuple[Session | None, RequestRecord | None, bool]:
        def authorize() -> tuple[Session | None, RequestRecord | None, bool]:
            session = self._by_token(token_hash)
            if session is None or not request_id or session.status != SessionStatus.ACTIVE:
                return session, None, False
            record, created = self._claim(call_scope(session.session_id), request_id, owner)
            return session, record, created

        return await self._call("authorize_call", authorize)

    def _complete(self, scope: str, request_id: str, result: str, now: float) -> None:
        existing = self.data.requests.get((scope, request_id))
        if existing is None:  # a result is never dropped, even if the PENDING record was lost or pruned
            self.data.requests[(scope, request_id)] = RequestRecord(
                scope, request_id, RequestState.DONE.value, "", result, now, now
            )
        else:
            self.data.requests[(scope, request_id)] = existing.copy(
                state=RequestState.DONE.value, result=result, finished_at=now
            )

    async def complete_request(self, scope: str, request_id: str, result: str) -> None:
        now = time.time()
        await self._call("complete_request", lambda: self._complete(scope, request_id, result, now))

    async def release_request(self, scope: str, request_id: str) -> None:
        def release() -> None:
            record = self.data.requests.get((scope, request_id))
            if record is not None and record.state == RequestState.PENDING:
                del self.data.requests[(scope, request_id)]

        await self._call("release_request", release)

    async def take_over_request(
        self, scope: str, request_id: str, dead_owner: str, owner: str
    ) -> tuple[RequestRecord | None, bool]:
        def take() -> tuple[RequestRecord | None, bool]:
            record = self.data.requests.get((scope, request_id))
            if record is None or record.state != RequestState.PENDING or record.owner != dead_owner:
                return (record.copy() if record is not None else None), False
            taken = RequestRecord(scope, request_id, RequestState.PENDING.value, owner, "", time.time(), 0.0)
            self.data.requests[(scope, request_id)] = taken
            return taken.copy(), True

        return await self._call("take_over_request", take)

    async def get_request(self, scope: str, request_id: str) -> RequestRecord | None:
        def get() -> RequestRecord | None:
            record = self.data.requests.get((scope, request_id))
            return record.copy() if record is not None else None

        return await self._call("get_request", get)

    async def heartbeat_owner(self, owner: str, ttl_s: float) -> None:
        def beat() -> None:
            self.data.owners[owner] = time.time() + ttl_s

        await self._call("heartbeat_owner", beat)

    async def owner_alive(self, owner: str) -> bool:
        return await self._call("owner_alive", lambda: self.data.owners.get(owner, 0.0) > time.time())

    # -- intents ----------------------------------------------------------------------------------------
    async def put_intent(self, intent: Intent) -> None:
        raw = intent.to_json()

        def put() -> None:
            self.data.intents[intent.intent_id] = raw

        await self._call("put_intent", put)

    async def get_intent(self, intent_id: str) -> Intent | None:
        def get() -> Intent | None:
            raw = self.data.intents.get(intent_id)
            return _common.decode(Intent, raw) if raw is not None else None

        return await self._call("get_intent", get)

    async def list_intents(self, run_id: str = "") -> list[Intent]:
        def list_all() -> list[Intent]:
            found = [_common.decode(Intent, raw) for raw in self.data.intents.values()]
            return sorted(
                (i for i in found if not run_id or i.run_id == run_id), key=lambda i: (i.created_at, i.intent_id)
            )

        return await self._call("list_intents", list_all)

    async def delete_intent(self, intent_id: str) -> None:
        await self._call("delete_intent", lambda: self.data.intents.pop(intent_id, None))

    # -- leases -----------------------------------------------------------------------------------------
    async def acquire_lease(self, name: str, holder: str, ttl_s: float) -> bool:
        def acquire() -> bool:
            now = time.time()
            current = self.data.leases.get(name)
            if current is not None and current[0] != holder and current[1] > now:
                return False  # held by another, not expired
            self.data.leases[name] = (holder, now + ttl_s)
            return True

        return await self._call("acquire_lease", acquire)

    async def release_lease(self, name: str, holder: str) -> None:
        def release() -> None:
            current = self.data.leases.get(name)
            if current is not None and current[0] == holder:
                del self.data.leases[name]

        await self._call("release_lease", release)

    # -- maintenance ------------------------------------------------------------------------------------
    async def prune(self, closed_before: float, requests_before: float) -> int:
        def prune() -> int:
            data, now = self.data, time.time()
            doomed = []
            for sid, raw in data.sessions.items():
                retain = _common.retention_time(_session(raw))
                if retain is not None and retain < closed_before:
                    doomed.append(sid)
            removed = sum(self._delete_session(sid) for sid in doomed)
            done = [
                key
                for key, r in data.requests.items()
                if r.state == RequestState.DONE and r.finished_at < requests_before
            ]
            for key in done:
                del data.requests[key]
            # Expired heartbeats and leases are dead weight; they are not counted as records.
            for owner in [o for o, expiry in data.owners.items() if expiry < now]:
                del data.owners[owner]
            for name in [n for n, (_, expiry) in data.leases.items() if expiry < now]:
                del data.leases[name]
            return removed + len(done)

        return await self._call("prune", prune)

    async def check_invariants(self) -> list[str]:
        def check() -> list[str]:
            data, problems = self.data, []
            for sid, raw in data.sessions.items():
                try:
                    session = Session.from_json(raw)
                except (ValueError, TypeError) as exc:
                    problems.append(f"session {sid}: undecodable record ({exc})")
                    continue
                problems.extend(_common.session_problems(session))
                if session.session_id != sid:
                    problems.append(f"session {sid}: stored under another id than its record's")
                if session.token_hash and data.tokens.get(session.token_hash) != sid:
                    problems.append(f"session {sid}: token index does not point at it")
            for token, holder in data.tokens.items():
                held = data.sessions.get(holder)
                if held is None:
                    problems.append(f"token index points at missing session {holder}")
                elif token != _current_token(held):
                    problems.append(f"session {holder}: token index holds a token that is not its current one")
            for state in {r.state for r in data.requests.values()}:
                if state not in {s.value for s in RequestState}:
                    problems.append(f"request records in unknown state {state!r}")
            return problems

        return await self._call("check_invariants", check)

    async def ping(self) -> None:
        await self._call("ping", lambda: None)

    async def health(self) -> None:
        """Nothing to probe but the object itself: StoreError once closed (or when `fail("health")`)."""
        await self._call("health", lambda: None)

    async def close(self) -> None:
        self._closed = True


def _current_token(raw: str) -> str:
    try:
        return Session.from_json(raw).token_hash
    except (ValueError, TypeError):
        return ""


async def open_memory_store(url: str) -> MemoryStore:
    """`memory://` (private) or `memory://NAME` (shared by name in this process)."""
    return await MemoryStore.open(url[len(URL_PREFIX) :])


__all__ = ["URL_PREFIX", "MemoryData", "MemoryStore", "open_memory_store"]
