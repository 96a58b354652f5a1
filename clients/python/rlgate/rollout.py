r"""`rlgate rollout`: run many episodes concurrently against a running stack with a policy.

    rlgate rollout --orchestrator 127.0.0.1:50051 --tasks all --episodes 2 --concurrency 16 \
        --policy reference --out traj.jsonl --summary-json summary.json

`--episodes` is per task. With `--fork-at K --branches N` each episode plays K turns and is forked N ways
(`AsyncEpisode.fork`); every branch plays on to its end and is a trajectory of its own (carrying the
prefix's messages, its `parent_session_id` and `branch_index`). Every episode runs in an `AsyncEpisode`
(its session is closed however it ends); the run's sessions carry one run id, and a final CloseSessions on
it reports anything left open (it should be 0). Output: a live progress bar, a summary table per
environment, JSONL trajectories (one line per episode) and the summary JSON
`{episodes, reward_mean, errors, verifier_errors, truncated, wall_s, episodes_per_s, ...}`, and with
`--plot` a figure of reward, turn latency and episodes/s over the run.
Screens reach the policy as images: `--policy openai` sends them as `image_url` parts (`--text-only`:
placeholders), and the conversation keeps the last `--keep-images` of them (older ones become a short note),
so a long episode's prompt stays bounded. Trajectories hold the text, each image as a placeholder.
The exit status is 1 when any episode failed (an error or a verifier error), else 0. Every failure of the
command itself (an unreachable orchestrator, a refused API key, an output path that cannot be written) ends
it with one line and exit status 1 (2 for bad options), and output paths are checked before any episode runs.

Heavier dependencies (rich, httpx, matplotlib) are imported when the command runs, and checked first."""

from __future__ import annotations

import asyncio
import copy
import importlib
import json
import os
import statistics
import sys
import time
import uuid
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from rlgate import protocol
from rlgate.client import ENV_API_KEY, ENV_ORCHESTRATOR, AsyncClient, ClientSettings
from rlgate.episode import ENV_TOOL_TIMEOUT, AsyncEpisode, tool_timeout_setting
from rlgate.errors import DeadlineExceeded, RlgateError, Unauthenticated, Unavailable, VerifierError
from rlgate.messages import DEFAULT_KEEP_IMAGES, Message, keep_last_images, to_text_dicts
from rlgate.policies import OpenAIPolicy, Policy, PolicyContext, PolicyError, ReferencePolicy
from rlgate.settings import split_addresses

if TYPE_CHECKING:
    from matplotlib.figure import Figure
from rlgate.v1 import common_pb2

# Deadline of the first call (ListTasks): an orchestrator that does not answer by then is reported as
# unreachable, rather than after the client's default 30 s of retries.
LIST_TASKS_TIMEOUT_S = 10.0


@dataclass
class EpisodeRecord:
    """One episode of a rollout: one JSONL line of the trajectories (`--out`).

    Times are in seconds since the run started; each turn's latency is its tool calls and Step (the
    policy's time excluded).

    Args:
        task_key: the task run.
        env_key: its environment, "env_id" or "env_id:version".
        episode_index: which episode of the task (0-based).
        session_id: the episode's session.
        reward: the verifier's score; None when none came back.
        done: the episode ended (a final answer, a done signal or the turn limit).
        truncated: it ended at the turn limit.
        turns: the turns taken.
        done_reason: why it ended, as the orchestrator said.
        verification_status: the verification's status name.
        error: what went wrong, if anything.
        error_type: "verifier", "rpc", "policy" or the exception's class.
        seconds: the episode's wall time.
        started_s: when the episode started.
        ended_s: when it ended.
        turn_ended_s: when each turn ended.
        turn_latency_s: each turn's latency.
        messages: the conversation as text, images as placeholders.
        tool_calls: every turn's tool calls and their results, in order.
        infra_faults: the infrastructure faults the episode met, by kind with their total (`InfraFaults`):
            not the policy's mistakes.
    """

    task_key: str
    env_key: str
    episode_index: int
    session_id: str = ""
    reward: float | None = None
    done: bool = False
    truncated: bool = False
    turns: int = 0
    done_reason: str = ""
    verification_status: str = ""
    error: str | None = None
    error_type: str | None = None
    seconds: float = 0.0
    started_s: float = 0.0
    ended_s: float = 0.0
    turn_ended_s: list[float] = field(default_factory=list)
    turn_latency_s: list[float] = field(default_factory=list)
    messages: list[dict[str, str]] = field(default_factory=list)
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    parent_session_id: str = ""  # --fork-at: the episode this branch was forked from
    branch_index: int = 0
    infra_faults: dict[str, int] = field(default_factory=dict)


