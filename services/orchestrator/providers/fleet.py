"""The `fleet` provider: Fleet (or localfleet) through the fleet-python async SDK.

The SDK's own HTTP client retries 404s and 5xx with waits of up to 300-900 s; rlgate hands it a plain
`httpx.AsyncClient` (no retry transport) and bounds every call with `asyncio.wait_for`, so retry policy and
deadlines are the orchestrator's. Idempotent reads and deletes get a short bounded retry here; creates are
never retried at this level (the provisioner decides, under the caller's deadline and admission control).

Creates are safe to retry: a create's idempotency key is its intent id (INTENT_ENV_VAR), sent as
X-Request-ID on its POST (the SDK makes a fresh id per `make()` call and offers no way to pass one, so a
request hook sets it for the create running in this context). A retry after a lost reply is answered 409
duplicate_request_id with the first attempt's instance, which the SDK adopts once it runs (fleet-python ≥
0.2.127) and `create_from_snapshot` adopts the same way; an instance that failed or is gone makes the key
stale (`StaleRequest`). A 429's Retry-After is read by a response hook and rides on the `RateLimited` error.
"""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import inspect
import logging
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx
from fleet import AsyncFleet
from fleet._async.client import AsyncEnv
from fleet._async.exceptions import (
    FleetAPIError,
    FleetConflictError,
    FleetEnvironmentNotFoundError,
    FleetError,
    FleetInstanceLimitError,
    FleetRateLimitError,
    FleetTimeoutError,
    FleetVersionNotFoundError,
)
from fleet._async.tasks import Task as FleetTask
from fleet.runner_auth import RunnerTokenProvider

from rlgate.core.backoff import Backoff
from rlgate.orchestrator.providers.base import (
    INTENT_ENV_VAR,
    SCREEN_MODALITIES,
    EnvNotFound,
    InstanceGone,
    InstanceHandle,
    InstanceLimit,
    Provider,
    ProviderError,
    RateLimited,
    ResetFailed,
    Retryable,
    SnapshotUnsupported,
    StaleRequest,
    TaskDef,
    Unsupported,
    VerifierRun,
    score_of,
)
from rlgate.orchestrator.tasks import task_from_json
from rlgate.runtime import tracing

log = logging.getLogger(__name__)
T = TypeVar("T")
# Between attempts of an idempotent SDK call: 0.2 s doubling to 2 s, ±50 %.
CALL_BACKOFF = Backoff(0.2, 2.0, jitter=0.5)

SCREEN_IMAGE_TYPE = "mcp"  # the image type whose aggregator serves the `computer` tool
SCREEN_TTL_S = 1800  # default instance lifetimes (when RLGATE_INSTANCE_TTL_S is 0), as Fleet's client sets
TOOL_USE_TTL_S = 900

CREATE_PATH = "/v1/env/instances"
# The longest Retry-After honoured (a larger one is the platform's business, not a reason to stall a Reset).
MAX_RETRY_AFTER_S = 60.0


@dataclass
class _CreateCall:
    """The create running in this context: its idempotency key, and the Retry-After of its last 429."""

    request_id: str
    retry_after_s: float | None = None


_CREATE_CALL: ContextVar[_CreateCall | None] = ContextVar("rlgate_fleet_create", default=None)


@contextlib.contextmanager
def _create_call(request_id: str) -> Iterator[_CreateCall]:
    call = _CreateCall(request_id)
    token = _CREATE_CALL.set(call)
    try:
        yield call
    finally:
        _CREATE_CALL.reset(token)


def retry_after(value: str | None) -> float | None:
    """Seconds from a Retry-After header (delta-seconds or an HTTP date), bounded; None when absent or bad."""
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            seconds = email.utils.parsedate_to_datetime(value).timestamp() - time.time()
        except (TypeError, ValueError):
            return None
    return min(MAX_RETRY_AFTER_S, max(0.0, seconds))


async def _key_create(request: httpx.Request) -> None:
    call = _CREATE_CALL.get()
    if call is not None and call.request_id and request.method == "POST" and request.url.path.endswith(CREATE_PATH):
        request.headers["X-Request-ID"] = call.request_id


