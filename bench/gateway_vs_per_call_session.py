"""gateway_vs_per_call_session: the gateway vs a fresh legacy-era MCP session per call.

The baseline is the reference Fleet integration's pattern (OpenEnv's FleetMCPClient): for every tool call
open a streamable-HTTP client, `initialize`, call, close (DELETE). Its SSL context is built once and
shared, so it is not inflated by TLS setup. The gateway side is one session's CallTool. Both call the same
read-only tool on the same legacy-era instance (tracker:v1), sequentially and 16-way, alternating in
rounds. Headline: calls/s gateway / baseline, sequential. Goal >= 3.
"""

from __future__ import annotations

import httpx2

from bench.fixtures import BENCH_TOOLS, ERA_ENV, BenchContext, Rlgate, per_call_session
from bench.harness import Entry, Goal, alternate, closed_loop, stats_table, throughput_ratios

NAME = "gateway_vs_per_call_session"
CONCURRENT = 16
BASELINE = "fresh legacy-era MCP session per call (initialize, call, close), shared SSL context"
GOALS = (Goal("ratio", ">=", 3.0),)


async def run(ctx: BenchContext) -> list[Entry]:
    env_key = ERA_ENV["legacy"]
    call = BENCH_TOOLS[env_key]
    total, rounds, budget = 100_000, ctx.rounds, ctx.duration_s
    ssl_context = httpx2.create_ssl_context()
    stack = await ctx.stack()
    async with Rlgate(stack) as rl:
        session = await rl.reset(env_key)
        try:
            url = await rl.mcp_url(session)

            async def gateway_op(_slot: int) -> None:
                await rl.call_tool(session, call)

            async def baseline_op(_slot: int) -> None:
                await per_call_session(url, call, ssl_context)

            stats = await alternate(
                rounds,
                {
                    "gateway seq": lambda: closed_loop(gateway_op, total, 1, warmup=20, duration_s=budget),
                    "per-call session seq": lambda: closed_loop(baseline_op, total, 1, warmup=5, duration_s=budget),
                    "gateway c16": lambda: closed_loop(gateway_op, total, CONCURRENT, warmup=32, duration_s=budget),
                    "per-call session c16": lambda: closed_loop(
                        baseline_op, total, CONCURRENT, warmup=16, duration_s=budget
                    ),
                },
            )
        finally:
            await rl.close_session(session)
    print(stats_table(stats, "calls/s"))
    gw, base = stats["gateway seq"], stats["per-call session seq"]
    gw16, base16 = stats["gateway c16"], stats["per-call session c16"]
    return [
        Entry(
            name=NAME,
            value=gw.per_s,
            baseline=base.per_s,
            unit="calls/s (sequential)",
            baseline_name=BASELINE,
            goals=GOALS,
            extra={
                "env_key": env_key,
                **gw.figures("gateway_seq_"),
                **base.figures("baseline_seq_"),
                **gw16.figures("gateway_c16_"),
                **base16.figures("baseline_c16_"),
                **throughput_ratios(gw, base, gw16, base16),
            },
        )
    ]
