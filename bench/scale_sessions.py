"""scale_sessions: how many sessions can start at once and all finish in time (OpenEnv's scaling method).

The method of OpenEnv's scaling study (openenv-scaling, tests/test_scaling.py): launch a batch of N
sessions at once; each connects, resets, takes one step whose environment waits `wait` seconds, and
closes. A session succeeds if it finishes without error within the timeout. Per N: success rate,
connect / reset (first observation) / step / total latency P50-P99 over the successful sessions,
sessions per second (successful / the batch's wall time), and the peak RSS and CPU seconds of each
process during the batch. A system's **max batch** is the largest N with >= 95 % success and total
P99 <= 3 x wait; a system stops at the first N below 50 % success.

- rlgate: one `rlgate.AsyncClient` shared by every session of the batch (what a trainer process holds;
  its channels are connected before the first batch, so there is no per-session connect). A session:
  Reset (the orchestrator's `mcp` provider on a static upstream: no instance to create), CallTool of
  `wait` through the gateway Reset named, a final Step carrying the call's summary that closes the session
  with the episode (`close_when_done`, as rlgate's SkyRL and Tinker adapters send it; `--close-rpc`: a
  Close RPC after it instead, for a side-by-side run). "step" is CallTool + Step. The toolgateway runs one
  process per core (`gateway_workers`), as deployed on a host.
- OpenEnv (openenv-core, its own virtualenv, bench/openenv_scale_side.py): its WebSocket server and its
  `GenericEnvClient`, one connection per session. "forward": an `MCPEnvironment` whose tool forwards the
  `CallToolAction` to the same upstream tool (the fair comparison, both pay the tool hop); "in-process":
  the published setup, a step that sleeps `wait` in the session's executor thread.
- The upstream (bench/scale_upstream.py): one mcp SDK server process whose `wait` tool sleeps.

Grid: N in 32 ... 8192, wait 1 s and 5 s (full); N up to 4096, wait 1 s (quick: the 8192 batches and
their timeouts took a minute of `make bench`'s 8, and the max batch is decided far below them).
Headline: rlgate's max batch per core (os.cpu_count()) against OpenEnv forwarding's, at wait 1 s; goal
ratio >= 4 and rlgate's total P99 at N = 1024 <= wait + 1 s. Plot: bench/scale_sessions.png. A subset on
its own (nothing merged): `python -m bench.scale_sessions --grid 32,128 --wait 1 --systems rlgate,openenv_forward`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import resource
import sys
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psutil

from bench.fixtures import BENCH_DIR, BenchContext, BenchError, child_process, run_dir
from bench.harness import Entry, Goal, describe, failed, format_table, percentile
from bench.step_vs_openenv import OPENENV_VERSION, ensure_venv
from rlgate import AsyncClient
from rlgate.core.convert import json_text
from rlgate.v1 import common_pb2, orchestrator_pb2

NAME = "scale_sessions"
GRID = (32, 128, 512, 1024, 2048, 4096, 8192)
WAITS = {"quick": (1.0,), "full": (1.0, 5.0)}
GRIDS = {"quick": GRID[:-1], "full": GRID}
HEADLINE_WAIT = 1.0
SUCCESS_MIN = 0.95  # max batch: at least this share of the batch succeeded ...
P99_FACTOR = 3.0  # ... and total P99 <= this x wait
STOP_BELOW = 0.5  # a system's grid ends at the first N with a lower success rate
GOAL_N = 1024
GATEWAY_WORKERS = os.cpu_count() or 1  # toolgateway processes: one per core (the orchestrator hands them out)
TIME_LIMIT_S = {"quick": 1200.0, "full": 5400.0}  # read by bench.__main__ instead of its default
SYSTEMS = ("rlgate", "openenv_forward", "openenv_inprocess")
LABELS = {"rlgate": "rlgate", "openenv_forward": "OpenEnv forwarding", "openenv_inprocess": "OpenEnv in-process"}
ENV_KEY = "scale:v1"
TOOL = "wait"
UPSTREAM = BENCH_DIR / "scale_upstream.py"
SIDE = BENCH_DIR / "openenv_scale_side.py"
PLOT = BENCH_DIR / "scale_sessions.png"
SAMPLE_S = 0.5  # RSS sampling period during a batch
BASELINE = "OpenEnv (openenv-core) WebSocket sessions, MCPEnvironment forwarding to the same upstream tool"
# Issue 31: a max batch of GOAL_N on this machine (total P99 <= 3 x wait there); the ratio is reported as measured.
GOALS = (Goal("ratio", ">=", 4.0), Goal("rlgate_max_batch", ">=", GOAL_N))

# One session: (ok, connect_s, reset_s, step_s, close_s, total_s, error); phases None where not measured.
Record = tuple[bool, float | None, float | None, float | None, float | None, float, str]


def timeout_for(wait: float) -> float:
    """A session's time limit: far above the max-batch bound (3 x wait), so a slow session counts as slow
    rather than failed, and a batch still ends in bounded time."""
    return 20.0 + 10.0 * wait


def raise_nofile() -> None:
    """Soft RLIMIT_NOFILE up to the hard limit, here and (inherited) in every process started after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


