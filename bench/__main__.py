"""`python -m bench [--quick|--full] [--only NAME,...]`: run the benchmarks, merge bench/results.json.

Each benchmark is a module with `NAME`, `async def run(ctx) -> list[Entry]` and optionally
`async def prepare(ctx)` (one-time setup outside the per-benchmark time limit); it starts what it needs
on loopback (stopped again after it, also when it fails), prints its own table, and its entries are merged
into results.json as soon as it ends, so an interrupted run keeps what it measured. A benchmark that fails
is recorded with its error, never with a figure. Exit status 1 when any benchmark failed.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import os
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.fixtures import BENCH_DIR, BenchContext, machine_info, run_dir
from bench.harness import SUMMARY_HEADERS, Entry, describe, failed, format_table, merge_results, summary_rows

BENCHMARKS = (
    "step_vs_grpc_echo",
    "gateway_vs_direct_mcp",
    "gateway_vs_per_call_session",
    "step_vs_openenv",
    "reset_warm_vs_cold",
    "fork_vs_replay",
    "provision_burst",
    "episodes_per_s",
    "sessions_10000",
    "scale_sessions",
    "cpu_per_session",
    "screenshot_vs_direct",
    "computer_use_16",
)
TIME_LIMIT_S = {"quick": 150.0, "full": 1800.0}  # per benchmark, unless its module sets TIME_LIMIT_S


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="small sizes (default)")
    mode.add_argument("--full", action="store_true", help="full sizes")
    parser.add_argument("--only", default="", help=f"comma-separated subset of: {', '.join(BENCHMARKS)}")
    parser.add_argument("--results", type=Path, default=BENCH_DIR / "results.json", help="results file to merge")
    parser.add_argument(
        "--table", action="store_true", help="print the summary table of the results file (Markdown) and run nothing"
    )
    args = parser.parse_args(argv)
    args.names = [n.strip() for n in args.only.split(",") if n.strip()] or list(BENCHMARKS)
    unknown = sorted(set(args.names) - set(BENCHMARKS))
    if unknown:
        parser.error(f"unknown benchmark(s): {', '.join(unknown)}")
    return args


async def run_one(name: str, ctx: BenchContext, limit_s: float) -> list[Entry]:
    try:
        module = importlib.import_module(f"bench.{name}")
        prepare = getattr(module, "prepare", None)
        if prepare is not None:  # one-time setup (e.g. a virtualenv to build): outside the time limit
            await prepare(ctx)
        limit_s = getattr(module, "TIME_LIMIT_S", {}).get("quick" if ctx.quick else "full", limit_s)
        async with asyncio.timeout(limit_s):
            return list(await module.run(ctx))
    except Exception as exc:  # recorded as the benchmark's result; the run goes on with the next one
        print(f"{name} FAILED: {describe(exc)}", file=sys.stderr)
        return [failed(name, "", exc)]
    finally:
        await ctx.close()


def table_from_results(results: dict[str, Any]) -> str:
    """The summary table of a results.json (headline rows, then one row per further goal)."""
    rows: list[list[Any]] = []
    for name, e in results.items():
        if name.startswith("_") or not isinstance(e, dict):
            continue
        if e.get("error") and e.get("value") is None:
            rows.append([name, None, None, None, e.get("unit", ""), e.get("goal", "-"), f"FAILED: {e['error'][:60]}"])
            continue
        rows.append(
            [
                name,
                e.get("value"),
                e.get("baseline"),
                e.get("ratio"),
                e.get("unit", ""),
                e.get("goal", "-"),
                e.get("met", "-"),
            ]
        )
        for goal, met in e.get("other_goals", {}).items():
            metric = goal.split(" ", 1)[0]
            rows.append([f"  {name}", e.get(metric), "", "", "", goal, met])
    return format_table(SUMMARY_HEADERS, rows)


async def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.table:
        print(table_from_results(json.loads(await asyncio.to_thread(args.results.read_text))))
        return 0
    mode = "full" if args.full else "quick"
    ctx = BenchContext(quick=mode == "quick", out_dir=run_dir(mode))
    run_info: dict[str, object] = {
        "mode": mode,
        "started_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": await asyncio.to_thread(machine_info),
    }
    everything: list[Entry] = []
    started = time.perf_counter()
    for name in args.names:
        print(f"\n== {name} ({mode}) ==", flush=True)
        t0 = time.perf_counter()
        entries = await run_one(name, ctx, TIME_LIMIT_S[mode])
        for entry in entries:
            entry.extra.setdefault("mode", mode)
            entry.extra.setdefault("seconds", round(time.perf_counter() - t0, 1))
            entry.extra.setdefault("started_at", run_info["started_at"])  # `_run` is the last run's, not every entry's
        everything.extend(entries)
        run_info["seconds"] = round(time.perf_counter() - started, 1)
        run_info["load_avg_1m_last"] = round(os.getloadavg()[0], 2)  # the machine is shared: how busy it was
        await asyncio.to_thread(merge_results, args.results, entries, run_info)
        print(format_table(SUMMARY_HEADERS, summary_rows(entries)), flush=True)
    print(f"\n== summary ({mode}, {time.perf_counter() - started:.0f} s; logs in {ctx.out_dir}) ==")
    print(format_table(SUMMARY_HEADERS, summary_rows(everything)))
    print(f"results merged into {args.results}")
    return 1 if any(e.error and e.value is None for e in everything) else 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main(sys.argv[1:])))
