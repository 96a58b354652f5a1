"""The control plane fleet-python talks to (`FLEET_BASE_URL`): environments, instances, account, tasks,
runs, heartbeats and the verifier bundle routes. Bodies and error shapes follow fleet-python 0.2.133's
models and `_handle_error_response` (403 instance limit, 404, 409 duplicate request id, 400 env/version).
"""

from __future__ import annotations

import base64
import binascii
import math
import time
from collections import defaultdict
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from rlgate.localfleet.browser import BrowserUnavailable
from rlgate.localfleet.catalog import UnknownEnvironment
from rlgate.localfleet.instances import (
    REGION,
    TEAM_ID,
    DuplicateRequest,
    Instance,
    InstanceGone,
    LimitExceeded,
    PlacementFailed,
    RateLimited,
    iso,
)
from rlgate.localfleet.mcp_mount import SCREEN_IMAGE_TYPE
from rlgate.localfleet.platform import Platform
from rlgate.localfleet.safe_unpickle import UnsafePayload, decode_verifier_args, split_env_marker
from rlgate.localfleet.snapshots import UnknownSnapshot, from_snapshot
from rlgate.localfleet.tasks_loader import task_response
from rlgate.localfleet.verifier_exec import BadBundle


def error(status: int, detail: Any) -> JSONResponse:
    return JSONResponse({"detail": detail}, status_code=status)


def instance_json(platform: Platform, inst: Instance) -> dict[str, Any]:
    root = platform.root_url(inst)
    api = f"{root}api/v1/env"
    return {
        "instance_id": inst.instance_id,
        "env_key": inst.spec.env_id,
        "version": inst.spec.version,
        "status": inst.status,
        "subdomain": inst.instance_id,
        "created_at": iso(inst.created_at),
        "updated_at": iso(inst.updated_at),
        "terminated_at": iso(inst.terminated_at),
        "team_id": TEAM_ID,
        "region": REGION,
        "env_variables": inst.env_variables,
        "data_key": inst.data_key,
        "data_version": inst.data_version,
        "urls": {
            "root": root,
            "app": [root],
            "api": None,
            "health": f"{api}/health",
            "api_docs": None,
            "manager": {
                "api": api,
                "docs": f"{api}/docs",
                "reset": f"{api}/reset",
                "diff": f"{api}/diff/structured",
                "snapshot": f"{api}/snapshot",
                "execute_verifier_function": f"{api}/execute_verifier_function",
                "execute_verifier_function_with_upload": f"{api}/execute_verifier_function_with_upload",
            },
            "mcp": {"api": f"{root}mcp", "aggregator": f"{root}api/v1/mcp"},
        },
        "health": inst.status == "running",
        "run_id": inst.run_id,
        "profile_id": None,
        "heartbeat_interval": inst.heartbeat_interval,
        "heartbeat_region": None,
        "ttl_seconds": inst.ttl_seconds,
        "image_type": inst.image_type,
        "mcp_era": inst.spec.mcp_era,
    }