@dataclass
class RolloutConfig:
    """The options of `rlgate rollout` (each field is the option of the same name).

    Args:
        orchestrator: the orchestrator's address, `host:port[,...]`.
        tasks: "all" or comma-separated task keys.
        modalities: "all" or comma-separated task modalities (tool_use, computer_use, browser_use): only tasks
            of these run (a stack without a browser serves no screens).
        episodes: episodes per task.
        concurrency: episodes at once.
        policy: "reference" (the task's reference solution) or "openai" (an OpenAI-compatible endpoint).
        base_url: the endpoint of `--policy openai`.
        model: the model name of `--policy openai`.
        api_key: the orchestrator's API key.
        max_turns: the turn limit per episode; 0 keeps the task's.
        run_id: the run id of the sessions; empty: generated.
        out: where to write the trajectories (JSONL), if anywhere.
        summary_json: where to write the summary JSON, if anywhere.
        plot: where to draw reward, turn latency and episodes/s over time, if anywhere.
        tool_timeout: seconds one tool call may take; None: `RLGATE_TOOL_TIMEOUT_S` or the default.
        keep_images: screens the policy sees: the last ones; older ones become a note.
        text_only: `--policy openai` sends images as text placeholders.
        progress: show a progress bar.
    """

    orchestrator: str
    tasks: str = "all"
    modalities: str = "all"
    episodes: int = 1
    concurrency: int = 8
    policy: str = "reference"
    base_url: str | None = None
    model: str | None = None
    api_key: str | None = None
    max_turns: int = 0
    run_id: str = ""
    out: Path | None = None
    summary_json: Path | None = None
    plot: Path | None = None
    tool_timeout: float | None = None
    keep_images: int = DEFAULT_KEEP_IMAGES
    text_only: bool = False
    progress: bool = True
    fork_at: int = 0  # 0: no forking
    branches: int = 1


async def run_episode(
    client: AsyncClient,
    task: common_pb2.TaskInfo,
    index: int,
    policy: Policy,
    config: RolloutConfig,
    run_started: float | None = None,
) -> EpisodeRecord:
    """One episode with `policy`; never raises (a failure is the record's error).

    Args:
        client: the client the episode runs on.
        task: the task, as ListTasks returned it.
        index: which episode of the task (0-based).
        policy: writes each assistant turn.
        config: the rollout's options (turn limit, run id, tool timeout).
        run_started: the zero of the record's timeline (`time.monotonic()`); None: this episode's start.
    """
    record = _new_record(task, index)
    started = time.monotonic()
    zero = started if run_started is None else run_started
    record.started_s = started - zero
    try:
        async with _episode(client, task, config) as ep:
            record.session_id = ep.session_id
            conversation = ep.initial_messages()
            record.messages = to_text_dicts(conversation)
            await _play(ep, task, record, conversation, policy, config, zero)
    except Exception as err:
        _failed(record, err)
    ended = time.monotonic()
    record.seconds, record.ended_s = ended - started, ended - zero
    return record


