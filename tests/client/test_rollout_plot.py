"""`rlgate rollout --plot`: reward, turn latency and episodes/s over the run, drawn from the timeline every
trajectory line now carries; matplotlib checked before anything runs. The summary table fits 80 columns."""

from __future__ import annotations

import itertools
import json
import re
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from rlgate import rollout
from rlgate.cli import cli
from rlgate.rollout import EpisodeRecord, plot_series, print_summary, summarize
from rlgate.v1 import common_pb2, orchestrator_pb2
from tests.client.scripted import ScriptedServer

SOLUTION = json.dumps({"tool_calls": [{"name": "echo", "arguments": {"x": 1}}], "final_answer": "42"})


def _tasks(req: orchestrator_pb2.ListTasksRequest) -> orchestrator_pb2.ListTasksResponse:
    assert req.include_reference_solution
    return orchestrator_pb2.ListTasksResponse(
        tasks=[
            common_pb2.TaskInfo(key=key, env_id=env, version="v1", reference_solution_json=SOLUTION)
            for key, env in (("mail-1", "mailbox"), ("cal-1", "calendar"))
        ]
    )


def test_rollout_writes_the_plot_beside_the_trajectories_and_summary(server: ScriptedServer, tmp_path: Path) -> None:
    server.script.push("ListTasks", _tasks)
    out, summary_json, plot = tmp_path / "traj.jsonl", tmp_path / "summary.json", tmp_path / "rollout.png"
    args = ["rollout", "--orchestrator", server.address, "--episodes", "3", "--concurrency", "2", "--no-progress",
            "--out", str(out), "--summary-json", str(summary_json), "--plot", str(plot)]  # fmt: skip
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    assert plot.read_bytes().startswith(b"\x89PNG\r\n\x1a\n") and plot.stat().st_size > 10_000
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(lines) == 6 and json.loads(summary_json.read_text())["episodes"] == 6
    for line in lines:  # the timeline the plot is drawn from
        assert len(line["turn_latency_s"]) == len(line["turn_ended_s"]) == 2 and line["reward"] == 1.0
        assert 0 <= line["started_s"] <= line["turn_ended_s"][0] <= line["turn_ended_s"][1] <= line["ended_s"]


def test_plot_series() -> None:
    def record(ended: float, reward: float | None, turns: list[tuple[float, float]]) -> EpisodeRecord:
        return EpisodeRecord(
            task_key="t", env_key="e", episode_index=0, reward=reward, ended_s=ended,
            turn_ended_s=[t for t, _ in turns], turn_latency_s=[s for _, s in turns],
        )  # fmt: skip

    records = [record(4.0, 0.0, [(3.0, 0.5)]), record(1.0, 1.0, [(0.5, 0.1), (1.0, 0.2)]), record(2.0, None, [])]
    records += [record(3.0 + i / 10, 1.0, []) for i in range(5)]
    series = plot_series(records, wall_s=4.0)
    assert series["reward"][0] == [1.0, 1.0] and series["reward"][-1] == [4.0, 0.0]
    assert series["reward_mean"][-1][1] == pytest.approx(6 / 7)  # seven scored episodes, six rewarded
    assert series["failed"] == [2.0]
    assert series["latency"] == [[0.5, 0.1], [1.0, 0.2], [3.0, 0.5]]
    assert len(series["throughput"]) == 4 and series["bin_s"] == 1.0  # about two episodes a bin
    assert sum(rate for _, rate in series["throughput"]) * series["bin_s"] == len(records)


@pytest.mark.parametrize(("rewards", "shown"), [([1.0] * 6, (0.0, 1.0)), ([0.5, 1.0, 3.0, -1.0], (-1.0, 3.0))])
def test_reward_axis_is_fixed_and_the_running_mean_is_drawn_over_the_dots(
    rewards: list[float], shown: tuple[float, float]
) -> None:
    records = [
        EpisodeRecord(
            task_key="t",
            env_key="e",
            episode_index=i,
            reward=r,
            ended_s=1.0 + i,
            turn_ended_s=[0.5 + i],
            turn_latency_s=[0.1],
        )
        for i, r in enumerate(rewards)
    ]
    figure = rollout.plot_figure(records, summarize(records, wall_s=10.0))
    reward_ax = figure.axes[0]
    low, high = reward_ax.get_ylim()
    assert low < shown[0] and high > shown[1] and high - low <= (shown[1] - shown[0]) * 1.2  # not auto-zoomed
    (dots,) = reward_ax.collections
    mean = next(line for line in reward_ax.get_lines() if line.get_label() == "running mean")
    assert mean.get_zorder() > dots.get_zorder()