def _opt_int(body: dict[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer")
    return value


def _opt_str(body: dict[str, Any], name: str) -> str | None:
    value = body.get(name)
    if value is not None and not isinstance(value, str):
        raise ValueError(f"{name} must be a string")
    return value


async def _json_body(request: Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except ValueError as exc:
        raise ValueError(f"request body is not JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise ValueError("request body must be a JSON object")
    return body


def routes(platform: Platform) -> list[Route]:
    registry = platform.registry
    started = iso(time.time()) or ""

    async def health(request: Request) -> JSONResponse:
        return JSONResponse({"status": "ok", "service": "localfleet", "instances": registry.running_count()})

    async def list_envs(request: Request) -> JSONResponse:
        return JSONResponse([platform.catalog.describe(e) for e in platform.catalog.env_ids()])

    async def get_env(request: Request) -> JSONResponse:
        try:
            spec = platform.catalog.resolve_key(request.path_params["env_key"])
        except UnknownEnvironment as exc:
            return error(404, str(exc))
        return JSONResponse(platform.catalog.describe(spec.env_id))

    async def regions(request: Request) -> JSONResponse:
        return JSONResponse([REGION])

    async def create(request: Request) -> JSONResponse:
        try:
            body = await _json_body(request)
            env_key = body.get("env_key")
            if not isinstance(env_key, str) or not env_key:
                raise ValueError("env_key is required")
            env_id, _, inline_version = env_key.partition(":")
            spec = platform.catalog.resolve(env_id, _opt_str(body, "env_version") or inline_version or None)
            env_vars = body.get("env_variables")
            if env_vars is not None and not isinstance(env_vars, dict):
                raise ValueError("env_variables must be an object")
            kwargs: dict[str, Any] = dict(
                run_id=_opt_str(body, "run_id"),
                ttl_seconds=_opt_int(body, "ttl_seconds"),
                heartbeat_interval=_opt_int(body, "heartbeat_interval"),
                data_key=_opt_str(body, "data_key"),
                data_version=_opt_str(body, "data_version"),
                image_type=_opt_str(body, "image_type"),
                current_from=from_snapshot(platform, _opt_str(body, "snapshot_id"), spec),
            )
        except (ValueError, UnknownEnvironment, UnknownSnapshot) as exc:
            return error(400, str(exc))
        if kwargs["image_type"] == SCREEN_IMAGE_TYPE:
            try:
                platform.browser.executable()  # refused now, not at the first screenshot
            except BrowserUnavailable as exc:
                return error(
                    412, {"error_type": "browser_unavailable", "message": f"image_type 'mcp' needs a browser: {exc}"}
                )
        try:
            inst = await registry.create(
                spec, request_id=request.headers.get("x-request-id"), env_variables=env_vars, **kwargs
            )
        except LimitExceeded as exc:
            return error(
                403,
                {
                    "error_type": "instance_limit_exceeded",
                    "message": str(exc),
                    "running_instances": exc.running,
                    "instance_limit": exc.limit,
                },
            )
        except RateLimited as exc:
            response = error(429, str(exc))
            response.headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after_s)))  # delta-seconds: whole
            return response
        except PlacementFailed as exc:
            return error(503, {"error_type": "placement_failed", "message": str(exc), "retryable": True})
        except DuplicateRequest as exc:
            return error(409, {"error": "duplicate_request_id", "instance_id": exc.instance_id, "message": str(exc)})
        except InstanceGone as exc:
            return error(409, str(exc))
        faults = platform.faults.for_env(spec.env_id, spec.version)
        if platform.faults.chance(faults.create_reply_loss_rate):  # made, but the caller never hears of it
            platform.counters.inc("create_replies_lost")
            connections = platform.endpoints.connections
            if connections is not None and connections.abort(request.scope.get("client")):
                return error(500, "reply lost (injected fault)")  # written to a closed socket: never read
        return JSONResponse(instance_json(platform, inst))

    async def list_instances(request: Request) -> JSONResponse:
        q = request.query_params
        found = registry.select(status=q.get("status") or None, run_id=q.get("run_id") or None)
        return JSONResponse([instance_json(platform, i) for i in found])

    async def get_instance(request: Request) -> JSONResponse:
        try:
            inst = registry.get(request.path_params["instance_id"])
        except InstanceGone as exc:
            return error(404, str(exc))
        return JSONResponse(instance_json(platform, inst))

    async def delete_instance(request: Request) -> JSONResponse:
        try:
            inst = await registry.delete(request.path_params["instance_id"])
        except InstanceGone as exc:
            return error(404, str(exc))
        return JSONResponse(instance_json(platform, inst))

    async def delete_batch(request: Request) -> JSONResponse:
        run_id = request.query_params.get("run_id")
        if not run_id:
            if request.query_params.get("profile_id"):
                return JSONResponse([])  # localfleet has no profiles
            return error(400, "At least one of run_id or profile_id must be provided")
        return JSONResponse([instance_json(platform, i) for i in await registry.delete_batch(run_id)])

    async def heartbeat(request: Request) -> JSONResponse:
        try:
            inst = registry.heartbeat(request.path_params["instance_id"])
        except InstanceGone as exc:
            return error(404, str(exc))
        enabled = bool(inst.heartbeat_interval)
        return JSONResponse(
            {
                "success": True,
                "instance_id": inst.instance_id,
                "last_heartbeat": iso(inst.last_heartbeat) if enabled else None,
                "deadline_timestamp": inst.heartbeat_deadline(),
                "interval_seconds": inst.heartbeat_interval,
            }
        )

    async def runs(request: Request) -> JSONResponse:
        groups: dict[str, list[Instance]] = defaultdict(list)
        active_only = request.query_params.get("active", "true").lower() != "false"
        for inst in [*registry.live.values(), *([] if active_only else registry.stopped.values())]:
            if inst.run_id:
                groups[inst.run_id].append(inst)
        return JSONResponse(
            [
                {
                    "run_id": run_id,
                    "running_count": sum(1 for i in insts if i.status == "running"),
                    "total_count": len(insts),
                    "first_created_at": iso(min(i.created_at for i in insts)),
                    "last_created_at": iso(max(i.created_at for i in insts)),
                }
                for run_id, insts in sorted(groups.items())
            ]
        )

    async def account(request: Request) -> JSONResponse:
        return JSONResponse(
            {
                "team_id": TEAM_ID,
                "team_name": "localfleet",
                "instance_limit": platform.faults.instance_limit(platform.config.instance_limit),
                "instance_count": registry.running_count(),
            }
        )

    async def runner_token(request: Request) -> JSONResponse:
        return JSONResponse({"token": "localfleet-runner"})  # accepted, never required

    def _tasks() -> list[dict[str, Any]]:
        return [task_response(t, started) for t in platform.tasks]

    async def list_tasks(request: Request) -> JSONResponse:
        q = request.query_params
        tasks = _tasks()
        env_key = q.get("env_key")
        if env_key:
            env_id, _, version = env_key.partition(":")
            tasks = [t for t in tasks if t["environment_id"] == env_id and (not version or t["version"] == version)]
        keys = q.getlist("task_keys")
        if keys:
            tasks = [t for t in tasks if t["key"] in set(keys)]
        return JSONResponse({"tasks": tasks, "total": len(tasks)})

    async def get_task(request: Request) -> JSONResponse:
        for t in _tasks():
            if t["key"] == request.path_params["task_key"]:
                return JSONResponse(t)
        return error(404, f"Task '{request.path_params['task_key']}' not found")

    async def get_verifier(request: Request) -> JSONResponse:
        for t in _tasks():
            if t.get("verifier_id") == request.path_params["verifier_id"]:
                return JSONResponse(t["verifier"])
        return error(404, f"Verifier '{request.path_params['verifier_id']}' not found")

    async def verifiers_check(request: Request) -> JSONResponse:
        sha = request.query_params.get("sha256", "")
        if platform.verifiers.has_bundle(sha):
            return JSONResponse({"success": True, "key": sha, "version": 1})
        return JSONResponse({"success": False})

    async def verifiers_execute(request: Request) -> JSONResponse:
        try:
            body = await _json_body(request)
            if body.get("bundle"):
                try:
                    bundle = base64.b64decode(body["bundle"], validate=True)
                except (binascii.Error, ValueError, TypeError) as exc:
                    raise ValueError(f"bundle is not base64: {exc}") from exc
                sha = platform.verifiers.add_bundle(bundle)
            else:
                sha = str(body.get("sha256") or "")
            code = platform.verifiers.bundles.get(sha)
            if code is None:
                # 400 (not 404, which the SDK's transport retries): the SDK re-sends with the bundle on "not found".
                return error(400, f"Verifier bundle not found for sha256 {sha!r}; upload the bundle")
            if body.get("args"):
                args, kwargs = decode_verifier_args(body["args"])
            else:
                args_array = body.get("args_array") or []
                if not isinstance(args_array, list):
                    raise ValueError("args_array must be a list")
                args, kwargs = list(args_array), {}
            instance_id, args = split_env_marker(args)
            if instance_id is None:
                raise ValueError("the verifier arguments name no instance ({'env': instance_id})")
            timeout = body.get("timeout")
            if timeout is not None and (
                not isinstance(timeout, int | float) or isinstance(timeout, bool) or not 1 <= timeout <= 300
            ):
                raise ValueError("timeout must be between 1 and 300 seconds")
        except (ValueError, BadBundle, UnsafePayload) as exc:
            return error(400, str(exc))
        try:
            inst = registry.running(instance_id)
        except InstanceGone as exc:
            return error(404, str(exc))
        result = await platform.verifiers.run_remote(inst, code, args, kwargs, timeout, key=body.get("key"))
        return JSONResponse(result)

    return [
        Route("/health", health, methods=["GET"]),
        Route("/v1/env/instances", create, methods=["POST"]),
        Route("/v1/env/instances", list_instances, methods=["GET"]),
        Route("/v1/env/instances/batch", delete_batch, methods=["DELETE"]),
        Route("/v1/env/instances/{instance_id}", get_instance, methods=["GET"]),
        Route("/v1/env/instances/{instance_id}", delete_instance, methods=["DELETE"]),
        Route("/v1/env/instances/{instance_id}/heartbeat", heartbeat, methods=["POST"]),
        Route("/v1/env/runs", runs, methods=["GET"]),
        Route("/v1/env/", list_envs, methods=["GET"]),
        Route("/v1/env", list_envs, methods=["GET"]),
        Route("/v1/env/{env_key}", get_env, methods=["GET"]),
        Route("/v1/regions", regions, methods=["GET"]),
        Route("/v1/account", account, methods=["GET"]),
        Route("/v1/runner-auth/token", runner_token, methods=["GET"]),
        Route("/v1/tasks", list_tasks, methods=["GET"]),
        Route("/v1/tasks/{task_key}", get_task, methods=["GET"]),
        Route("/v1/verifiers/check", verifiers_check, methods=["GET"]),
        Route("/v1/verifiers/execute", verifiers_execute, methods=["POST"]),
        Route("/v1/verifiers/{verifier_id}", get_verifier, methods=["GET"]),
    ]