@dataclass
class Batch:
    system: str
    n: int
    wait: float
    records: list[Record]
    wall_s: float
    rss_kb: dict[str, int] = field(default_factory=dict)  # peak per process during the batch
    cpu_s: dict[str, float] = field(default_factory=dict)  # CPU time per process during the batch

    @property
    def success(self) -> float:
        return sum(1 for r in self.records if r[0]) / self.n

    def summary(self) -> dict[str, Any]:
        ok = [r for r in self.records if r[0]]
        timings = [r[1:6] for r in ok]
        out: dict[str, Any] = {"n": self.n, "ok": len(ok), "success": round(self.success, 4)}
        for index, phase in enumerate(("connect", "reset", "step", "close", "total")):
            values = [v for t in timings if (v := t[index]) is not None]
            for q in (50, 95, 99) if phase == "total" else (50, 99):
                out[f"{phase}_p{q}_s"] = round(percentile(values, q), 4) if values else None
        out["wall_s"] = round(self.wall_s, 3)
        out["sessions_per_s"] = round(len(ok) / self.wall_s, 1)
        out["rss_mib"] = {name: round(kb / 1024, 1) for name, kb in self.rss_kb.items()}
        out["cpu_s"] = {name: round(s, 2) for name, s in self.cpu_s.items()}
        errors = Counter(r[6] for r in self.records if not r[0])
        if errors:
            out["errors"] = dict(errors.most_common(3))
        return out


def passes(row: Mapping[str, Any], wait: float) -> bool:
    p99 = row.get("total_p99_s")
    return row["success"] >= SUCCESS_MIN and p99 is not None and p99 <= P99_FACTOR * wait


def max_batch(rows: Sequence[Mapping[str, Any]], wait: float) -> int:
    """The largest N that passes (0: none did)."""
    return max((row["n"] for row in rows if passes(row, wait)), default=0)


class Monitor:
    """Peak RSS and CPU time of named processes while a batch runs (RSS sampled every SAMPLE_S)."""

    def __init__(self, pids: Mapping[str, int]) -> None:
        self.procs = {name: psutil.Process(pid) for name, pid in pids.items()}
        self.rss_kb = dict.fromkeys(self.procs, 0)
        self.cpu_s: dict[str, float] = {}
        self._cpu0: dict[str, float] = {}
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def _cpu(self) -> dict[str, float]:
        return {name: sum(p.cpu_times()[:2]) for name, p in self.procs.items()}

    def _sample(self) -> None:
        for name, proc in self.procs.items():
            self.rss_kb[name] = max(self.rss_kb[name], proc.memory_info().rss // 1024)

    async def _run(self) -> None:
        while not self._stop.is_set():
            await asyncio.to_thread(self._sample)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), SAMPLE_S)

    async def __aenter__(self) -> Monitor:
        self._cpu0 = await asyncio.to_thread(self._cpu)
        self._task = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._stop.set()
        if self._task is not None:
            await self._task
        await asyncio.to_thread(self._sample)
        cpu1 = await asyncio.to_thread(self._cpu)
        self.cpu_s = {name: cpu1[name] - self._cpu0[name] for name in self.procs}


async def quiesce(pids: Sequence[int], idle_cores: float = 0.15, bound_s: float = 20.0) -> None:
    """Wait (bounded) until the processes use less than `idle_cores` of CPU together: what a batch left
    behind (closing sessions, threads, logs) is finished before the next batch is timed."""
    procs = [psutil.Process(pid) for pid in pids]

    def cpu() -> float:
        return sum(sum(p.cpu_times()[:2]) for p in procs)

    deadline = time.monotonic() + bound_s
    before = await asyncio.to_thread(cpu)
    while time.monotonic() < deadline:
        await asyncio.sleep(0.5)
        now = await asyncio.to_thread(cpu)
        if (now - before) / 0.5 < idle_cores:
            return
        before = now


