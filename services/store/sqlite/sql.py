"""The statement helpers every module of the SQLite store uses: a write transaction, a scalar query, and the
number of rows a write changed."""

from __future__ import annotations

import contextlib
from typing import Any

import apsw

from rlgate.store.models import StoreError


@contextlib.contextmanager
def transaction(conn: apsw.Connection) -> Any:
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


def scalar(conn: apsw.Connection, sql: str, bindings: tuple[Any, ...] = ()) -> Any:
    """The first column of a query that always returns a row (an aggregate, a PRAGMA)."""
    row = conn.execute(sql, bindings).fetchone()
    if row is None:
        raise StoreError(f"no row from {sql!r}")
    return row[0]


def changed_rows(conn: apsw.Connection, sql: str, bindings: tuple[Any, ...]) -> int:
    """Run one INSERT/UPDATE/DELETE; the number of rows it changed (apsw's cursors have no rowcount)."""
    conn.execute(sql, bindings)
    return int(conn.changes())
