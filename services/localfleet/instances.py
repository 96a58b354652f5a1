"""Instances: their SQLite files, lifecycle (ttl, heartbeat, delete) and the registry the routes share.

Each instance owns a directory `{data_dir}/instances/{id}/` with `seed.db` and `current.db` (copies of the
environment's template) and `instance.json` (so instances outlive a localfleet restart, as Fleet's do).
Tools reach `current.db` through `Instance.current_db()`; the connections a tool call opens are closed when
the call ends (`db_call_scope`).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import json
import logging
import shutil
import sqlite3
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rlgate.localfleet.catalog import Catalog
from rlgate.localfleet.counters import Counters
from rlgate.localfleet.environments.base import EnvironmentSpec
from rlgate.localfleet.faults import EnvFaults, FaultRegistry

log = logging.getLogger(__name__)

TEAM_ID = "localfleet"
REGION = "local"
_TOMBSTONES = 10_000  # stopped instances remembered (GET shows them as "stopped")
_REQUEST_IDS = 100_000  # create request ids remembered for duplicate detection

_call_conns: contextvars.ContextVar[list[sqlite3.Connection] | None] = contextvars.ContextVar(
    "localfleet_call_conns", default=None
)


@contextlib.contextmanager
def db_call_scope() -> Iterator[None]:
    """Close every connection tools opened inside this block (one tool call)."""
    conns: list[sqlite3.Connection] = []
    token = _call_conns.set(conns)
    try:
        yield
    finally:
        _call_conns.reset(token)
        for conn in conns:
            with contextlib.suppress(sqlite3.Error):
                conn.close()


def connect(path: Path, read_only: bool = False) -> sqlite3.Connection:
    if read_only:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, check_same_thread=False, timeout=10)
    else:
        conn = sqlite3.connect(path, check_same_thread=False, timeout=10)
    conn.execute("PRAGMA busy_timeout = 10000")
    return conn


def iso(ts: float | None) -> str | None:
    return None if ts is None else datetime.fromtimestamp(ts, UTC).isoformat().replace("+00:00", "Z")


class LimitExceeded(Exception):
    def __init__(self, running: int, limit: int, scope: str) -> None:
        super().__init__(
            f"Instance limit reached{scope}: You have {running} running instances out of a maximum of {limit}."
        )
        self.running, self.limit = running, limit


class RateLimited(Exception):
    """Too many creations in flight (Fleet's per-team burst cap) or too many per second (its rate limit); the
    SDK raises FleetRateLimitError. `retry_after_s` is the Retry-After answered."""

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class PlacementFailed(Exception):
    """A create refused for now with nothing created, marked `"retryable": true` (as Fleet's placement
    failures are)."""


class DuplicateRequest(Exception):
    def __init__(self, instance_id: str) -> None:
        super().__init__(f"Request was already processed for instance '{instance_id}'")
        self.instance_id = instance_id


class InstanceGone(LookupError):
    """No such instance, or it is no longer running."""


@dataclass(slots=True)  # up to 10,000 stopped ones are kept as tombstones: no per-object __dict__
class Instance:
    instance_id: str
    spec: EnvironmentSpec
    directory: Path
    created_at: float
    env_variables: dict[str, Any]
    run_id: str | None = None
    ttl_seconds: int | None = None
    heartbeat_interval: int | None = None
    data_key: str | None = None
    data_version: str | None = None
    image_type: str | None = None
    status: str = "pending"
    updated_at: float = 0.0
    terminated_at: float | None = None
    last_heartbeat: float | None = None

    @property
    def seed_path(self) -> Path:
        return self.directory / "seed.db"

    @property
    def current_path(self) -> Path:
        return self.directory / "current.db"

    def db_path(self, name: str) -> Path:
        if name == "seed":
            return self.seed_path
        if name == "current":
            return self.current_path
        raise KeyError(name)

    def current_db(self) -> sqlite3.Connection:
        """A connection to `current.db`, closed when the tool call that asked for it ends."""
        if self.status != "running":
            raise InstanceGone(f"instance {self.instance_id} is {self.status}")
        conn = connect(self.current_path)
        conns = _call_conns.get()
        if conns is not None:
            conns.append(conn)
        return conn

    def heartbeat_deadline(self) -> float | None:
        if not self.heartbeat_interval:
            return None
        # One missed beat is tolerated: the instance dies after two intervals of silence.
        return (self.last_heartbeat or self.created_at) + 2 * self.heartbeat_interval

    def expires_at(self) -> float | None:
        ends = [
            t
            for t in (self.heartbeat_deadline(), self.created_at + self.ttl_seconds if self.ttl_seconds else None)
            if t is not None
        ]
        return min(ends) if ends else None

    def to_record(self) -> dict[str, Any]:
        """What instance.json holds (enough to rebuild the instance after a restart)."""
        return {
            "instance_id": self.instance_id,
            "env_id": self.spec.env_id,
            "version": self.spec.version,
            "created_at": self.created_at,
            "env_variables": self.env_variables,
            "run_id": self.run_id,
            "ttl_seconds": self.ttl_seconds,
            "heartbeat_interval": self.heartbeat_interval,
            "data_key": self.data_key,
            "data_version": self.data_version,
            "image_type": self.image_type,
        }


class InstanceRegistry:
    """Every instance of this localfleet process: create, read, list, delete, heartbeat, expire."""

    def __init__(
        self,
        catalog: Catalog,
        data_dir: Path,
        faults: FaultRegistry,
        counters: Counters,
        instance_limit: int,
        reaper_interval_s: float = 1.0,
    ) -> None:
        self.catalog = catalog
        self.root = data_dir / "instances"
        self.faults = faults
        self.counters = counters
        self.default_limit = instance_limit
        self.reaper_interval_s = reaper_interval_s
        self.live: dict[str, Instance] = {}
        self.stopped: dict[str, Instance] = {}
        self._request_ids: dict[str, str] = {}
        self._buckets: dict[str, tuple[float, float]] = {}  # env_key -> (tokens, at): the create_rate fault
        self._creating = 0  # create requests being served (counters: creates_in_flight_peak)
        self._reaper: asyncio.Task[None] | None = None
        # Called with the id of every instance that stops, so per-instance state elsewhere (MCP sessions)
        # dies with it instead of lingering until its own idle timeout.
        self.on_stopped: list[Callable[[str], Awaitable[None]]] = []

    # ---- lifecycle of the registry itself ----

    async def start(self) -> None:
        await asyncio.to_thread(self.root.mkdir, parents=True, exist_ok=True)
        for record in await asyncio.to_thread(self._scan):
            try:
                spec = self.catalog.resolve(record["env_id"], record["version"])
            except LookupError:
                log.warning("dropping instance %s of unknown environment %s", record["instance_id"], record["env_id"])
                await asyncio.to_thread(shutil.rmtree, self.root / record["instance_id"], True)
                continue
            inst = self._from_record(record, spec)
            inst.last_heartbeat = time.time()  # heartbeats missed while localfleet was down do not count
            self.live[inst.instance_id] = inst
        if self.live:
            log.info("restored %d instances from %s", len(self.live), self.root)
        self._reaper = asyncio.create_task(self._reap_forever(), name="localfleet-reaper")

    async def stop(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
            self._reaper = None

    def _scan(self) -> list[dict[str, Any]]:
        records = []
        for path in sorted(self.root.glob("*/instance.json")):
            try:
                records.append(json.loads(path.read_text()))
            except (OSError, json.JSONDecodeError):
                log.warning("ignoring unreadable %s", path)
        return records

    def _from_record(self, r: dict[str, Any], spec: EnvironmentSpec) -> Instance:
        return Instance(
            instance_id=r["instance_id"],
            spec=spec,
            directory=self.root / r["instance_id"],
            created_at=r["created_at"],
            env_variables=r.get("env_variables") or {},
            run_id=r.get("run_id"),
            ttl_seconds=r.get("ttl_seconds"),
            heartbeat_interval=r.get("heartbeat_interval"),
            data_key=r.get("data_key"),
            data_version=r.get("data_version"),
            image_type=r.get("image_type"),
            status="running",
            updated_at=r["created_at"],
        )

    # ---- operations ----

    def running_count(self, env_key: str | None = None) -> int:
        return sum(1 for i in self.live.values() if env_key is None or i.spec.env_key == env_key)

    async def create(
        self,
        spec: EnvironmentSpec,
        *,
        request_id: str | None,
        env_variables: dict[str, Any] | None,
        run_id: str | None,
        ttl_seconds: int | None,
        heartbeat_interval: int | None,
        data_key: str | None = None,
        data_version: str | None = None,
        image_type: str | None = None,
        current_from: Callable[[Path], None] | None = None,
    ) -> Instance:
        """`current_from(path)`, when given, writes the live database (a snapshot's) instead of the seed."""
        # Every create request counts while it is served, refused ones too: the peak is what callers sent.
        self._creating += 1
        self.counters.peak("creates_in_flight_peak", self._creating)
        try:
            faults = self._admit(spec, request_id)
            now = time.time()
            inst = Instance(
                instance_id=uuid.uuid4().hex[:16],
                spec=spec,
                directory=self.root / "",
                created_at=now,
                env_variables={**spec.env_variables, **(env_variables or {})},
                run_id=run_id,
                ttl_seconds=ttl_seconds or None,
                heartbeat_interval=heartbeat_interval or None,
                data_key=data_key,
                data_version=data_version,
                image_type=image_type,
                updated_at=now,
                last_heartbeat=now,
            )
            inst.directory = self.root / inst.instance_id
            # Bound before the slow part, so a retried POST finds it (409) and a GET shows "pending".
            self.live[inst.instance_id] = inst
            if request_id:
                self._request_ids[request_id] = inst.instance_id
                while len(self._request_ids) > _REQUEST_IDS:
                    self._request_ids.pop(next(iter(self._request_ids)))
            try:
                if faults.create_delay_s:
                    await asyncio.sleep(faults.create_delay_s)
                template = await self.catalog.template(spec)
                await asyncio.to_thread(self._materialize, inst, template, current_from)
            except BaseException as exc:
                deleted = self.live.pop(inst.instance_id, None) is None
                await asyncio.to_thread(shutil.rmtree, inst.directory, True)
                if deleted and isinstance(exc, Exception):  # its files were removed from under the copy
                    raise InstanceGone(f"instance {inst.instance_id} was deleted while being created") from exc
                raise
            if inst.instance_id not in self.live:  # deleted while it was being created
                await asyncio.to_thread(shutil.rmtree, inst.directory, True)
                raise InstanceGone(f"instance {inst.instance_id} was deleted while being created")
            inst.status = "running"
            inst.updated_at = time.time()
            self.counters.inc("instances_created")
            return inst
        finally:
            self._creating -= 1

    def _admit(self, spec: EnvironmentSpec, request_id: str | None) -> EnvFaults:
        """The create's refusals (a repeated request id, the instance limits, the in-flight cap, the create rate,
        a placement failure), raised before anything is made; the faults that apply to `spec` otherwise."""
        if request_id and request_id in self._request_ids:
            raise DuplicateRequest(self._request_ids[request_id])
        faults = self.faults.for_env(spec.env_id, spec.version)
        limit = self.faults.instance_limit(self.default_limit)
        if self.running_count() >= limit:
            raise LimitExceeded(self.running_count(), limit, "")
        if faults.instance_limit is not None and self.running_count(spec.env_key) >= faults.instance_limit:
            raise LimitExceeded(self.running_count(spec.env_key), faults.instance_limit, f" for {spec.env_key}")
        inflight = sum(1 for i in self.live.values() if i.status == "pending" and i.spec.env_key == spec.env_key)
        if faults.max_inflight_creates is not None and inflight >= faults.max_inflight_creates:
            self.counters.inc("creates_throttled")
            self.counters.inc("creates_over_inflight_cap")
            raise RateLimited(f"Too many in-flight instance creations for this team ({inflight} for {spec.env_key})")
        self._take_create_token(spec.env_key, faults.create_rate)
        if self.faults.chance(faults.placement_failure_rate):
            self.counters.inc("creates_placement_failed")
            raise PlacementFailed(f"no capacity to place {spec.env_key} right now")
        return faults

    def _take_create_token(self, env_key: str, rate: float) -> None:
        """The create_rate fault: a token bucket of one second's worth per environment; RateLimited (with the
        wait for the next token) when it is empty."""
        if rate <= 0:
            return
        now = time.monotonic()
        tokens, at = self._buckets.get(env_key, (max(1.0, rate), now))
        tokens = min(max(1.0, rate), tokens + (now - at) * rate)
        if tokens < 1.0:
            self._buckets[env_key] = (tokens, now)
            self.counters.inc("creates_throttled")
            self.counters.inc("creates_over_rate")
            raise RateLimited(f"Rate limit exceeded: {rate:g} creates/s for {env_key}", (1.0 - tokens) / rate)
        self._buckets[env_key] = (tokens - 1.0, now)

    @staticmethod
    def _materialize(inst: Instance, template: Path, current_from: Callable[[Path], None] | None = None) -> None:
        inst.directory.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(template, inst.seed_path)
        if current_from is None:
            shutil.copyfile(template, inst.current_path)
        else:
            current_from(inst.current_path)
        (inst.directory / "instance.json").write_text(json.dumps(inst.to_record()))

    def get(self, instance_id: str) -> Instance:
        inst = self.live.get(instance_id) or self.stopped.get(instance_id)
        if inst is None:
            raise InstanceGone(f"Instance '{instance_id}' not found")
        return inst

    def running(self, instance_id: str) -> Instance:
        inst = self.live.get(instance_id)
        if inst is None or inst.status != "running":
            raise InstanceGone(f"Instance '{instance_id}' not found or not running")
        return inst

    def select(self, status: str | None = None, run_id: str | None = None) -> list[Instance]:
        pool = list(self.stopped.values()) if status == "stopped" else list(self.live.values())
        return [
            i
            for i in pool
            if (status in (None, "stopped") or i.status == status) and (run_id is None or i.run_id == run_id)
        ]

    async def delete(self, instance_id: str, reason: str = "deleted") -> Instance:
        inst = self.live.pop(instance_id, None)
        if inst is None:
            return self.get(instance_id)  # already stopped: idempotent; unknown: InstanceGone
        inst.status = "stopped"
        inst.terminated_at = inst.updated_at = time.time()
        self.stopped[instance_id] = inst
        while len(self.stopped) > _TOMBSTONES:
            self.stopped.pop(next(iter(self.stopped)))
        self.counters.inc("instances_expired" if reason == "expired" else "instances_deleted")
        for hook in self.on_stopped:
            try:
                await hook(instance_id)
            except Exception:  # cleanup elsewhere must not keep the instance half-deleted
                log.exception("cleanup of stopped instance %s failed", instance_id)
        await asyncio.to_thread(shutil.rmtree, inst.directory, True)
        log.info("instance %s %s", instance_id, reason)
        return inst

    async def delete_batch(self, run_id: str) -> list[Instance]:
        return [await self.delete(i.instance_id) for i in self.select(run_id=run_id)]

    def heartbeat(self, instance_id: str) -> Instance:
        inst = self.running(instance_id)
        inst.last_heartbeat = inst.updated_at = time.time()
        return inst

    async def reset(self, inst: Instance) -> None:
        """Restore `current` from `seed` (SQLite backup: consistent even with tool connections open)."""
        await asyncio.to_thread(self._restore, inst)

    @staticmethod
    def _restore(inst: Instance) -> None:
        src = connect(inst.seed_path, read_only=True)
        dst = connect(inst.current_path)
        try:
            src.backup(dst)
        finally:
            src.close()
            dst.close()

    async def _reap_forever(self) -> None:
        while True:
            await asyncio.sleep(self.reaper_interval_s)
            now = time.time()
            for inst in list(self.live.values()):
                ends = inst.expires_at()
                if inst.status == "running" and ends is not None and now >= ends:
                    try:
                        await self.delete(inst.instance_id, reason="expired")
                    except Exception:  # one bad directory must not stop the reaper
                        log.exception("reaping %s failed", inst.instance_id)
