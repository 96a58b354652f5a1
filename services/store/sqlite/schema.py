"""The SQLite store's schema: the tables and indexes (DDL), the migrations from older versions, and
`PRAGMA user_version`, which says which version a file holds."""

from __future__ import annotations

import apsw

from rlgate.store.models import OPEN_STATUSES, StoreError
from rlgate.store.sqlite.sql import scalar

SCHEMA_VERSION = 4  # PRAGMA user_version; a change adds a step to _MIGRATIONS and bumps it


# The open statuses as SQL text: the partial index of open sessions and the queries it serves must spell its
# condition out (SQLite uses a partial index only where the query's WHERE provably implies the index's, which
# bound parameters never do).
OPEN_SQL = "status IN (" + ", ".join(f"'{s}'" for s in sorted(OPEN_STATUSES)) + ")"
OPEN_INDEX = f"CREATE INDEX IF NOT EXISTS sessions_open ON sessions(status) WHERE {OPEN_SQL}"


# A session by its agent token, through the partial index `sessions_token` (WHERE token_hash != ''): without
# the index's own condition spelled out, `token_hash = ?` scans every session the store keeps, closed ones
# too (a day's worth), on every CallTool and Reset.
BY_TOKEN_SQL = "token_hash = ? AND token_hash != ''"


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


# Create admission, one row per provider account (rlgate.store.admission): new in version 4.
_ADMISSION_V4 = """CREATE TABLE IF NOT EXISTS admission (
    account TEXT PRIMARY KEY,
    data    TEXT NOT NULL  -- AdmissionState JSON
)"""


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
{OPEN_INDEX};
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
{_ADMISSION_V4};
"""


# _MIGRATIONS[v]: the statements that take a version-v database to v + 1 (split on ";" as _SCHEMA is).
_MIGRATIONS = {
    # v2, two writes less per tool call (every CallTool appends a log entry and records its response):
    # - tool_calls without AUTOINCREMENT, which rewrites sqlite_sequence on every insert. `seq` only orders
    #   a session's entries, and a plain rowid (largest + 1) is larger than every row it is ordered with.
    # - requests as a rowid table: in a WITHOUT ROWID table a record over about a quarter of a page spills
    #   into an overflow page, and a DONE record with its base64 response did even for a small tool result.
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
    2: OPEN_INDEX,
    # v4: admission control for instance creation, shared by every process on the store.
    3: _ADMISSION_V4,
}


assert sorted(_MIGRATIONS) == list(range(1, SCHEMA_VERSION))


def _apply(conn: apsw.Connection, script: str) -> None:
    # One statement per execute: apsw runs a multi-statement string only up to the first statement that
    # returns a row, which a PRAGMA may.
    for statement in script.split(";"):
        if statement.strip():
            conn.execute(statement)


def migrate(conn: apsw.Connection) -> None:
    """Create the schema in a new database, or bring an older one up to SCHEMA_VERSION (in a transaction)."""
    version = scalar(conn, "PRAGMA user_version")
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
