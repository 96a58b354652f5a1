"""localfleet's HTTP server: `create_app(config)` (an ASGI app) and `run(config)` (uvicorn, until a signal).

Layout (all under one port; `{root}` = `{public_url}/instances/{id}/`):
  /health, /v1/...                     control plane (fleet-python's FLEET_BASE_URL)
  {root}api/v1/env/...                 instance manager
  {root}mcp, {root}api/v1/mcp          MCP endpoints (routed by `MCPEndpoints`, outside Starlette)
  {root} and its other sub-paths       the instance's web app (routed by `WebApps`)
  /_admin/...                          faults and counters, for tests
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.types import Receive, Scope, Send

from rlgate.localfleet import admin, control_plane, manager_api, snapshots
from rlgate.localfleet.config import LocalfleetConfig
from rlgate.localfleet.connections import ConnectionTracker
from rlgate.localfleet.environments.base import EnvironmentSpec
from rlgate.localfleet.platform import Platform
from rlgate.runtime import eventloop
from rlgate.runtime.config import is_loopback, redacted, split_host_port

log = logging.getLogger(__name__)


class LocalfleetApp:
    """The ASGI app: MCP paths go to `MCPEndpoints`, everything else to a Starlette router."""

    def __init__(self, platform: Platform) -> None:
        self.platform = platform

        @contextlib.asynccontextmanager
        async def lifespan(_: Starlette) -> AsyncIterator[None]:
            async with platform.running():
                yield

        self.router = Starlette(
            routes=[
                *control_plane.routes(platform),
                *manager_api.routes(platform),
                *snapshots.routes(platform),
                *admin.routes(platform),
            ],
            lifespan=lifespan,
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            self.platform.counters.inc("http_requests")
            path = scope["path"]
            target = self.platform.endpoints.match(path)
            if target is not None:
                await self.platform.endpoints.handle(scope, receive, send, *target)
                return
            instance_id = self.platform.webapps.match(path)
            if instance_id is not None:
                await self.platform.webapps.handle(scope, receive, send, instance_id)
                return
            if path.startswith("/v1/") and not _has_credentials(scope):
                await _deny(send)
                return
        await self.router(scope, receive, send)


def _has_credentials(scope: Scope) -> bool:
    names = {k for k, _ in scope.get("headers") or []}
    return b"authorization" in names or b"x-jwt-token" in names


async def _deny(send: Send) -> None:
    body = json.dumps({"detail": "Missing API key (send Authorization: Bearer <any key>)"}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 401,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})


def create_app(
    config: LocalfleetConfig, specs: list[EnvironmentSpec] | None = None, tasks: list[dict[str, Any]] | None = None
) -> LocalfleetApp:
    """The app for `config`; `specs`/`tasks` default to the bundled environments and task files."""
    return LocalfleetApp(Platform(config, specs, tasks))


async def serve(
    config: LocalfleetConfig, specs: list[EnvironmentSpec] | None = None, tasks: list[dict[str, Any]] | None = None
) -> None:
    host, port = split_host_port(config.listen)
    if not is_loopback(host):
        log.warning("localfleet is listening on %s: it has no authentication (admin routes included)", host)
    app = create_app(config, specs, tasks)
    tracker = ConnectionTracker(app.platform.counters)
    app.platform.endpoints.connections = tracker
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=host,
            port=port,
            http=tracker.protocol_class(),
            lifespan="on",
            ws="none",
            log_level="warning",
            access_log=False,
            timeout_graceful_shutdown=1,
            timeout_keep_alive=30,
        )
    )
    log.info(
        "localfleet on http://%s:%d (%d environments, %d tasks) %s",
        host,
        port,
        len(app.platform.catalog.specs),
        len(app.platform.tasks),
        redacted(config),
    )
    await server.serve()


def run(config: LocalfleetConfig) -> None:
    from rlgate.runtime.logs import setup_logging

    setup_logging(config.log_level, service="localfleet")
    eventloop.run(serve(config))
