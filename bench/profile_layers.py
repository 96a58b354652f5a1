"""Where a scale batch's CPU goes: py-spy on every service process, samples split by layer and by RPC.

    python -m bench.profile_layers [--n 512] [--batches 3] [--rate 250] [--out DIR]
    python -m bench.profile_layers --from DIR      # the tables again from raw profiles already recorded

Starts the setup of `cpu_per_session` (bench/cpu_per_session.py: scale_sessions' stack, one toolgateway per
core), warms it up, then runs `--batches` batches of `--n` sessions (wait 1 s) while `py-spy record` samples
the orchestrator and each toolgateway (all threads, idle ones left out, raw collapsed stacks by function;
`--nonblocking`, so the process is never paused). The process's CPU time over the same batches (psutil)
turns each share of samples into CPU ms per session.

A sample's layer: the first of CONTEXT_LAYERS with a frame anywhere on its stack (work done on behalf of
logging, of the MCP SDK, of the store...), else the first of LEAF_LAYERS met walking from the leaf up (the
frames that wrap every handler, gRPC's and the interceptors', count only for their own work). A sample's
RPC: the servicer method on its stack, if any. py-spy sees Python threads only: CPU of gRPC's C-core
threads shows up as the gap between the process's CPU and the sampled time ("unsampled").
py-spy is not a project dependency: it comes with the `dev` extra.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import subprocess
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psutil

from bench.cpu_per_session import WAIT_S, scale_stack
from bench.fixtures import BenchContext, BenchError, run_dir
from bench.harness import format_table
from bench.profile import py_spy_record
from bench.scale_sessions import quiesce, rlgate_batch

# Checked in order; a sample belongs to the first whose pattern matches any frame of its stack.
CONTEXT_LAYERS = (
    (
        "logging + metrics + tracing",
        re.compile(
            r"\((logging/|prometheus_client/|opentelemetry/)|runtime/(logs|metrics|tracing)\.py|"
            r"orchestrator/metrics\.py|toolgateway/recording\.py"
        ),
    ),
    (
        "MCP call (mcp SDK, aiohttp, anyio, mcpclient)",
        re.compile(
            r"\((mcp/|mcp_types/|httpx2/|httpcore2/|anyio/|h11/|h2/|aiohttp/|aiohappyeyeballs/|yarl/|multidict/)|mcpclient/"
        ),
    ),
    ("store calls + worker thread (apsw)", re.compile(r"store/|\(apsw|_worker\.py|ledger/")),
    ("auth + token lookup", re.compile(r"runtime/auth\.py|toolgateway/auth\.py|ApiKeys")),
)
# Checked from the leaf up; a sample belongs to the first layer one of its frames matches.
LEAF_LAYERS = (
    ("JSON", re.compile(r"\((json/|orjson)|runtime/jsoncodec\.py|core/convert\.py")),
    ("protobuf", re.compile(r"google/protobuf|_pb2\.py")),
    ("interceptors", re.compile(r"runtime/(interceptors|deadline)\.py")),
    ("grpc.aio (Python side)", re.compile(r"\(grpc/|grpc/_cython|\.pyx")),
    ("rlgate service code", re.compile(r"orchestrator/|toolgateway/|runtime/|rlgate/core/")),
    ("asyncio event loop", re.compile(r"asyncio/|uvloop|selectors\.py|runtime/eventloop\.py")),
)
# perf's shared objects, grouped: where the CPU goes below Python (gRPC's C core, SQLite, the kernel).
DSO_GROUPS = (
    ("CPython interpreter (libpython)", re.compile(r"libpython|^python")),
    ("grpc C core + Cython (cygrpc)", re.compile(r"cygrpc|grpc")),
    ("SQLite (apsw)", re.compile(r"apsw|sqlite|^__init__\.cpython")),
    ("kernel (other: sockets, epoll, futex, file I/O and locks)", re.compile(r"kernel|vdso")),
    ("libc, allocator", re.compile(r"libc|libm|ld-linux|libstdc|malloc")),
    ("protobuf upb", re.compile(r"_message|upb|protobuf")),
    ("uvloop / libuv", re.compile(r"uvloop|loop\.cpython")),
    ("json (orjson)", re.compile(r"orjson")),
)
RPC = re.compile(r"^(?:\w+\.)?(Reset|Step|State|Close|CloseSessions|CallTool|ListTools) \([^)]*servicer\.py[:)]")


def parse(collapsed: str) -> list[tuple[list[str], int]]:
    out = []
    for line in collapsed.splitlines():
        stack, _, count_text = line.rpartition(" ")
        if stack and count_text.isdigit():
            out.append(([f for f in stack.split(";") if f], int(count_text)))
    return out


def layer_of(frames: Sequence[str]) -> str:
    for name, rx in CONTEXT_LAYERS:
        if any(rx.search(f) for f in frames):
            return name
    for frame in reversed(frames):
        for name, rx in LEAF_LAYERS:
            if rx.search(frame):
                return name
    return "other"


def rpc_of(frames: Sequence[str]) -> str:
    for frame in frames:
        if m := RPC.match(frame):
            return m.group(1)
    return "(no servicer frame: gRPC, loop, background tasks)"


def split(collapsed: str) -> tuple[Counter[str], Counter[str], int]:
    by_layer: Counter[str] = Counter()
    by_rpc: Counter[str] = Counter()
    total = 0
    for frames, count in parse(collapsed):
        by_layer[layer_of(frames)] += count
        by_rpc[rpc_of(frames)] += count
        total += count
    return by_layer, by_rpc, total


def report(meta: dict[str, Any], profiles: dict[str, str]) -> str:
    """Tables per process: CPU ms per session by thread, by shared object (perf), by Python layer and by RPC
    (py-spy: shares of the GIL holder's samples, scaled to the main thread's CPU)."""
    cpu_ms, rate, seconds = meta["cpu_ms"], meta["rate"], meta["seconds"]
    out = []
    for name, collapsed in profiles.items():
        threads = meta.get("threads_ms", {}).get(name, {})
        if threads:
            rows = [[t, round(ms, 3)] for t, ms in sorted(threads.items(), key=lambda kv: -kv[1]) if ms >= 0.005]
            out.append(f"{name}: CPU ms per session by thread\n" + format_table(["thread", "CPU ms/session"], rows))
        dsos = Counter(meta.get("dsos", {}).get(name, {}))
        if dsos:
            total_dso = sum(dsos.values())
            rows = [[d, f"{k / total_dso:.1%}", round(cpu_ms[name] * k / total_dso, 3)] for d, k in dsos.most_common()]
            out.append(
                f"{name}: perf samples by shared object\n"
                + format_table(["shared object", "samples", "CPU ms/session"], rows)
            )
        by_layer, by_rpc, total = split(collapsed)
        if not total:
            out.append(f"{name}: no samples")
            continue
        out.append(
            f"{name}: {cpu_ms[name]:.2f} CPU ms per session; py-spy: {total} samples of the GIL holder at {rate} Hz "
            f"over {seconds.get(name, 0):.1f} s, their shares x the process's CPU"
        )
        for title, counter in (("Python layer", by_layer), ("RPC", by_rpc)):
            rows = [[key, f"{k / total:.1%}", round(cpu_ms[name] * k / total, 3)] for key, k in counter.most_common()]
            out.append(format_table([title, "samples", "~CPU ms/session"], rows))
    return "\n\n".join(out)


async def record(pid: int, rate: int, out: Path) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        *py_spy_record(pid, rate, out), stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL
    )


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds per thread name (Linux's comm; threads of one name summed)."""
    out: dict[str, float] = {}
    for thread in psutil.Process(pid).threads():
        try:
            comm = Path(f"/proc/{pid}/task/{thread.id}/comm").read_text().strip()
        except OSError:
            comm = "?"
        if thread.id == pid:
            comm = "main (event loop)"
        elif comm == "python":
            comm = "other Python threads (store worker, checkpointer)"
        out[comm] = out.get(comm, 0.0) + thread.user_time + thread.system_time
    return out