async def run_forked(
    client: AsyncClient,
    task: common_pb2.TaskInfo,
    index: int,
    policy: Policy,
    config: RolloutConfig,
    run_started: float | None = None,
) -> list[EpisodeRecord]:
    """`--fork-at K --branches N`: one episode plays K turns, is forked N ways (`AsyncEpisode.fork`) and
    each branch plays on to its end; one record per branch (the prefix's turns in each), never raising. An
    episode that ends before turn K is one record, as without forking."""
    record = _new_record(task, index)
    started = time.monotonic()
    zero = started if run_started is None else run_started
    record.started_s = started - zero
    records = [record]
    try:
        async with _episode(client, task, config) as ep:
            record.session_id = ep.session_id
            conversation = ep.initial_messages()
            record.messages = to_text_dicts(conversation)
            turn = await _play(ep, task, record, conversation, policy, config, zero, stop_at=config.fork_at)
            if not record.done:
                branches = await ep.fork(config.branches, messages=conversation)
                records = [copy.deepcopy(record) for _ in branches]

                async def branch(b: AsyncEpisode, r: EpisodeRecord) -> None:
                    r.session_id, r.branch_index, r.parent_session_id = b.session_id, b.branch_index, ep.session_id
                    try:
                        async with b:
                            await _play(b, task, r, list(conversation), policy, config, zero, turn=turn)
                    except Exception as err:
                        _failed(r, err)
                    r.ended_s = time.monotonic() - zero
                    r.seconds = r.ended_s - r.started_s

                await asyncio.gather(*(branch(b, r) for b, r in zip(branches, records, strict=True)))
                return records
    except Exception as err:
        for r in records:
            _failed(r, err)
    ended = time.monotonic()
    for r in records:
        r.seconds, r.ended_s = ended - started, ended - zero
    return records


def _new_record(task: common_pb2.TaskInfo, index: int) -> EpisodeRecord:
    env_key = f"{task.env_id}:{task.version}" if task.version else task.env_id
    return EpisodeRecord(task_key=task.key, env_key=env_key, episode_index=index)


def _episode(client: AsyncClient, task: common_pb2.TaskInfo, config: RolloutConfig) -> AsyncEpisode:
    return client.episode(
        task_key=task.key,
        max_turns=config.max_turns,
        run_id=config.run_id,
        labels={"rlgate-tool": "rollout"},
        tool_timeout_s=config.tool_timeout,
        close_when_done=True,  # one episode per session: the Step that ends it closes it (no Close)
    )


async def _play(
    ep: AsyncEpisode,
    task: common_pb2.TaskInfo,
    record: EpisodeRecord,
    conversation: list[Message],
    policy: Policy,
    config: RolloutConfig,
    zero: float,
    *,
    turn: int = 0,
    stop_at: int | None = None,
) -> int:
    """Turns of `policy` from `turn` until the episode ends (or `stop_at` turns were played), recorded;
    `conversation` (what the policy sees) grows in place. Returns the turn count."""
    while stop_at is None or turn < stop_at:
        # The listed task, not Reset's: only ListTasks carries a reference solution (when asked).
        context = PolicyContext(task, list(conversation), turn, ep.max_turns)
        text = await policy(context)
        # Stored (and shown to the policy again) as sendable text: a lone surrogate could not be
        # written to the JSONL nor posted to a chat endpoint. The turn parses the text as written.
        reply = Message("assistant", protocol.sendable_text(text))
        conversation.append(reply)
        record.messages.append(reply.to_text_dict())
        turn_started = time.monotonic()
        result = await ep.turn(text)
        turn_ended = time.monotonic()
        record.turn_latency_s.append(turn_ended - turn_started)
        record.turn_ended_s.append(turn_ended - zero)
        # Older screens leave the conversation as the new ones arrive: its size stays bounded.
        conversation[:] = keep_last_images([*conversation, *result.observations], config.keep_images)
        record.messages.extend(to_text_dicts(result.observations))
        record.tool_calls.extend(r.as_dict() for r in result.tool_calls)
        record.turns = result.turn
        record.infra_faults = result.step.infra_faults.as_dict()
        turn += 1
        if result.done:
            record.done, record.truncated = True, result.truncated
            record.reward = result.reward
            record.done_reason = result.done_reason
            record.verification_status = result.verification_status
            break
    return turn


def _failed(record: EpisodeRecord, err: Exception) -> None:
    """What went wrong, by kind: one broken episode must not end the run; it is reported."""
    if isinstance(err, VerifierError):
        record.done, record.error, record.error_type = True, str(err), "verifier"
        record.verification_status = err.status
    elif isinstance(err, RlgateError):
        record.error, record.error_type = str(err), "rpc"
    elif isinstance(err, PolicyError):
        record.error, record.error_type = str(err), "policy"
    else:
        record.error, record.error_type = f"{type(err).__name__}: {err}", type(err).__name__


