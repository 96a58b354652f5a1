"""The shared benchmark harness: timing, percentiles, ratio entries, results.json, tables.

Every benchmark measures with `closed_loop` (warm-up first, then `total` operations spread over
`concurrency` workers, each latency taken with `perf_counter`), turns what it measured into `Entry`s
(value, baseline, ratio = value / baseline, unit, a goal on one of them) and hands them back to
`bench.__main__`, which merges them into `bench/results.json` and prints a table. Nothing here knows
about rlgate, so the math is unit-tested on its own (tests/unit/test_bench_harness.py).
"""

from __future__ import annotations

import asyncio
import json
import math
import operator
import os
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

_OPS: dict[str, Callable[[float, float], bool]] = {
    "<=": operator.le,
    ">=": operator.ge,
    "<": operator.lt,
    ">": operator.gt,
}


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between closest ranks (numpy's default)."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"q must be within 0..100, not {q}")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


@dataclass(frozen=True)
class Stats:
    """What one measured run gives: operation count, wall time, latency percentiles and throughput."""

    n: int
    elapsed_s: float
    p50_ms: float
    p99_ms: float
    mean_ms: float
    per_s: float
    concurrency: int = 1
    latencies_s: tuple[float, ...] = field(default=(), repr=False)
    round_per_s: tuple[float, ...] = ()  # throughput of each round merged into this (see `round_ratios`)

    @classmethod
    def from_latencies(cls, latencies_s: Sequence[float], elapsed_s: float, concurrency: int = 1) -> Stats:
        if not latencies_s:
            raise ValueError("no latencies measured")
        if elapsed_s <= 0:
            raise ValueError(f"elapsed time must be positive, not {elapsed_s}")
        return cls(
            n=len(latencies_s),
            elapsed_s=elapsed_s,
            p50_ms=percentile(latencies_s, 50) * 1e3,
            p99_ms=percentile(latencies_s, 99) * 1e3,
            mean_ms=sum(latencies_s) / len(latencies_s) * 1e3,
            per_s=len(latencies_s) / elapsed_s,
            concurrency=concurrency,
            latencies_s=tuple(latencies_s),
        )

    @classmethod
    def merge(cls, runs: Sequence[Stats]) -> Stats:
        """Several rounds of the same measurement as one (latencies pooled, wall times added).

        Benchmarks alternate rlgate and its baseline in rounds, so slow phases of a shared machine hit
        both sides rather than one.
        """
        if not runs:
            raise ValueError("no runs to merge")
        latencies = [x for run in runs for x in run.latencies_s]
        merged = cls.from_latencies(latencies, sum(run.elapsed_s for run in runs), runs[0].concurrency)
        return replace(merged, round_per_s=tuple(run.per_s for run in runs))

    def figures(self, prefix: str = "") -> dict[str, float]:
        """Rounded figures for an entry's extra fields, e.g. {'seq_p50_ms': 1.23, ...}."""
        return {
            f"{prefix}p50_ms": round(self.p50_ms, 3),
            f"{prefix}p99_ms": round(self.p99_ms, 3),
            f"{prefix}per_s": round(self.per_s, 1),
            f"{prefix}n": self.n,
        }


Operation = Callable[[int], Awaitable[object]]  # called with the worker's slot, 0..concurrency-1


async def closed_loop(
    op: Operation, total: int, concurrency: int = 1, warmup: int = 0, duration_s: float | None = None
) -> Stats:
    """Run `op(slot)` `total` times with `concurrency` workers (each starts its next op when its last ends).

    A worker always passes its own slot, so a benchmark can give each worker its own session. With
    `duration_s`, no operation starts after that many seconds (those in flight finish and count), so a
    slow, shared machine shortens the sample rather than the run overrunning its budget.
    `warmup` operations run first with the same concurrency and are not measured. An exception in any
    operation stops the run and propagates (a benchmark never reports figures from a failing path).
    """
    if total < 1 or concurrency < 1:
        raise ValueError("total and concurrency must be >= 1")
    if warmup:
        await _drive(op, warmup, min(concurrency, warmup), None, None)
    latencies: list[float] = []
    start = time.perf_counter()
    deadline = None if duration_s is None else start + duration_s
    await _drive(op, total, min(concurrency, total), latencies, deadline)
    return Stats.from_latencies(latencies, time.perf_counter() - start, concurrency)


async def _drive(
    op: Operation, total: int, concurrency: int, latencies: list[float] | None, deadline: float | None
) -> None:
    counter = iter(range(total))

    async def worker(slot: int) -> None:
        for _ in counter:  # shared iterator: `total` operations in all, whichever worker is free
            t0 = time.perf_counter()
            if deadline is not None and t0 >= deadline:
                return
            await op(slot)
            if latencies is not None:
                latencies.append(time.perf_counter() - t0)

    async with asyncio.TaskGroup() as group:
        for slot in range(concurrency):
            group.create_task(worker(slot))


async def alternate(rounds: int, measures: Mapping[str, Callable[[], Awaitable[Stats]]]) -> dict[str, Stats]:
    """Run each measurement once per round, `rounds` times, in the given order and then in reverse (A B, B A,
    A B, ...): a machine that drifts slower or faster over a round then weighs on both sides alike, which
    running A first every round does not. Each measurement's rounds are merged."""
    collected: dict[str, list[Stats]] = {name: [] for name in measures}
    forth = list(measures)
    for round_ in range(rounds):
        for name in forth if round_ % 2 == 0 else forth[::-1]:
            collected[name].append(await measures[name]())
    return {name: Stats.merge(runs) for name, runs in collected.items()}


def round_ratios(value: Stats, baseline: Stats) -> list[float]:
    """Throughput ratio of each round, value / baseline: `alternate` measures the two back to back in every
    round, so these pairs show how far the pooled ratio moves within one run (the machine's drift)."""
    if len(value.round_per_s) != len(baseline.round_per_s):
        raise ValueError("the two measurements ran a different number of rounds")
    return [round(v / b, 3) for v, b in zip(value.round_per_s, baseline.round_per_s, strict=True)]


def throughput_ratios(seq: Stats, seq_baseline: Stats, c16: Stats, c16_baseline: Stats) -> dict[str, Any]:
    """The extra figures of an entry whose headline is a sequential throughput ratio: the 16-way ratio and
    both modes' per-round ratios."""
    return {
        "ratio_c16": round(c16.per_s / c16_baseline.per_s, 3),
        "ratio_rounds_seq": round_ratios(seq, seq_baseline),
        "ratio_rounds_c16": round_ratios(c16, c16_baseline),
    }


def safe_ratio(value: float | None, baseline: float | None) -> float | None:
    """value / baseline, or None when either is missing or the baseline is zero."""
    if value is None or baseline is None or baseline == 0:
        return None
    return value / baseline


@dataclass(frozen=True)
class Goal:
    """A target on one figure of an entry: `metric op target`, e.g. ratio <= 1.5."""

    metric: str  # "ratio", "value", or the name of an extra figure
    op: str
    target: float

    def __post_init__(self) -> None:
        if self.op not in _OPS:
            raise ValueError(f"goal operator must be one of {sorted(_OPS)}, not {self.op!r}")

    def check(self, figure: float | None) -> bool | None:
        return None if figure is None else _OPS[self.op](figure, self.target)

    def __str__(self) -> str:
        return f"{self.metric} {self.op} {self.target:g}"


@dataclass
class Entry:
    """One line of results.json: `value` of rlgate against a named `baseline`, their `ratio`, extras.

    `goals[0]` is the headline goal (normally on `ratio`); further goals check extra figures.
    """

    name: str
    value: float | None
    baseline: float | None
    unit: str
    baseline_name: str = ""  # what the baseline is (a measured peer/limit), or "" when there is none
    goals: tuple[Goal, ...] = ()
    extra: dict[str, Any] = field(default_factory=dict)
    error: str | None = None  # set when the benchmark (or its baseline) could not run: no figure is faked

    @property
    def ratio(self) -> float | None:
        return safe_ratio(self.value, self.baseline)

    def figure(self, metric: str) -> float | None:
        if metric == "ratio":
            return self.ratio
        if metric == "value":
            return self.value
        raw = self.extra.get(metric)
        return float(raw) if isinstance(raw, int | float) and not isinstance(raw, bool) else None

    def check(self, goal: Goal) -> bool | None:
        return goal.check(self.figure(goal.metric))

    @property
    def met(self) -> bool | None:
        """Whether the headline goal is met (None: no goal, or no figure to judge)."""
        return self.check(self.goals[0]) if self.goals else None

    def to_json(self) -> dict[str, Any]:
        ratio = self.ratio
        out: dict[str, Any] = {
            "value": _round(self.value),
            "baseline": _round(self.baseline),
            "ratio": None if ratio is None else round(ratio, 3),
            "unit": self.unit,
        }
        if self.baseline_name:
            out["baseline_name"] = self.baseline_name
        if self.goals:
            out["goal"] = str(self.goals[0])
            out["met"] = self.met
        if len(self.goals) > 1:
            out["other_goals"] = {str(g): self.check(g) for g in self.goals[1:]}
        if self.error:
            out["error"] = self.error
        out.update(self.extra)
        return out


def _round(x: float | None) -> float | None:
    if x is None:
        return None
    return round(x, 3) if abs(x) < 1000 else round(x, 1)


def failed(
    name: str, unit: str, error: BaseException | str, baseline_name: str = "", goals: tuple[Goal, ...] = ()
) -> Entry:
    """An entry that records why a benchmark could not produce its figure."""
    return Entry(
        name=name, value=None, baseline=None, unit=unit, baseline_name=baseline_name, goals=goals, error=describe(error)
    )


def describe(error: BaseException | str, limit: int = 500) -> str:
    """A one-line account of a failure for results.json (exception groups unwrapped)."""
    while isinstance(error, BaseExceptionGroup) and len(error.exceptions) == 1:
        error = error.exceptions[0]
    text = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
    return " ".join(text.split())[:limit]


def merge_results(path: Path, entries: Iterable[Entry], run_info: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Update `path` with `entries` (by name; other benchmarks' entries are kept) and write it atomically.

    A file that is missing or not a JSON object is replaced. `run_info` lands under the "_run" key.
    """
    current: dict[str, Any] = {}
    try:
        loaded = json.loads(path.read_text())
        if isinstance(loaded, dict):
            current = loaded
    except (OSError, ValueError):
        pass
    for entry in entries:
        current[entry.name] = entry.to_json()
    if run_info is not None:
        current["_run"] = dict(run_info)
    ordered = {k: current[k] for k in sorted(current)}
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(ordered, indent=2, sort_keys=False) + "\n")
    os.replace(tmp, path)
    return ordered


def fmt(x: Any) -> str:
    """A figure for a table cell: 3 significant-ish digits, '-' for missing."""
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "NO"
    if isinstance(x, float):
        if x == 0:
            return "0"
        if abs(x) >= 100:
            return f"{x:,.0f}"
        if abs(x) >= 10:
            return f"{x:.1f}"
        return f"{x:.2f}" if abs(x) >= 0.01 else f"{x:.2g}"
    return str(x)


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain-text table (also valid Markdown): numbers right-aligned, text left-aligned, cells via `fmt`."""
    cells = [[fmt(c) for c in row] for row in rows]
    numeric = [[isinstance(c, int | float) and not isinstance(c, bool) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    line = "| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)) + " |"
    rule = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    body = [
        "| " + " | ".join(c.rjust(w) if num else c.ljust(w) for c, w, num in zip(r, widths, n, strict=True)) + " |"
        for r, n in zip(cells, numeric, strict=True)
    ]
    return "\n".join([line, rule, *body])


SUMMARY_HEADERS = ("benchmark", "value", "baseline", "ratio", "unit", "goal", "met")


def summary_rows(entries: Iterable[Entry]) -> list[list[Any]]:
    """The headline row of each entry, then one row per further goal; a failed entry shows its error."""
    rows: list[list[Any]] = []
    for e in entries:
        if e.error and e.value is None:
            rows.append([e.name, "-", "-", "-", e.unit, str(e.goals[0]) if e.goals else "-", f"FAILED: {e.error[:60]}"])
            continue
        rows.append(
            [
                e.name,
                e.value,
                e.baseline,
                e.ratio,
                e.unit,
                str(e.goals[0]) if e.goals else "-",
                e.met if e.goals else "-",
            ]
        )
        for goal in e.goals[1:]:
            rows.append([f"  {e.name}", e.figure(goal.metric), "", "", "", str(goal), e.check(goal)])
    return rows


def stats_table(stats: Mapping[str, Stats], unit: str = "ops/s") -> str:
    """One row per measured path: concurrency, throughput, p50/p99 latency, operation count."""
    return format_table(
        ["path", "concurrency", unit, "p50 ms", "p99 ms", "n"],
        [[name, s.concurrency, s.per_s, s.p50_ms, s.p99_ms, s.n] for name, s in stats.items()],
    )
