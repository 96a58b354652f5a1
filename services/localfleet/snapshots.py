"""Snapshots of an instance's live database, and the route that takes them (`{root}api/v1/env/snapshot`, the
manager's `snapshot` URL Fleet's `ManagerURLs` lists).

A snapshot is a copy of `current.db` made with SQLite's online backup API, so it is consistent even while
tools write. It lives in `{data_dir}/snapshots/{id}.db` and outlives its instance: the control plane creates
instances from it (`POST /v1/env/instances` with `snapshot_id`), each getting the snapshot as its `current`
database and the environment's seed as its `seed` (the verifier's baseline stays the task's seed state).

Bounded: at most `MAX_SNAPSHOTS` are kept (the oldest is dropped first), and each lives `SNAPSHOT_TTL_S`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from rlgate.localfleet.instances import Instance, InstanceGone, connect, iso

if TYPE_CHECKING:
    from rlgate.localfleet.environments.base import EnvironmentSpec
    from rlgate.localfleet.platform import Platform

MAX_SNAPSHOTS = 1000
SNAPSHOT_TTL_S = 3600.0


class UnknownSnapshot(LookupError):
    """No such snapshot (never taken, expired or evicted)."""


@dataclass(frozen=True, slots=True)
class Snapshot:
    snapshot_id: str
    env_id: str
    version: str
    path: Path
    taken_at: float


class Snapshots:
    """The snapshots of one localfleet process (not persisted across restarts: their files are removed)."""

    def __init__(self, data_dir: Path, max_snapshots: int = MAX_SNAPSHOTS, ttl_s: float = SNAPSHOT_TTL_S) -> None:
        self.root = data_dir / "snapshots"
        self._max = max_snapshots
        self._ttl_s = ttl_s
        self._taken: OrderedDict[str, Snapshot] = OrderedDict()

    async def take(self, inst: Instance) -> Snapshot:
        """A consistent copy of the instance's live database."""
        snapshot_id = "snap-" + uuid.uuid4().hex[:20]
        snap = Snapshot(snapshot_id, inst.spec.env_id, inst.spec.version, self.root / f"{snapshot_id}.db", time.time())
        await asyncio.to_thread(_backup, inst.current_path, snap.path)
        self._taken[snap.snapshot_id] = snap
        await self._trim()
        return snap

    def get(self, snapshot_id: str) -> Snapshot:
        snap = self._taken.get(snapshot_id)
        if snap is None or time.time() - snap.taken_at > self._ttl_s:
            raise UnknownSnapshot(f"Snapshot '{snapshot_id}' not found")
        return snap

    async def _trim(self) -> None:
        now = time.time()
        drop = [s for s in self._taken.values() if now - s.taken_at > self._ttl_s]
        while len(self._taken) - len(drop) > self._max:
            oldest = next(s for s in self._taken.values() if s not in drop)
            drop.append(oldest)
        for snap in drop:
            self._taken.pop(snap.snapshot_id, None)
            await asyncio.to_thread(snap.path.unlink, True)

    async def clear(self) -> None:
        """Remove every snapshot file (start-up: snapshots are not restored)."""
        self._taken.clear()

        def wipe() -> None:
            self.root.mkdir(parents=True, exist_ok=True)
            for path in self.root.glob("*.db"):
                with contextlib.suppress(OSError):
                    path.unlink()

        await asyncio.to_thread(wipe)


def _backup(source: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    src = connect(source, read_only=True)
    dst = connect(target)
    try:
        src.backup(dst)
    finally:
        src.close()
        dst.close()


def from_snapshot(platform: Platform, snapshot_id: str | None, spec: EnvironmentSpec) -> Callable[[Path], None] | None:
    """A create's `snapshot_id` (POST /v1/env/instances): what writes the new instance's live database from
    the snapshot, or None without one. `UnknownSnapshot` for an unknown one, ValueError for one of another
    environment or version."""
    if not snapshot_id:
        return None
    snap = platform.snapshots.get(snapshot_id)
    if (snap.env_id, snap.version) != (spec.env_id, spec.version):
        raise ValueError(
            f"snapshot {snapshot_id!r} is of {snap.env_id}:{snap.version}, not {spec.env_id}:{spec.version}"
        )
    return functools.partial(_backup, snap.path)


def routes(platform: Platform) -> list[Route]:
    """`POST {root}api/v1/env/snapshot` -> `{"success", "snapshot_id", "env_key", "version", "created_at"}`."""
    from rlgate.localfleet.manager_api import PREFIX

    async def snapshot(request: Request) -> JSONResponse:
        try:
            inst = platform.registry.running(request.path_params["instance_id"])
        except InstanceGone as exc:
            return JSONResponse({"detail": str(exc)}, status_code=404)
        snap = await platform.snapshots.take(inst)
        return JSONResponse(
            {
                "success": True,
                "snapshot_id": snap.snapshot_id,
                "env_key": snap.env_id,
                "version": snap.version,
                "created_at": iso(snap.taken_at),
            }
        )

    return [Route(f"{PREFIX}/snapshot", snapshot, methods=["POST"])]