def _percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def summarize(records: Sequence[EpisodeRecord], wall_s: float) -> dict[str, Any]:
    """The summary JSON (`--summary-json`): totals over `records`, and the same per environment.

    Args:
        records: the run's episodes.
        wall_s: the run's wall time in seconds.
    """

    def group(items: Sequence[EpisodeRecord]) -> dict[str, Any]:
        rewards = [r.reward for r in items if r.reward is not None]
        seconds = [r.seconds for r in items]
        return {
            "episodes": len(items),
            "reward_mean": statistics.fmean(rewards) if rewards else None,
            "scored": len(rewards),
            "errors": sum(r.error is not None and r.error_type != "verifier" for r in items),
            "verifier_errors": sum(r.error_type == "verifier" for r in items),
            "truncated": sum(r.truncated for r in items),
            # infrastructure faults, apart from the policy's errors: in all, and the episodes that met any
            "infra_faults": sum(r.infra_faults.get("total", 0) for r in items),
            "episodes_with_infra_faults": sum(r.infra_faults.get("total", 0) > 0 for r in items),
            "turns_mean": statistics.fmean([r.turns for r in items]) if items else 0.0,
            "p50_s": _percentile(seconds, 0.5),
            "p99_s": _percentile(seconds, 0.99),
        }

    by_env: dict[str, list[EpisodeRecord]] = defaultdict(list)
    for r in records:
        by_env[r.env_key].append(r)
    summary = group(records)
    summary.update(
        wall_s=wall_s,
        episodes_per_s=len(records) / wall_s if wall_s > 0 else 0.0,
        per_env={env: group(items) for env, items in sorted(by_env.items())},
    )
    return summary


def _select(tasks: Sequence[common_pb2.TaskInfo], wanted: str) -> list[common_pb2.TaskInfo]:
    if wanted.strip() == "all":
        return list(tasks)
    by_key = {t.key: t for t in tasks}
    keys = [k.strip() for k in wanted.split(",") if k.strip()]
    missing = [k for k in keys if k not in by_key]
    if missing:
        raise click.UsageError(f"unknown task key(s): {', '.join(missing)}")
    return [by_key[k] for k in keys]


def _policy(config: RolloutConfig) -> Policy:
    if config.policy == "reference":
        return ReferencePolicy()
    if not config.base_url or not config.model:
        raise click.UsageError("--policy openai needs --base-url and --model")
    return OpenAIPolicy(config.base_url, config.model, images=not config.text_only)


