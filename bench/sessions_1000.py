"""sessions_1000: memory per open session in the orchestrator + gateway.

A fresh stack (no warm pool; session and instance limits raised above the count) first runs 10 sessions
to the end (first-use costs: imports, pools, caches), then its RSS is read (psutil, the service PIDs).
Then N sessions are opened 32 at a time, each doing Reset, ListTools and one CallTool, so the gateway
holds their upstream MCP clients, and all N are kept open while RSS is read again. value = (RSS after -
RSS before) of orchestrator + gateway / N, in KiB. Goal <= 200. N = 1,000 in the full run; the quick run
opens 200 and reports the same per-session figure. RSS after closing them all is recorded too.
"""

from __future__ import annotations

import asyncio

from bench.fixtures import (
    BENCH_TOOLS,
    ERA_ENV,
    RECONCILE_WORKAROUND,
    BenchContext,
    Rlgate,
    Session,
    rss_kb,
    service_pids,
)
from bench.harness import Entry, Goal, format_table

NAME = "sessions_1000"
OPEN_CONCURRENCY = 32
SERVICES = ("orchestrator", "toolgateway")


async def run(ctx: BenchContext) -> list[Entry]:
    env_key = ERA_ENV["modern"]
    call = BENCH_TOOLS[env_key]
    count = ctx.size(200, 1000)
    limit = str(count + 64)
    stack = await ctx.stack(
        "sessions",
        orchestrator_args=[*RECONCILE_WORKAROUND, "--max-sessions", limit],
        localfleet_args=["--instance-limit", limit],
    )
    pids = service_pids(stack, *SERVICES, "localfleet")
    gate = asyncio.Semaphore(OPEN_CONCURRENCY)
    async with Rlgate(stack) as rl:

        async def open_session() -> Session:
            async with gate:
                session = await rl.reset(env_key)
                await rl.list_tools(session)
                await rl.call_tool(session, call)
                return session

        async def close(session: Session) -> None:
            async with gate:
                await rl.close_session(session)

        warm = await asyncio.gather(*(open_session() for _ in range(10)))
        await asyncio.gather(*(close(s) for s in warm))
        await asyncio.sleep(1.0)
        before = await asyncio.to_thread(rss_kb, pids)
        sessions = await asyncio.gather(*(open_session() for _ in range(count)))
        await asyncio.sleep(1.0)
        after = await asyncio.to_thread(rss_kb, pids)
        await asyncio.gather(*(close(s) for s in sessions))
        await asyncio.sleep(1.0)
        closed = await asyncio.to_thread(rss_kb, pids)
    print(
        format_table(
            ["process", "RSS before KiB", f"with {count} sessions", "after closing", "KiB/session"],
            [[name, before[name], after[name], closed[name], (after[name] - before[name]) / count] for name in pids],
        )
    )
    grown = sum(after[name] - before[name] for name in SERVICES)
    return [
        Entry(
            name=NAME,
            value=grown / count,
            baseline=None,
            unit="KiB per open session (orchestrator + gateway)",
            goals=(Goal("value", "<=", 200.0),),
            extra={
                "sessions": count,
                **({"workaround": " ".join(RECONCILE_WORKAROUND)} if RECONCILE_WORKAROUND else {}),
                **{f"{name}_rss_before_kb": before[name] for name in pids},
                **{f"{name}_rss_open_kb": after[name] for name in pids},
                **{f"{name}_rss_closed_kb": closed[name] for name in pids},
                **{f"{name}_kb_per_session": round((after[name] - before[name]) / count, 1) for name in pids},
            },
        )
    ]
