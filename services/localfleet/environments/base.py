"""What an environment provides to localfleet, and how its tools reach their instance's database.

An environment is a seeded SQLite schema plus MCP tools. localfleet builds one `MCPServer` per environment
(not per instance); each tool finds the instance it serves through `instance_db(ctx)`, which the platform
resolves from the request URL (`/instances/{id}/mcp`). Tests without HTTP can bind an instance with
`bind_instance(...)` (a context variable) and use the in-memory `mcp.Client(server)`.
"""

from __future__ import annotations

import contextvars
import sqlite3
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

AppFactory = Callable[[Callable[[], sqlite3.Connection]], list[Any]]  # -> list[starlette.routing.BaseRoute]


class InstanceLike(Protocol):
    """The part of a localfleet instance that tools need."""

    instance_id: str

    def current_db(self) -> sqlite3.Connection: ...


@dataclass(frozen=True)
class EnvironmentSpec:
    """A localfleet environment: `env_id:version`, its database and its tools."""

    env_id: str  # e.g. "mailbox"
    version: str  # e.g. "v1"
    name: str
    description: str
    schema_sql: str  # CREATE TABLE statements
    seed: Callable[[sqlite3.Connection], None]  # deterministic: same rows on every call
    register_tools: Callable[[Any], None]  # (mcp.server.MCPServer) -> None; adds 8-15 tools
    env_variables: dict[str, str] = field(default_factory=dict)  # e.g. LOGGED_IN_USER
    mcp_era: str = "modern"  # "modern" (2026-07-28, stateless) or "legacy" (initialize + Mcp-Session-Id)
    # The web app served at the instance's `{root}` (what the `computer` tool's browser shows): given a
    # function returning the instance's `current` connection, its routes, with paths relative to the app
    # root. None: a page naming the environment.
    app: AppFactory | None = None

    @property
    def env_key(self) -> str:
        return f"{self.env_id}:{self.version}"


_bound: contextvars.ContextVar[InstanceLike | None] = contextvars.ContextVar("localfleet_instance", default=None)
_resolver: Callable[[Any], InstanceLike | None] | None = None


class InstanceNotFound(LookupError):
    """The request names no live instance (deleted, expired, or never existed)."""


def set_instance_resolver(resolver: Callable[[Any], InstanceLike | None]) -> None:
    """Installed by the localfleet platform: maps an MCP tool `Context` to its instance."""
    global _resolver
    _resolver = resolver


def bind_instance(instance: InstanceLike) -> contextvars.Token[InstanceLike | None]:
    """Bind an instance for the current context (in-memory tests); undo with `_bound.reset(token)`."""
    return _bound.set(instance)


def current_instance(ctx: Any) -> InstanceLike:
    """The instance a tool call targets."""
    inst = _bound.get()
    if inst is None and _resolver is not None:
        inst = _resolver(ctx)
    if inst is None:
        raise InstanceNotFound("no live instance for this request")
    return inst


def instance_db(ctx: Any) -> sqlite3.Connection:
    """The `current` database of the instance a tool call targets."""
    return current_instance(ctx).current_db()