class _JsonlWriter:
    """Appends records from a queue in a thread (no file I/O on the event loop)."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.queue: asyncio.Queue[EpisodeRecord | None] = asyncio.Queue()

    async def run(self) -> None:
        if self.path is None:
            while await self.queue.get() is not None:
                pass
            return
        fh = await asyncio.to_thread(self.path.open, "w", encoding="utf-8")
        try:
            while (record := await self.queue.get()) is not None:
                await asyncio.to_thread(fh.write, json.dumps(asdict(record), ensure_ascii=False) + "\n")
        finally:
            await asyncio.to_thread(fh.close)


async def _list_tasks(client: AsyncClient, config: RolloutConfig) -> list[common_pb2.TaskInfo]:
    """The run's tasks; the orchestrator's refusals become one-line errors naming what to do."""
    try:
        # Reference solutions are answer keys: fetched only for the policy that replays them.
        listed = await client.list_tasks(
            include_reference_solution=config.policy == "reference", timeout=LIST_TASKS_TIMEOUT_S
        )
    except Unauthenticated as err:
        given = "refused the API key" if config.api_key else "needs an API key: pass --api-key or set " + ENV_API_KEY
        raise click.ClickException(f"the orchestrator at {config.orchestrator} {given} ({err})") from err
    except (Unavailable, DeadlineExceeded) as err:
        raise click.ClickException(f"cannot reach the orchestrator at {config.orchestrator} ({err})") from err
    return [t for t in _select(listed, config.tasks) if _of_modality(t, config.modalities)]


def _of_modality(task: common_pb2.TaskInfo, wanted: str) -> bool:
    if wanted.strip() == "all":
        return True
    return (task.modality or "tool_use") in {m.strip() for m in wanted.split(",")}


async def run_rollout(config: RolloutConfig) -> tuple[dict[str, Any], list[EpisodeRecord]]:
    """Run every episode of `config` with a progress bar.

    Args:
        config: the rollout's options.

    Returns:
        The summary (as `summarize` makes it) and the episodes' records.

    Raises:
        click.ClickException: the orchestrator cannot be reached.
        click.UsageError: an unknown task key, or `--policy openai` without `--base-url` and `--model`.
    """
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    config.run_id = config.run_id or f"rollout-{uuid.uuid4().hex[:12]}"
    policy = _policy(config)
    console = Console(stderr=True)
    async with AsyncClient(config.orchestrator, settings=ClientSettings.from_env(api_key=config.api_key)) as client:
        try:
            tasks = await _list_tasks(client, config)
        except BaseException:
            await policy.aclose()
            raise
        jobs = [(task, i) for task in tasks for i in range(config.episodes)]
        semaphore = asyncio.Semaphore(max(1, config.concurrency))
        writer = _JsonlWriter(config.out)
        writer_task = asyncio.create_task(writer.run())
        records: list[EpisodeRecord] = []
        started = time.monotonic()
        progress = Progress(
            TextColumn("[bold]rollout"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("reward {task.fields[reward]}  errors {task.fields[errors]}"),
            TimeElapsedColumn(),
            console=console,
            disable=not config.progress,
        )

        async def one(task: common_pb2.TaskInfo, index: int, bar: Any) -> None:
            async with semaphore:
                if config.fork_at:
                    made = await run_forked(client, task, index, policy, config, started)
                else:
                    made = [await run_episode(client, task, index, policy, config, started)]
            records.extend(made)
            for record in made:
                await writer.queue.put(record)
            rewards = [r.reward for r in records if r.reward is not None]
            progress.update(
                bar,
                advance=1,
                reward=f"{statistics.fmean(rewards):.3f}" if rewards else "-",
                errors=sum(r.error is not None for r in records),
            )

        try:
            with progress:
                bar = progress.add_task("episodes", total=len(jobs), reward="-", errors=0)
                await asyncio.gather(*(one(task, i, bar) for task, i in jobs))
        finally:
            await writer.queue.put(None)
            await writer_task
            await policy.aclose()
        wall = time.monotonic() - started
        try:
            left_open: int | None = len(await client.close_sessions(run_id=config.run_id))
        except RlgateError as err:  # the episodes ran: report them, and that the check could not be made
            click.echo(f"could not check for sessions left open ({err})", err=True)
            left_open = None
    summary = summarize(records, wall)
    summary["run_id"] = config.run_id
    summary["sessions_left_open"] = left_open
    return summary, records


# ------------------------------------------------------------------------------------------------ output


def print_summary(summary: dict[str, Any]) -> None:
    """The per-environment table, sized for an 80-column terminal (two-line headers, environment names
    folded when long), then one line for the run.

    Args:
        summary: as `summarize` made it.
    """
    from rich import box
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"rlgate rollout {summary.get('run_id', '')}", box=box.SIMPLE_HEAD, show_edge=False, collapse_padding=True
    )
    table.add_column("environment", overflow="fold", min_width=11, ratio=1)
    for header in ("episodes", "mean\nreward", "trun-\ncated", "verifier\nerrors", "other\nerrors",
                   "mean\nturns", "p50\ns", "p99\ns"):  # fmt: skip
        table.add_column(header, justify="right", no_wrap=True)

    def row(name: str, g: dict[str, Any]) -> list[str]:
        reward = "-" if g["reward_mean"] is None else f"{g['reward_mean']:.3f}"
        return [name, str(g["episodes"]), reward, str(g["truncated"]), str(g["verifier_errors"]),
                str(g["errors"]), f"{g['turns_mean']:.1f}", f"{g['p50_s']:.2f}", f"{g['p99_s']:.2f}"]  # fmt: skip

    for env, group in summary["per_env"].items():
        table.add_row(*row(env, group))
    table.add_row(*row("all", summary), style="bold")
    console = Console()
    console.print(table)
    if summary.get("infra_faults"):  # not the policy's doing: said apart from its errors
        console.print(
            f"infrastructure faults: {summary['infra_faults']} in {summary['episodes_with_infra_faults']} "
            "episode(s) (see infra_faults in the trajectories)"
        )
    left = summary["sessions_left_open"]
    console.print(
        f"{summary['episodes']} episodes in {summary['wall_s']:.1f}s ({summary['episodes_per_s']:.2f}/s); "
        f"sessions left open: {'unknown' if left is None else left}"
    )


def plot_series(records: Sequence[EpisodeRecord], wall_s: float) -> dict[str, Any]:
    """What `write_plot` draws, as plain lists (x: seconds since the run started):
    `reward` (each scored episode's end and reward), `reward_mean` (the running mean at those points),
    `failed` (end times of episodes without a reward), `latency` (each turn's end and latency) and
    `throughput` (bin starts and episodes/s ended in each bin, `bin_s` wide).

    Args:
        records: the run's episodes.
        wall_s: the run's wall time in seconds.
    """
    ended = sorted(records, key=lambda r: r.ended_s)
    scored = [(r.ended_s, r.reward) for r in ended if r.reward is not None]
    running: list[float] = []
    for i, (_, reward) in enumerate(scored):
        running.append(reward if i == 0 else running[-1] + (reward - running[-1]) / (i + 1))
    latency = sorted((t, s) for r in records for t, s in zip(r.turn_ended_s, r.turn_latency_s, strict=True))
    span = max([wall_s, *(r.ended_s for r in records)], default=0.0)
    bins = max(1, min(30, len(records) // 2))  # about two episodes a bin: a rate, not single events
    bin_s = span / bins if span > 0 else 1.0
    counts = [0] * bins
    for r in records:
        counts[min(bins - 1, int(r.ended_s / bin_s))] += 1
    return {
        "reward": [[t, v] for t, v in scored],
        "reward_mean": [[t, m] for (t, _), m in zip(scored, running, strict=True)],
        "failed": [r.ended_s for r in ended if r.reward is None],
        "latency": [[t, s] for t, s in latency],
        "throughput": [[i * bin_s, c / bin_s] for i, c in enumerate(counts)],
        "bin_s": bin_s,
    }


def write_plot(path: Path, records: Sequence[EpisodeRecord], summary: dict[str, Any]) -> None:
    """Reward, turn latency and episodes/s over the run, in one figure.

    Args:
        path: the figure's file; its suffix names the format.
        records: the run's episodes.
        summary: as `summarize` made it.
    """
    plot_figure(records, summary).savefig(path, dpi=110)


def plot_figure(records: Sequence[EpisodeRecord], summary: dict[str, Any]) -> Figure:
    """The figure `write_plot` writes: reward on a fixed 0-1 axis (widened by rewards outside it) with the
    running mean drawn over the episodes' dots, turn latency, and episodes/s.

    Args:
        records: the run's episodes.
        summary: as `summarize` made it.
    """
    from matplotlib.figure import Figure  # the object API: no pyplot state, no display needed

    series = plot_series(records, summary["wall_s"])
    figure = Figure(figsize=(9, 8), layout="constrained")
    reward_ax, latency_ax, rate_ax = figure.subplots(3, 1, sharex=True)
    mean = "-" if summary["reward_mean"] is None else f"{summary['reward_mean']:.3f}"
    figure.suptitle(f"rlgate rollout {summary.get('run_id', '')}: {summary['episodes']} episodes, mean reward {mean}")
    if series["reward"]:
        reward_ax.scatter(*zip(*series["reward"], strict=True), s=10, alpha=0.4, label="episode", zorder=2)
        reward_ax.plot(*zip(*series["reward_mean"], strict=True), color="black", linewidth=2, label="running mean",
                       zorder=3)  # fmt: skip  # over the dots
    # A fixed axis: 0 to 1, widened only by rewards outside it (all 1.0 is a flat line at the top, not noise).
    rewards = [r for _, r in series["reward"]]
    low, high = min([0.0, *rewards]), max([1.0, *rewards])
    reward_ax.set_ylim(low - 0.05 * (high - low), high + 0.05 * (high - low))
    if series["failed"]:
        reward_ax.plot(series["failed"], [0.0] * len(series["failed"]), "|", color="red", markersize=12,
                       label="no reward (error)")  # fmt: skip
    reward_ax.set_ylabel("reward")
    if series["latency"]:
        latency_ax.scatter(*zip(*series["latency"], strict=True), s=6, alpha=0.4)
    latency_ax.set_ylabel("turn latency (s)")
    starts, rates = (list(column) for column in zip(*series["throughput"], strict=True))
    # The last bin drawn to its end: a post step ends at its last point.
    rate_ax.step([*starts, starts[-1] + series["bin_s"]], [*rates, rates[-1]], where="post",
                 label=f"per {series['bin_s']:.3g} s bin")  # fmt: skip
    rate_ax.axhline(summary["episodes_per_s"], color="black", linestyle="--", label="whole run")
    rate_ax.set_ylabel("episodes/s")
    rate_ax.set_xlabel("seconds since the run started")
    for ax in (reward_ax, rate_ax):
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="best", fontsize="small")
    for ax in (reward_ax, latency_ax, rate_ax):
        ax.grid(alpha=0.3)
    return figure


# ----------------------------------------------------------------------------------------------- command


def _check_output(path: Path | None, option: str) -> None:
    """An output path the run could write: its folder exists and is writable (checked before any episode)."""
    if path is None:
        return
    folder = path.parent
    if not folder.is_dir():
        raise click.BadParameter(f"folder {str(folder)!r} does not exist", param_hint=f"'{option}'")
    if path.is_dir():
        raise click.BadParameter(f"{str(path)!r} is a folder", param_hint=f"'{option}'")
    if not os.access(folder, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise click.BadParameter(f"{str(path)!r} is not writable", param_hint=f"'{option}'")


def _require(module: str, why: str) -> None:
    try:
        importlib.import_module(module)
    except ImportError as err:
        raise click.ClickException(f"{why} needs {module}, which is not installed ({err}): {_EXTRA_HINT}") from err


LOCAL_ORCHESTRATOR = "127.0.0.1:50051"  # `rlgate up`'s orchestrator
_GRPC_SCHEMES = ("dns:", "ipv4:", "ipv6:", "unix:", "unix-abstract:", "vsock:")  # target forms gRPC itself reads


def _check_orchestrator(addresses: str) -> None:
    """Each address a gRPC target (`host:port`, or a scheme gRPC reads), refused at once otherwise: a URL such
    as `http://...` would only fail after the client's retries, with a message about DNS."""
    try:
        targets = split_addresses(addresses)
    except (TypeError, ValueError) as err:
        raise click.BadParameter(str(err), param_hint="'--orchestrator'") from err
    for target in targets:
        if target.lower().startswith(_GRPC_SCHEMES):
            continue
        if "://" in target:
            raise click.BadParameter(
                f"{target!r} is a URL; the orchestrator is a gRPC address host:port, such as "
                f"{LOCAL_ORCHESTRATOR} (the local stack's)",
                param_hint="'--orchestrator'",
            )
        host, _, port = target.rpartition(":")
        if not host or not port.isdigit():
            raise click.BadParameter(
                f"{target!r} is not host:port (for example {LOCAL_ORCHESTRATOR})", param_hint="'--orchestrator'"
            )


_EXTRA_HINT = "pip install 'rlgate[rollout]' (from the rlgate checkout)"


def preflight(config: RolloutConfig) -> None:
    """Everything the run needs that can be checked before it starts: output paths, libraries, settings.

    Args:
        config: the rollout's options; `tool_timeout` is resolved in place.

    Raises:
        click.BadParameter: an output path the run could not write, a plot format matplotlib lacks, or a
            bad tool timeout.
        click.ClickException: a library the options need is not installed.
    """
    _check_orchestrator(config.orchestrator)
    for path, option in ((config.out, "--out"), (config.summary_json, "--summary-json"), (config.plot, "--plot")):
        _check_output(path, option)
    _require("rich", "rlgate rollout")
    if config.policy == "openai":
        _require("httpx", "--policy openai")
    if config.plot is not None:
        _require("matplotlib", "--plot")
        from matplotlib.figure import Figure

        formats = Figure().canvas.get_supported_filetypes()
        if config.plot.suffix.lstrip(".").lower() not in formats:
            raise click.BadParameter(
                f"{config.plot.name!r}: the suffix names the format, one of {', '.join(sorted(formats))}",
                param_hint="'--plot'",
            )
    try:
        config.tool_timeout = tool_timeout_setting(config.tool_timeout)
    except ValueError as err:
        raise click.BadParameter(str(err), param_hint="'--tool-timeout'") from err


@click.command("rollout")
@click.option(
    "--orchestrator", envvar=ENV_ORCHESTRATOR, default=LOCAL_ORCHESTRATOR, show_default=True,
    help=f"host:port[,...] (default: the local stack of `rlgate up`) [env: {ENV_ORCHESTRATOR}]",
)  # fmt: skip
@click.option("--api-key", envvar=ENV_API_KEY, default=None, help=f"Orchestrator API key [env: {ENV_API_KEY}]")
@click.option("--tasks", default="all", show_default=True, help="'all' or comma-separated task keys")
@click.option(
    "--modalities", default="all", show_default=True,
    help="'all' or comma-separated task modalities (tool_use, computer_use, browser_use) to run",
)  # fmt: skip
@click.option(
    "--episodes", default=1, show_default=True, type=click.IntRange(min=1),
    help="Episodes of EACH task: the run plays (number of tasks) x N episodes",
)  # fmt: skip
@click.option("--concurrency", default=8, show_default=True, type=click.IntRange(min=1), help="Episodes at once")
@click.option("--policy", type=click.Choice(["reference", "openai"]), default="reference", show_default=True)
@click.option("--base-url", envvar="OPENAI_BASE_URL", default=None, help="OpenAI-compatible endpoint (--policy openai)")
@click.option("--model", default=None, help="Model name (--policy openai); key from OPENAI_API_KEY")
@click.option(
    "--text-only", is_flag=True, default=False,
    help="--policy openai: send each image as a text placeholder (an endpoint without vision)",
)  # fmt: skip
@click.option(
    "--keep-images", default=DEFAULT_KEEP_IMAGES, show_default=True, type=click.IntRange(min=0),
    help="Screens the policy sees: the last N images of the conversation (older ones become a note)",
)  # fmt: skip
@click.option("--max-turns", default=0, show_default=True, help="Turn limit per episode (0: the task's)")
@click.option("--run-id", default="", help="Run id for the sessions (default: generated)")
@click.option(
    "--tool-timeout", type=float, default=None,
    help=f"Seconds one tool call may take before the model sees an error (default 120) [env: {ENV_TOOL_TIMEOUT}]",
)  # fmt: skip
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=None, help="JSONL trajectories")
@click.option("--summary-json", type=click.Path(dir_okay=False, path_type=Path), default=None, help="Summary JSON")
@click.option(
    "--plot", type=click.Path(dir_okay=False, path_type=Path), default=None,
    help="Figure of reward, turn latency and episodes/s over time (.png, .svg, .pdf; needs matplotlib)",
)  # fmt: skip
@click.option(
    "--fork-at", default=0, show_default=True, type=click.IntRange(min=0),
    help="Fork each episode after this many turns (0: never); its branches play on (--branches)",
)  # fmt: skip
@click.option(
    "--branches", default=1, show_default=True, type=click.IntRange(min=1, max=16),
    help="Branches per forked episode (--fork-at); each is a trajectory of its own",
)  # fmt: skip
@click.option("--progress/--no-progress", default=True, show_default=True)
def rollout_command(**options: Any) -> None:
    """Run episodes concurrently with a policy and report rewards per environment."""
    config = RolloutConfig(**options)
    preflight(config)
    summary, records = asyncio.run(run_rollout(config))
    print_summary(summary)
    if config.summary_json is not None:
        config.summary_json.write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    if config.plot is not None:
        write_plot(config.plot, records, summary)
    failed = summary["errors"] + summary["verifier_errors"]
    if failed:
        click.echo(f"{failed} episode(s) failed; see the trajectories for details", err=True)
    sys.exit(1 if failed else 0)
