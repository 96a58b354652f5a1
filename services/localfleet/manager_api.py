"""The instance-manager API under `{root}api/v1/env/` (what `env.instance` / `env.db()` call)."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from rlgate.localfleet.instances import Instance, InstanceGone, connect, iso
from rlgate.localfleet.platform import Platform

PREFIX = "/instances/{instance_id}/api/v1/env"
Endpoint = Callable[[Request], Awaitable[JSONResponse]]
InstanceHandler = Callable[[Request, Instance], Awaitable[JSONResponse]]
DatabaseHandler = Callable[[Request, Instance, str], Awaitable[JSONResponse]]


def _gone(exc: Exception) -> JSONResponse:
    return JSONResponse({"detail": str(exc)}, status_code=404)


async def _body(request: Request) -> dict[str, Any]:
    raw = await request.body()
    if not raw:
        return {}
    try:
        doc = await request.json()
    except ValueError:
        return {}
    return doc if isinstance(doc, dict) else {}


def routes(platform: Platform) -> list[Route]:
    registry = platform.registry

    def per_instance(handler: InstanceHandler) -> Endpoint:
        """The endpoint: `handler(request, inst)` for the running instance the path names; 404 when it is gone."""

        async def endpoint(request: Request) -> JSONResponse:
            try:
                inst = registry.running(request.path_params["instance_id"])
            except InstanceGone as exc:
                return _gone(exc)
            return await handler(request, inst)

        return endpoint

    def per_database(handler: DatabaseHandler) -> Endpoint:
        """As `per_instance`, with the database the path names (`seed` or `current`); 404 for another name."""

        async def on_instance(request: Request, inst: Instance) -> JSONResponse:
            name = request.path_params["name"]
            try:
                inst.db_path(name)
            except KeyError:
                return JSONResponse({"detail": f"No sqlite resource named {name!r}"}, 404)
            return await handler(request, inst, name)

        return per_instance(on_instance)

    async def reset(request: Request, inst: Instance) -> JSONResponse:
        faults = platform.faults.for_env(inst.spec.env_id, inst.spec.version)
        platform.counters.inc_env(inst.spec.env_id, "resets")
        if faults.reset_hang:
            platform.counters.inc_env(inst.spec.env_id, "reset_hangs")
            while (await request.receive())["type"] != "http.disconnect":  # hang until the client gives up
                pass
            return JSONResponse({"success": False, "message": "hung (injected fault)"}, status_code=504)
        started = time.monotonic()
        await registry.reset(inst)
        return JSONResponse({"success": True, "message": f"Reset to seed in {time.monotonic() - started:.3f}s"})

    async def resources(request: Request, inst: Instance) -> JSONResponse:
        return JSONResponse(
            [
                {"name": "seed", "type": "sqlite", "mode": "ro", "label": "Initial state"},
                {"name": "current", "type": "sqlite", "mode": "rw", "label": "Live state"},
            ]
        )

    async def health(request: Request, inst: Instance) -> JSONResponse:
        return JSONResponse(
            {"status": "healthy", "timestamp": iso(time.time()), "service": "localfleet-instance-manager"}
        )

    async def describe(request: Request, inst: Instance, name: str) -> JSONResponse:
        try:
            tables = await asyncio.to_thread(_describe, inst, name)
        except sqlite3.Error as exc:
            return JSONResponse(
                {
                    "success": False,
                    "resource_name": name,
                    "error": str(exc),
                    "message": f"Failed to describe database: {exc}",
                }
            )
        return JSONResponse({"success": True, "resource_name": name, "tables": tables, "message": "Schema retrieved"})

    async def query(request: Request, inst: Instance, name: str) -> JSONResponse:
        body = await _body(request)
        sql = body.get("query")
        if not isinstance(sql, str) or not sql.strip():
            return JSONResponse({"detail": "query must be a non-empty string"}, status_code=400)
        args = body.get("args") or []
        read_only = bool(body.get("read_only", True)) or name == "seed"
        try:
            result = await asyncio.to_thread(_query, inst, name, sql, list(args), read_only)
        except sqlite3.Error as exc:
            return JSONResponse({"success": False, "error": str(exc), "message": f"Query failed: {exc}"})
        return JSONResponse(result)

    async def diff_structured(request: Request, inst: Instance) -> JSONResponse:
        body = await _body(request)
        ignore = body.get("ignore_config") or {}
        from fleet.verifiers.local_executor import diff_dbs

        result = await asyncio.to_thread(
            diff_dbs,
            str(inst.seed_path),
            str(inst.current_path),
            set(ignore.get("tables") or []),
            {t: set(f) for t, f in (ignore.get("table_fields") or {}).items()},
        )
        return JSONResponse(result)

    async def execute_verifier_function(request: Request, inst: Instance) -> JSONResponse:
        body = await _body(request)
        code = body.get("function_code")
        if not isinstance(code, str) or not code.strip():
            return JSONResponse({"detail": "function_code must be a non-empty string"}, status_code=400)
        outcome = await platform.verifiers.run_manager(inst, code, body.get("function_name"), body.get("text_solution"))
        return JSONResponse(outcome)

    return [
        Route(f"{PREFIX}/reset", per_instance(reset), methods=["POST"]),
        Route(f"{PREFIX}/resources", per_instance(resources), methods=["GET"]),
        Route(f"{PREFIX}/health", per_instance(health), methods=["GET"]),
        Route(f"{PREFIX}/resources/sqlite/{{name}}/describe", per_database(describe), methods=["GET"]),
        Route(f"{PREFIX}/resources/sqlite/{{name}}/query", per_database(query), methods=["POST"]),
        Route(f"{PREFIX}/diff/structured", per_instance(diff_structured), methods=["POST"]),
        Route(f"{PREFIX}/execute_verifier_function", per_instance(execute_verifier_function), methods=["POST"]),
    ]


def _describe(inst: Instance, name: str) -> list[dict[str, Any]]:
    conn = connect(inst.db_path(name), read_only=True)
    try:
        tables = []
        for table, sql in conn.execute(
            "SELECT name, sql FROM sqlite_master WHERE type='table' AND name NOT LIKE 'sqlite_%' ORDER BY name"
        ):
            cols = conn.execute(f'PRAGMA table_info("{table.replace(chr(34), chr(34) * 2)}")').fetchall()
            tables.append(
                {
                    "name": table,
                    "sql": sql or "",
                    "columns": [
                        {
                            "name": c[1],
                            "type": c[2],
                            "notnull": bool(c[3]),
                            "default_value": c[4],
                            "primary_key": c[5] > 0,
                            "pk": c[5],
                        }
                        for c in cols
                    ],
                }
            )
        return tables
    finally:
        conn.close()


def _query(inst: Instance, name: str, sql: str, args: list[Any], read_only: bool) -> dict[str, Any]:
    conn = connect(inst.db_path(name), read_only=read_only)
    try:
        cur = conn.execute(sql, args)
        columns = [d[0] for d in cur.description] if cur.description else None
        rows = [[_jsonable(v) for v in r] for r in cur.fetchall()] if columns is not None else None
        if not read_only:
            conn.commit()
        return {
            "success": True,
            "columns": columns,
            "rows": rows,
            "rows_affected": cur.rowcount if cur.rowcount >= 0 else None,
            "last_insert_id": cur.lastrowid,
            "message": "Query executed",
        }
    finally:
        conn.close()


def _jsonable(value: Any) -> Any:
    if isinstance(value, bytes):
        import base64

        return base64.b64encode(value).decode()
    return value
