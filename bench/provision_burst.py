"""provision_burst: a burst of Resets against a platform that caps creates as Fleet does, rlgate against a
client-side per-process semaphore (what SkyRL-Fleet's Tinker entry point does), in the same run.

Both sides face their own localfleet with the same faults: at most 16 creates in flight and 20 creates/s
(429 past either; each create takes 0.2 s). rlgate: one stack whose orchestrator admits creates by its shared
admission (16 in flight, 20/s, the same numbers as the platform's caps), N Resets from two runs at once, each
session closed as soon as it has started. Baseline: two "trainer processes", each its own fleet-python client
with its default retries (3, on 429 too) behind an `asyncio.Semaphore(8)`, N creates between them, each
instance deleted as soon as it has started. Figures: seconds until all N have started, and failures (a Reset
or a create that failed after its retries). Headline: rlgate's time against the cap's ideal N / rate; goals:
0 failures and a time within 1.2x of the ideal.
"""

from __future__ import annotations

import asyncio
import json
import time

import grpc
from fleet import AsyncFleet

from bench.fixtures import ERA_ENV, BenchContext
from bench.harness import Entry, Goal
from rlgate.v1 import orchestrator_pb2, orchestrator_pb2_grpc

NAME = "provision_burst"
IN_FLIGHT_CAP = 16
RATE_CAP = 20.0
CREATE_S = 0.2
PROCESSES = 2  # the baseline's trainer processes
PER_PROCESS = 8  # SkyRL-Fleet's asyncio.Semaphore(8)
GOALS = (Goal("ratio", "<=", 1.2), Goal("failures", "<=", 0))
TIME_LIMIT_S = {"quick": 300.0, "full": 1800.0}


async def faults_args(ctx: BenchContext) -> list[str]:
    path = ctx.out_dir / "faults-provision-burst.json"
    doc = {
        "environments": {
            "*": {"max_inflight_creates": IN_FLIGHT_CAP, "create_rate": RATE_CAP, "create_delay_s": CREATE_S}
        }
    }
    await asyncio.to_thread(path.parent.mkdir, parents=True, exist_ok=True)
    await asyncio.to_thread(path.write_text, json.dumps(doc))
    return ["--faults", str(path)]


async def rlgate_side(ctx: BenchContext, env_key: str, count: int, faults: list[str]) -> tuple[float, int]:
    """(seconds until all `count` Resets have started, failures)."""
    stack = await ctx.stack(
        "rlgate",
        localfleet_args=faults,
        env={
            "RLGATE_MAX_CONCURRENT_CREATES": str(IN_FLIGHT_CAP),
            "RLGATE_CREATE_RATE": str(RATE_CAP),
            "RLGATE_CREATE_BURST": str(IN_FLIGHT_CAP),
            "RLGATE_CREATE_QUEUE_WAIT_S": "1800",
            "RLGATE_MAX_SESSIONS": str(2 * count),
        },
    )
    failures = 0
    # One channel per run, as two trainer processes would hold (a connection carries at most 1,024 calls).
    channels = [grpc.aio.insecure_channel(stack.orchestrator_address) for _ in range(2)]
    stubs = [orchestrator_pb2_grpc.OrchestratorServiceStub(c) for c in channels]

    async def episode(run: int) -> None:
        nonlocal failures
        try:
            reset = await stubs[run].Reset(
                orchestrator_pb2.ResetRequest(env_key=env_key, run_id=f"run-{run}"), timeout=1800
            )
        except grpc.aio.AioRpcError:
            failures += 1
            return
        await stubs[run].Close(orchestrator_pb2.CloseRequest(session_id=reset.session_id), timeout=60)

    try:
        start = time.perf_counter()
        await asyncio.gather(*(episode(i % 2) for i in range(count)))
        elapsed = time.perf_counter() - start
    finally:
        for channel in channels:
            await channel.close()
    await ctx.stop_stack("rlgate")
    return elapsed, failures


async def baseline_side(ctx: BenchContext, env_key: str, count: int, faults: list[str]) -> tuple[float, int]:
    """(seconds until all `count` creates have started or failed, failures)."""
    stack = await ctx.stack("semaphore", localfleet_args=faults)
    failures = 0

    async def process(share: int) -> None:
        nonlocal failures
        fleet = AsyncFleet(api_key="localfleet", base_url=stack.localfleet_url)  # the SDK's default retries
        gate = asyncio.Semaphore(PER_PROCESS)

        async def create() -> None:
            nonlocal failures
            async with gate:
                try:
                    env = await fleet.make(env_key)
                except Exception:
                    failures += 1
                    return
            await fleet.delete(env.instance_id)

        await asyncio.gather(*(create() for _ in range(share)))

    start = time.perf_counter()
    shares = [count // PROCESSES + (1 if i < count % PROCESSES else 0) for i in range(PROCESSES)]
    await asyncio.gather(*(process(share) for share in shares))
    elapsed = time.perf_counter() - start
    await ctx.stop_stack("semaphore")
    return elapsed, failures


async def run(ctx: BenchContext) -> list[Entry]:
    env_key = ERA_ENV["modern"]
    count = ctx.size(128, 1024)
    faults = await faults_args(ctx)
    ideal = count / RATE_CAP
    rl_s, rl_failures = await rlgate_side(ctx, env_key, count, faults)
    base_s, base_failures = await baseline_side(ctx, env_key, count, faults)
    print(f"{NAME}: {count} starts against {IN_FLIGHT_CAP} in flight / {RATE_CAP:g} per s (ideal {ideal:.1f} s)")
    print(f"  rlgate (shared admission)          {rl_s:7.1f} s  failures {rl_failures}")
    print(f"  semaphore({PER_PROCESS}) x {PROCESSES} processes          {base_s:7.1f} s  failures {base_failures}")
    return [
        Entry(
            name=NAME,
            value=round(rl_s, 2),
            baseline=round(ideal, 2),
            unit=f"s until {count} Resets started",
            baseline_name=f"the platform cap's ideal, {count} / {RATE_CAP:g} per s",
            goals=GOALS,
            extra={
                "count": count,
                "failures": rl_failures,
                "baseline_s": round(base_s, 2),
                "baseline_failures": base_failures,
                "baseline_what": f"fleet-python make() behind asyncio.Semaphore({PER_PROCESS}) in {PROCESSES} "
                "processes, the SDK's default retries",
            },
        )
    ]
