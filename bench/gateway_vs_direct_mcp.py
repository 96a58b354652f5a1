"""gateway_vs_direct_mcp: CallTool through the gateway vs a persistent mcp 2.x client, same tool, same instance.

For each MCP era (modern = mailbox:v1, 2026-07-28 stateless; legacy = tracker:v1, initialize + session
id) one session is opened through the orchestrator; the direct baseline connects one long-lived
`mcp.Client` (mode auto, as a user would) to the very endpoint the gateway uses for that session. Both
call the same read-only tool with the same arguments, sequentially and 16-way concurrently (one client /
one session each), alternating in rounds. The gateway is called as a trainer calls it: unary CallTool
RPCs through `rlgate.AsyncClient` (one persistent channel, like the baseline's persistent client).
Headline: p50 gateway / p50 direct, modern, sequential (goal <= 1.5); throughput gateway / direct
(goal >= 0.67) sequential and 16-way.
"""

from __future__ import annotations

from bench.fixtures import BENCH_TOOLS, ERA_ENV, BenchContext, BenchError, Rlgate, direct_call, persistent_mcp
from bench.harness import Entry, Goal, Stats, alternate, closed_loop, describe, failed, round_ratios, stats_table
from rlgate import AsyncClient

NAME = "gateway_vs_direct_mcp"
CONCURRENT = 16
BASELINE = "persistent mcp 2.x client calling the localfleet tool directly"
GOALS = (Goal("ratio", "<=", 1.3), Goal("throughput_ratio_seq", ">=", 0.67), Goal("throughput_ratio_c16", ">=", 0.67))


async def measure_era(ctx: BenchContext, rl: Rlgate, trainer: AsyncClient, era: str) -> dict[str, Stats]:
    env_key = ERA_ENV[era]
    call = BENCH_TOOLS[env_key]
    total, rounds, budget = 100_000, ctx.rounds, ctx.duration_s
    session = await rl.reset(env_key)
    try:
        url = await rl.mcp_url(session)
        async with persistent_mcp(url) as client:

            async def gateway_op(_slot: int) -> None:
                reply = await trainer.call_tool(session.token, call.name, call.arguments)
                if reply.result.is_error:
                    raise BenchError(f"CallTool {call.name} returned an error: {reply.result.error_message!r}")

            async def direct_op(_slot: int) -> None:
                await direct_call(client, call)

            return await alternate(
                rounds,
                {
                    f"{era} gateway seq": lambda: closed_loop(gateway_op, total, 1, warmup=30, duration_s=budget),
                    f"{era} direct seq": lambda: closed_loop(direct_op, total, 1, warmup=30, duration_s=budget),
                    f"{era} gateway c16": lambda: closed_loop(
                        gateway_op, total, CONCURRENT, warmup=32, duration_s=budget
                    ),
                    f"{era} direct c16": lambda: closed_loop(
                        direct_op, total, CONCURRENT, warmup=32, duration_s=budget
                    ),
                },
            )
    finally:
        await rl.close_session(session)


async def run(ctx: BenchContext) -> list[Entry]:
    stack = await ctx.stack()
    extra: dict[str, object] = {}
    results: dict[str, dict[str, Stats]] = {}
    async with (
        Rlgate(stack) as rl,
        AsyncClient(stack.orchestrator_address, gateway_addresses=stack.gateway_address) as trainer,
    ):
        for era in ("modern", "legacy"):
            try:
                results[era] = await measure_era(ctx, rl, trainer, era)
            except Exception as exc:  # an era that cannot run is recorded, the other still reports
                extra[f"{era}_error"] = describe(exc)
    for stats in results.values():
        print(stats_table(stats, "calls/s"))
    for era, stats in results.items():
        for mode in ("seq", "c16"):
            gw, direct = stats[f"{era} gateway {mode}"], stats[f"{era} direct {mode}"]
            extra |= gw.figures(f"{era}_gateway_{mode}_") | direct.figures(f"{era}_direct_{mode}_")
            extra[f"{era}_p50_ratio_{mode}"] = round(gw.p50_ms / direct.p50_ms, 3)
            extra[f"{era}_throughput_ratio_{mode}"] = round(gw.per_s / direct.per_s, 3)
            extra[f"{era}_throughput_ratio_rounds_{mode}"] = round_ratios(gw, direct)
    if "modern" not in results:
        return [failed(NAME, "ms", str(extra.get("modern_error", "modern era did not run")), BASELINE, GOALS)]
    modern = results["modern"]
    extra["throughput_ratio_seq"] = extra["modern_throughput_ratio_seq"]
    extra["throughput_ratio_c16"] = extra["modern_throughput_ratio_c16"]
    return [
        Entry(
            name=NAME,
            value=modern["modern gateway seq"].p50_ms,
            baseline=modern["modern direct seq"].p50_ms,
            unit="ms (p50, modern, sequential)",
            baseline_name=BASELINE,
            goals=GOALS,
            extra=extra,
        )
    ]
