"""Helpers every environment shares: row access, not-found errors, write transactions and seed vocabulary.

Tools receive a plain `sqlite3.Connection` from the platform (no row factory assumed), so rows are turned
into dicts here from `cursor.description`.
"""

from __future__ import annotations

import importlib
import random
import sqlite3
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime, timedelta
from typing import Any

from mcp.server.mcpserver.exceptions import ToolError

from rlgate.localfleet.environments.base import AppFactory

Params = Sequence[Any]


def rows(conn: sqlite3.Connection, sql: str, params: Params = ()) -> list[dict[str, Any]]:
    """All rows of a query as dicts keyed by column name."""
    cur = conn.execute(sql, params)
    cols = [d[0] for d in cur.description]
    return [dict(zip(cols, r, strict=True)) for r in cur.fetchall()]


def row(conn: sqlite3.Connection, sql: str, params: Params = ()) -> dict[str, Any] | None:
    """The first row of a query as a dict, or None."""
    cur = conn.execute(sql, params)
    r = cur.fetchone()
    if r is None:
        return None
    return dict(zip([d[0] for d in cur.description], r, strict=True))


def require(conn: sqlite3.Connection, sql: str, params: Params, missing: str) -> dict[str, Any]:
    """The first row of a query, or a model-visible ToolError saying what was not found."""
    found = row(conn, sql, params)
    if found is None:
        raise ToolError(missing)
    return found


def scalar(conn: sqlite3.Connection, sql: str, params: Params = ()) -> Any:
    r = conn.execute(sql, params).fetchone()
    return None if r is None else r[0]


@contextmanager
def write(conn: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    """One write transaction: committed on success, rolled back if the tool raises (e.g. a ToolError).

    It takes SQLite's write lock up front (BEGIN IMMEDIATE), so checks made inside it (a hold still active,
    the next id) cannot be invalidated by a concurrent call on the same instance before the write lands.
    """
    if not conn.in_transaction:
        conn.execute("BEGIN IMMEDIATE")
    try:
        yield conn
    except BaseException:
        conn.rollback()
        raise
    else:
        conn.commit()


def meta(conn: sqlite3.Connection, key: str) -> str:
    """A value from the environment's `meta` table (the app's fixed 'today', the logged-in user...)."""
    value = scalar(conn, "SELECT value FROM meta WHERE key = ?", (key,))
    if value is None:
        raise ToolError(f"environment is missing its '{key}' setting")
    return str(value)


def app_clock(conn: sqlite3.Connection, latest_sql: str) -> str:
    """The app's clock for a write: a minute after the newest timestamp `latest_sql` returns, never before
    the environment's 'today' at 09:00. Deterministic, so replaying the same calls gives the same rows."""
    start = datetime.fromisoformat(meta(conn, "today") + "T09:00:00")
    latest = scalar(conn, latest_sql)
    now = max(start, datetime.fromisoformat(str(latest)) + timedelta(minutes=1)) if latest else start
    return now.strftime("%Y-%m-%dT%H:%M:00")


def webui_routes(env_id: str) -> AppFactory:
    """An environment's `app`: the routes of its web UI (services/localfleet/webui/<env_id>.py), served at each
    instance's app URL. Imported when first served, as the UI builds on the environment's own module."""

    def app(connect: Callable[[], sqlite3.Connection]) -> list[Any]:
        ui = importlib.import_module(f"rlgate.localfleet.webui.{env_id}")
        routes: list[Any] = ui.app_routes(connect)
        return routes

    return app


def like_pattern(text: str) -> str:
    """A LIKE pattern matching `text` anywhere, with LIKE wildcards in the text taken literally."""
    escaped = text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    return f"%{escaped}%"


def create_schema(conn: sqlite3.Connection, schema_sql: str) -> None:
    conn.executescript(schema_sql)
    conn.commit()


# --- seed vocabulary (fixed lists; environments draw from them with their own fixed-seed Random) ---

FIRST_NAMES = (
    "Alex",
    "Priya",
    "Jordan",
    "Mei",
    "Tomás",
    "Aisha",
    "Lukas",
    "Sofia",
    "Kenji",
    "Olivia",
    "Mateo",
    "Amara",
    "Noah",
    "Hana",
    "Ravi",
    "Elena",
    "Samuel",
    "Zoe",
    "Ibrahim",
    "Chloe",
    "Daniel",
    "Fatima",
    "Oscar",
    "Leila",
    "Marcus",
    "Yuki",
    "Gabriel",
    "Nora",
    "Ethan",
    "Ingrid",
    "Victor",
    "Maya",
    "Henrik",
    "Camila",
    "Omar",
    "Grace",
    "Felix",
    "Anya",
    "Julian",
    "Rosa",
)
LAST_NAMES = (
    "Morgan",
    "Patel",
    "Lee",
    "Chen",
    "García",
    "Okafor",
    "Schmidt",
    "Rossi",
    "Tanaka",
    "Brown",
    "Silva",
    "Nwosu",
    "Kim",
    "Novak",
    "Sharma",
    "Petrov",
    "Cohen",
    "Dubois",
    "Haddad",
    "Walsh",
    "Nguyen",
    "Khan",
    "Larsen",
    "Moreau",
    "Reyes",
    "Sato",
    "Fischer",
    "Costa",
    "Ahmed",
    "Murphy",
)
COMPANIES = (
    ("Northwind", "northwind.example"),
    ("Contoso", "contoso.example"),
    ("Fabrikam", "fabrikam.example"),
    ("Tailspin Toys", "tailspin.example"),
    ("Litware", "litware.example"),
    ("Adventure Works", "adventure.example"),
    ("Wide World Importers", "wideworld.example"),
    ("Proseware", "proseware.example"),
)


def full_name(rng: random.Random) -> str:
    return f"{rng.choice(FIRST_NAMES)} {rng.choice(LAST_NAMES)}"


def unique_names(rng: random.Random, count: int) -> list[str]:
    """`count` distinct full names, deterministic for a given Random state."""
    names: list[str] = []
    seen: set[str] = set()
    while len(names) < count:
        name = full_name(rng)
        if name not in seen:
            seen.add(name)
            names.append(name)
    return names


def slug(name: str) -> str:
    """ASCII lowercase slug of a person's name, e.g. 'Tomás García' -> 'tomas.garcia'."""
    table = str.maketrans("áéíóúñçãõ", "aeiouncao")
    return ".".join(part.lower().translate(table) for part in name.split())
