"""Each instance's web app, served at its `{root}` (`urls.app == [root]`), as Fleet serves an instance's app
at the root of its own host.

One Starlette app per environment, not per instance (like the MCP servers): the router below takes the
instance from the path (`/instances/{id}/...`), and the app's routes reach that instance's `current`
database through the connection function they were built with (closed when the request ends). Paths under
`{root}` belong to the app except `mcp` and `api/...` (the MCP endpoints and the instance manager).

An app sees `scope["root_path"] == "/instances/{id}"`: links built with `request.url_for(...)` or from
`request.scope["root_path"]` stay inside the instance (an absolute `href="/x"` would leave it).
"""

from __future__ import annotations

import contextvars
import html
import re
import sqlite3
from urllib.parse import urlsplit

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, RedirectResponse
from starlette.routing import BaseRoute, Route
from starlette.types import Receive, Scope, Send

from rlgate.localfleet.environments.base import EnvironmentSpec
from rlgate.localfleet.instances import Instance, InstanceGone, InstanceRegistry, db_call_scope

INSTANCE_PATH = re.compile(r"^/instances/(?P<id>[A-Za-z0-9_-]+)(?P<rest>/.*)?$")

_serving: contextvars.ContextVar[Instance | None] = contextvars.ContextVar("localfleet_app_instance", default=None)


def app_root(instance_id: str) -> str:
    """The path of an instance's app (what `{root}` points at)."""
    return f"/instances/{instance_id}/"


def in_app(instance_id: str, path: str) -> bool:
    """Whether `path` is a page of the instance's app (not its MCP endpoints or its manager API)."""
    root = app_root(instance_id)
    if path == root.rstrip("/"):
        return True
    if not path.startswith(root):
        return False
    rest = path[len(root) :]
    return not (rest in ("mcp", "mcp/") or rest.startswith("api/"))


def same_origin(url: str, origin: str) -> bool:
    """Whether `url` is on `origin` (`scheme://host:port`), compared as the browser does (default ports)."""
    a, b = urlsplit(url), urlsplit(origin)
    defaults = {"http": 80, "https": 443}
    try:
        return (a.scheme, a.hostname, a.port or defaults.get(a.scheme)) == (
            b.scheme,
            b.hostname,
            b.port or defaults.get(b.scheme),
        )
    except ValueError:  # a malformed port
        return False


def _current_db() -> sqlite3.Connection:
    inst = _serving.get()
    if inst is None:
        raise RuntimeError("no instance is being served (an app's connection asked for outside a request)")
    return inst.current_db()


def _placeholder(spec: EnvironmentSpec) -> list[BaseRoute]:
    """The page of an environment without a web app."""
    name, description = html.escape(spec.name), html.escape(spec.description)
    page = (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{name}</title></head>"
        f"<body style='font-family:sans-serif;margin:2em'><h1>{name}</h1><p>{description}</p>"
        "<p>This environment has no web app.</p></body></html>"
    )

    async def index(request: Request) -> HTMLResponse:
        return HTMLResponse(page)

    return [Route("/", index, methods=["GET"])]


class WebApps:
    """Every environment's app, and the router from `/instances/{id}/...` to the instance's."""

    def __init__(self, specs: list[EnvironmentSpec], registry: InstanceRegistry) -> None:
        self.registry = registry
        self._apps = {
            spec.env_key: Starlette(routes=spec.app(_current_db) if spec.app else _placeholder(spec)) for spec in specs
        }

    @staticmethod
    def match(path: str) -> str | None:
        """The instance whose app `path` addresses, or None (not an app path)."""
        m = INSTANCE_PATH.match(path)
        if m is None or not in_app(m.group("id"), path):
            return None
        return m.group("id")

    async def handle(self, scope: Scope, receive: Receive, send: Send, instance_id: str) -> None:
        try:
            inst = self.registry.running(instance_id)
        except InstanceGone as exc:
            await JSONResponse({"detail": str(exc)}, status_code=404)(scope, receive, send)
            return
        root = app_root(instance_id)
        if scope["path"] == root.rstrip("/"):
            query = scope.get("query_string", b"").decode("latin-1")
            location = scope.get("root_path", "") + root + (f"?{query}" if query else "")
            await RedirectResponse(location, status_code=307)(scope, receive, send)
            return
        scope = dict(scope)
        scope["root_path"] = scope.get("root_path", "") + root.rstrip("/")
        token = _serving.set(inst)
        try:
            with db_call_scope():  # the connections the request's handlers opened close with it
                await self._apps[inst.spec.env_key](scope, receive, send)
        finally:
            _serving.reset(token)
