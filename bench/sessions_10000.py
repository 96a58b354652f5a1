"""sessions_10000: memory per open session in the orchestrator + gateway, 10,000 sessions open on one stack.

Two fresh stacks, one after the other, measured alike:

- **one upstream** (the headline): the orchestrator's `mcp` provider on one MCP server (bench/scale_upstream.py,
  2026-07-28, stateless), as a trainer on its own MCP servers runs. Every session's endpoint is the same URL,
  so the gateway's sessions share common upstream clients. N = 10,000 (full), 1,000 (quick).
- **an instance per session** (beside it): localfleet, each session on an instance of its own (mailbox:v1,
  2026-07-28), as on Fleet: every session's endpoints are URLs of their own, so the gateway holds one upstream
  MCP client per session. N = 1,000 (full), 200 (quick): each instance is a copy of its environment's
  SQLite file (~250 KB), so 10,000 would need 2.5 GB of disk and half an hour here for the same per-session
  figure.

Per stack: 10 sessions run to the end (first-use costs: imports, pools, caches), then RSS of orchestrator and
gateway is read (psutil, the service PIDs); N sessions are opened 32 at a time, each doing Reset, ListTools
and one CallTool (so the gateway holds what a session's calls need), and all N are kept open while RSS is
read again; then they are closed and RSS read once more. value = (RSS open - RSS before) of orchestrator +
gateway / N on the one-upstream stack, in KiB. Goal <= 50; the instance-per-session figure's goal is the
200 KiB sessions_1000 had.
"""

from __future__ import annotations

import asyncio
import sys
from dataclasses import dataclass
from typing import Any

from bench.fixtures import (
    BENCH_TOOLS,
    ERA_ENV,
    BenchContext,
    Rlgate,
    Session,
    ToolCall,
    child_process,
    rss_kb,
    service_pids,
)
from bench.harness import Entry, Goal, format_table
from bench.scale_sessions import ENV_KEY, TOOL, UPSTREAM, raise_nofile

NAME = "sessions_10000"
OPEN_CONCURRENCY = 32
WARM_SESSIONS = 10
SERVICES = ("orchestrator", "toolgateway")
SETTLE_S = 1.0  # after a wave of sessions, before RSS is read: closes and the janitor's pass land
TIME_LIMIT_S = {"quick": 900.0, "full": 3600.0}  # read by bench.__main__ instead of its default
GOALS = (Goal("value", "<=", 50.0), Goal("per_instance_kb_per_session", "<=", 200.0))


@dataclass
class Figures:
    sessions: int
    before: dict[str, int]
    open: dict[str, int]
    closed: dict[str, int]

    def kb_per_session(self, name: str) -> float:
        return (self.open[name] - self.before[name]) / self.sessions

    @property
    def services_kb_per_session(self) -> float:
        return sum(self.kb_per_session(name) for name in SERVICES)


async def measure(rl: Rlgate, pids: dict[str, int], env_key: str, call: ToolCall, count: int) -> Figures:
    gate = asyncio.Semaphore(OPEN_CONCURRENCY)

    async def open_session() -> Session:
        async with gate:
            session = await rl.reset(env_key)
            await rl.list_tools(session)
            reply = await rl.call_tool(session, call)
            if reply.result.is_error:
                raise RuntimeError(f"CallTool {call.name} returned an error: {reply.result.error_message!r}")
            return session

    async def close(session: Session) -> None:
        async with gate:
            await rl.close_session(session)

    warm = await asyncio.gather(*(open_session() for _ in range(WARM_SESSIONS)))
    await asyncio.gather(*(close(s) for s in warm))
    await asyncio.sleep(SETTLE_S)
    before = await asyncio.to_thread(rss_kb, pids)
    sessions = await asyncio.gather(*(open_session() for _ in range(count)))
    await asyncio.sleep(SETTLE_S)
    opened = await asyncio.to_thread(rss_kb, pids)
    await asyncio.gather(*(close(s) for s in sessions))
    await asyncio.sleep(SETTLE_S)
    closed = await asyncio.to_thread(rss_kb, pids)
    return Figures(count, before, opened, closed)


async def one_upstream(ctx: BenchContext, count: int) -> Figures:
    raise_nofile()
    async with child_process([sys.executable, str(UPSTREAM)], ctx.out_dir / "logs" / "sessions-upstream.log") as (
        _,
        port,
    ):
        stack = await ctx.stack(
            "sessions-one-upstream",
            mcp_envs=[f"{ENV_KEY}=http://127.0.0.1:{port}/mcp"],
            orchestrator_args=["--max-sessions", str(count + 64)],
        )
        try:
            async with Rlgate(stack) as rl:
                return await measure(rl, service_pids(stack, *SERVICES), ENV_KEY, ToolCall(TOOL, {"seconds": 0}), count)
        finally:
            await ctx.stop_stack("sessions-one-upstream")


async def instance_per_session(ctx: BenchContext, count: int) -> Figures:
    env_key = ERA_ENV["modern"]
    limit = str(count + 64)
    stack = await ctx.stack(
        "sessions-per-instance",
        orchestrator_args=["--max-sessions", limit],
        localfleet_args=["--instance-limit", limit],
    )
    try:
        async with Rlgate(stack) as rl:
            return await measure(rl, service_pids(stack, *SERVICES), env_key, BENCH_TOOLS[env_key], count)
    finally:
        await ctx.stop_stack("sessions-per-instance")


def _table(label: str, f: Figures) -> str:
    return f"{label}, {f.sessions} sessions open:\n" + format_table(
        ["process", "RSS before KiB", "open", "after closing", "KiB/session"],
        [[n, f.before[n], f.open[n], f.closed[n], round(f.kb_per_session(n), 1)] for n in SERVICES],
    )


def _extra(prefix: str, f: Figures) -> dict[str, Any]:
    out: dict[str, Any] = {f"{prefix}sessions": f.sessions}
    for name in SERVICES:
        out[f"{prefix}{name}_rss_before_kb"] = f.before[name]
        out[f"{prefix}{name}_rss_open_kb"] = f.open[name]
        out[f"{prefix}{name}_rss_closed_kb"] = f.closed[name]
        out[f"{prefix}{name}_kb_per_session"] = round(f.kb_per_session(name), 1)
    return out


async def run(ctx: BenchContext) -> list[Entry]:
    shared = await one_upstream(ctx, ctx.size(1_000, 10_000))
    print(_table("one upstream (mcp provider, common upstream clients)", shared))
    own = await instance_per_session(ctx, ctx.size(200, 1_000))
    print(_table("an instance per session (localfleet, an upstream client per session)", own))
    return [
        Entry(
            name=NAME,
            value=shared.services_kb_per_session,
            baseline=None,
            unit="KiB per open session (orchestrator + gateway), one upstream",
            goals=GOALS,
            extra={
                **_extra("", shared),
                "per_instance_kb_per_session": round(own.services_kb_per_session, 1),
                **_extra("per_instance_", own),
            },
        )
    ]
