"""Load and soak.

Load: N concurrent episodes x M turns (one CallTool + one Step per turn, the last Step ends the episode) over
both MCP eras, with 1% injected tool errors and 10 ms tool latency on every environment: zero failed
episodes, zero leaked instances or open sessions; turn latency percentiles recorded. Full size (RLGATE_FULL=1)
is the issue's 200 x 20; the quick set's size is in conftest.QUICK.

Soak: episodes run back to back for SIZES.soak_s while RSS and open file descriptors of the three service
processes are sampled; the last third's median must stay within a generous margin of the first third's
(after a warm-up), and the series is recorded.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import psutil
import pytest

from rlgate import AsyncClient, RlgateError
from rlgate.v1 import common_pb2, orchestrator_pb2
from tests.reliability.conftest import SIZES, Figures
from tests.reliability.harness import API_KEY, Audit, AuditedStack, percentile, start_stack, thirds_medians

# A cheap read-only tool with no required arguments per environment (era).
TOOLS = {"mailbox:v1": "list_folders", "tracker:v1": "list_repos"}
FAULTS = {"environments": {"*": {"tool_latency_s": 0.01, "tool_error_rate": 0.01}}}
RSS_FACTOR, RSS_SLACK_MB, FD_SLACK = 1.3, 40.0, 30


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, audit: Audit) -> Iterator[AuditedStack]:
    s = start_stack(tmp_path_factory.mktemp("load"), audit, orchestrator_args=["--max-concurrent-creates", "32"])
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture
async def client(stack: AuditedStack) -> AsyncIterator[AsyncClient]:
    c = AsyncClient(stack.orchestrator_address, api_key=API_KEY)
    try:
        yield c
    finally:
        await c.close()


class Stats:
    def __init__(self) -> None:
        self.turns: list[float] = []
        self.calls: list[float] = []
        self.resets: list[float] = []
        self.tool_errors = 0
        self.failures: list[str] = []
        self.episodes = 0


async def episode(client: AsyncClient, audit: Audit, env_key: str, turns: int, stats: Stats, label: str) -> None:
    """Reset, `turns` x (CallTool + Step), Close. Any status error fails the episode."""
    session_id = ""
    try:
        t0 = time.perf_counter()
        reset = await client.reset(env_key=env_key, max_turns=turns + 1, labels={"suite": label}, timeout=300.0)
        stats.resets.append(time.perf_counter() - t0)
        session_id = reset.session_id
        audit.token(reset.agent_token)
        tool = TOOLS[env_key]
        for turn in range(turns):
            t0 = time.perf_counter()
            reply = await client.call_tool(reset.agent_token, tool, {}, gateway=reset.gateway_address, timeout=60.0)
            t1 = time.perf_counter()
            if reply.result.is_error:
                stats.tool_errors += 1
            summary = orchestrator_pb2.ToolCallSummary(
                name=tool, is_error=reply.result.is_error, error_kind=reply.result.error_kind
            )
            step = await client.step(
                session_id, assistant_text=f"turn {turn}", tool_calls=[summary], done=turn == turns - 1, timeout=60.0
            )
            t2 = time.perf_counter()
            stats.calls.append(t1 - t0)
            stats.turns.append(t2 - t0)
            if step.done != (turn == turns - 1):
                raise AssertionError(f"turn {turn}: done={step.done}")
        stats.episodes += 1
    except (RlgateError, AssertionError) as exc:
        stats.failures.append(f"{env_key}: {exc}")
    finally:
        if session_id:
            try:
                await client.close_session(session_id, timeout=60.0)
            except RlgateError as exc:
                stats.failures.append(f"close {session_id}: {exc}")


def ms(values: list[float], q: float) -> float:
    return round(percentile(values, q) * 1000, 1)


async def test_load(stack: AuditedStack, client: AsyncClient, audit: Audit, figures: Figures) -> None:
    stack.admin.set_faults(FAULTS)
    injected_before = stack.admin.counters().get("tool_errors_injected", 0)
    stats = Stats()
    envs = list(TOOLS)
    started = time.perf_counter()
    try:
        await asyncio.gather(
            *(episode(client, audit, envs[i % 2], SIZES.load_calls, stats, "load") for i in range(SIZES.load_episodes))
        )
    finally:
        stack.admin.clear_faults()
    wall = time.perf_counter() - started
    left = await asyncio.to_thread(stack.admin.wait_instances, 0, 30.0)
    open_sessions = await client.list_sessions(status=common_pb2.SESSION_STATUS_ACTIVE, labels={"suite": "load"})
    injected = stack.admin.counters().get("tool_errors_injected", 0) - injected_before
    figures.record("load", "episodes", SIZES.load_episodes)
    figures.record("load", "calls_per_episode", SIZES.load_calls)
    figures.record("load", "failed_episodes", len(stats.failures))
    figures.record("load", "failures_sample", stats.failures[:5])
    figures.record("load", "instances_left", left)
    figures.record("load", "open_sessions_left", len(open_sessions))
    figures.record("load", "wall_s", round(wall, 1))
    figures.record("load", "tool_calls", len(stats.calls))
    figures.record("load", "tool_errors_seen", stats.tool_errors)
    figures.record("load", "tool_errors_injected", injected)
    figures.record(
        "load",
        "turn_ms",
        {
            "p50": ms(stats.turns, 50),
            "p95": ms(stats.turns, 95),
            "p99": ms(stats.turns, 99),
            "max": ms(stats.turns, 100),
        },
    )
    figures.record("load", "call_tool_ms", {"p50": ms(stats.calls, 50), "p99": ms(stats.calls, 99)})
    figures.record("load", "reset_ms", {"p50": ms(stats.resets, 50), "p99": ms(stats.resets, 99)})
    figures.record("load", "turns_per_s", round(len(stats.turns) / wall, 1))
    assert stats.failures == []
    assert stats.episodes == SIZES.load_episodes
    assert left == 0
    assert open_sessions == []
    assert stats.tool_errors == injected  # every injected failure reached the agent as an is_error result


class Sampler:
    """RSS (MB) and open fds of the three service processes every `period` seconds, in a thread."""

    def __init__(self, stack: AuditedStack, period: float) -> None:
        self.procs = {name: psutil.Process(p.pid) for name, p in stack.procs.items()}
        self.period = period
        self.series: dict[str, list[tuple[float, float, int]]] = {name: [] for name in self.procs}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._t0 = time.monotonic()

    def _run(self) -> None:
        while not self._stop.is_set():
            for name, proc in self.procs.items():
                try:
                    rss = proc.memory_info().rss / 2**20
                    fds = proc.num_fds()
                except psutil.Error:
                    continue
                self.series[name].append((round(time.monotonic() - self._t0, 1), round(rss, 1), fds))
            self._stop.wait(self.period)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)


@pytest.mark.timeout(SIZES.soak_s + 240)
async def test_soak(stack: AuditedStack, client: AsyncClient, audit: Audit, figures: Figures) -> None:
    stack.admin.set_faults(FAULTS)
    stats = Stats()
    envs = list(TOOLS)
    deadline = time.monotonic() + SIZES.soak_s

    async def worker(i: int) -> None:
        n = 0
        while time.monotonic() < deadline:
            await episode(client, audit, envs[(i + n) % 2], 5, stats, "soak")
            n += 1

    try:
        with Sampler(stack, SIZES.soak_sample_s) as sampler:
            await asyncio.gather(*(worker(i) for i in range(SIZES.soak_concurrency)))
    finally:
        stack.admin.clear_faults()
    left = await asyncio.to_thread(stack.admin.wait_instances, 0, 30.0)
    summary: dict[str, Any] = {}
    problems: list[str] = []
    for name, series in sampler.series.items():
        warm = series[max(1, len(series) // 10) :]  # drop the warm-up
        rss_first, rss_last = thirds_medians([s[1] for s in warm])
        fd_first, fd_last = thirds_medians([float(s[2]) for s in warm])
        summary[name] = {
            "rss_mb_first_third": rss_first,
            "rss_mb_last_third": rss_last,
            "fds_first_third": fd_first,
            "fds_last_third": fd_last,
            "samples": len(series),
        }
        if rss_last > rss_first * RSS_FACTOR + RSS_SLACK_MB:
            problems.append(f"{name}: RSS grew {rss_first:.0f} -> {rss_last:.0f} MB")
        if fd_last > fd_first + FD_SLACK:
            problems.append(f"{name}: open fds grew {fd_first:.0f} -> {fd_last:.0f}")
    figures.record("soak", "duration_s", SIZES.soak_s)
    figures.record("soak", "episodes", stats.episodes)
    figures.record("soak", "failed_episodes", len(stats.failures))
    figures.record("soak", "instances_left", left)
    figures.record("soak", "summary", summary)
    figures.record("soak", "series", sampler.series)
    figures.record("soak", "turn_ms", {"p50": ms(stats.turns, 50), "p99": ms(stats.turns, 99)})
    assert stats.failures == []
    assert stats.episodes > 0
    assert left == 0
    assert problems == [], problems
