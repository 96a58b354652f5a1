"""reset_warm_vs_cold: Reset served from a warm pool vs Reset that provisions an instance on demand.

Two stacks against their own localfleet: one with `--warm-pool mailbox:v1=N` (measured once localfleet
reports the N pooled instances running), one without. Each does N sequential Resets of mailbox:v1 (each
session closed again outside the timing). Headline ratio: p50 cold / p50 warm (value = cold p50,
baseline = warm p50). No goal is set for it in the issue; it shows what the pool hides. localfleet creates
an instance in milliseconds (a copy of a seeded SQLite file), so the full run repeats the pair with
localfleet's `create_delay_s` fault at 2 s, closer to a real image's start, as extra figures.
"""

from __future__ import annotations

import asyncio
import json
import time

from fleet import AsyncFleet

from bench.fixtures import ERA_ENV, BenchContext, BenchError, Rlgate
from bench.harness import Entry, Stats, stats_table

NAME = "reset_warm_vs_cold"
SLOW_CREATE_S = 2.0  # full run only: localfleet's create_delay_s fault, a Fleet-like provisioning time


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


async def compare(ctx: BenchContext, env_key: str, count: int, create_delay_s: float) -> tuple[Stats, Stats, float]:
    """(warm, cold, pool fill seconds) on two fresh stacks whose localfleet takes `create_delay_s` per create."""
    pool = count + 1
    fill_timeout_s = 120.0 + 2 * pool * create_delay_s
    extra_args: list[str] = []
    if create_delay_s:
        faults = ctx.out_dir / f"faults-create-{create_delay_s:g}s.json"
        await asyncio.to_thread(faults.parent.mkdir, parents=True, exist_ok=True)
        await asyncio.to_thread(
            faults.write_text, json.dumps({"environments": {"*": {"create_delay_s": create_delay_s}}})
        )
        extra_args = ["--faults", str(faults)]
    tag = f"{create_delay_s:g}s"
    warm_stack, cold_stack = await asyncio.gather(
        ctx.stack(f"warm-{tag}", localfleet_args=extra_args, orchestrator_args=["--warm-pool", f"{env_key}={pool}"]),
        ctx.stack(f"cold-{tag}", localfleet_args=extra_args),
    )
    fill_s = await wait_for_pool(warm_stack.localfleet_url, env_key, pool, fill_timeout_s)
    async with Rlgate(warm_stack) as warm, Rlgate(cold_stack) as cold:
        # One unmeasured Reset on each stack pays first-use costs; the pool then refills to `pool`.
        await resets(cold, env_key, 1)
        await resets(warm, env_key, 1)
        await wait_for_pool(warm_stack.localfleet_url, env_key, pool, fill_timeout_s)
        warm_stats = await resets(warm, env_key, count)
        cold_stats = await resets(cold, env_key, count)
    await ctx.stop_stack(f"warm-{tag}")
    await ctx.stop_stack(f"cold-{tag}")
    return warm_stats, cold_stats, fill_s


async def run(ctx: BenchContext) -> list[Entry]:
    env_key = ERA_ENV["modern"]
    count = ctx.size(8, 30)
    warm, cold, fill_s = await compare(ctx, env_key, count, 0.0)
    stats = {"warm pool": warm, "cold (on demand)": cold}
    extra: dict[str, object] = {**warm.figures("warm_"), **cold.figures("cold_"), "pool_fill_s": round(fill_s, 1)}
    if not ctx.quick:  # what the pool hides when provisioning takes as long as a real image's start
        warm_d, cold_d, _ = await compare(ctx, env_key, count, SLOW_CREATE_S)
        stats |= {f"warm pool, {SLOW_CREATE_S:g} s creates": warm_d, f"cold, {SLOW_CREATE_S:g} s creates": cold_d}
        extra |= {
            **warm_d.figures("slow_create_warm_"),
            **cold_d.figures("slow_create_cold_"),
            "slow_create_s": SLOW_CREATE_S,
            "slow_create_ratio": round(cold_d.p50_ms / warm_d.p50_ms, 2),
        }
    print(stats_table(stats, "resets/s"))
    return [
        Entry(
            name=NAME,
            value=cold.p50_ms,
            baseline=warm.p50_ms,
            unit="ms (Reset p50, cold / warm)",
            baseline_name=f"Reset from a warm pool ({env_key}={count + 1})",
            extra=extra,
        )
    ]