def dso_group(dso: str) -> str:
    for name, rx in DSO_GROUPS:
        if rx.search(dso):
            return name
    return f"other ({dso})"


# Symbols that name a cost of their own, whatever their shared object: the cyclic garbage collector, and the
# kernel switching threads (a thread handing work to another and waiting: the store's worker, the GIL).
SYMBOL_GROUPS = (
    (
        "CPython cyclic GC (in libpython)",
        re.compile(r"^(gc_collect|visit_|subtract_refs|move_unreachable|update_refs|deduce_unreachable|\w+_?traverse)"),
    ),
    ("kernel: thread switches (finish_task_switch)", re.compile(r"^finish_task_switch")),
)


def perf_split(data: Path) -> dict[int, Counter[str]]:
    """{pid: {DSO or symbol group: samples}} (every thread of each process) from `perf script`."""
    text = subprocess.run(
        ["perf", "script", "-i", str(data), "-F", "pid,ip,sym,dso"],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    ).stdout
    out: dict[int, Counter[str]] = {}
    for line in text.splitlines():
        m = re.match(r"\s*(\d+)\s+\S+\s+(\S*).*\((.*)\)\s*$", line)
        if not m:
            continue
        group = next((name for name, rx in SYMBOL_GROUPS if rx.search(m.group(2))), None)
        out.setdefault(int(m.group(1)), Counter())[group or dso_group(Path(m.group(3)).name)] += 1
    return out


