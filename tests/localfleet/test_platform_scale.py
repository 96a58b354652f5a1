"""500 live instances in one localfleet process: creation time and resident memory (printed; generous bounds)."""

from __future__ import annotations

import asyncio
import os
import time

import httpx
import psutil
import pytest
from mcp import Client

from tests.support.localfleet import LocalfleetProcess

AUTH = {"Authorization": "Bearer scale"}
N = 500


def _dir_size(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


@pytest.mark.slow
async def test_500_live_instances() -> None:
    with LocalfleetProcess() as lf:
        assert lf.pid is not None
        proc = psutil.Process(lf.pid)
        sem = asyncio.Semaphore(16)
        async with httpx.AsyncClient(base_url=lf.base_url, headers=AUTH, timeout=120) as http:
            envs = [e["env_key"] for e in (await http.get("/v1/env/")).json()]
            env_key = "mailbox" if "mailbox" in envs else envs[0]
            rss_idle = proc.memory_info().rss
            async def make(i: int) -> dict:
                async with sem:
                    r = await http.post("/v1/env/instances", json={"env_key": env_key, "run_id": "scale"})
                    assert r.status_code == 200, r.text
                    return r.json()

            started = time.monotonic()
            instances = await asyncio.gather(*(make(i) for i in range(N)))
            create_s = time.monotonic() - started
            rss_live = proc.memory_info().rss
            account = (await http.get("/v1/account")).json()
            assert account["instance_count"] == N

            # they are live: MCP on the first and last, the manager on one in the middle
            for inst in (instances[0], instances[-1]):
                async with Client(inst["urls"]["root"] + "mcp") as client:
                    assert (await client.list_tools()).tools
            mid = instances[N // 2]["urls"]["manager"]["api"]
            assert (await http.post(f"{mid}/reset", json={})).json()["success"]
            rss_used = proc.memory_info().rss
            disk = _dir_size(lf.data_dir)

            started = time.monotonic()
            closed = (await http.delete("/v1/env/instances/batch", params={"run_id": "scale"})).json()
            delete_s = time.monotonic() - started
            assert len(closed) == N

        mib = 1024 * 1024
        print(f"\nlocalfleet {N} x {env_key}: create {create_s:.1f}s ({create_s / N * 1000:.1f} ms/instance, "
              f"16 concurrent), RSS idle {rss_idle / mib:.0f} MiB, with {N} live {rss_live / mib:.0f} MiB, "
              f"after MCP use {rss_used / mib:.0f} MiB, disk {disk / mib:.0f} MiB, batch delete {delete_s:.1f}s")
        assert create_s < 240
        assert rss_used < 1024 * mib
