"""Test-only admin routes: faults (read/replace), counters (read/reset), forgetting MCP sessions.

localfleet listens on loopback only; these routes are there so tests can flip faults without a restart.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from rlgate.localfleet.faults import FaultError
from rlgate.localfleet.platform import Platform


def routes(platform: Platform) -> list[Route]:
    async def get_faults(request: Request) -> JSONResponse:
        return JSONResponse(platform.faults.plan.to_json())

    async def set_faults(request: Request) -> JSONResponse:
        try:
            doc = await request.json()
            platform.faults.set(doc)
        except (ValueError, FaultError) as exc:
            return JSONResponse({"detail": str(exc)}, status_code=400)
        return JSONResponse(platform.faults.plan.to_json())

    async def get_counters(request: Request) -> JSONResponse:
        snap = platform.counters.snapshot()
        snap["open_connections"] = platform.endpoints.connections.open_count if platform.endpoints.connections else None
        snap["running_instances"] = platform.registry.running_count()
        snap["open_screens"] = platform.browser.open_screens
        snap["browser_running"] = platform.browser.running
        return JSONResponse(snap)

    async def reset_counters(request: Request) -> JSONResponse:
        platform.counters.reset()
        return JSONResponse({"reset": True})

    async def forget_sessions(request: Request) -> JSONResponse:
        return JSONResponse({"forgotten": await platform.endpoints.forget_all_sessions()})

    return [
        Route("/_admin/faults", get_faults, methods=["GET"]),
        Route("/_admin/faults", set_faults, methods=["POST", "PUT"]),
        Route("/_admin/counters", get_counters, methods=["GET"]),
        Route("/_admin/counters", reset_counters, methods=["DELETE"]),
        Route("/_admin/counters/reset", reset_counters, methods=["POST"]),
        Route("/_admin/forget_sessions", forget_sessions, methods=["POST"]),
    ]