async def _note_retry_after(response: httpx.Response) -> None:
    call = _CREATE_CALL.get()
    if call is not None and response.status_code == 429:
        call.retry_after_s = retry_after(response.headers.get("retry-after"))


def _create_error(exc: BaseException, what: str, call: _CreateCall) -> ProviderError:
    """A create's failure: a stale idempotency key and a 429's Retry-After are known here."""
    err = map_fleet_error(exc, what)
    if isinstance(exc, FleetConflictError) and exc.instance_id:  # the key's instance failed: new key next
        return StaleRequest(f"{what}: {exc.message}")
    if isinstance(err, InstanceGone):  # the key's instance vanished while adopted
        return StaleRequest(str(err))
    if isinstance(err, RateLimited) and err.retry_after_s is None:
        err.retry_after_s = call.retry_after_s
    return err


# Placement failures Fleet reports as transient (fleet.md §5 #9).
_RETRYABLE_HINTS = ("retryable", "in-flight", "in flight", "placement", "temporarily", "try again")


def map_fleet_error(exc: BaseException, what: str) -> ProviderError:
    """A fleet-python exception as a provider error (the vocabulary the orchestrator maps to gRPC)."""
    if isinstance(exc, ProviderError):
        return exc
    if isinstance(exc, asyncio.TimeoutError | FleetTimeoutError | httpx.TimeoutException):
        return Retryable(f"{what}: timed out")
    if isinstance(exc, FleetInstanceLimitError):
        return InstanceLimit(f"{what}: {exc.message}", exc.running_instances, exc.instance_limit)
    if isinstance(exc, FleetRateLimitError):  # its Retry-After is read from the response (see _create_error)
        return RateLimited(f"{what}: rate limited: {exc.message}")
    if isinstance(exc, FleetEnvironmentNotFoundError | FleetVersionNotFoundError):
        return EnvNotFound(f"{what}: {exc.message}")
    if isinstance(exc, FleetConflictError):
        return Retryable(f"{what}: conflict: {exc.message}")
    if isinstance(exc, FleetAPIError):
        status = exc.status_code
        text = exc.message.lower()
        if status == 404:
            return InstanceGone(f"{what}: not found")
        if status == 412:  # the platform cannot serve this kind of instance (localfleet: screens, no browser)
            return Unsupported(f"{what}: {exc.message}")
        if status is None or status >= 500 or any(h in text for h in _RETRYABLE_HINTS):
            return Retryable(f"{what}: {exc.message}")
        if status == 400 and "not found" in text:
            return EnvNotFound(f"{what}: {exc.message}")
        return ProviderError(f"{what}: HTTP {status}: {exc.message}")
    if isinstance(exc, httpx.HTTPError | OSError):
        return Retryable(f"{what}: {type(exc).__name__}: {exc}")
    if isinstance(exc, FleetError):
        return ProviderError(f"{what}: {exc.message}")
    return ProviderError(f"{what}: {type(exc).__name__}: {exc}")


