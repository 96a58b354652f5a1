"""What an in-memory store holds (`MemoryData`, shared by name in this process) and the plumbing every call
runs through (`MemoryBase`)."""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Self, TypeVar

from rlgate.store import _common
from rlgate.store.models import RequestRecord, Session, StoreError

T = TypeVar("T")

URL_PREFIX = "memory://"
_named: weakref.WeakValueDictionary[str, MemoryData] = weakref.WeakValueDictionary()
_named_lock = threading.Lock()


@dataclass
class Logged:
    """One entry of a session's tool-call log."""

    episode: int
    request_id: str
    data: str  # ToolCallEntry JSON


@dataclass(eq=False)
class MemoryData:
    """Everything one in-memory store holds; shared by the store objects opened on one name."""

    name: str = ""
    sessions: dict[str, str] = field(default_factory=dict)  # id -> Session JSON (version and activity included)
    tokens: dict[str, str] = field(default_factory=dict)  # current token hash -> session id
    tool_calls: dict[str, list[Logged]] = field(default_factory=dict)  # session id -> log, oldest first
    requests: dict[tuple[str, str], RequestRecord] = field(default_factory=dict)
    owners: dict[str, float] = field(default_factory=dict)  # owner -> heartbeat expiry (time.time())
    intents: dict[str, str] = field(default_factory=dict)  # id -> Intent JSON
    leases: dict[str, tuple[str, float]] = field(default_factory=dict)  # name -> (holder, expiry)
    admission: dict[str, str] = field(default_factory=dict)  # provider account -> AdmissionState JSON
    lock: threading.RLock = field(default_factory=threading.RLock)


def session_of(raw: str) -> Session:
    return _common.decode(Session, raw)


def current_token(raw: str) -> str:
    try:
        return Session.from_json(raw).token_hash
    except (ValueError, TypeError):
        return ""


class MemoryBase:
    """The data and `_call`; the concerns' mixins (sessions, requests, ...) build on it."""

    def __init__(self, data: MemoryData | None = None) -> None:
        self.data = data if data is not None else MemoryData()
        self._closed = False

    @classmethod
    async def open(cls, name: str = "") -> Self:
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

    async def _call(self, method: str, op: Callable[[], T]) -> T:
        """Run `op` as one atomic store call (see the package docstring). `method` names the `SessionStore`
        method it serves (a test double failing some calls tells them apart by it)."""
        self._open()
        await asyncio.sleep(0)  # a real backend's round trip: other tasks run between calls
        self._open()
        with self.data.lock:
            return op()

    def _open(self) -> None:
        if self._closed:
            raise StoreError("store is closed")

    async def close(self) -> None:
        self._closed = True
