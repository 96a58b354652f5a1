"""Raw access to a SQLite store's file from tests: through apsw, the SQLite library the store itself runs on.

Never through the stdlib `sqlite3` while a store may be open in the same process. That is a second copy of
SQLite: its locks do not exclude apsw's (POSIX locks belong to the process, and each copy keeps its own table
of them), and when its last connection closes it believes it is the file's last user, checkpoints and deletes
the WAL from under the open store (https://sqlite.org/howtocorrupt.html, "Multiple copies of SQLite linked
into the same application"). Tests outside tests/store that hold the store's write lock should use
`hold_write_lock` from here.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import apsw

BUSY_TIMEOUT_MS = 10_000


def connect(path: str | Path, *, read_only: bool = False) -> apsw.Connection:
    """A connection to an existing store file (autocommit; BEGIN/COMMIT are explicit, as in the store)."""
    flags = apsw.SQLITE_OPEN_READONLY if read_only else apsw.SQLITE_OPEN_READWRITE
    conn = apsw.Connection(str(path), flags=flags)
    conn.set_busy_timeout(BUSY_TIMEOUT_MS)
    return conn


@contextlib.contextmanager
def connection(path: str | Path, *, read_only: bool = False) -> Iterator[apsw.Connection]:
    conn = connect(path, read_only=read_only)
    try:
        yield conn
    finally:
        conn.close()


def value(conn: apsw.Connection, sql: str, bindings: tuple[Any, ...] = ()) -> Any:
    """The first column of the first row of a query that returns one."""
    row = conn.execute(sql, bindings).fetchone()
    assert row is not None, sql
    return row[0]


def hold_write_lock(path: str | Path) -> apsw.Connection:
    """A connection holding the file's write lock (BEGIN IMMEDIATE), as another process's writer would:
    `conn.execute("ROLLBACK"); conn.close()` to let go."""
    conn = connect(path)
    conn.execute("BEGIN IMMEDIATE")
    return conn


def integrity(path: str | Path) -> list[str]:
    """`PRAGMA integrity_check` of the file: ["ok"] when it is sound."""
    with connection(path, read_only=True) as conn:
        return [str(row[0]) for row in conn.execute("PRAGMA integrity_check")]


def root_pages(path: str | Path) -> dict[str, int]:
    """Each table's and index's root page number."""
    with connection(path, read_only=True) as conn:
        return {
            str(name): int(page)
            for name, page in conn.execute("SELECT name, rootpage FROM sqlite_schema WHERE rootpage > 0")
        }


def checkpoint_truncate(path: str | Path) -> None:
    """Move everything from the WAL into the database file and empty the WAL (so the file alone is current)."""
    with connection(path) as conn:
        busy = value(conn, "PRAGMA wal_checkpoint(TRUNCATE)")
        assert busy == 0, "a reader or writer kept the checkpoint from finishing"


def overwrite_pages(path: str | Path, pages: list[int], fill: bytes = b"\xa5") -> None:
    """Write garbage over whole pages of the database file (1-based page numbers), behind SQLite's back."""
    with connection(path, read_only=True) as conn:
        page_size = int(value(conn, "PRAGMA page_size"))
    with open(path, "r+b") as f:
        for page in pages:
            f.seek((page - 1) * page_size)
            f.write((fill * page_size)[:page_size])
        f.flush()
        os.fsync(f.fileno())