class FleetProvider(Provider):
    """fleet-python's AsyncFleet with rlgate's HTTP client and timeouts."""

    name = "fleet"

    def __init__(
        self, base_url: str, api_key: str, *, request_timeout: float = 30.0, max_connections: int = 200
    ) -> None:
        # No retry transport: the SDK default retries 404 (so "gone" looks like a hang) and waits minutes.
        self._http = httpx.AsyncClient(
            timeout=httpx.Timeout(request_timeout, connect=min(10.0, request_timeout)),
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
            # W3C trace context on every Fleet call; a create's idempotency key; a 429's Retry-After.
            event_hooks={"request": [tracing.httpx_request_hook, _key_create], "response": [_note_retry_after]},
        )
        self._fleet = AsyncFleet(
            api_key=api_key or None,
            base_url=base_url.rstrip("/") or None,
            httpx_client=self._http,
            max_retries=0,
            timeout=request_timeout,
        )
        # One runner-token resolution per client (as the SDK intends), not one per rebuilt instance object:
        # every `_env()` would otherwise pay a control-plane round trip before its first manager call.
        self._runner_tokens = RunnerTokenProvider(self._fleet.client)
        self.backoff = CALL_BACKOFF

    @property
    def sdk(self) -> AsyncFleet:
        return self._fleet

    async def close(self) -> None:
        await self._http.aclose()

    # -- helpers ----------------------------------------------------------------------------------------
    async def _call(self, what: str, fn: Callable[[], Awaitable[T]], timeout_s: float, *, attempts: int = 1) -> T:
        """Run an SDK call under `timeout_s` (total), retrying transient failures of idempotent calls."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        for attempt in range(1, attempts + 1):
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise Retryable(f"{what}: timed out")
            try:
                return await asyncio.wait_for(fn(), remaining)
            except Exception as exc:
                err = map_fleet_error(exc, what)
                wait = self.backoff.delay(attempt - 1)
                if not err.retryable or attempt == attempts or deadline - loop.time() < wait:
                    raise err from exc
                await asyncio.sleep(wait)
        raise AssertionError("unreachable")

    def _env(self, handle: InstanceHandle) -> AsyncEnv:
        """Rebuild the SDK's instance object from the stored record (no HTTP call)."""
        env = AsyncEnv(client=self._fleet.client, **handle.raw)
        env._runner_token_provider = self._runner_tokens
        return env

    @staticmethod
    def _handle(env: Any) -> InstanceHandle:
        raw = env.model_dump(mode="json")
        urls = env.urls
        root = urls.root if urls else ""
        manager = urls.manager.api if urls and urls.manager else ""
        version = env.version or ""
        env_key = f"{env.env_key}:{version}" if version and ":" not in env.env_key else env.env_key
        return InstanceHandle(
            instance_id=env.instance_id,
            env_key=env_key,
            root_url=root,
            manager_url=manager,
            endpoints=[f"{root}mcp", f"{root}api/v1/mcp"] if root else [],
            status=env.status or "",
            run_id=env.run_id or "",
            env_variables=dict(env.env_variables or {}),
            raw=raw,
        )

    # -- tasks ------------------------------------------------------------------------------------------
    async def load_tasks(self, *, timeout_s: float) -> list[TaskDef]:
        async def fetch() -> list[TaskDef]:
            out = []
            for sdk_task in await self._fleet.load_tasks():  # GET /v1/tasks, verifiers built by the SDK
                task = task_from_json(
                    {
                        "key": sdk_task.key,
                        "prompt": sdk_task.prompt,
                        "env_id": sdk_task.env_id,
                        "version": sdk_task.version,
                        "metadata": sdk_task.metadata or {},
                        "env_variables": sdk_task.env_variables or {},
                        "verifier_code": sdk_task.verifier_func or "",
                    }
                )  # modality and max_turns ride in metadata (TaskResponse has no field for them)
                task.sdk_task = sdk_task
                out.append(task)
            return out

        return await self._call("load tasks", fetch, timeout_s, attempts=3)

    async def parse_task(self, obj: dict[str, Any]) -> TaskDef:
        """Normalise one task and build the SDK's Task (and its verifier) for remote verification."""
        task = task_from_json(obj)
        sdk_json = dict(obj)
        sdk_json.setdefault("env_id", task.env_id)
        sdk_json.setdefault("version", task.version)
        if task.verifier_code:
            sdk_json["verifier_code"] = task.verifier_code
        try:
            task.sdk_task = await self._fleet.load_task_from_json(sdk_json)
        except Exception as exc:  # a malformed task must not sink the whole set
            log.warning("task %s: SDK could not load it: %s", task.key, exc)
        return task

    # -- instances --------------------------------------------------------------------------------------
    async def create(
        self,
        env_key: str,
        *,
        env_variables: dict[str, Any],
        run_id: str,
        ttl_s: int,
        heartbeat_interval_s: int,
        timeout_s: float,
        modality: str = "tool_use",
    ) -> InstanceHandle:
        # As Fleet's reference client provisions: screens on `image_type="mcp"` images (whose aggregator has
        # the `computer` tool), and a longer default life for them.
        screen = modality in SCREEN_MODALITIES
        ttl = ttl_s or (SCREEN_TTL_S if screen else TOOL_USE_TTL_S)

        async def make() -> AsyncEnv:
            return await self._fleet.make(
                env_key,
                env_variables=env_variables,
                image_type=SCREEN_IMAGE_TYPE if screen else None,
                run_id=run_id,
                ttl_seconds=ttl,
                heartbeat_interval=heartbeat_interval_s,
                timeout=timeout_s,
                max_wait_seconds=max(1, int(timeout_s) - 2),
            )

        with _create_call(str(env_variables.get(INTENT_ENV_VAR, ""))) as call:
            try:
                env = await self._call(f"create {env_key}", make, timeout_s)
            except ProviderError as err:
                raise _create_error(err.__cause__ or err, f"create {env_key}", call) from err
        if env.status in ("error", "stopped"):
            raise Retryable(f"create {env_key}: instance {env.instance_id} came up {env.status}")
        return self._handle(env)

    # -- snapshots (Fork) -------------------------------------------------------------------------------
    # The SDK has no snapshot call: its own HTTP clients carry them (the instance's manager client for the
    # manager's `snapshot` URL, the control plane's for a create from a snapshot), each under a timeout.
    def snapshot_unsupported(self, handle: InstanceHandle) -> str:
        manager = (handle.raw.get("urls") or {}).get("manager") or {}
        if not manager.get("snapshot"):
            return f"instance {handle.instance_id} lists no manager snapshot URL"
        return ""

    async def snapshot(self, handle: InstanceHandle, *, timeout_s: float) -> str:
        why = self.snapshot_unsupported(handle)
        if why:
            raise SnapshotUnsupported(why)
        env = self._env(handle)

        async def take() -> str:
            response = await env.instance.client.request("POST", "/snapshot")
            status: int = response.status_code  # the SDK's instance client is plain httpx: no raise on status
            if status in (404, 405, 501):
                raise SnapshotUnsupported(f"instance {handle.instance_id} answers no snapshot (HTTP {status})")
            if status >= 500:
                raise Retryable(f"snapshot of {handle.instance_id}: HTTP {status}")
            if status != 200:
                raise ProviderError(f"snapshot of {handle.instance_id}: HTTP {status}: {response.text[:200]}")
            body = response.json()
            snapshot_id = body.get("snapshot_id") if isinstance(body, dict) else None
            if not isinstance(snapshot_id, str) or not snapshot_id:
                raise ProviderError(f"snapshot of {handle.instance_id}: the answer names no snapshot_id")
            return snapshot_id

        return await self._call(f"snapshot {handle.instance_id}", take, timeout_s)

    async def create_from_snapshot(
        self,
        env_key: str,
        snapshot_id: str,
        *,
        env_variables: dict[str, Any],
        run_id: str,
        ttl_s: int,
        heartbeat_interval_s: int,
        timeout_s: float,
        modality: str = "tool_use",
    ) -> InstanceHandle:
        screen = modality in SCREEN_MODALITIES
        env_id, _, version = env_key.partition(":")
        body: dict[str, Any] = {
            "env_key": env_id,
            "snapshot_id": snapshot_id,
            "env_variables": env_variables,
            "run_id": run_id,
            "image_type": SCREEN_IMAGE_TYPE if screen else None,
            "ttl_seconds": ttl_s or (SCREEN_TTL_S if screen else TOOL_USE_TTL_S),
            "heartbeat_interval": heartbeat_interval_s or None,
            "max_wait_seconds": max(1, int(timeout_s) - 2),
        }
        if version:
            body["env_version"] = version

        async def make() -> InstanceHandle:
            try:
                response = await self._fleet.client.request(
                    "POST", CREATE_PATH, json={k: v for k, v in body.items() if v is not None}, timeout=timeout_s
                )
                env = AsyncEnv(client=self._fleet.client, **response.json())
            except FleetConflictError as exc:
                if not exc.instance_id:
                    raise
                env = await self._fleet.instance(exc.instance_id)  # a retry of a create that happened: adopt it
            loop = asyncio.get_running_loop()
            ends = loop.time() + timeout_s
            while env.status == "pending" and loop.time() < ends:  # a platform that answers before it runs
                await asyncio.sleep(0.5)
                env = await self._fleet.instance(env.instance_id)
            return self._handle(env)

        what = f"create {env_key} from {snapshot_id}"
        with _create_call(str(env_variables.get(INTENT_ENV_VAR, ""))) as call:
            try:
                handle = await self._call(what, make, timeout_s)
            except ProviderError as err:
                raise _create_error(err.__cause__ or err, what, call) from err
        if handle.status != "running":
            raise Retryable(f"create {env_key}: instance {handle.instance_id} came up {handle.status}")
        return handle

    async def reset(self, handle: InstanceHandle, *, timeout_s: float) -> None:
        env = self._env(handle)
        try:
            result = await asyncio.wait_for(env.reset(), timeout_s)
        except TimeoutError as exc:
            raise ResetFailed(f"reset of {handle.instance_id} did not answer within {timeout_s:.1f}s") from exc
        except Exception as exc:
            raise ResetFailed(f"reset of {handle.instance_id} failed: {map_fleet_error(exc, 'reset')}") from exc
        if not result.success:
            raise ResetFailed(f"reset of {handle.instance_id} reported failure: {result.message}")

    async def health(self, handle: InstanceHandle, *, timeout_s: float) -> bool:
        env = self._env(handle)
        try:
            info = await asyncio.wait_for(self._fleet.instance(handle.instance_id), timeout_s)
            if info.status != "running":
                return False
            response = await asyncio.wait_for(env.instance.client.request("GET", "/health"), timeout_s)
            status: int = response.status_code  # the fleet SDK is untyped
            return status == 200
        except Exception as exc:
            log.info("health check of %s failed: %s", handle.instance_id, map_fleet_error(exc, "health"))
            return False

    async def delete(self, instance_id: str, *, timeout_s: float) -> None:
        try:
            await self._call(f"delete {instance_id}", lambda: self._fleet.delete(instance_id), timeout_s, attempts=3)
        except InstanceGone:
            return  # 404 on delete: already done

    async def heartbeat(self, instance_id: str, *, timeout_s: float) -> None:
        await self._call(f"heartbeat {instance_id}", lambda: self._fleet.heartbeat(instance_id), timeout_s, attempts=2)

    async def list_instances(self, run_id: str, *, timeout_s: float) -> list[InstanceHandle]:
        envs = await self._call("list instances", lambda: self._fleet.instances(run_id=run_id), timeout_s, attempts=3)
        return [self._handle(e) for e in envs if e.status in ("pending", "running") and e.run_id == run_id]

    # -- verification -----------------------------------------------------------------------------------
    async def verify(
        self,
        task: TaskDef,
        handle: InstanceHandle,
        final_answer: str | None,
        *,
        timeout_s: float,
        tool_calls: Sequence[Any] | None = None,
    ) -> VerifierRun:
        """One run through the SDK's remote path (`Task.verify_detailed_async` -> /v1/verifiers/execute)."""
        sdk_task: FleetTask | None = task.sdk_task
        if sdk_task is None:
            return VerifierRun(success=False, message=f"task {task.key} has no loadable verifier")
        if sdk_task.verifier is None and sdk_task.verifier_func:
            try:
                sdk_task._rebuild_verifier()
            except Exception as exc:
                return VerifierRun(success=False, message=f"verifier code does not load: {exc}")
        kwargs: dict[str, Any] = {}
        if _accepts(sdk_task.verifier, "final_answer"):
            kwargs["final_answer"] = final_answer
        env = self._env(handle)
        try:
            response = await asyncio.wait_for(sdk_task.verify_detailed_async(env, **kwargs), timeout_s)
        except TimeoutError:
            raise
        except Exception as exc:
            err = map_fleet_error(exc, "verifier")
            if isinstance(err, InstanceGone | Retryable):
                raise Retryable(str(err)) from exc
            return VerifierRun(success=False, message=str(err))
        stdout = response.stdout or ""
        if not response.success:
            error = response.error or {}
            message = error.get("message") or error.get("type") or "verifier failed"
            if error.get("type"):
                message = f"{error['type']}: {error.get('message', '')}".strip()
            return VerifierRun(success=False, message=str(message), stdout=stdout)
        return VerifierRun(success=True, score=score_of(response.result), stdout=stdout)


def _accepts(verifier: Any, name: str) -> bool:
    func = getattr(verifier, "func", None)
    if func is None:
        return True
    try:
        params = inspect.signature(func).parameters
    except (TypeError, ValueError):
        return True
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
