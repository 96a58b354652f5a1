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
abandoned claims to release. `data` is the shared state (tests damage it behind the store's back; tests/fakes
has a store that fails or pauses calls on demand).

One module per concern (sessions, toolcalls, requests, intents, admission, owners, upkeep: each a mixin of `MemoryStore`
over `data.MemoryBase`).
"""

from __future__ import annotations

from rlgate.store.base import SessionStore
from rlgate.store.memory.admission import MemoryAdmission
from rlgate.store.memory.data import URL_PREFIX, MemoryBase, MemoryData
from rlgate.store.memory.intents import MemoryIntents
from rlgate.store.memory.owners import MemoryLeases, MemoryOwners
from rlgate.store.memory.requests import MemoryRequests
from rlgate.store.memory.sessions import MemorySessions
from rlgate.store.memory.toolcalls import MemoryToolCalls
from rlgate.store.memory.upkeep import MemoryUpkeep


class MemoryStore(
    MemorySessions,
    MemoryToolCalls,
    MemoryRequests,
    MemoryIntents,
    MemoryAdmission,
    MemoryOwners,
    MemoryLeases,
    MemoryUpkeep,
    MemoryBase,
    SessionStore,
):
    """The in-memory `SessionStore` (see the package docstring). `await MemoryStore.open(name)`, or
    `MemoryStore()` for a private one; `await close()` when done."""


async def open_memory_store(url: str) -> MemoryStore:
    """`memory://` (private) or `memory://NAME` (shared by name in this process)."""
    return await MemoryStore.open(url[len(URL_PREFIX) :])


__all__ = ["URL_PREFIX", "MemoryData", "MemoryStore", "open_memory_store"]
