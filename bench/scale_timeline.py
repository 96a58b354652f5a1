"""Where a scale batch's time goes: when each phase of its sessions ends, and which process is busy meanwhile.

    python -m bench.scale_timeline [--n 1024] [--batches 3] [--window 0.25]

Starts the setup of `cpu_per_session` (bench/cpu_per_session.py: scale_sessions' stack, one toolgateway per
core, warmed up), then runs `--batches` batches of `--n` sessions (wait 1 s, `scale_sessions.rlgate_session`),
each once the stack is idle. Every session of a batch starts at the batch's start, so the time a phase ends
is counted from there. Per batch:
- the ends of each phase (the Reset, the CallTool, the Step, the Close): p1, p50, p99 and the last, over the
  sessions that got that far;
- every process's CPU in each `--window` seconds of the batch, in cores (CPU seconds over wall seconds;
  psutil, user + system).

A phase that ends far later than the one before it holds the tail. A window where one process runs near a
whole core while the others idle is a serial stretch: less CPU elsewhere does not shorten it. A diagnosis
like bench.profile_layers: nothing is merged into results.json.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import sys
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import psutil

from bench.cpu_per_session import WAIT_S, scale_stack
from bench.fixtures import BenchContext, run_dir
from bench.harness import format_table, percentile
from bench.scale_sessions import PHASES, quiesce, rlgate_session, timeout_for
from rlgate import AsyncClient

# One sample: (seconds since the batch started, {process: its CPU seconds so far}).
Sample = tuple[float, Mapping[str, float]]


def phase_rows(ends: Sequence[Mapping[str, float]]) -> list[list[object]]:
    """Per phase: [phase, sessions that ended it, p1, p50, p99, last], the ends in seconds."""
    rows: list[list[object]] = []
    for phase in PHASES:
        values = [e[phase] for e in ends if phase in e]
        if values:
            quantiles = [round(percentile(values, q), 3) for q in (1, 50, 99)]
            rows.append([phase, len(values), *quantiles, round(max(values), 3)])
        else:
            rows.append([phase, 0, "-", "-", "-", "-"])
    return rows


def window_rows(samples: Sequence[Sample], names: Sequence[str]) -> list[list[object]]:
    """Per window between consecutive samples: [its end, each process's cores in it]."""
    rows: list[list[object]] = []
    for (t0, cpu0), (t1, cpu1) in itertools.pairwise(samples):
        span = t1 - t0
        if span > 0:
            rows.append([round(t1, 2), *(round((cpu1[n] - cpu0[n]) / span, 2) for n in names)])
    return rows


async def _sample(procs: Mapping[str, psutil.Process]) -> dict[str, float]:
    def read() -> dict[str, float]:
        return {name: float(sum(p.cpu_times()[:2])) for name, p in procs.items()}

    return await asyncio.to_thread(read)


async def batch(client: AsyncClient, procs: Mapping[str, psutil.Process], n: int, window: float) -> str:
    """One batch of `n` sessions; its two tables."""
    ends: list[dict[str, float]] = [{} for _ in range(n)]
    run_id = f"timeline-{uuid.uuid4().hex[:12]}"
    samples: list[Sample] = [(0.0, await _sample(procs))]
    start = time.perf_counter()

    def ended(i: int) -> Callable[[str], None]:
        def mark(phase: str) -> None:
            ends[i][phase] = time.perf_counter() - start

        return mark

    timeout_s = timeout_for(WAIT_S)
    sessions = asyncio.gather(*(rlgate_session(client, WAIT_S, run_id, timeout_s, ended(i)) for i in range(n)))
    while not sessions.done():
        await asyncio.wait([sessions], timeout=window)
        samples.append((time.perf_counter() - start, await _sample(procs)))
    records = sessions.result()
    failed = sum(1 for r in records if not r[0])
    names = list(procs)
    return (
        f"{n} sessions, {failed} failed; phase ends, seconds from the batch's start:\n"
        + format_table(["phase", "sessions", "p1", "p50", "p99", "last"], phase_rows(ends))
        + f"\n\nCPU per {window:g} s window, in cores:\n"
        + format_table(["until s", *names], window_rows(samples, names))
    )


async def timeline(n: int, batches: int, window: float, out: Path) -> None:
    ctx = BenchContext(quick=True, out_dir=out)
    try:
        async with scale_stack(ctx, n) as sut:
            procs = {name: psutil.Process(pid) for name, pid in sut.pids.items()}
            for index in range(batches):
                await quiesce([*sut.pids.values()])
                print(f"== batch {index + 1} of {batches}: " + await batch(sut.client, procs, n, window) + "\n")
    finally:
        await ctx.close()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.scale_timeline", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--n", type=int, default=1024, help="sessions per batch")
    parser.add_argument("--batches", type=int, default=3)
    parser.add_argument("--window", type=float, default=0.25, help="seconds per CPU sample")
    args = parser.parse_args(argv)
    if args.n < 1 or args.batches < 1 or args.window <= 0:
        parser.error("--n and --batches must be at least 1, --window above 0")
    out = run_dir("timeline")
    out.mkdir(parents=True, exist_ok=True)
    asyncio.run(timeline(args.n, args.batches, args.window, out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
