"""cpu_per_session: the services' CPU time per session during a scale batch, against a bare echo's per call.

What decides `scale_sessions`' total P99 at large N on a small machine is CPU: a batch of N sessions is
N x (the services' CPU per session) of work on `os.cpu_count()` cores. This benchmark measures that figure
directly, in the setup of `scale_sessions` (bench/scale_sessions.py: the orchestrator's `mcp` provider on
the scale upstream, one toolgateway process per core, one shared `rlgate.AsyncClient`, sessions of Reset,
CallTool `wait`, a final Step and Close): per round, one batch of N sessions at once (wait 1 s), with the
CPU time (user + system) of the orchestrator and every toolgateway process taken before and after the
batch; the client's and the upstream's CPU are recorded beside it (the benchmark's own, not the services').

Baseline, alternating with the batches in the same run: the server CPU per call of a bare grpc.aio unary
echo (bench/echo_server.py, on the services' event loop, no interceptors), driven `ECHO_CONCURRENCY`-way
from this process. A session is four RPCs and one upstream tool call, so the ratio is a session's cost in
bare echo calls.

Headline: the services' CPU ms per session (summed over rounds / sessions) against the echo's CPU ms per call.
The goal is on their ratio, <= GOAL_RATIO (issue 31's target, about 4.1 ms per session where an echo call
costs about 0.25 ms): absolute CPU times move with the shared machine's speed by more than the levers
measured here, and the echo, measured alternately with the batches, moves with it. Sizes: N = 512 (full,
6 rounds) or 128 (quick, 2 rounds).

A second entry from the same stack, `lone_reset_close_vs_grpc_echo`: a new session's Reset and its Close, one
session at a time (no other load), against one echo call at a time, alternating, p50 latency of each: what a
session's start and end cost beyond gRPC's floor on an idle machine, where store round trips show (issue 31:
a Reset on the mcp provider registers its session and records its answer in one write).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import grpc
import psutil

from bench.echo_server import METHOD
from bench.fixtures import RPC_TIMEOUT_S, BenchContext, BenchError, child_process
from bench.harness import Entry, Goal, alternate, closed_loop, format_table, stats_table
from bench.scale_sessions import (
    ENV_KEY,
    GATEWAY_WORKERS,
    UPSTREAM,
    Monitor,
    quiesce,
    raise_nofile,
    rlgate_batch,
    warm_up,
)
from rlgate import AsyncClient

NAME = "cpu_per_session"
WAIT_S = 1.0
SIZES = {"quick": 128, "full": 512}  # sessions per batch
ECHO_CALLS_PER_SESSION = 4  # echo calls per round: this many per session of the round's batch
ECHO_CONCURRENCY = 64
GOAL_RATIO = 16.4  # a session's services' CPU in bare echo calls' (issue 31: 4.1 ms against 0.25 ms)
UNIT = "services' CPU ms per session"
ECHO_PAYLOAD = uuid.uuid4().bytes * 8
BASELINE = "bare grpc.aio unary echo server: server CPU ms per call (same run)"
GOALS = (Goal("ratio", "<=", GOAL_RATIO),)
LONE_NAME = "lone_reset_close_vs_grpc_echo"
LONE_RESETS = {"quick": 100, "full": 300}  # sessions per round, one at a time
LONE_BASELINE = "bare grpc.aio unary echo: p50 ms of one call at a time (same run, alternating)"


def _cpu_s(proc: psutil.Process) -> float:
    return float(sum(proc.cpu_times()[:2]))


@dataclass
class ScaleStack:
    """What a scale batch runs on: the stack, its client, the upstream and the echo server."""

    client: AsyncClient
    echo: grpc.aio.UnaryUnaryMultiCallable[bytes, bytes]
    services: dict[str, int]  # the orchestrator's and every toolgateway's pid
    pids: dict[str, int]  # the services, this process (the client) and the upstream
    echo_pid: int


@contextlib.asynccontextmanager
async def scale_stack(ctx: BenchContext, n: int) -> AsyncIterator[ScaleStack]:
    """The setup of `scale_sessions` for batches of up to `n`, warmed up; everything stopped on exit."""
    raise_nofile()
    logs = ctx.out_dir / "logs"
    async with contextlib.AsyncExitStack() as stack:
        upstream_proc, port = await stack.enter_async_context(
            child_process([sys.executable, str(UPSTREAM)], logs / "cpu-upstream.log")
        )
        echo_proc, echo_port = await stack.enter_async_context(
            child_process([sys.executable, "-m", "bench.echo_server"], logs / "cpu-echo.log")
        )
        rl = await ctx.stack(
            "cpu",
            gateway_workers=GATEWAY_WORKERS,
            mcp_envs=[f"{ENV_KEY}=http://127.0.0.1:{port}/mcp"],  # the mcp provider: no localfleet runs
            orchestrator_args=["--max-sessions", str(4 * n)],
        )
        client = await stack.enter_async_context(AsyncClient(rl.orchestrator_address))
        channel = await stack.enter_async_context(grpc.aio.insecure_channel(f"127.0.0.1:{echo_port}"))
        services = {"orchestrator": rl.procs["orchestrator"].pid, **{g: rl.procs[g].pid for g in rl.gateways}}
        sut = ScaleStack(
            client=client,
            echo=channel.unary_unary(METHOD),
            services=services,
            pids={**services, "client": os.getpid(), "upstream": upstream_proc.pid},
            echo_pid=echo_proc.pid,
        )
        # First-use costs (channels, upstream connections, imports on first call) before anything is timed.
        warm_up("rlgate", await rlgate_batch(client, 4, 0.0))
        warm_up("rlgate", await rlgate_batch(client, min(n, 64), 0.0))
        await closed_loop(echo_op(sut), 500, ECHO_CONCURRENCY)
        yield sut


def echo_op(sut: ScaleStack) -> Callable[[int], Awaitable[None]]:
    async def op(_slot: int) -> None:
        if await sut.echo(ECHO_PAYLOAD, timeout=RPC_TIMEOUT_S) != ECHO_PAYLOAD:
            raise BenchError("echo server returned different bytes")

    return op


async def run(ctx: BenchContext) -> list[Entry]:
    n = ctx.size(SIZES["quick"], SIZES["full"])
    rounds = ctx.rounds
    services_cpu = 0.0
    per_process: dict[str, float] = {}
    echo_cpu = 0.0
    echo_calls = 0
    sessions = 0
    failures = 0
    async with scale_stack(ctx, n) as sut:
        echo_server = psutil.Process(sut.echo_pid)
        every_pid = [*sut.pids.values(), sut.echo_pid]
        for round_ in range(rounds):
            for side in ("batch", "echo") if round_ % 2 == 0 else ("echo", "batch"):
                await quiesce(every_pid)
                if side == "batch":
                    async with Monitor(sut.pids) as monitor:
                        records, _wall = await rlgate_batch(sut.client, n, WAIT_S)
                    failures += sum(1 for r in records if not r[0])
                    sessions += n
                    for name, cpu in monitor.cpu_s.items():
                        per_process[name] = per_process.get(name, 0.0) + cpu
                    services_cpu += sum(monitor.cpu_s[name] for name in sut.services)
                else:
                    calls = ECHO_CALLS_PER_SESSION * n
                    before = await asyncio.to_thread(_cpu_s, echo_server)
                    await closed_loop(echo_op(sut), calls, ECHO_CONCURRENCY)
                    echo_cpu += await asyncio.to_thread(_cpu_s, echo_server) - before
                    echo_calls += calls
        lone = await lone_resets(ctx, sut)
    if failures:
        raise BenchError(f"{failures} of {sessions} sessions failed: CPU per session would be of a failing path")
    value_ms = services_cpu / sessions * 1e3
    echo_ms = echo_cpu / echo_calls * 1e3
    per_process_ms = {name: round(cpu / sessions * 1e3, 3) for name, cpu in per_process.items()}
    print(
        format_table(
            ["process", "CPU ms per session"],
            [[name, ms] for name, ms in per_process_ms.items()] + [["echo server (per call)", echo_ms]],
        )
    )
    return [
        Entry(
            name=NAME,
            value=value_ms,
            baseline=echo_ms,
            unit=UNIT,
            baseline_name=BASELINE,
            goals=GOALS,
            extra={
                "load_avg_1m": round(os.getloadavg()[0], 2),  # the machine is shared: how busy it was
                "sessions_per_batch": n,
                "rounds": rounds,
                "wait_s": WAIT_S,
                "gateway_workers": GATEWAY_WORKERS,
                "per_process_ms": per_process_ms,
                "echo_concurrency": ECHO_CONCURRENCY,
                "echo_calls": echo_calls,
            },
        ),
        lone,
    ]


async def lone_resets(ctx: BenchContext, sut: ScaleStack) -> Entry:
    """Sequential new sessions (Reset, Close) against sequential echo calls, alternating rounds (p50 latency)."""
    count = ctx.size(LONE_RESETS["quick"], LONE_RESETS["full"])

    async def session_op(_slot: int) -> None:
        reset = await sut.client.reset(env_key=ENV_KEY, run_id="lone")
        await sut.client.close_session(reset.session_id)

    stats = await alternate(
        ctx.rounds,
        {
            "reset + close": lambda: closed_loop(session_op, count, 1, warmup=10),
            "echo": lambda: closed_loop(echo_op(sut), count, 1),
        },
    )
    print(stats_table(stats))
    return Entry(
        name=LONE_NAME,
        value=stats["reset + close"].p50_ms,
        baseline=stats["echo"].p50_ms,
        unit="Reset + Close p50 ms, one session at a time",
        baseline_name=LONE_BASELINE,
        extra={
            "p99_ms": stats["reset + close"].p99_ms,
            "echo_p99_ms": stats["echo"].p99_ms,
            "sessions": stats["reset + close"].n,
        },
    )
