"""SQLite backend: one file in WAL mode, shared safely by several processes and many tasks.

The library is apsw with the SQLite it bundles, never the stdlib `sqlite3` module (the system's SQLite:
3.40.1 on Debian 12). SQLite 3.7.0 to 3.51.2 has the WAL-reset bug (https://sqlite.org/wal.html#walresetbug):
two connections writing or checkpointing one file at once can corrupt it, and that is what an orchestrator,
a gateway and their checkpointer threads do all day. `SqliteStore.open` refuses a library older than
MIN_SQLITE_VERSION. Nothing in a process that has the store open may open its file through another copy of
SQLite (the stdlib's): two copies in one process do not see each other's POSIX locks, and the first to close
the file drops the other's locks and may delete the WAL under it (https://sqlite.org/howtocorrupt.html,
"Multiple copies of SQLite linked into the same application").

Every store object owns one connection on one dedicated worker thread (`_worker.ThreadWorker`: a queue,
results handed back to the loop in batches), so SQLite never runs on the event loop and calls on one
object are serialised. apsw has no implicit transactions: a read runs in autocommit, and every write runs
in an explicit `BEGIN IMMEDIATE` transaction (the write lock is taken up front, waiting up to `busy_timeout`
for other processes), which makes every read-check-write below atomic across processes; compare-and-set is
a conditional `UPDATE ... WHERE version = ?`. `synchronous=NORMAL` in WAL mode survives process crashes (not
power loss) without an fsync per commit; checkpoints run on a thread of their own (`_checkpointer`), never
inside a store call's commit.

Damage is caught early: `open()` runs `PRAGMA quick_check` (bounded by QUICK_CHECK_BUDGET_S) and refuses a
corrupt file with `StoreCorrupt`, which names the file and the recovery doc; a store call that meets a
malformed page raises `StoreCorrupt` too, and `health()` reports it from then on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import apsw

from rlgate.store import _common
from rlgate.store._checkpointer import JOURNAL_SIZE_LIMIT, Checkpointer
from rlgate.store._worker import Abandoned, ThreadWorker, WorkerStopped
from rlgate.store.base import SessionStore
from rlgate.store.claims import BackgroundWrites
from rlgate.store.models import (
    OPEN_STATUSES,
    ConflictError,
    Intent,
    RequestExists,
    RequestRecord,
    RequestState,
    Session,
    SessionStatus,
    StoreCorrupt,
    StoreError,
    StoreFull,
    ToolCallEntry,
    Writes,
    call_scope,
)

log = logging.getLogger(__name__)

T = TypeVar("T")

SCHEMA_VERSION = 3  # PRAGMA user_version; a change adds a step to _MIGRATIONS and bumps it

# The open statuses as SQL text: the partial index of open sessions and the queries it serves must spell its
# condition out (SQLite uses a partial index only where the query's WHERE provably implies the index's, which
# bound parameters never do).
_OPEN_SQL = "status IN (" + ", ".join(f"'{s}'" for s in sorted(OPEN_STATUSES)) + ")"
_OPEN_INDEX = f"CREATE INDEX IF NOT EXISTS sessions_open ON sessions(status) WHERE {_OPEN_SQL}"
# A session by its agent token, through the partial index `sessions_token` (WHERE token_hash != ''): without
# the index's own condition spelled out, `token_hash = ?` scans every session the store keeps, closed ones
# too (a day's worth), on every CallTool and Reset.
_BY_TOKEN_SQL = "token_hash = ? AND token_hash != ''"

# The columns of the two tables version 2 changed, for a new database and for the migration to 2. A later
# change to either table adds a block of its own: migration 1 keeps building version 2.
_TOOL_CALLS_V2 = """\
    seq        INTEGER PRIMARY KEY,  -- orders a session's entries, a plain rowid (see _MIGRATIONS)
    session_id TEXT NOT NULL,
    episode    INTEGER NOT NULL,
    request_id TEXT NOT NULL,
    data       TEXT NOT NULL
"""
_REQUESTS_V2 = """\
    scope       TEXT NOT NULL,
    request_id  TEXT NOT NULL,
    state       TEXT NOT NULL,
    owner       TEXT NOT NULL,
    result      TEXT NOT NULL,
    created_at  REAL NOT NULL,
    finished_at REAL NOT NULL,
    PRIMARY KEY (scope, request_id)  -- a rowid table, so a DONE record stays in its page (see _MIGRATIONS)
