"""computer_use_16: 16 concurrent computer-use episodes, and what an open screen costs in memory.

Each episode is what a trainer runs: Reset on one of localfleet's computer-use tasks (an `image_type="mcp"`
instance), a `screenshot`, the task's stored reference solution (clicks, typing, keys, page opens: the actions
a model would send, replayed in order through the gateway, each answering with a screenshot), then Close.
16 episodes run at once (one per task, round robin over the 14 tasks), so 16 browser contexts are open
together, the default bound of localfleet's screens. Every action must answer without an error and carry its
image; the action latencies are pooled over all episodes. The first action of an episode also opens its
screen (a browser context and the page's load, one at a time in localfleet), so its latencies are reported
apart as well (`first_action_*`), and those of the actions after it (`later_action_*`).

Memory is Chromium's process tree under localfleet (every process below localfleet whose executable is the
browser: its main process, zygotes, GPU/utility and its renderers; Playwright's driver is not part of it),
as PSS summed over the tree (the headline: each shared page split between the processes sharing it, so the
sum is what the tree costs) and as RSS summed (recorded too, but it counts the browser's shared code and data
once in every process that maps it, so a new renderer seems to cost what the machine does not pay).
It is measured with the browser up and no screen open (after one episode opened and closed the first
screen), then with the 16 screens open and their episodes done acting; the cost of one
context is the difference over 16 (goal <= 80 MB PSS), the baseline the browser alone.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import httpx2
import psutil

from bench.fixtures import REPO_ROOT, RPC_TIMEOUT_S, BenchContext, BenchError, Rlgate, Session
from bench.harness import Entry, Goal, Stats, stats_table
from rlgate import AsyncClient

NAME = "computer_use_16"
EPISODES = 16
TASKS_FILE = REPO_ROOT / "services" / "localfleet" / "tasks" / "computer_use.json"
MB = 1e6
BASELINE = "Chromium's process tree with the browser up and no context open (PSS)"
GOALS = (Goal("value", "<=", 80.0),)
SCREENSHOT: dict[str, Any] = {"action": "screenshot"}
SETTLE_S = 2.0  # after contexts open or close: let the browser finish what the change started before measuring


def episodes(path: Path) -> list[tuple[str, list[dict[str, Any]]]]:
    """(task key, its actions: a screenshot, then its reference solution's `computer` calls) per task."""
    out = []
    for task in json.loads(path.read_text())["tasks"]:
        calls = task.get("metadata", {}).get("reference_solution", {}).get("tool_calls", [])
        actions = [c["arguments"] for c in calls if c.get("name") == "computer"]
        out.append((task["key"], [SCREENSHOT, *actions]))
    if not out:
        raise BenchError(f"no computer-use tasks in {path}")
    return out


def browser_memory(localfleet_pid: int) -> dict[str, Any]:
    """RSS and PSS (MB) summed over the browser's processes below localfleet, and how many of each kind
    (Chromium's `--type=`: renderer, zygote, utility, gpu-process; "browser" for the main one)."""
    rss = pss = 0
    kinds: dict[str, int] = {}
    for proc in psutil.Process(localfleet_pid).children(recursive=True):
        try:
            if "chrom" not in proc.name().lower():
                continue
            info = proc.memory_full_info()
            kind = next((a.split("=", 1)[1] for a in proc.cmdline() if a.startswith("--type=")), "browser")
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue  # a renderer that ended while the tree was walked
        rss += info.rss
        pss += info.pss
        kinds[kind] = kinds.get(kind, 0) + 1
    return {"rss_mb": round(rss / MB, 1), "pss_mb": round(pss / MB, 1), "processes": dict(sorted(kinds.items()))}


async def open_screens(http: httpx2.AsyncClient, localfleet_url: str) -> int:
    reply = await http.get(f"{localfleet_url.rstrip('/')}/_admin/counters")
    reply.raise_for_status()
    return int(reply.json()["open_screens"])


async def wait_screens(http: httpx2.AsyncClient, localfleet_url: str, want: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while (n := await open_screens(http, localfleet_url)) != want:
        if time.monotonic() > deadline:
            raise BenchError(f"localfleet has {n} open screens, expected {want} within {timeout_s:g}s")
        await asyncio.sleep(0.2)
    await asyncio.sleep(SETTLE_S)


async def act(trainer: AsyncClient, session: Session, arguments: dict[str, Any]) -> float:
    """One `computer` action through the gateway; its latency in seconds (BenchError unless it answers whole)."""
    t0 = time.perf_counter()
    reply = await trainer.call_tool(session.token, "computer", arguments, timeout=RPC_TIMEOUT_S)
    elapsed = time.perf_counter() - t0
    result = reply.result
    if result.is_error or result.error_message:
        raise BenchError(f"computer {arguments.get('action')} failed: {result.error_message!r}")
    if not any(b.HasField("image") for b in result.content):
        raise BenchError(f"computer {arguments.get('action')} answered without a screenshot")
    return elapsed


async def run(ctx: BenchContext) -> list[Entry]:
    stack = await ctx.stack()
    localfleet_pid = stack.procs["localfleet"].pid
    plans = episodes(TASKS_FILE)
    waves = ctx.size(1, 3)
    latencies: list[float] = []
    firsts: list[float] = []
    laters: list[float] = []
    memory: dict[str, dict[str, Any]] = {}
    async with (
        Rlgate(stack) as rl,
        AsyncClient(stack.orchestrator_address, gateway_addresses=stack.gateway_address) as trainer,
        httpx2.AsyncClient(timeout=RPC_TIMEOUT_S) as http,
    ):
        # The browser starts on the first screen; closing that episode leaves it up with no context.
        first = await rl.reset(task_key=plans[0][0])
        try:
            await act(trainer, first, SCREENSHOT)
        finally:
            await rl.close_session(first)
        await wait_screens(http, stack.localfleet_url, 0)
        memory["no_context"] = await asyncio.to_thread(browser_memory, localfleet_pid)

        started = time.perf_counter()
        for wave in range(waves):
            sessions = await asyncio.gather(
                *(rl.reset(task_key=plans[i % len(plans)][0]) for i in range(EPISODES)), return_exceptions=True
            )
            opened = [s for s in sessions if isinstance(s, Session)]
            try:
                failures = [s for s in sessions if not isinstance(s, Session)]
                if failures:
                    raise BenchError(f"{len(failures)} of {EPISODES} Resets failed: {failures[0]!r}")

                async def episode(i: int, session: Session) -> list[float]:
                    return [await act(trainer, session, a) for a in plans[i % len(plans)][1]]

                for times in await asyncio.gather(*(episode(i, s) for i, s in enumerate(opened))):
                    latencies.extend(times)
                    firsts.append(times[0])
                    laters.extend(times[1:])
                if wave == 0:
                    await wait_screens(http, stack.localfleet_url, EPISODES)
                    memory["open_16"] = await asyncio.to_thread(browser_memory, localfleet_pid)
            finally:
                await asyncio.gather(*(rl.close_session(s) for s in opened), return_exceptions=True)
            await wait_screens(http, stack.localfleet_url, 0)
        elapsed = time.perf_counter() - started
        memory["closed_again"] = await asyncio.to_thread(browser_memory, localfleet_pid)

    actions = Stats.from_latencies(latencies, elapsed, EPISODES)
    opening = Stats.from_latencies(firsts, elapsed, EPISODES)
    later = Stats.from_latencies(laters, elapsed, EPISODES)
    print(
        stats_table(
            {"computer action (16 episodes at once)": actions, "  first (opens the screen)": opening, "  later": later},
            "actions/s",
        )
    )
    base, full = memory["no_context"], memory["open_16"]
    per_rss = (full["rss_mb"] - base["rss_mb"]) / EPISODES
    per_pss = (full["pss_mb"] - base["pss_mb"]) / EPISODES
    for name, figures in memory.items():
        print(f"browser memory, {name}: {figures}")
    print(f"per context: RSS {per_rss:.1f} MB, PSS {per_pss:.1f} MB")
    return [
        Entry(
            name=NAME,
            value=per_pss,
            baseline=base["pss_mb"],
            unit="MB PSS per open browser context",
            baseline_name=BASELINE,
            goals=GOALS,
            extra={
                "per_context_rss_mb": round(per_rss, 1),
                "action_p50_ms": round(actions.p50_ms, 1),
                "action_p99_ms": round(actions.p99_ms, 1),
                "first_action_p50_ms": round(opening.p50_ms, 1),
                "first_action_p99_ms": round(opening.p99_ms, 1),
                "later_action_p50_ms": round(later.p50_ms, 1),
                "later_action_p99_ms": round(later.p99_ms, 1),
                "actions": actions.n,
                "actions_per_s": round(actions.per_s, 1),
                "episodes": EPISODES * waves,
                "memory_mb": memory,
            },
        )
    ]