def test_plot_needs_matplotlib_checked_before_running(
    server: ScriptedServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    args = ["rollout", "--orchestrator", server.address, "--plot", str(tmp_path / "p.png")]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit)
    last = result.output.strip().splitlines()[-1]
    assert last.startswith("Error: --plot needs matplotlib, which is not installed") and "rlgate[rollout]" in last
    assert server.script.count("ListTasks") == 0


def test_plot_format_follows_the_suffix(server: ScriptedServer, tmp_path: Path) -> None:
    result = CliRunner().invoke(cli, ["rollout", "--orchestrator", server.address, "--plot", str(tmp_path / "p.xyz")])
    assert result.exit_code == 2 and "the suffix names the format" in result.output
    assert server.script.count("ListTasks") == 0


def test_summary_table_fits_80_columns(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    records = [
        EpisodeRecord(task_key="t", env_key=env, episode_index=i, reward=0.5, turns=12, seconds=123.45,
                      error="x" if i == 0 else None, error_type="verifier" if i == 0 else None)
        for env in ("mailbox:v1", "a-rather-long-environment-name:v12") for i in range(1000)
    ]  # fmt: skip
    summary = summarize(records, wall_s=987.6)
    summary.update(run_id="rollout-0123456789ab", sessions_left_open=0)
    print_summary(summary)
    lines = capsys.readouterr().out.splitlines()
    assert max(len(line) for line in lines) <= 80, "\n".join(lines)
    assert "…" not in "\n".join(lines)  # nothing cut short
    rows = [re.split(r"\s{2,}", line.strip()) for line in lines if line.strip().startswith(("mailbox", "all"))]
    assert rows[0] == ["mailbox:v1", "1000", "0.500", "0", "1", "0", "12.0", "123.45", "123.45"]
    assert rows[1][:2] == ["all", "2000"]
    first = next(i for i, line in enumerate(lines) if line.strip().startswith("a-rather"))
    folded = [lines[first].split()[0]]
    folded += [line.strip() for line in itertools.takewhile(lambda line: len(line.split()) == 1, lines[first + 1 :])]
    assert "".join(folded) == "a-rather-long-environment-name:v12"  # folded onto more lines, not cut
    assert lines[-1] == "2000 episodes in 987.6s (2.03/s); sessions left open: 0"


def test_an_unknown_left_open_count_is_said(capsys: pytest.CaptureFixture[str]) -> None:
    summary = summarize([], wall_s=1.0)
    summary.update(run_id="r", sessions_left_open=None)
    rollout.print_summary(summary)
    assert capsys.readouterr().out.splitlines()[-1].endswith("sessions left open: unknown")


def test_infrastructure_faults_are_summed_apart_from_errors(capsys: pytest.CaptureFixture[str]) -> None:
    faulted = {"outcome_unknown": 1, "client_retries": 2, "total": 3}
    records = [
        EpisodeRecord(task_key="t", env_key="mailbox:v1", episode_index=0, reward=1.0, infra_faults=faulted),
        EpisodeRecord(task_key="t", env_key="mailbox:v1", episode_index=1, reward=1.0),
    ]
    summary = summarize(records, wall_s=1.0)
    assert (summary["infra_faults"], summary["episodes_with_infra_faults"], summary["errors"]) == (3, 1, 0)
    assert summary["per_env"]["mailbox:v1"]["infra_faults"] == 3
    summary.update(run_id="r", sessions_left_open=0)
    rollout.print_summary(summary)
    assert "infrastructure faults: 3 in 1 episode(s)" in capsys.readouterr().out
