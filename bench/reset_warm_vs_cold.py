"""reset_warm_vs_cold: Reset served from a warm pool vs Reset that provisions an instance on demand.

Two stacks against their own localfleet: one with `--warm-pool mailbox:v1=N` (measured once localfleet
reports the N pooled instances running), one without. Each does N sequential Resets of mailbox:v1 (each
session closed again outside the timing). Headline ratio: p50 cold / p50 warm (value = cold p50,
baseline = warm p50). No goal is set for it in the issue; it shows what the pool hides.
"""

from __future__ import annotations

import asyncio
import time

from fleet import AsyncFleet

from bench.fixtures import ERA_ENV, BenchContext, BenchError, Rlgate
from bench.harness import Entry, Stats, stats_table

NAME = "reset_warm_vs_cold"


async def running_instances(fleet: AsyncFleet, env_key: str) -> int:
    env_id = env_key.partition(":")[0]
    return sum(1 for inst in await fleet.instances(status="running") if inst.env_key in (env_id, env_key))


async def wait_for_pool(base_url: str, env_key: str, size: int, timeout_s: float) -> float:
    """Seconds until localfleet runs `size` instances of `env_key` (the orchestrator's warm pool)."""
    fleet = AsyncFleet(api_key="localfleet", base_url=base_url, max_retries=0, timeout=30.0)
    start = time.perf_counter()
    while (count := await running_instances(fleet, env_key)) < size:
        if time.perf_counter() - start > timeout_s:
            raise BenchError(f"warm pool of {size} not filled after {timeout_s:.0f} s ({count} running)")
        await asyncio.sleep(0.25)
    return time.perf_counter() - start


async def resets(rl: Rlgate, env_key: str, count: int) -> Stats:
    latencies: list[float] = []
    start = time.perf_counter()
    for _ in range(count):
        session = await rl.reset(env_key)
        latencies.append(session.reset_ms / 1e3)
        await rl.close_session(session)
    return Stats.from_latencies(latencies, time.perf_counter() - start)


async def run(ctx: BenchContext) -> list[Entry]:
    env_key = ERA_ENV["modern"]
    count = ctx.size(8, 30)
    pool = count + 1
    fill_timeout_s = 120.0 if ctx.quick else 600.0
    warm_stack, cold_stack = await asyncio.gather(
        ctx.stack("warm", orchestrator_args=["--warm-pool", f"{env_key}={pool}"]),
        ctx.stack("cold"))
    fill_s = await wait_for_pool(warm_stack.localfleet_url, env_key, pool, fill_timeout_s)
    async with Rlgate(warm_stack) as warm, Rlgate(cold_stack) as cold:
        # One unmeasured Reset on each stack pays first-use costs; the pool then refills to `pool`.
        await resets(cold, env_key, 1)
        await resets(warm, env_key, 1)
        await wait_for_pool(warm_stack.localfleet_url, env_key, pool, fill_timeout_s)
        warm_stats = await resets(warm, env_key, count)
        cold_stats = await resets(cold, env_key, count)
    stats = {"warm pool": warm_stats, "cold (on demand)": cold_stats}
    print(stats_table(stats, "resets/s"))
    return [Entry(
        name=NAME, value=cold_stats.p50_ms, baseline=warm_stats.p50_ms, unit="ms (Reset p50, cold / warm)",
        baseline_name=f"Reset from a warm pool ({env_key}={pool})",
        extra={**warm_stats.figures("warm_"), **cold_stats.figures("cold_"), "pool_fill_s": round(fill_s, 1)},
    )]
