"""Two processes sharing one store (the SQLite file / the Redis server): concurrent writes from both are
all visible, compare-and-set and request claims stay exact across processes, and a lease is exclusive."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import pytest

from rlgate.store import Session, SessionStore
from tests.store import worker
from tests.store.conftest import Backend

pytestmark = pytest.mark.backends("sqlite", "redis")  # another process opens the store: not the in-memory one
WORKER = Path(worker.__file__)


async def run_worker(url: str, *args: str, limit_s: float = 90.0) -> dict[str, Any]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        str(WORKER),
        url,
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), limit_s)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode == 0, err.decode()
    result: dict[str, Any] = json.loads(out.decode().strip().splitlines()[-1])
    return result


async def test_two_processes_write_concurrently(store: SessionStore, backend: Backend) -> None:
    n = 30
    await store.create_session(Session(session_id=worker.SHARED_COUNTER, env_key="counter"))
    child, parent = await asyncio.gather(
        run_worker(backend.url, "write", "child", str(n)), worker.write(store, "parent", n)
    )
    for prefix in ("child", "parent"):
        page, cursor = await store.list_sessions(run_id=prefix, limit=1000)
        assert sorted(s.session_id for s in page) == sorted(f"{prefix}-{i}" for i in range(n))
        assert cursor == ""
        assert await store.count_tool_calls(f"{prefix}-{n - 1}", 1) == 2
    counter = await store.get_session(worker.SHARED_COUNTER)
    assert counter is not None and counter.turn == 2 * n and counter.version == 2 * n + 1
    # each shared request id was claimed by exactly one of the two processes
    assert set(child["won"]).isdisjoint(parent["won"])
    assert set(child["won"]) | set(parent["won"]) == {f"req-{i}" for i in range(n)}
    assert await store.check_invariants() == []


async def test_lease_exclusive_across_processes(store: SessionStore, backend: Backend) -> None:
    assert await store.acquire_lease("leader", "parent", 30)
    assert (await run_worker(backend.url, "lease", "leader", "child", "30")) == {"acquired": False}
    await store.release_lease("leader", "parent")
    assert (await run_worker(backend.url, "lease", "leader", "child", "30")) == {"acquired": True}
    assert not await store.acquire_lease("leader", "parent", 30)