# -- rlgate ------------------------------------------------------------------------------------------------
PHASES = ("reset", "call", "step", "close")  # what `rlgate_session` tells `ended` of, in order (no "close"
# when the Step closed the session)


async def rlgate_session(
    client: AsyncClient,
    wait: float,
    run_id: str,
    timeout_s: float,
    ended: Callable[[str], None] | None = None,
    close_rpc: bool = False,
) -> Record:
    """One session (see the module doc). `ended(phase)`, if given, is called as each of PHASES ends (for
    bench.scale_timeline, which splits "step" into the CallTool and the Step). `close_rpc`: close with a
    Close RPC after the Step instead of the Step's `close_when_done`."""
    mark = ended or _unmarked
    t0 = time.perf_counter()
    try:
        async with asyncio.timeout(timeout_s):
            reset = await client.reset(env_key=ENV_KEY, run_id=run_id)
            t1 = time.perf_counter()
            mark("reset")
            request_id = uuid.uuid4().hex
            arguments = {"seconds": wait}
            reply = await client.call_tool(
                reset.agent_token, TOOL, arguments, request_id=request_id, gateway=reset.gateway_address
            )
            if reply.result.is_error:
                raise BenchError(f"CallTool {TOOL} returned an error: {reply.result.error_message!r}")
            mark("call")
            step = await client.step(
                reset.session_id,
                assistant_text="waited",
                done=True,
                close_when_done=not close_rpc,
                tool_calls=[
                    orchestrator_pb2.ToolCallSummary(
                        name=TOOL, arguments_json=json_text(arguments), request_id=request_id
                    )
                ],
            )
            t2 = time.perf_counter()
            mark("step")
            if not close_rpc:
                if step.status != common_pb2.SESSION_STATUS_CLOSED:
                    raise BenchError(f"the final Step left the session {common_pb2.SessionStatus.Name(step.status)}")
                return (True, None, t1 - t0, t2 - t1, None, t2 - t0, "")
            await client.close_session(reset.session_id)
            t3 = time.perf_counter()
            mark("close")
        return (True, None, t1 - t0, t2 - t1, t3 - t2, t3 - t0, "")
    except Exception as exc:  # the session failed; the batch goes on and counts it
        return (False, None, None, None, None, time.perf_counter() - t0, describe(exc, 160))


def _unmarked(_phase: str) -> None:
    pass


async def rlgate_batch(client: AsyncClient, n: int, wait: float, close_rpc: bool = False) -> tuple[list[Record], float]:
    run_id = f"scale-{uuid.uuid4().hex[:12]}"
    timeout_s = timeout_for(wait)
    start = time.perf_counter()
    records = await asyncio.gather(
        *(rlgate_session(client, wait, run_id, timeout_s, close_rpc=close_rpc) for _ in range(n))
    )
    wall_s = time.perf_counter() - start
    # A session given up on may still hold a slot (e.g. a Reset the server finished after the deadline).
    with contextlib.suppress(Exception):
        await client.close_sessions(run_id=run_id, timeout=120.0)
    return list(records), wall_s


