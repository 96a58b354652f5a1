"""episodes_per_s: full episodes through the whole stack at concurrency 1, 16, 64 and 256.

An episode is Reset(mailbox:v1, max_turns=10), then 10 turns of CallTool (gateway) + Step (orchestrator),
then Close; the 10th Step ends it (truncated at max turns; no task, so no verifier run). The stack runs
with a warm pool of 16 mailbox instances, so at higher concurrency Resets also wait for provisioning, as
they would in a real run. Per level: episodes/s and the p99 of one turn (CallTool + Step). `value` is
episodes/s at concurrency 64; `baseline` episodes/s at concurrency 1 (so `ratio` is the scaling).
A PNG of both figures against concurrency is written to bench/episodes_per_s.png.
"""

from __future__ import annotations

import asyncio
import time

from bench.fixtures import BENCH_DIR, BENCH_TOOLS, ERA_ENV, RECONCILE_WORKAROUND, BenchContext, BenchError, Rlgate
from bench.harness import Entry, Stats, closed_loop, format_table, percentile
from bench.plot import line_panels

NAME = "episodes_per_s"
TURNS = 10
LEVELS = (1, 16, 64, 256)
WARM_POOL = 16
PLOT = BENCH_DIR / "episodes_per_s.png"


async def run(ctx: BenchContext) -> list[Entry]:
    env_key = ERA_ENV["modern"]
    call = BENCH_TOOLS[env_key]
    episodes_at = {1: ctx.size(4, 12), 16: ctx.size(16, 64), 64: ctx.size(64, 192), 256: ctx.size(256, 512)}
    stack = await ctx.stack(
        "episodes", orchestrator_args=[*RECONCILE_WORKAROUND, "--warm-pool", f"{env_key}={WARM_POOL}"]
    )
    rows: list[list[object]] = []
    figures: dict[str, object] = {}
    per_level: dict[int, tuple[Stats, list[float]]] = {}
    async with Rlgate(stack) as rl:

        async def episode(turn_latencies: list[float]) -> None:
            session = await rl.reset(env_key, max_turns=TURNS)
            try:
                for turn in range(1, TURNS + 1):
                    t0 = time.perf_counter()
                    await rl.call_tool(session, call)
                    reply = await rl.step(session, call)
                    turn_latencies.append(time.perf_counter() - t0)
                    if reply.done != (turn == TURNS):
                        raise BenchError(f"turn {turn}/{TURNS}: done={reply.done} (truncated={reply.truncated})")
            finally:
                await rl.close_session(session)

        await episode([])  # warm-up: first-use costs of every service
        for level in LEVELS:
            turns: list[float] = []

            async def op(_slot: int, turns: list[float] = turns) -> None:
                await episode(turns)

            stats = await closed_loop(op, episodes_at[level], level)
            per_level[level] = (stats, turns)
    turn_p99 = {level: percentile(turns, 99) * 1e3 for level, (_, turns) in per_level.items()}
    for level, (stats, turns) in per_level.items():
        p50, p99 = percentile(turns, 50) * 1e3, turn_p99[level]
        rows.append([level, stats.n, stats.per_s, stats.per_s * TURNS, p50, p99, stats.p50_ms])
        figures |= {
            f"c{level}_episodes_per_s": round(stats.per_s, 2),
            f"c{level}_turn_p50_ms": round(p50, 2),
            f"c{level}_turn_p99_ms": round(p99, 2),
            f"c{level}_episodes": stats.n,
        }
    print(
        format_table(
            ["concurrency", "episodes", "episodes/s", "turns/s", "turn p50 ms", "turn p99 ms", "episode p50 ms"], rows
        )
    )
    await asyncio.to_thread(
        line_panels,
        PLOT,
        f"rlgate episodes (Reset, {TURNS} x (CallTool + Step), Close), {'quick' if ctx.quick else 'full'} run",
        "concurrent episodes",
        list(LEVELS),
        [
            ("episodes/s", [per_level[c][0].per_s for c in LEVELS]),
            ("p99 turn latency (CallTool + Step), ms", [turn_p99[c] for c in LEVELS]),
        ],
    )
    return [
        Entry(
            name=NAME,
            value=per_level[64][0].per_s,
            baseline=per_level[1][0].per_s,
            unit="episodes/s (concurrency 64)",
            baseline_name="the same stack at concurrency 1 (ratio = scaling)",
            extra={
                **figures,
                "turns_per_episode": TURNS,
                "warm_pool": WARM_POOL,
                "plot": "bench/episodes_per_s.png",
                **({"workaround": " ".join(RECONCILE_WORKAROUND)} if RECONCILE_WORKAROUND else {}),
            },
        )
    ]