async def profile(n: int, batches: int, rate: int, out: Path) -> None:
    ctx = BenchContext(quick=True, out_dir=out)
    try:
        async with scale_stack(ctx, n) as sut:
            procs = {name: psutil.Process(pid) for name, pid in sut.services.items()}
            await quiesce([*sut.pids.values()])
            spies = {name: await record(pid, rate, out / f"{name}.txt") for name, pid in sut.services.items()}
            perf = await asyncio.create_subprocess_exec(
                "perf",
                "record",
                "-F",
                "997",
                "-o",
                str(out / "perf.data"),
                "-p",
                ",".join(str(pid) for pid in sut.services.values()),
                stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.DEVNULL,
            )
            await asyncio.sleep(1.0)  # py-spy and perf attached
            cpu0 = {name: sum(p.cpu_times()[:2]) for name, p in procs.items()}
            threads0 = {name: thread_cpu(pid) for name, pid in sut.services.items()}
            started = asyncio.get_running_loop().time()
            for _ in range(batches):
                records, _wall = await rlgate_batch(sut.client, n, WAIT_S)
                if failed := [r[6] for r in records if not r[0]]:
                    raise BenchError(f"{len(failed)} sessions failed, e.g. {failed[0]}")
            await quiesce([*sut.pids.values()])
            cpu1 = {name: sum(p.cpu_times()[:2]) for name, p in procs.items()}
            threads1 = {name: thread_cpu(pid) for name, pid in sut.services.items()}
            seconds = asyncio.get_running_loop().time() - started
            perf.send_signal(2)
            await asyncio.wait_for(perf.wait(), 60)
            for spy in spies.values():
                spy.send_signal(2)  # SIGINT: py-spy writes its output and exits
            for spy in spies.values():
                await asyncio.wait_for(spy.wait(), 60)
        sessions = n * batches
        cpu_ms = {name: (cpu1[name] - cpu0[name]) / sessions * 1e3 for name in procs}
        threads_ms = {
            name: {t: (s - threads0[name].get(t, 0.0)) / sessions * 1e3 for t, s in threads1[name].items()}
            for name in procs
        }
        dsos = await asyncio.to_thread(perf_split, out / "perf.data")
        meta = {
            "n": n,
            "batches": batches,
            "rate": rate,
            "cpu_ms": cpu_ms,
            "threads_ms": threads_ms,
            "pids": dict(sut.services),
            "dsos": {name: dict(dsos.get(pid, {})) for name, pid in sut.services.items()},
            "seconds": dict.fromkeys(procs, seconds),
        }
        await asyncio.to_thread((out / "meta.json").write_text, json.dumps(meta, indent=2))
    finally:
        await ctx.close()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.profile_layers", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--n", type=int, default=512, help="sessions per batch")
    parser.add_argument("--batches", type=int, default=3)
    parser.add_argument("--rate", type=int, default=250, help="py-spy samples per second")
    parser.add_argument("--out", type=Path, default=None, help="where raw profiles go (default bench/out/...)")
    parser.add_argument("--from", dest="source", type=Path, default=None, help="report on an earlier recording")
    args = parser.parse_args(argv)
    out = args.source
    if out is None:
        out = args.out or run_dir("profile-layers")
        out.mkdir(parents=True, exist_ok=True)
        asyncio.run(profile(args.n, args.batches, args.rate, out))
    meta = json.loads((out / "meta.json").read_text())
    if args.source is not None and "pids" in meta and (out / "perf.data").exists():  # groups as defined now
        dsos = perf_split(out / "perf.data")
        meta["dsos"] = {name: dict(dsos.get(pid, {})) for name, pid in meta["pids"].items()}
    profiles = {name: (out / f"{name}.txt").read_text() for name in meta["cpu_ms"]}
    print(f"{meta['batches']} batches of {meta['n']} sessions, py-spy at {meta['rate']} Hz; raw profiles in {out}\n")
    print(report(meta, profiles))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
