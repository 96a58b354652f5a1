"""Where the services spend their CPU under a benchmark's load: py-spy on the orchestrator and gateway.

    python -m bench.profile step|calltool|turn [--seconds 15] [--concurrency 16] [--out DIR]

Starts a fresh local stack, drives 16-way (or --concurrency) load of one kind (Step on one session per
worker; CallTool on one session; turns = CallTool + Step, one session per worker), samples both service
processes with `py-spy record --gil` (raw collapsed stacks by function, only the thread holding the GIL) and
prints the top frames by own time and by inclusive time.
py-spy is not a project dependency: `.venv/bin/pip install -c constraints.txt py-spy` first.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import shutil
import sys
from collections import Counter
from pathlib import Path

from bench.fixtures import BENCH_TOOLS, ERA_ENV, BenchContext, Rlgate, Session, run_dir, service_pids
from bench.harness import closed_loop, format_table

SCENARIOS = ("step", "calltool", "turn")
CONCURRENT = 16
# Frames on (nearly) every stack say nothing about where the time goes: process/loop/thread plumbing.
_PLUMBING = re.compile(
    r"\((threading\.py|<frozen runpy>|asyncio/(runners|base_events|events)\.py|click/|"
    r"rlgate/cli\.py|runtime/config\.py|concurrent/futures/thread\.py|contextlib\.py)"
    r"|^run \(\w+/server\.py"
)


# Leaf-first: a sample counts for the first layer (from the leaf up) one of its frames belongs to.
LAYERS = (
    (
        "SQLite store + thread hand-off",
        re.compile(
            r"store/sqlite\.py|concurrent/futures/thread\.py|threading\.py|"
            r"_write_to_self|_read_from_self|run_in_executor|sqlite3"
        ),
    ),
    ("validation (pydantic, jsonschema)", re.compile(r"pydantic|jsonschema|referencing/")),
    ("logging + metrics", re.compile(r"logging/|prometheus_client/|runtime/logs\.py|runtime/metrics\.py")),
    ("MCP client (mcp, httpx2, httpcore2, anyio)", re.compile(r"\(mcp/|mcp_types/|httpx2/|httpcore2/|anyio/|h11/")),
    ("gRPC + interceptors", re.compile(r"grpc/|runtime/interceptors\.py|servicer\.py")),
    ("protobuf/Struct conversion", re.compile(r"protobuf/|rlgate/core/convert\.py")),
    ("rlgate service code", re.compile(r"toolgateway/|orchestrator/|store/|localfleet/")),
    ("event loop: waiting in select", re.compile(r"EpollSelector\.select")),
    ("event loop callbacks (incl. grpc.aio Cython: no Python frames)", re.compile(r"asyncio/")),
)


def layers(collapsed: str) -> list[tuple[str, float]]:
    """Share of on-CPU samples per layer (see LAYERS), largest first; unmatched samples are "other"."""
    counts: Counter[str] = Counter()
    for line in collapsed.splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        frames = stack.split(";")
        layer = next((name for frame in reversed(frames) for name, rx in LAYERS if rx.search(frame)), "other")
        counts[layer] += int(count_text)
    total = sum(counts.values()) or 1
    return [(name, n / total) for name, n in counts.most_common()]


def hot_spots(collapsed: str, top: int = 15) -> tuple[list[tuple[str, float]], list[tuple[str, float]]]:
    """(own-time, inclusive-time) shares of the top frames in py-spy's raw (collapsed) output."""
    own: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    total = 0
    for line in collapsed.splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = [f for f in stack.split(";") if f]
        if not frames:
            continue
        total += count
        own[frames[-1]] += count
        for frame in set(frames):
            inclusive[frame] += count
    if total == 0:
        return [], []
    ranked = [(f, n / total) for f, n in inclusive.most_common() if not _PLUMBING.search(f)]
    return [(f, n / total) for f, n in own.most_common(top)], ranked[:top]


def py_spy_record(pid: int, rate: int, out: Path, *, seconds: int | None = None) -> list[str]:
    """The py-spy command that samples the GIL holder's Python stack of `pid` into `out` (raw format), for
    `seconds` or until it is stopped."""
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    duration = ["--duration", str(seconds)] if seconds is not None else []
    return [py_spy, "record", "--pid", str(pid), *duration, "--rate", str(rate), "--format", "raw",
            "--function", "--gil", "--nonblocking", "--output", str(out)]  # fmt: skip


async def record(pid: int, seconds: int, out: Path) -> str:
    proc = await asyncio.create_subprocess_exec(
        *py_spy_record(pid, 200, out, seconds=seconds), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    log, _ = await asyncio.wait_for(proc.communicate(), seconds + 60)
    if proc.returncode != 0:
        raise RuntimeError(f"py-spy record failed ({proc.returncode}): {log.decode(errors='replace')[-800:]}")
    return await asyncio.to_thread(out.read_text)


async def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.profile", description=__doc__)
    parser.add_argument("scenario", choices=SCENARIOS)
    parser.add_argument("--seconds", type=int, default=15)
    parser.add_argument("--concurrency", type=int, default=CONCURRENT, help=f"workers (default {CONCURRENT})")
    parser.add_argument("--out", type=Path, default=None, help="where the raw profiles go (default bench/out/...)")
    args = parser.parse_args(argv)
    out = args.out or run_dir(f"profile-{args.scenario}")
    ctx = BenchContext(quick=True, out_dir=out)
    env_key = ERA_ENV["modern"]
    call = BENCH_TOOLS[env_key]
    try:
        stack = await ctx.stack()
        pids = service_pids(stack, "orchestrator", "toolgateway")
        async with Rlgate(stack) as rl:
            sessions: list[Session] = [await rl.reset(env_key) for _ in range(CONCURRENT)]

            async def op(slot: int) -> None:
                session = sessions[0 if args.scenario == "calltool" else slot]
                if args.scenario != "step":
                    await rl.call_tool(session, call)
                if args.scenario != "calltool":
                    await rl.step(session, call)

            await closed_loop(op, 200, args.concurrency)  # warm-up
            load = asyncio.create_task(closed_loop(op, 10_000_000, args.concurrency, duration_s=args.seconds + 3))
            profiles = await asyncio.gather(
                *(record(pid, args.seconds, out / f"{name}.txt") for name, pid in pids.items())
            )
            stats = await load
        print(
            f"{args.scenario}: {stats.per_s:.0f} ops/s at concurrency {args.concurrency}, p50 {stats.p50_ms:.1f} ms "
            f"(while sampled)"
        )
        for name, collapsed in zip(pids, profiles, strict=True):
            print(f"\n{name}: samples by layer (leaf-first)")
            print(format_table(["share", "layer"], [[f"{share:.1%}", layer] for layer, share in layers(collapsed)]))
            own, inclusive = hot_spots(collapsed)
            print(f"\n{name}: top frames by own time")
            print(format_table(["share", "frame"], [[f"{share:.1%}", frame] for frame, share in own]))
            print(f"\n{name}: top frames by inclusive time (loop/thread plumbing left out)")
            print(format_table(["share", "frame"], [[f"{share:.1%}", frame] for frame, share in inclusive]))
        print(f"\nraw profiles in {out}")
    finally:
        await ctx.close()
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main(sys.argv[1:])))
