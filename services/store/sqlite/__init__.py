"""SQLite backend: one file in WAL mode, shared safely by several processes and many tasks.

The library is apsw with the SQLite it bundles, never the stdlib `sqlite3` module (the system's SQLite:
3.40.1 on Debian 12). SQLite 3.7.0 to 3.51.2 has the WAL-reset bug (https://sqlite.org/wal.html#walresetbug):
two connections writing or checkpointing one file at once can corrupt it, and that is what an orchestrator,
a gateway and their checkpointer threads do all day. `SqliteStore.open` refuses a library older than
MIN_SQLITE_VERSION. Nothing in a process that has the store open may open its file through another copy of
SQLite (the stdlib's): two copies in one process do not see each other's POSIX locks, and the first to close
the file drops the other's locks and may delete the WAL under it (https://sqlite.org/howtocorrupt.html,
"Multiple copies of SQLite linked into the same application").

The package holds one module per concern (sessions, toolcalls, requests, intents, admission, owners, upkeep: each a
mixin of `SqliteStore` over `connection.SqliteBase`), the schema and its migrations (schema), and the library
check (library).

Every store object owns one connection on one dedicated worker thread (`_worker.ThreadWorker`: a queue,
results handed back to the loop in batches), so SQLite never runs on the event loop and calls on one
object are serialised. apsw has no implicit transactions: a read runs in autocommit, and every write runs
in an explicit `BEGIN IMMEDIATE` transaction (the write lock is taken up front, waiting up to `busy_timeout`
for other processes, tried again every few milliseconds: `connection.BusyWait`; writes queued together share
one, each in a savepoint of its own and answered after its COMMIT: `connection.GroupCommit`), which makes
every read-check-write below atomic across processes; compare-and-set is a conditional `UPDATE ... WHERE
version = ?`. `synchronous=NORMAL` in WAL mode survives process crashes (not power loss) without an fsync per
commit; checkpoints run on a thread of their own (`_checkpointer`), never inside a store call's commit.

Damage is caught early: `open()` runs `PRAGMA quick_check` (bounded by QUICK_CHECK_BUDGET_S) and refuses a
corrupt file with `StoreCorrupt`, which names the file and the recovery doc; a store call that meets a
malformed page raises `StoreCorrupt` too, and `health()` reports it from then on.
"""

from __future__ import annotations

from rlgate.store.base import SessionStore
from rlgate.store.sqlite.admission import SqliteAdmission
from rlgate.store.sqlite.connection import QUICK_CHECK_BUDGET_S, SqliteBase
from rlgate.store.sqlite.intents import SqliteIntents
from rlgate.store.sqlite.library import (
    MIN_SQLITE_VERSION,
    RECOVERY_DOC,
    check_sqlite_library,
    corrupt_error,
    sqlite_library_version,
)
from rlgate.store.sqlite.owners import SqliteLeases, SqliteOwners
from rlgate.store.sqlite.requests import SqliteRequests
from rlgate.store.sqlite.schema import SCHEMA_VERSION
from rlgate.store.sqlite.sessions import SqliteSessions
from rlgate.store.sqlite.toolcalls import SqliteToolCalls
from rlgate.store.sqlite.upkeep import SqliteUpkeep


class SqliteStore(
    SqliteSessions,
    SqliteToolCalls,
    SqliteRequests,
    SqliteIntents,
    SqliteAdmission,
    SqliteOwners,
    SqliteLeases,
    SqliteUpkeep,
    SqliteBase,
    SessionStore,
):
    """The SQLite `SessionStore`. Open with `await SqliteStore.open(path)`; `await close()` when done."""


__all__ = [
    "MIN_SQLITE_VERSION",
    "QUICK_CHECK_BUDGET_S",
    "RECOVERY_DOC",
    "SCHEMA_VERSION",
    "SqliteStore",
    "check_sqlite_library",
    "corrupt_error",
    "sqlite_library_version",
]
