"""The benchmark harness: percentile math, closed-loop timing, ratio entries, results.json merging, tables.

These never run a benchmark; they check the arithmetic and the file format the benchmarks rely on.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from bench.harness import (
    Entry,
    Goal,
    Stats,
    alternate,
    closed_loop,
    describe,
    failed,
    fmt,
    format_table,
    merge_results,
    percentile,
    round_ratios,
    safe_ratio,
    summary_rows,
)


def test_percentile_interpolates_between_closest_ranks() -> None:
    values = [4.0, 1.0, 3.0, 2.0]  # unsorted on purpose
    assert percentile(values, 0) == 1.0
    assert percentile(values, 100) == 4.0
    assert percentile(values, 50) == pytest.approx(2.5)
    assert percentile(list(range(1, 101)), 99) == pytest.approx(99.01)
    assert percentile([7.0], 99) == 7.0


@pytest.mark.parametrize(("values", "q"), [([], 50), ([1.0], -1), ([1.0], 101)])
def test_percentile_rejects_bad_input(values: list[float], q: float) -> None:
    with pytest.raises(ValueError):
        percentile(values, q)


def test_stats_from_latencies() -> None:
    stats = Stats.from_latencies([0.001, 0.002, 0.003, 0.004], elapsed_s=0.5, concurrency=2)
    assert stats.n == 4
    assert stats.per_s == pytest.approx(8.0)
    assert stats.p50_ms == pytest.approx(2.5)
    assert stats.mean_ms == pytest.approx(2.5)
    assert stats.figures("x_") == {"x_p50_ms": 2.5, "x_p99_ms": pytest.approx(3.97), "x_per_s": 8.0, "x_n": 4}
    with pytest.raises(ValueError):
        Stats.from_latencies([], 1.0)
    with pytest.raises(ValueError):
        Stats.from_latencies([0.1], 0.0)


def test_merge_pools_latencies_and_adds_wall_time() -> None:
    a = Stats.from_latencies([0.001] * 10, 0.01)
    b = Stats.from_latencies([0.003] * 30, 0.09)
    merged = Stats.merge([a, b])
    assert merged.n == 40
    assert merged.per_s == pytest.approx(400.0)
    assert merged.p50_ms == pytest.approx(3.0)
    assert merged.round_per_s == pytest.approx((1000.0, 333.333), rel=1e-3)


def test_round_ratios_pair_the_rounds_of_two_measurements() -> None:
    def rounds(*per_s: float) -> Stats:
        return Stats.merge([Stats.from_latencies([0.001] * int(n), 1.0) for n in per_s])

    assert round_ratios(rounds(100, 120, 90), rounds(100, 100, 100)) == [1.0, 1.2, 0.9]
    with pytest.raises(ValueError, match="number of rounds"):
        round_ratios(rounds(100, 120), rounds(100))


async def test_closed_loop_runs_total_ops_with_bounded_concurrency() -> None:
    running = peak = 0
    slots: list[int] = []

    async def op(slot: int) -> None:
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        slots.append(slot)
        await asyncio.sleep(0.002)
        running -= 1

    stats = await closed_loop(op, total=40, concurrency=4, warmup=8)
    assert stats.n == 40  # warm-up not measured
    assert len(slots) == 48
    assert peak == 4
    assert set(slots) == {0, 1, 2, 3}
    assert stats.p50_ms >= 2.0
    assert stats.per_s <= 4 / 0.002 * 1.05  # cannot beat concurrency / latency


async def test_closed_loop_propagates_failures() -> None:
    async def op(slot: int) -> None:
        raise RuntimeError("tool failed")

    with pytest.raises(ExceptionGroup):
        await closed_loop(op, total=3)


async def test_alternate_runs_each_measure_once_per_round_forth_and_back() -> None:
    order: list[str] = []

    def measure(name: str, latency: float) -> Callable[[], Awaitable[Stats]]:
        async def run() -> Stats:
            order.append(name)
            return Stats.from_latencies([latency], latency)

        return run

    stats = await alternate(3, {"a": measure("a", 0.001), "b": measure("b", 0.002)})
    assert order == ["a", "b", "b", "a", "a", "b"]
    assert stats["a"].n == 3
    assert stats["b"].p50_ms == pytest.approx(2.0)


def test_ratio_and_goals() -> None:
    assert safe_ratio(3.0, 2.0) == 1.5
    assert safe_ratio(1.0, 0.0) is None
    assert safe_ratio(None, 1.0) is None
    entry = Entry(
        "x",
        value=3.0,
        baseline=2.0,
        unit="ms",
        goals=(Goal("ratio", "<=", 1.5), Goal("extra_fig", ">=", 0.67)),
        extra={"extra_fig": 0.5},
    )
    assert entry.ratio == 1.5
    assert entry.met is True  # 1.5 <= 1.5
    assert entry.check(entry.goals[1]) is False
    assert Entry("y", value=None, baseline=2.0, unit="ms", goals=(Goal("ratio", ">=", 1),)).met is None
    with pytest.raises(ValueError):
        Goal("ratio", "=~", 1.0)


def test_entry_json_format() -> None:
    entry = Entry(
        "gateway_vs_direct_mcp",
        value=2.34567,
        baseline=1.5,
        unit="ms",
        baseline_name="direct",
        goals=(Goal("ratio", "<=", 1.5), Goal("tp", ">=", 0.67)),
        extra={"tp": 0.7, "mode": "quick"},
    )
    data = entry.to_json()
    assert data == {
        "value": 2.346,
        "baseline": 1.5,
        "ratio": 1.564,
        "unit": "ms",
        "baseline_name": "direct",
        "goal": "ratio <= 1.5",
        "met": False,
        "other_goals": {"tp >= 0.67": True},
        "tp": 0.7,
        "mode": "quick",
    }
    json.dumps(data)  # serialisable as is


def test_failed_entry_records_the_error_and_no_figure() -> None:
    group = ExceptionGroup("outer", [ConnectionError("refused\n on 127.0.0.1")])
    entry = failed("step_vs_openenv", "turns/s", group)
    data = entry.to_json()
    assert data["value"] is None and data["ratio"] is None
    assert data["error"] == "ConnectionError: refused on 127.0.0.1"
    assert describe("x" * 900) == "x" * 500
    assert "FAILED" in summary_rows([entry])[0][-1]


def test_merge_results_keeps_other_entries_and_replaces_same_names(tmp_path: Path) -> None:
    path = tmp_path / "results.json"
    merge_results(path, [Entry("a", 1.0, 2.0, "x"), Entry("b", 3.0, None, "y")], {"mode": "quick"})
    merged = merge_results(path, [Entry("a", 5.0, 2.0, "x")])
    on_disk = json.loads(path.read_text())
    assert on_disk == merged
    assert on_disk["a"]["value"] == 5.0 and on_disk["a"]["ratio"] == 2.5
    assert on_disk["b"]["value"] == 3.0 and on_disk["b"]["ratio"] is None
    assert on_disk["_run"] == {"mode": "quick"}
    assert not (tmp_path / "results.json.tmp").exists()


def test_merge_results_replaces_a_corrupt_file(tmp_path: Path) -> None:
    path = tmp_path / "results.json"
    path.write_text("[not an object")
    merge_results(path, [Entry("a", 1.0, 1.0, "x")])
    assert set(json.loads(path.read_text())) == {"a"}


def test_table_formatting() -> None:
    assert fmt(None) == "-"
    assert fmt(True) == "yes" and fmt(False) == "NO"
    assert fmt(1234.5) == "1,234" or fmt(1234.5) == "1,235"
    assert fmt(12.345) == "12.3"
    assert fmt(1.2345) == "1.23"
    assert fmt(0.001234) == "0.0012"
    table = format_table(["name", "v"], [["a", 1.5], ["bb", None]])
    lines = table.splitlines()
    assert lines[0].startswith("| name") and set(lines[1]) <= {"|", "-"}
    assert len({len(line) for line in lines}) == 1  # aligned
    rows = summary_rows([Entry("e", 2.0, 1.0, "u", goals=(Goal("ratio", ">=", 3), Goal("value", "<=", 5)))])
    assert rows[0][-1] is False and rows[1][-1] is True


def test_summary_table_from_a_results_file() -> None:
    from bench.__main__ import table_from_results

    results = {
        "_run": {"mode": "quick"},
        "a": Entry(
            "a", 2.0, 1.0, "ms", goals=(Goal("ratio", "<=", 1.5), Goal("tp", ">=", 0.67)), extra={"tp": 0.7}
        ).to_json(),
        "b": failed("b", "turns/s", RuntimeError("no venv")).to_json(),
    }
    lines = table_from_results(results).splitlines()
    assert lines[2].startswith("| a ") and "ratio <= 1.5" in lines[2] and "NO" in lines[2]
    assert "tp >= 0.67" in lines[3] and "yes" in lines[3]
    assert "FAILED: RuntimeError: no venv" in lines[4]
    assert not any("_run" in line for line in lines)


def test_profile_hot_spots_and_layers_from_collapsed_stacks() -> None:
    from bench.profile import hot_spots, layers

    collapsed = "\n".join(
        [
            "run (asyncio/runners.py:1);Handle._run (asyncio/events.py:78);call (toolgateway/service.py:1) 6",
            "run (asyncio/runners.py:1);_worker (concurrent/futures/thread.py:69);claim (store/sqlite.py:9) 3",
            "run (asyncio/runners.py:1);send (httpx2/_client.py:1) 1",
            "garbage line",
        ]
    )
    own, inclusive = hot_spots(collapsed)
    assert own[0] == ("call (toolgateway/service.py:1)", 0.6)
    assert ("run (asyncio/runners.py:1)", 1.0) not in inclusive  # plumbing left out
    shares = dict(layers(collapsed))
    assert shares["rlgate service code"] == pytest.approx(0.6)
    assert shares["SQLite store + thread hand-off"] == pytest.approx(0.3)
    assert shares["MCP client (mcp, httpx2, httpcore2, anyio)"] == pytest.approx(0.1)


def test_scale_timeline_phase_ends_count_only_the_sessions_that_got_that_far() -> None:
    from bench.scale_timeline import phase_rows

    ends = [{"reset": 0.1 * i, "call": 1.0 + 0.1 * i, "step": 1.1 + 0.1 * i} for i in range(1, 11)]
    ends.append({"reset": 2.0})  # failed in its CallTool
    rows = {row[0]: row for row in phase_rows(ends)}
    assert rows["reset"][1] == 11 and rows["reset"][-1] == 2.0
    assert rows["call"][1:] == [10, pytest.approx(1.109), pytest.approx(1.55), pytest.approx(1.991), 2.0]
    assert rows["close"] == ["close", 0, "-", "-", "-", "-"]


def test_scale_timeline_windows_give_each_process_its_cores() -> None:
    from bench.scale_timeline import window_rows

    samples = [(0.0, {"a": 1.0, "b": 5.0}), (0.25, {"a": 1.25, "b": 5.0}), (0.5, {"a": 1.3, "b": 5.1})]
    assert window_rows(samples, ["a", "b"]) == [[0.25, 1.0, 0.0], [0.5, 0.2, 0.4]]
    assert window_rows(samples[:1], ["a", "b"]) == []