"""

# Applied statement by statement (split on ";"), so no ";" inside a statement or a comment.
_SCHEMA = f"""
CREATE TABLE IF NOT EXISTS sessions (
    session_id     TEXT PRIMARY KEY,
    created_at     REAL NOT NULL,
    status         TEXT NOT NULL,
    run_id         TEXT NOT NULL,
    token_hash     TEXT NOT NULL,
    retain_at      REAL,             -- when a finished session became prunable (NULL while open)
    version        INTEGER NOT NULL,
    last_active_at REAL NOT NULL,    -- kept out of `data` so touch_session needs no version bump
    data           TEXT NOT NULL
);
CREATE UNIQUE INDEX IF NOT EXISTS sessions_token ON sessions(token_hash) WHERE token_hash != '';
CREATE INDEX IF NOT EXISTS sessions_created ON sessions(created_at DESC, session_id DESC);
CREATE INDEX IF NOT EXISTS sessions_run ON sessions(run_id, created_at DESC, session_id DESC);
{_OPEN_INDEX};
CREATE INDEX IF NOT EXISTS sessions_retain ON sessions(retain_at) WHERE retain_at IS NOT NULL;
CREATE TABLE IF NOT EXISTS session_labels (
    session_id TEXT NOT NULL,
    key        TEXT NOT NULL,
    value      TEXT NOT NULL,
    PRIMARY KEY (session_id, key)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS session_labels_kv ON session_labels(key, value);
CREATE TABLE IF NOT EXISTS tool_calls (
{_TOOL_CALLS_V2});
CREATE INDEX IF NOT EXISTS tool_calls_session ON tool_calls(session_id, episode, seq);
CREATE UNIQUE INDEX IF NOT EXISTS tool_calls_request
    ON tool_calls(session_id, episode, request_id) WHERE request_id != '';
CREATE TABLE IF NOT EXISTS requests (
{_REQUESTS_V2});
CREATE INDEX IF NOT EXISTS requests_done ON requests(finished_at) WHERE state = 'done';
CREATE TABLE IF NOT EXISTS owners (
    owner      TEXT PRIMARY KEY,
    expires_at REAL NOT NULL
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS intents (
    intent_id  TEXT PRIMARY KEY,
    run_id     TEXT NOT NULL,
    created_at REAL NOT NULL,
    data       TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS intents_run ON intents(run_id, created_at, intent_id);
CREATE INDEX IF NOT EXISTS intents_created ON intents(created_at, intent_id);
CREATE TABLE IF NOT EXISTS leases (
    name       TEXT PRIMARY KEY,
    holder     TEXT NOT NULL,
    expires_at REAL NOT NULL
) WITHOUT ROWID;
"""

# _MIGRATIONS[v]: the statements that take a version-v database to v + 1 (split on ";" as _SCHEMA is).
_MIGRATIONS = {
    # v2, two writes less per tool call (every CallTool appends a log entry and records its response):
    # - tool_calls without AUTOINCREMENT, which rewrites sqlite_sequence on every insert. `seq` only orders
    #   a session's entries, and a plain rowid (largest + 1) is larger than every row it is ordered with.
    # - requests as a rowid table: in a WITHOUT ROWID table a record over ~1 KB spills into an overflow
    #   page, and a DONE record with its base64 response (~1.5 KB for a small tool result) always did.
    1: f"""
CREATE TABLE tool_calls_v2 (
{_TOOL_CALLS_V2});
INSERT INTO tool_calls_v2 (seq, session_id, episode, request_id, data)
    SELECT seq, session_id, episode, request_id, data FROM tool_calls;
DROP TABLE tool_calls;
ALTER TABLE tool_calls_v2 RENAME TO tool_calls;
DELETE FROM sqlite_sequence WHERE name = 'tool_calls';
CREATE INDEX tool_calls_session ON tool_calls(session_id, episode, seq);
CREATE UNIQUE INDEX tool_calls_request ON tool_calls(session_id, episode, request_id) WHERE request_id != '';
CREATE TABLE requests_v2 (
{_REQUESTS_V2});
INSERT INTO requests_v2 (scope, request_id, state, owner, result, created_at, finished_at)
    SELECT scope, request_id, state, owner, result, created_at, finished_at FROM requests;
DROP TABLE requests;
ALTER TABLE requests_v2 RENAME TO requests;
CREATE INDEX requests_done ON requests(finished_at) WHERE state = 'done';
""",
    # v3: the max-sessions check counts open sessions on every new-session Reset; without an index that
    # scanned every session the store keeps (closed ones too, for the retention period: a day by default).
    2: _OPEN_INDEX,
}
assert sorted(_MIGRATIONS) == list(range(1, SCHEMA_VERSION))

_SESSION_COLUMNS = "data, version, last_active_at"
_IN_BATCH = 500  # ids per IN (...) list: far below SQLite's bound on bound parameters

MIN_SQLITE_VERSION = (3, 51, 3)  # the first release without the WAL-reset bug (see the module's docstring)
QUICK_CHECK_BUDGET_S = 5.0  # open()'s quick_check gives up (and logs) past this: ~0.1 s per 150 MB cached
_QUICK_CHECK_STEPS = 1000  # how often (in SQLite's steps) the quick_check looks at the clock
RECOVERY_DOC = 'docs/operations.md, "Recovering a store"'
_HEALTH_KEY = "rlgate:health-probe"  # the leases row health() writes and deletes in one transaction
_CORRUPT = (apsw.CorruptError, apsw.NotADBError)


def sqlite_library_version() -> str:
    """The version of the SQLite library the store runs on (apsw's bundled one), e.g. "3.54.1"."""
    return str(apsw.sqlite_lib_version())


def check_sqlite_library() -> str:
    """The library's version; StoreError if it still has the WAL-reset bug (older than MIN_SQLITE_VERSION)."""
    version = sqlite_library_version()
    numbers = tuple(int(part) for part in version.split(".")[:3] if part.isdigit())
    if numbers < MIN_SQLITE_VERSION:
        wanted = ".".join(map(str, MIN_SQLITE_VERSION))
        raise StoreError(
            f"the SQLite store needs SQLite {wanted} or later, but apsw {apsw.apswversion()} runs SQLite {version}, "
            "which has the WAL-reset corruption bug (https://sqlite.org/wal.html#walresetbug); "
            f"install rlgate's server extra with its constraints (apsw>={wanted}.0)"
        )
    return version


def corrupt_error(path: str, detail: str) -> StoreCorrupt:
    """The StoreCorrupt for the database at `path`: names the file and where recovery is explained."""
    where = path if path == ":memory:" else os.path.abspath(path)
    return StoreCorrupt(
        f"sqlite store {where} is corrupt ({detail}); rlgate will not run on it. Stop every service using it, "
        f"back it up, then recover it or start a new one: see {RECOVERY_DOC}"
    )


def _apply(conn: apsw.Connection, script: str) -> None:
    # One statement per execute: apsw runs a multi-statement string only up to the first statement that
    # returns a row, which a PRAGMA may.
    for statement in script.split(";"):
        if statement.strip():
            conn.execute(statement)


def _migrate(conn: apsw.Connection) -> None:
    """Create the schema in a new database, or bring an older one up to SCHEMA_VERSION (in a transaction)."""
    version = _value(conn, "PRAGMA user_version")
    if version > SCHEMA_VERSION:
        raise StoreError(
            f"schema version {version} is newer than this rlgate's ({SCHEMA_VERSION}); "
            "upgrade rlgate or point it at another store"
        )
    if version == SCHEMA_VERSION:
        return
    if version == 0:
        _apply(conn, _SCHEMA)
    else:
        for step in range(version, SCHEMA_VERSION):
            _apply(conn, _MIGRATIONS[step])
    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")


def _quick_check(conn: apsw.Connection, path: str) -> None:
    """StoreCorrupt unless `PRAGMA quick_check` passes. O(file size) but fast (it reads each page once and
    skips index-vs-table checks); past QUICK_CHECK_BUDGET_S it is interrupted and the store opens with a
    warning, so a huge store still starts."""
    deadline = time.monotonic() + QUICK_CHECK_BUDGET_S
    conn.set_progress_handler(lambda: time.monotonic() > deadline, _QUICK_CHECK_STEPS)
    try:
        problems = [str(row[0]).replace("\n", "; ") for row in conn.execute("PRAGMA quick_check(5)")]
    except apsw.InterruptError:
        log.warning(
            "sqlite store %s: quick_check stopped after %.0f s (%d MB); opened unchecked",
            path,
            QUICK_CHECK_BUDGET_S,
            os.path.getsize(path) // 2**20,
        )
        return
    finally:
        conn.set_progress_handler(None)
    if problems != ["ok"]:
        raise corrupt_error(path, "quick_check: " + "; ".join(problems))


def _connect(path: str, busy_timeout_s: float) -> apsw.Connection:
    """Open, check and migrate the database (runs on the store's worker thread)."""
    if path != ":memory:":
        parent = os.path.dirname(os.path.abspath(path))
        os.makedirs(parent, exist_ok=True)
    conn = apsw.Connection(path)  # read-write, created if missing; autocommit until an explicit BEGIN
    try:
        conn.set_busy_timeout(int(busy_timeout_s * 1000))
        _retry_busy(lambda: conn.execute("PRAGMA journal_mode = WAL").fetchall(), busy_timeout_s)
        conn.execute("PRAGMA synchronous = NORMAL")
        if path != ":memory:":
            conn.execute("PRAGMA wal_autocheckpoint = 0")  # the Checkpointer's job
            conn.execute(f"PRAGMA journal_size_limit = {JOURNAL_SIZE_LIMIT}")
            _quick_check(conn, path)
        with _transaction(conn):
            _migrate(conn)
    except _CORRUPT as exc:
        conn.close()
        raise corrupt_error(path, str(exc)) from exc
    except BaseException:
        conn.close()
        raise
    return conn


def _retry_busy(op: Callable[[], object], budget_s: float) -> None:
    """Switching to WAL needs a moment with no other writer; retry while another process holds the lock
    (this switch answers SQLITE_BUSY at once rather than waiting out the busy timeout)."""
    deadline = time.monotonic() + budget_s
    while True:
        try:
            op()
            return
        except apsw.BusyError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


@contextlib.contextmanager
def _transaction(conn: apsw.Connection) -> Any:
    """BEGIN IMMEDIATE ... COMMIT, rolled back on any exception."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:  # also when COMMIT itself failed: never leave the connection mid-transaction
            with contextlib.suppress(apsw.Error):
                conn.execute("ROLLBACK")
        raise


def _value(conn: apsw.Connection, sql: str, bindings: tuple[Any, ...] = ()) -> Any:
    """The first column of a query that always returns a row (an aggregate, a PRAGMA)."""
    row = conn.execute(sql, bindings).fetchone()
    if row is None:
        raise StoreError(f"no row from {sql!r}")
    return row[0]


def _changes(conn: apsw.Connection, sql: str, bindings: tuple[Any, ...]) -> int:
    """Run one INSERT/UPDATE/DELETE; the number of rows it changed (apsw's cursors have no rowcount)."""
    conn.execute(sql, bindings)
    return int(conn.changes())


def _session_from_row(row: tuple[str, int, float]) -> Session:
    session = _common.decode(Session, row[0])
    session.version = int(row[1])
    session.last_active_at = float(row[2])
    return session


def _request_from_row(row: tuple[Any, ...]) -> RequestRecord:
    return _common.request_record(*row)


class SqliteStore(SessionStore):
    """The SQLite `SessionStore`. Open with `await SqliteStore.open(path)`; `await close()` when done."""

    def __init__(
        self, path: str, conn: apsw.Connection, worker: ThreadWorker, checkpointer: Checkpointer | None = None
    ) -> None:
        self.path = path
        self._conn = conn
        self._worker = worker
        self.checkpointer = checkpointer
        self._closed = False
        self._background = BackgroundWrites()
        self._corrupt = ""  # what the first malformed page a call met said; health() fails from then on

    @classmethod
    async def open(cls, path: str, *, busy_timeout_s: float = 15.0) -> SqliteStore:
        """Open (creating, checking and migrating) the database at `path`. StoreCorrupt if the file is damaged,
        StoreError if it cannot be opened or the SQLite library is too old (MIN_SQLITE_VERSION)."""
        check_sqlite_library()
        worker = ThreadWorker("rlgate-sqlite")
        try:
            conn = await worker.submit(_connect, path, busy_timeout_s)
        except StoreCorrupt:
            worker.stop()
            raise
        except (StoreError, apsw.Error, OSError) as exc:  # StoreError: a schema from a newer rlgate
            worker.stop()
            kind = StoreFull if isinstance(exc, apsw.FullError) else StoreError
            raise kind(f"cannot open sqlite store {path!r}: {exc}") from exc
        except BaseException:
            worker.stop()
            raise
        checkpointer = Checkpointer(path).start() if path != ":memory:" else None
        return cls(path, conn, worker, checkpointer)

    def __repr__(self) -> str:
        return f"SqliteStore({self.path!r})"

    # -- plumbing ---------------------------------------------------------------------------------------
    async def _run(self, fn: Callable[..., T], *args: Any, abandoned: Abandoned | None = None) -> T:
        """Run `fn(conn, *args)` on the worker thread. A cancelled caller does not undo a started write;
        `abandoned(result)` gets the result of one whose caller was cancelled."""
        if self._closed:
            raise StoreError("store is closed")
        try:
            return await self._worker.submit(fn, self._conn, *args, abandoned=abandoned)
        except apsw.Error as exc:
            raise self._error(exc) from exc
        except WorkerStopped as exc:  # a concurrent close() got there first
            raise StoreError("store is closed") from exc

    def _error(self, exc: apsw.Error) -> StoreError:
        """The StoreError for an SQLite error: StoreCorrupt (remembered for health()), StoreFull, or plain."""
        if isinstance(exc, _CORRUPT):
            self._corrupt = self._corrupt or str(exc)
            return corrupt_error(self.path, str(exc))
        if isinstance(exc, apsw.FullError):
            return StoreFull(f"sqlite store {self.path!r} is full ({exc}): free disk space")
        return StoreError(f"sqlite store {self.path!r}: {exc}")

    async def _write(self, fn: Callable[..., T], *args: Any, abandoned: Abandoned | None = None) -> T:
        """Run `fn(conn, *args)` inside one BEGIN IMMEDIATE transaction."""

        def in_transaction(conn: apsw.Connection, *inner: Any) -> T:
            with _transaction(conn):
                return fn(conn, *inner)

        return await self._run(in_transaction, *args, abandoned=abandoned)

    def _release_abandoned(self, scope: str, request_id: str) -> None:
        """A claim landed after its caller was cancelled: release it (see `SessionStore.claim_request`)."""
        if not self._closed:
            self._background.spawn(self.release_request(scope, request_id))

    # -- sessions ---------------------------------------------------------------------------------------
    @staticmethod
    def _insert_session_rows(conn: apsw.Connection, session: Session) -> None:
        conn.execute(
            "INSERT INTO sessions (created_at, status, run_id, token_hash, retain_at, version,"
            " last_active_at, data, session_id) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                session.created_at,
                session.status,
                session.run_id,
                session.token_hash,
                _common.retention_time(session),
                session.version,
                session.last_active_at,
                session.to_json(),
                session.session_id,
            ),
        )
        conn.executemany(
            "INSERT INTO session_labels (session_id, key, value) VALUES (?, ?, ?)",
            [(session.session_id, k, v) for k, v in session.labels.items()],
        )

    @staticmethod
    def _token_taken(conn: apsw.Connection, token_hash: str, session_id: str) -> bool:
        if not token_hash:
            return False
        row = conn.execute(f"SELECT session_id FROM sessions WHERE {_BY_TOKEN_SQL}", (token_hash,)).fetchone()
        return row is not None and row[0] != session_id

    async def create_session(self, session: Session) -> Session:
        stored = session.copy(version=1)

        def create(conn: apsw.Connection) -> None:
            if conn.execute("SELECT 1 FROM sessions WHERE session_id = ?", (stored.session_id,)).fetchone():
                raise ConflictError(f"session {stored.session_id} already exists")
            if self._token_taken(conn, stored.token_hash, stored.session_id):
                raise ConflictError(f"agent token of session {stored.session_id} is already in use")
            self._insert_session_rows(conn, stored)

        await self._write(create)
        return stored

    async def get_session(self, session_id: str) -> Session | None:
        def get(conn: apsw.Connection) -> Session | None:
            row = conn.execute(
                f"SELECT {_SESSION_COLUMNS} FROM sessions WHERE session_id = ?", (session_id,)
            ).fetchone()
            return _session_from_row(row) if row else None

        return await self._run(get)

    @staticmethod
    def _next_version(session: Session) -> Session:
        """What update_session writes: a copy with version + 1 and updated_at now."""
        return session.copy(version=session.version + 1, updated_at=time.time())

    @classmethod
    def _update_rows(cls, conn: apsw.Connection, stored: Session) -> float:
        """Compare-and-set `stored` (version already bumped) inside a transaction; its last_active_at.

        The hot path of every Step, so it writes only what changed: a turn rewrites `data`, `version` and
        `last_active_at`; the indexed columns and the label rows only when they differ from the stored
        ones (rewriting unchanged index entries costs more than the rest of the update)."""
        sid, expected = stored.session_id, stored.version - 1
        row = conn.execute(
            "SELECT version, created_at, status, run_id, token_hash, retain_at, last_active_at"
            " FROM sessions WHERE session_id = ?",
            (sid,),
        ).fetchone()
        if row is None:
            raise ConflictError(f"session {sid} does not exist")
        if row[0] != expected:
            raise ConflictError(f"session {sid} changed (version {row[0]}, expected {expected})")
        # A token this session holds already is no other session's (the index is unique).
        if stored.token_hash != row[4] and cls._token_taken(conn, stored.token_hash, sid):
            raise ConflictError(f"agent token of session {sid} is already in use")
        last_active_at = max(float(row[6]), stored.last_active_at)  # activity never moves backwards
        indexed = (stored.created_at, stored.status, stored.run_id, stored.token_hash, _common.retention_time(stored))
        if indexed == tuple(row[1:6]):
            conn.execute(
                "UPDATE sessions SET version = ?, last_active_at = ?, data = ? WHERE session_id = ?",
                (stored.version, last_active_at, stored.to_json(), sid),
            )
        else:
            conn.execute(
                "UPDATE sessions SET created_at = ?, status = ?, run_id = ?, token_hash = ?, retain_at = ?,"
                " version = ?, last_active_at = ?, data = ? WHERE session_id = ?",
                (*indexed, stored.version, last_active_at, stored.to_json(), sid),
            )
        labels = dict(conn.execute("SELECT key, value FROM session_labels WHERE session_id = ?", (sid,)))
        if labels != stored.labels:
            conn.execute("DELETE FROM session_labels WHERE session_id = ?", (sid,))
            conn.executemany(
                "INSERT INTO session_labels (session_id, key, value) VALUES (?, ?, ?)",
                [(sid, k, v) for k, v in stored.labels.items()],
            )
        return last_active_at

    async def update_session(self, session: Session) -> Session:
        stored = self._next_version(session)
        stored.last_active_at = await self._write(self._update_rows, stored)
        return stored

    @staticmethod
    def _by_token_row(conn: apsw.Connection, token_hash: str) -> Session | None:
        row = conn.execute(f"SELECT {_SESSION_COLUMNS} FROM sessions WHERE {_BY_TOKEN_SQL}", (token_hash,)).fetchone()
        return _session_from_row(row) if row else None

    async def session_by_token(self, token_hash: str) -> Session | None:
        if not token_hash:  # "" is what a revoked session holds; it must never match
            return None
        return await self._run(self._by_token_row, token_hash)

    @staticmethod
    def _touch_rows(conn: apsw.Connection, session_id: str, now: float) -> None:
        conn.execute(
            "UPDATE sessions SET last_active_at = max(last_active_at, ?) WHERE session_id = ?",
            (now, session_id),
        )

    async def touch_session(self, session_id: str, now: float) -> None:
        await self._write(self._touch_rows, session_id, now)

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
        where: list[str] = []
        params: list[Any] = []
        if statuses is not None:
            if not statuses:
                return [], ""
            where.append(f"status IN ({', '.join('?' for _ in statuses)})")
            params.extend(sorted(statuses))
            if statuses <= OPEN_STATUSES:  # through the partial index of open sessions, not every session kept
                where.append(_OPEN_SQL)
        if run_id:
            where.append("run_id = ?")
            params.append(run_id)
        for key, value in (labels or {}).items():
            where.append(
                "EXISTS (SELECT 1 FROM session_labels l"
                " WHERE l.session_id = s.session_id AND l.key = ? AND l.value = ?)"
            )
            params.extend((key, value))
        if position is not None:
            where.append("(created_at < ? OR (created_at = ? AND session_id < ?))")
            params.extend((position[0], position[0], position[1]))
        sql = f"SELECT {_SESSION_COLUMNS} FROM sessions s"
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY created_at DESC, session_id DESC LIMIT ?"
        params.append(limit + 1)

        def page(conn: apsw.Connection) -> list[Session]:
            return [_session_from_row(row) for row in conn.execute(sql, params)]

        sessions = await self._run(page)
        if len(sessions) > limit:
            sessions = sessions[:limit]
            return sessions, _common.encode_cursor(sessions[-1])
        return sessions, ""

    async def sessions_open(self, session_ids: Sequence[str]) -> set[str]:
        ids = list(dict.fromkeys(session_ids))

        def which(conn: apsw.Connection) -> set[str]:
            statuses = tuple(sorted(OPEN_STATUSES))
            marks = ", ".join("?" for _ in statuses)
            found: set[str] = set()
            for start in range(0, len(ids), _IN_BATCH):
                chunk = ids[start : start + _IN_BATCH]
                rows = conn.execute(
                    f"SELECT session_id FROM sessions WHERE session_id IN ({', '.join('?' for _ in chunk)}) "
                    f"AND status IN ({marks}) AND token_hash != ''",
                    (*chunk, *statuses),
                )
                found.update(str(row[0]) for row in rows)
            return found

        return await self._run(which) if ids else set()

    async def count_open_sessions(self) -> int:
        def count(conn: apsw.Connection) -> int:  # O(open sessions), from the partial index
            return int(_value(conn, f"SELECT COUNT(*) FROM sessions WHERE {_OPEN_SQL}"))

        return await self._run(count)

    @staticmethod
    def _delete_session_rows(conn: apsw.Connection, session_id: str) -> int:
        deleted = _changes(conn, "DELETE FROM sessions WHERE session_id = ?", (session_id,))
        conn.execute("DELETE FROM session_labels WHERE session_id = ?", (session_id,))
        conn.execute("DELETE FROM tool_calls WHERE session_id = ?", (session_id,))
        return int(deleted)

    async def delete_session(self, session_id: str) -> None:
        await self._write(self._delete_session_rows, session_id)

    # -- tool-call log ----------------------------------------------------------------------------------
    @staticmethod
    def _append_row(conn: apsw.Connection, entry: ToolCallEntry) -> None:
        # (session, episode, request_id) is logged once, so a retried append does not double-count.
        conn.execute(
            "INSERT OR IGNORE INTO tool_calls (session_id, episode, request_id, data) VALUES (?, ?, ?, ?)",
            (entry.session_id, entry.episode, entry.request_id, entry.to_json()),
        )

    async def append_tool_call(self, entry: ToolCallEntry) -> int:
        def append(conn: apsw.Connection) -> int:
            self._append_row(conn, entry)
            return self._count_calls(conn, entry.session_id, entry.episode)

        return await self._write(append)

    async def list_tool_calls(self, session_id: str, episode: int | None = None) -> list[ToolCallEntry]:
        def list_calls(conn: apsw.Connection) -> list[ToolCallEntry]:
            if episode is None:
                rows = conn.execute("SELECT data FROM tool_calls WHERE session_id = ? ORDER BY seq", (session_id,))
            else:
                rows = conn.execute(
                    "SELECT data FROM tool_calls WHERE session_id = ? AND episode = ? ORDER BY seq",
                    (session_id, episode),
                )
            return [_common.decode(ToolCallEntry, row[0]) for row in rows]

        return await self._run(list_calls)

    @staticmethod
    def _count_calls(conn: apsw.Connection, session_id: str, episode: int) -> int:
        return int(
            _value(conn, "SELECT count(*) FROM tool_calls WHERE session_id = ? AND episode = ?", (session_id, episode))
        )

    async def count_tool_calls(self, session_id: str, episode: int) -> int:
        return await self._run(self._count_calls, session_id, episode)

    # -- composite --------------------------------------------------------------------------------------
    async def _commit_writes(self, session: Session | None, writes: Writes) -> Session | None:
        stored = self._next_version(session) if session is not None else None
        last_active_at = await self._write(self._commit_rows, stored, writes, time.time())
        if stored is not None and last_active_at is not None:
            stored.last_active_at = last_active_at
        return stored

    @classmethod
    def _commit_rows(cls, conn: apsw.Connection, stored: Session | None, writes: Writes, now: float) -> float | None:
        """`commit`'s writes inside a transaction; the session's last_active_at (None without a session)."""
        request, tool_call = writes.request, writes.tool_call
        if (writes.new_request or writes.held_by) and request is not None:
            existing = cls._request_row(conn, request[0], request[1])
            if existing is not None and (
                writes.new_request or _common.held_elsewhere(existing, writes.held_by, request[2])
            ):
                raise RequestExists(existing)  # rolls the (still empty) transaction back
        # Then the session: a lost compare-and-set raises before anything else is written.
        last = cls._update_rows(conn, stored) if stored is not None else None
        if request is not None:
            cls._complete_row(conn, *request, now)
        if tool_call is not None:
            cls._append_row(conn, tool_call)
            cls._touch_rows(conn, tool_call.session_id, tool_call.finished_at)
        return last

    async def change_session(
        self, session_id: str, change: Callable[[Session], Writes | None]
    ) -> tuple[Session | None, bool]:
        # One transaction on the store's thread: the read, `change` and the commit (no other writer between
        # them, so no compare-and-set can be lost).
        def run(conn: apsw.Connection) -> tuple[Session | None, bool]:
            row = conn.execute(
                f"SELECT {_SESSION_COLUMNS} FROM sessions WHERE session_id = ?", (session_id,)
            ).fetchone()
            if row is None:
                return None, False
            session = _session_from_row(row)
            writes = change(session)
            if writes is None:
                return session, False
            stored = self._next_version(session)
            last_active_at = self._commit_rows(conn, stored, writes, time.time())
            assert last_active_at is not None
            stored.last_active_at = last_active_at
            return stored, True

        return await self._write(run)

    # -- request records --------------------------------------------------------------------------------
    _REQUEST_COLUMNS = "scope, request_id, state, owner, result, created_at, finished_at"

    @classmethod
    def _request_row(cls, conn: apsw.Connection, scope: str, request_id: str) -> RequestRecord | None:
        row = conn.execute(
            f"SELECT {cls._REQUEST_COLUMNS} FROM requests WHERE scope = ? AND request_id = ?",
            (scope, request_id),
        ).fetchone()
        return _request_from_row(row) if row else None

    @classmethod
    def _claim_row(cls, conn: apsw.Connection, scope: str, request_id: str, owner: str) -> tuple[RequestRecord, bool]:
        now = time.time()
        created = _changes(
            conn,
            "INSERT OR IGNORE INTO requests (scope, request_id, state, owner, result, created_at,"
            " finished_at) VALUES (?, ?, ?, ?, '', ?, 0)",
            (scope, request_id, RequestState.PENDING.value, owner, now),
        )
        if created == 1:  # the record is exactly what was inserted: no need to read it back
            return RequestRecord(scope, request_id, RequestState.PENDING.value, owner, "", now, 0.0), True
        existing = cls._request_row(conn, scope, request_id)
        assert existing is not None  # the insert was ignored because it exists, inside this transaction
        return existing, False

    async def claim_request(self, scope: str, request_id: str, owner: str) -> tuple[RequestRecord, bool]:
        def abandoned(claim: tuple[RequestRecord, bool]) -> None:
            if claim[1]:
                self._release_abandoned(scope, request_id)

        return await self._write(self._claim_row, scope, request_id, owner, abandoned=abandoned)

    async def authorize_call(
        self, token_hash: str, request_id: str, owner: str
    ) -> tuple[Session | None, RequestRecord | None, bool]:
        if not token_hash:  # a revoked session holds ""; it must never match
            return None, None, False

        def authorize(conn: apsw.Connection) -> tuple[Session | None, RequestRecord | None, bool]:
            session = self._by_token_row(conn, token_hash)
            if session is None or not request_id or session.status != SessionStatus.ACTIVE:
                return session, None, False
            record, created = self._claim_row(conn, call_scope(session.session_id), request_id, owner)
            return session, record, created

        def abandoned(result: tuple[Session | None, RequestRecord | None, bool]) -> None:
            if result[2] and result[0] is not None:
                self._release_abandoned(call_scope(result[0].session_id), request_id)

        # Without a request_id nothing is written: a plain read, no write lock.
        return await (self._write(authorize, abandoned=abandoned) if request_id else self._run(authorize))

    @staticmethod
    def _complete_row(conn: apsw.Connection, scope: str, request_id: str, result: str, now: float) -> None:
        # An upsert: a result is never dropped, even if the PENDING record was lost or pruned.
        conn.execute(
            "INSERT INTO requests (scope, request_id, state, owner, result, created_at, finished_at)"
            " VALUES (?, ?, 'done', '', ?, ?, ?) ON CONFLICT (scope, request_id) DO UPDATE SET"
            " state = 'done', result = excluded.result, finished_at = excluded.finished_at",
            (scope, request_id, result, now, now),
        )

    async def complete_request(self, scope: str, request_id: str, result: str) -> None:
        await self._write(self._complete_row, scope, request_id, result, time.time())

    async def release_request(self, scope: str, request_id: str) -> None:
        def release(conn: apsw.Connection) -> None:
            conn.execute(
                "DELETE FROM requests WHERE scope = ? AND request_id = ? AND state = 'pending'",
                (scope, request_id),
            )

        await self._write(release)

    async def take_over_request(
        self, scope: str, request_id: str, dead_owner: str, owner: str
    ) -> tuple[RequestRecord | None, bool]:
        def take(conn: apsw.Connection) -> tuple[RequestRecord | None, bool]:
            now = time.time()
            taken = _changes(
                conn,
                "UPDATE requests SET owner = ?, created_at = ? WHERE scope = ? AND request_id = ?"
                " AND state = 'pending' AND owner = ?",
                (owner, now, scope, request_id, dead_owner),
            )
            if taken == 1:
                return RequestRecord(scope, request_id, RequestState.PENDING.value, owner, "", now, 0.0), True
            return self._request_row(conn, scope, request_id), False

        def abandoned(result: tuple[RequestRecord | None, bool]) -> None:
            if result[1] and not self._closed:  # taken after the caller gave up: hand it back
                self._background.spawn(self.take_over_request(scope, request_id, owner, dead_owner))

        return await self._write(take, abandoned=abandoned)

    async def get_request(self, scope: str, request_id: str) -> RequestRecord | None:
        return await self._run(self._request_row, scope, request_id)

    async def heartbeat_owner(self, owner: str, ttl_s: float) -> None:
        def beat(conn: apsw.Connection) -> None:
            conn.execute(
                "INSERT INTO owners (owner, expires_at) VALUES (?, ?)"
                " ON CONFLICT (owner) DO UPDATE SET expires_at = excluded.expires_at",
                (owner, time.time() + ttl_s),
            )

        await self._write(beat)

    async def owner_alive(self, owner: str) -> bool:
        def alive(conn: apsw.Connection) -> bool:
            row = conn.execute("SELECT expires_at FROM owners WHERE owner = ?", (owner,)).fetchone()
            return row is not None and row[0] > time.time()

        return await self._run(alive)

    # -- intents ----------------------------------------------------------------------------------------
    async def put_intent(self, intent: Intent) -> None:
        def put(conn: apsw.Connection) -> None:
            conn.execute(
                "INSERT INTO intents (intent_id, run_id, created_at, data) VALUES (?, ?, ?, ?)"
                " ON CONFLICT (intent_id) DO UPDATE SET run_id = excluded.run_id,"
                " created_at = excluded.created_at, data = excluded.data",
                (intent.intent_id, intent.run_id, intent.created_at, intent.to_json()),
            )

        await self._write(put)

    async def get_intent(self, intent_id: str) -> Intent | None:
        def get(conn: apsw.Connection) -> Intent | None:
            row = conn.execute("SELECT data FROM intents WHERE intent_id = ?", (intent_id,)).fetchone()
            return _common.decode(Intent, row[0]) if row else None

        return await self._run(get)

    async def list_intents(self, run_id: str = "") -> list[Intent]:
        def list_all(conn: apsw.Connection) -> list[Intent]:
            if run_id:
                rows = conn.execute(
                    "SELECT data FROM intents WHERE run_id = ? ORDER BY created_at, intent_id", (run_id,)
                )
            else:
                rows = conn.execute("SELECT data FROM intents ORDER BY created_at, intent_id")
            return [_common.decode(Intent, row[0]) for row in rows]

        return await self._run(list_all)

    async def delete_intent(self, intent_id: str) -> None:
        def delete(conn: apsw.Connection) -> None:
            conn.execute("DELETE FROM intents WHERE intent_id = ?", (intent_id,))

        await self._write(delete)

    # -- leases -----------------------------------------------------------------------------------------
    async def acquire_lease(self, name: str, holder: str, ttl_s: float) -> bool:
        def acquire(conn: apsw.Connection) -> bool:
            now = time.time()
            # One statement: take a free or expired lease, or renew our own; otherwise change nothing.
            changed = _changes(
                conn,
                "INSERT INTO leases (name, holder, expires_at) VALUES (?, ?, ?)"
                " ON CONFLICT (name) DO UPDATE SET holder = excluded.holder, expires_at = excluded.expires_at"
                " WHERE leases.holder = excluded.holder OR leases.expires_at <= ?",
                (name, holder, now + ttl_s, now),
            )
            return changed == 1

        return await self._write(acquire)

    async def release_lease(self, name: str, holder: str) -> None:
        def release(conn: apsw.Connection) -> None:
            conn.execute("DELETE FROM leases WHERE name = ? AND holder = ?", (name, holder))

        await self._write(release)

    # -- maintenance ------------------------------------------------------------------------------------
    async def prune(self, closed_before: float, requests_before: float) -> int:
        def prune(conn: apsw.Connection) -> int:
            now = time.time()
            doomed = [
                row[0]
                for row in conn.execute(
                    "SELECT session_id FROM sessions WHERE retain_at IS NOT NULL AND retain_at < ?",
                    (closed_before,),
                )
            ]
            removed = sum(self._delete_session_rows(conn, sid) for sid in doomed)
            removed += _changes(
                conn, "DELETE FROM requests WHERE state = 'done' AND finished_at < ?", (requests_before,)
            )
            # Expired heartbeats and leases are dead weight; they are not counted as records.
            conn.execute("DELETE FROM owners WHERE expires_at < ?", (now,))
            conn.execute("DELETE FROM leases WHERE expires_at < ?", (now,))
            return removed

        return await self._write(prune)

    async def check_invariants(self) -> list[str]:
        def check(conn: apsw.Connection) -> list[str]:
            problems: list[str] = []
            rows: list[Any] = conn.execute(
                "SELECT session_id, status, run_id, token_hash, created_at, retain_at, version, data FROM sessions"
            ).fetchall()
            labels: dict[str, dict[str, str]] = {}
            for sid, key, value in conn.execute("SELECT session_id, key, value FROM session_labels"):
                labels.setdefault(sid, {})[key] = value
            for sid, status, run_id, token_hash, created_at, retain_at, version, data in rows:
                try:
                    session = Session.from_json(data)
                except (ValueError, TypeError) as exc:
                    problems.append(f"session {sid}: undecodable record ({exc})")
                    continue
                session.version = version
                problems.extend(_common.session_problems(session))
                columns = (session.session_id, session.status, session.run_id, session.token_hash)
                if columns != (sid, status, run_id, token_hash) or session.created_at != created_at:
                    problems.append(f"session {sid}: indexed columns disagree with the record")
                if retain_at != _common.retention_time(session):
                    problems.append(f"session {sid}: retention time out of step with its status")
                if labels.pop(sid, {}) != session.labels:
                    problems.append(f"session {sid}: label index disagrees with the record")
            problems.extend(f"label index lists missing session {sid}" for sid in labels)
            for (state,) in conn.execute("SELECT DISTINCT state FROM requests"):
                if state not in {s.value for s in RequestState}:
                    problems.append(f"request records in unknown state {state!r}")
            return problems

        return await self._run(check)

    async def ping(self) -> None:
        def ping(conn: apsw.Connection) -> None:
            conn.execute("SELECT 1").fetchone()

        await self._run(ping)

    async def health(self) -> None:
        """Read the schema and the first page of every table, then write and delete a leases row of one page
        in one transaction (the row needs a page of its own, so a store that cannot grow fails here with
        StoreFull, and COMMIT appends to the WAL, so a full disk does too). Nothing is left behind; other
        connections never see the row. A malformed page met here or by any earlier call: StoreCorrupt."""

        def probe(conn: apsw.Connection) -> None:
            tables = [
                row[0]
                for row in conn.execute(
                    "SELECT name FROM sqlite_schema WHERE type = 'table' AND name NOT LIKE 'sqlite_%'"
                )
            ]
            for table in tables:
                conn.execute(f'SELECT 1 FROM "{table}" LIMIT 1').fetchall()
            page_size = int(_value(conn, "PRAGMA page_size"))
            with _transaction(conn):
                conn.execute(
                    "INSERT OR REPLACE INTO leases (name, holder, expires_at) VALUES (?, zeroblob(?), 0)",
                    (_HEALTH_KEY, page_size),
                )
                conn.execute("DELETE FROM leases WHERE name = ?", (_HEALTH_KEY,))

        if not self._corrupt:
            await self._run(probe)
        if self._corrupt:
            raise corrupt_error(self.path, self._corrupt)

    async def close(self) -> None:
        if self._closed:
            return
        await self._background.drain()  # releases of abandoned claims, before the connection goes
        self._closed = True
        try:
            await self._worker.submit(self._conn.close)  # after every call already queued
        finally:
            self._worker.stop()
            if self.checkpointer is not None:
                await asyncio.to_thread(self.checkpointer.stop)