# -- OpenEnv -----------------------------------------------------------------------------------------------
class Driver:
    """The OpenEnv client process (bench/openenv_scale_side.py drive), asked for one batch at a time."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc

    async def batch(self, url: str, mode: str, n: int, wait: float) -> tuple[list[Record], float]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        timeout_s = timeout_for(wait)
        request = {"url": url, "mode": mode, "sessions": n, "wait": wait, "timeout_s": timeout_s}
        self.proc.stdin.write(json.dumps(request).encode() + b"\n")
        await self.proc.stdin.drain()
        line = await asyncio.wait_for(self.proc.stdout.readline(), timeout_s + 300.0)
        if not line:
            raise BenchError(f"OpenEnv driver exited ({self.proc.returncode}); see its log")
        result = json.loads(line)
        return [tuple(r) for r in result["sessions"]], float(result["wall_s"])


def warm_up(label: str, result: tuple[list[Record], float]) -> None:
    """A system that fails its warm-up batch is misconfigured: no figure for it."""
    errors = [r[6] for r in result[0] if not r[0]]
    if errors:
        raise BenchError(f"{label} failed its warm-up sessions: {errors[0]}")


# -- the grid ----------------------------------------------------------------------------------------------
BatchFn = Callable[[int, float], Awaitable[tuple[list[Record], float]]]


@dataclass
class SystemUnderTest:
    name: str
    run_batch: BatchFn
    pids: dict[str, int]  # the processes whose RSS and CPU are reported
    stopped: dict[float, int] = field(default_factory=dict)  # wait -> the N below STOP_BELOW


async def measure(
    ctx: BenchContext, grid: Sequence[int], waits: Sequence[float], systems: Sequence[str], close_rpc: bool = False
) -> dict[str, dict[float, list[dict[str, Any]]]]:
    """Run the grid; {system: {wait: [per-N summary, ...]}}. Everything started here is stopped again.
    `close_rpc`: see `rlgate_session`."""
    raise_nofile()
    python_oe = await ensure_venv() if any(s.startswith("openenv") for s in systems) else None
    max_n = max(grid)
    logs = ctx.out_dir / "logs"
    rows: dict[str, dict[float, list[dict[str, Any]]]] = {s: {w: [] for w in waits} for s in systems}
    async with contextlib.AsyncExitStack() as stack:
        upstream_proc, port = await stack.enter_async_context(
            child_process([sys.executable, str(UPSTREAM)], logs / "scale-upstream.log")
        )
        upstream_url = f"http://127.0.0.1:{port}/mcp"
        suts: list[SystemUnderTest] = []
        if "rlgate" in systems:
            rl = await ctx.stack(
                "scale",
                gateway_workers=GATEWAY_WORKERS,
                mcp_envs=[f"{ENV_KEY}={upstream_url}"],  # the mcp provider: no localfleet runs
                orchestrator_args=["--max-sessions", str(2 * max_n)],
            )
            client = await stack.enter_async_context(AsyncClient(rl.orchestrator_address))
            # Channels connected and first-use costs paid before the first timed batch.
            warm_up(LABELS["rlgate"], await rlgate_batch(client, 4, 0.0))
            suts.append(
                SystemUnderTest(
                    "rlgate",
                    lambda n, w: rlgate_batch(client, n, w, close_rpc),
                    {
                        "client": os.getpid(),
                        "orchestrator": rl.procs["orchestrator"].pid,
                        **{name: rl.procs[name].pid for name in rl.gateways},
                        "upstream": upstream_proc.pid,
                    },
                )
            )
        if python_oe is not None:
            side = [str(python_oe), str(SIDE)]
            serve = [*side, "serve", "--max-sessions", str(max_n + 64), "--timeout-s", str(timeout_for(max(waits)))]
            driver_proc, _ = await stack.enter_async_context(
                child_process([*side, "drive"], logs / "openenv-scale-drive.log", stdin=True)
            )
            driver = Driver(driver_proc)
            for name, mode, extra in (
                ("openenv_forward", "forward", ["--upstream", upstream_url]),
                ("openenv_inprocess", "sleep", []),
            ):
                if name not in systems:
                    continue
                proc, server_port = await stack.enter_async_context(
                    child_process([*serve, "--mode", mode, *extra], logs / f"openenv-scale-{mode}.log")
                )
                url = f"http://127.0.0.1:{server_port}"

                def run_batch(
                    n: int, w: float, url: str = url, mode: str = mode
                ) -> Awaitable[tuple[list[Record], float]]:
                    return driver.batch(url, mode, n, w)

                warm_up(LABELS[name], await run_batch(4, 0.0))  # first-use costs, as for rlgate
                pids = {"client": driver_proc.pid, "server": proc.pid}
                if mode == "forward":
                    pids["upstream"] = upstream_proc.pid
                suts.append(SystemUnderTest(name, run_batch, pids))
        # Every system's processes, not only the next one's: a batch is not timed while another system's
        # last batch is still closing its sessions or writing its logs on the same cores.
        every_pid = sorted({pid for sut in suts for pid in sut.pids.values()})
        for wait in waits:
            for index, n in enumerate(grid):
                order = suts if index % 2 == 0 else suts[::-1]  # the machine's drift lands on every system
                for sut in order:
                    if wait in sut.stopped:
                        continue
                    await quiesce(every_pid)
                    async with Monitor(sut.pids) as monitor:
                        records, wall_s = await sut.run_batch(n, wait)
                    batch = Batch(sut.name, n, wait, records, wall_s, monitor.rss_kb, monitor.cpu_s)
                    row = batch.summary()
                    rows[sut.name][wait].append(row)
                    print(
                        f"  {LABELS[sut.name]:<20} wait {wait:g} s  N {n:>5}: {row['success']:7.1%} ok, "
                        f"total p99 {_s(row['total_p99_s'])}, {row['sessions_per_s']} sessions/s"
                        + (f"; errors {row['errors']}" if row.get("errors") else ""),
                        flush=True,
                    )
                    if batch.success < STOP_BELOW:
                        sut.stopped[wait] = n
    return rows


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} s"


def tables(rows: Mapping[str, Mapping[float, Sequence[Mapping[str, Any]]]]) -> str:
    """One table per system and wait."""
    out = []
    for system, per_wait in rows.items():
        for wait, lines in per_wait.items():
            procs = list(lines[0]["rss_mib"]) if lines else []
            headers = [
                "N",
                "success",
                "connect p50/p99 s",
                "reset p50/p99 s",
                "step p50/p99 s",
                "total p50/p95/p99 s",
                "sessions/s",
                *(f"{p} MiB / CPU s" for p in procs),
            ]
            body = [
                [
                    r["n"],
                    f"{r['success']:.1%}",
                    f"{_pair(r, 'connect')}",
                    f"{_pair(r, 'reset')}",
                    f"{_pair(r, 'step')}",
                    "/".join(_num(r[f"total_p{q}_s"]) for q in (50, 95, 99)),
                    r["sessions_per_s"],
                    *(f"{r['rss_mib'][p]:.0f} / {r['cpu_s'][p]:.1f}" for p in procs),
                ]
                for r in lines
            ]
            out.append(
                f"{LABELS[system]}, wait {wait:g} s (max batch {max_batch(lines, wait)}):\n"
                + format_table(headers, body)
            )
    return "\n\n".join(out)


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _pair(row: Mapping[str, Any], phase: str) -> str:
    return f"{_num(row[f'{phase}_p50_s'])}/{_num(row[f'{phase}_p99_s'])}"


def plot(rows: Mapping[str, Mapping[float, Sequence[Mapping[str, Any]]]], path: Path, title: str) -> Path:
    """Success rate and total P99 against N, one line per system and wait."""
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_ok, ax_p99) = plt.subplots(1, 2, figsize=(12, 4.8))
    colors = {"rlgate": "tab:blue", "openenv_forward": "tab:red", "openenv_inprocess": "tab:orange"}
    markers = {"rlgate": "o", "openenv_forward": "s", "openenv_inprocess": "^"}
    for system, per_wait in rows.items():
        for wait, lines in per_wait.items():
            if not lines:
                continue
            style = "-" if wait == HEADLINE_WAIT else "--"
            label = f"{LABELS[system]}, wait {wait:g} s"
            ns = [r["n"] for r in lines]
            ax_ok.plot(
                ns,
                [100 * r["success"] for r in lines],
                style,
                marker=markers[system],
                color=colors[system],
                label=label,
            )
            p99 = [(r["n"], r["total_p99_s"]) for r in lines if r["total_p99_s"] is not None]
            ax_p99.plot(
                [x for x, _ in p99],
                [y for _, y in p99],
                style,
                marker=markers[system],
                color=colors[system],
                label=label,
            )
    waits = sorted({w for per_wait in rows.values() for w in per_wait})
    for wait in waits:
        ax_p99.axhline(P99_FACTOR * wait, color="grey", linestyle=":", linewidth=1)
        ax_p99.annotate(
            f"{P99_FACTOR:g} x wait {wait:g} s", (GRID[0], P99_FACTOR * wait), fontsize=8, color="grey", va="bottom"
        )
    ax_ok.axhline(100 * SUCCESS_MIN, color="grey", linestyle=":", linewidth=1)
    for ax, ylabel in ((ax_ok, "sessions succeeded (%)"), (ax_p99, "total latency P99 (s, successful sessions)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(list(GRID), [str(n) for n in GRID])
        ax.set_xlabel("sessions launched at once (N)")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
    ax_ok.set_ylim(0, 105)
    ax_p99.set_yscale("log")
    ax_p99.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    ax_p99.yaxis.set_minor_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    ax_ok.legend(fontsize=8, loc="lower left")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


async def prepare(ctx: BenchContext) -> None:
    """Build the OpenEnv virtualenv if needed (outside the time limit)."""
    try:
        ctx.prepared[NAME] = await ensure_venv()
    except BenchError as exc:
        ctx.prepared[NAME] = exc


async def run(ctx: BenchContext) -> list[Entry]:
    unit = "max batch per core (sessions at once, wait 1 s)"
    if isinstance(ctx.prepared.get(NAME), BaseException):
        return [failed(NAME, unit, ctx.prepared[NAME], BASELINE, GOALS)]  # type: ignore[arg-type]
    mode = "quick" if ctx.quick else "full"
    waits = WAITS[mode]
    rows = await measure(ctx, GRIDS[mode], waits, SYSTEMS)
    print(tables(rows))
    cores = os.cpu_count() or 1
    wait = HEADLINE_WAIT
    best = {system: max_batch(rows[system][wait], wait) for system in SYSTEMS}
    at_goal_n = next((r for r in rows["rlgate"][wait] if r["n"] == GOAL_N), None)
    rl_p99 = None if at_goal_n is None else at_goal_n["total_p99_s"]
    entry = Entry(
        name=NAME,
        value=best["rlgate"] / cores,
        baseline=best["openenv_forward"] / cores,
        unit=unit,
        baseline_name=BASELINE,
        goals=GOALS,
        extra={
            "cores": cores,
            "rlgate_gateway_workers": GATEWAY_WORKERS,
            "wait_s": wait,
            "timeout_s": {f"{w:g}": timeout_for(w) for w in waits},
            "rlgate_max_batch": best["rlgate"],
            "openenv_forward_max_batch": best["openenv_forward"],
            "openenv_inprocess_max_batch": best["openenv_inprocess"],
            "openenv_inprocess_max_batch_per_core": round(best["openenv_inprocess"] / cores, 1),
            f"rlgate_n{GOAL_N}_total_p99_s": rl_p99,
            **({"max_batch_wait_5s": {s: max_batch(rows[s][5.0], 5.0) for s in SYSTEMS}} if 5.0 in waits else {}),
            "criterion": f"success >= {SUCCESS_MIN:.0%} and total p99 <= {P99_FACTOR:g} x wait; a system stops at "
            f"the first N below {STOP_BELOW:.0%} success",
            "per_n": {f"wait_{w:g}s": {s: rows[s][w] for s in SYSTEMS} for w in waits},
            "openenv_core": OPENENV_VERSION,
        },
    )
    met = entry.check(GOALS[0]) and entry.check(GOALS[1])
    print(
        f"max batch at wait {wait:g} s: rlgate {best['rlgate']}, OpenEnv forwarding {best['openenv_forward']}, "
        f"OpenEnv in-process {best['openenv_inprocess']} ({cores} cores); ratio "
        f"{'-' if entry.ratio is None else f'{entry.ratio:.2f}'}; rlgate total p99 at N = {GOAL_N}: {_s(rl_p99)}"
    )
    print(f"goal (ratio >= 4 and rlgate max batch >= {GOAL_N}): {'met' if met else 'NOT met'}")
    stamp = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    await asyncio.to_thread(
        plot,
        rows,
        PLOT,
        f"scale_sessions ({mode}, {stamp}, {cores} cores): N sessions at "
        "once, each reset + one step that waits + close",
    )
    return [entry]


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.scale_sessions", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--grid", default="32,128", help="comma-separated N")
    parser.add_argument("--wait", default="1.0", help="comma-separated wait seconds")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated subset of {SYSTEMS}")
    parser.add_argument("--close-rpc", action="store_true", help="rlgate sessions end with a Close RPC after the Step")
    args = parser.parse_args(argv)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    if unknown := sorted(set(systems) - set(SYSTEMS)):
        parser.error(f"unknown system(s): {unknown}")
    grid = [int(x) for x in args.grid.split(",")]
    waits = [float(x) for x in args.wait.split(",")]
    ctx = BenchContext(quick=True, out_dir=run_dir("scale"))

    async def go() -> None:
        try:
            print(tables(await measure(ctx, grid, waits, systems, close_rpc=args.close_rpc)))
        finally:
            await ctx.close()

    asyncio.run(go())


if __name__ == "__main__":
    main(sys.argv[1:])
