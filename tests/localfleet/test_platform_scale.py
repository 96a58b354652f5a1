"""500 live instances in one localfleet process: creation time and resident memory (printed; generous bounds)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from typing import Any

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

            async def make(i: int) -> dict[str, Any]:
                async with sem:
                    r = await http.post("/v1/env/instances", json={"env_key": env_key, "run_id": "scale"})
                    assert r.status_code == 200, r.text
                    instance: dict[str, Any] = r.json()
                    return instance

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
        print(
            f"\nlocalfleet {N} x {env_key}: create {create_s:.1f}s ({create_s / N * 1000:.1f} ms/instance, "
            f"16 concurrent), RSS idle {rss_idle / mib:.0f} MiB, with {N} live {rss_live / mib:.0f} MiB, "
            f"after MCP use {rss_used / mib:.0f} MiB, disk {disk / mib:.0f} MiB, batch delete {delete_s:.1f}s"
        )
        assert create_s < 240
        assert rss_used < 1024 * mib


VERIFIER = "def v(before, after, transcript=None):\n    return 1\n"


async def _episode(http: httpx.AsyncClient, env_key: str, verify: bool) -> None:
    """One episode as the stack runs it: create, reset, MCP on both endpoints, verify, delete.

    The instance is deleted while its MCP clients are still open (their DELETE then gets 404), as happens
    when the orchestrator ends an episode before the gateway drops its clients.
    """
    r = await http.post("/v1/env/instances", json={"env_key": env_key, "run_id": "soak"})
    assert r.status_code == 200, r.text
    inst = r.json()
    root = inst["urls"]["root"]
    assert (await http.post(inst["urls"]["manager"]["reset"], json={})).json()["success"]
    async with contextlib.AsyncExitStack() as stack:
        for endpoint in ("mcp", "api/v1/mcp"):
            client = await stack.enter_async_context(Client(root + endpoint, read_timeout_seconds=60))
            await client.list_tools()
            assert not (await client.call_tool("add_note", {"title": "t", "body": "b"})).is_error
        if verify:
            out = (
                await http.post(
                    root + "api/v1/env/execute_verifier_function",
                    json={"function_code": VERIFIER, "function_name": "v"},
                )
            ).json()
            assert out["success"], out
        assert (await http.delete(f"/v1/env/instances/{inst['instance_id']}")).status_code == 200


@pytest.mark.slow
async def test_memory_flat_over_episodes() -> None:
    """RSS per episode stays small over a few hundred create → MCP (both eras) → verify → delete cycles.

    Before the fix every legacy-era session of a deleted instance stayed in the SDK's session manager until
    its 10-minute idle timeout, so RSS grew with every episode (the benchmarks log in docs/ has the figures).
    """
    warmup, n = 40, 300
    with LocalfleetProcess(environments="tests.support.localfleet:tiny_environments") as lf:
        assert lf.pid is not None
        proc = psutil.Process(lf.pid)
        sem = asyncio.Semaphore(4)
        async with httpx.AsyncClient(base_url=lf.base_url, headers=AUTH, timeout=60) as http:

            async def one(i: int) -> None:
                async with sem:
                    await _episode(http, "notes" if i % 2 == 0 else "notes-legacy", verify=i % 5 == 0)

            await asyncio.gather(*(one(i) for i in range(warmup)))  # imports, templates, allocator pools
            rss0, started = proc.memory_info().rss, time.monotonic()
            await asyncio.gather(*(one(i) for i in range(n)))
            took, rss1 = time.monotonic() - started, proc.memory_info().rss
            counters = (await http.get("/_admin/counters")).json()
        per_episode = (rss1 - rss0) / n
        print(
            f"\nlocalfleet {n} episodes in {took:.1f}s: RSS {rss0 / 2**20:.1f} -> {rss1 / 2**20:.1f} MiB, "
            f"{per_episode / 1024:.1f} KiB per episode, fds {proc.num_fds()}"
        )
        assert counters["instances_created"] == counters["instances_deleted"] == warmup + n
        assert counters["running_instances"] == 0
        assert per_episode < 20 * 1024, f"{per_episode / 1024:.1f} KiB per episode"
