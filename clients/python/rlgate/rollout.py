"""`rlgate rollout`: run many episodes concurrently against a running stack with a policy.

    rlgate rollout --orchestrator 127.0.0.1:50051 --tasks all --episodes 2 --concurrency 16 \\
        --policy reference --out traj.jsonl --summary-json summary.json

`--episodes` is per task. Every episode runs in an `AsyncEpisode` (its session is closed however it ends);
the run's sessions carry one run id, and a final CloseSessions on it reports anything left open (it
should be 0). Output: a live progress bar, a summary table per environment, JSONL trajectories (one line
per episode) and the summary JSON
`{episodes, reward_mean, errors, verifier_errors, truncated, wall_s, episodes_per_s, ...}`.
The exit status is 1 when any episode failed (an error or a verifier error), else 0.

Heavier dependencies (rich, httpx) are imported when the command runs."""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import time
import uuid
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import click

from rlgate.client import ENV_API_KEY, ENV_ORCHESTRATOR, AsyncClient, ClientSettings
from rlgate.errors import RlgateError, VerifierError
from rlgate.policies import OpenAIPolicy, Policy, PolicyContext, PolicyError, ReferencePolicy
from rlgate.v1 import common_pb2


@dataclass
class EpisodeRecord:
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
    error_type: str | None = None  # "verifier", "rpc", "policy" or the exception class
    seconds: float = 0.0
    messages: list[dict[str, str]] = field(default_factory=list)
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class RolloutConfig:
    orchestrator: str
    tasks: str = "all"
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
    progress: bool = True


async def run_episode(
    client: AsyncClient, task: common_pb2.TaskInfo, index: int, policy: Policy, config: RolloutConfig
) -> EpisodeRecord:
    env_key = f"{task.env_id}:{task.version}" if task.version else task.env_id
    record = EpisodeRecord(task_key=task.key, env_key=env_key, episode_index=index)
    started = time.monotonic()
    try:
        async with client.episode(
            task_key=task.key, max_turns=config.max_turns, run_id=config.run_id, labels={"rlgate-tool": "rollout"}
        ) as ep:
            record.session_id = ep.session_id
            record.messages = ep.initial_messages()
            turn = 0
            while True:
                # The listed task, not Reset's: only ListTasks carries a reference solution (when asked).
                context = PolicyContext(task, list(record.messages), turn, ep.max_turns)
                text = await policy(context)
                record.messages.append({"role": "assistant", "content": text})
                result = await ep.turn(text)
                record.messages.extend(result.observations)
                record.tool_calls.extend(r.as_dict() for r in result.tool_calls)
                record.turns = result.turn
                turn += 1
                if result.done:
                    record.done, record.truncated = True, result.truncated
                    record.reward = result.reward
                    record.done_reason = result.done_reason
                    record.verification_status = result.verification_status
                    break
    except VerifierError as err:
        record.done, record.error, record.error_type = True, str(err), "verifier"
        record.verification_status = err.status
    except RlgateError as err:
        record.error, record.error_type = str(err), "rpc"
    except PolicyError as err:
        record.error, record.error_type = str(err), "policy"
    except Exception as err:  # one broken episode must not end the run; it is reported
        record.error, record.error_type = f"{type(err).__name__}: {err}", type(err).__name__
    record.seconds = time.monotonic() - started
    return record


def _percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def summarize(records: Sequence[EpisodeRecord], wall_s: float) -> dict[str, Any]:
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
    return OpenAIPolicy(config.base_url, config.model)


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


async def run_rollout(config: RolloutConfig) -> tuple[dict[str, Any], list[EpisodeRecord]]:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    config.run_id = config.run_id or f"rollout-{uuid.uuid4().hex[:12]}"
    policy = _policy(config)
    console = Console(stderr=True)
    async with AsyncClient(config.orchestrator, settings=ClientSettings.from_env(api_key=config.api_key)) as client:
        # Reference solutions are answer keys: fetched only for the policy that replays them.
        listed = await client.list_tasks(include_reference_solution=config.policy == "reference")
        tasks = _select(listed, config.tasks)
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
                record = await run_episode(client, task, index, policy, config)
            records.append(record)
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
        left_open = await client.close_sessions(run_id=config.run_id)
    summary = summarize(records, wall)
    summary["run_id"] = config.run_id
    summary["sessions_left_open"] = len(left_open)
    return summary, records


def print_summary(summary: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"rlgate rollout {summary.get('run_id', '')}")
    for column in ("environment", "episodes", "mean reward", "truncated", "verifier errors", "errors",
                   "mean turns", "p50 s", "p99 s"):  # fmt: skip
        table.add_column(column, justify="left" if column == "environment" else "right")

    def row(name: str, g: dict[str, Any]) -> list[str]:
        reward = "-" if g["reward_mean"] is None else f"{g['reward_mean']:.3f}"
        return [name, str(g["episodes"]), reward, str(g["truncated"]), str(g["verifier_errors"]),
                str(g["errors"]), f"{g['turns_mean']:.1f}", f"{g['p50_s']:.2f}", f"{g['p99_s']:.2f}"]  # fmt: skip

    for env, group in summary["per_env"].items():
        table.add_row(*row(env, group))
    table.add_row(*row("all", summary), style="bold")
    console = Console()
    if not console.is_terminal:
        console = Console(width=140)  # a file or pipe: do not squeeze the table into 80 columns
    console.print(table)
    console.print(
        f"{summary['episodes']} episodes in {summary['wall_s']:.1f}s ({summary['episodes_per_s']:.2f}/s); "
        f"sessions left open: {summary['sessions_left_open']}"
    )


@click.command("rollout")
@click.option(
    "--orchestrator", envvar=ENV_ORCHESTRATOR, required=True, help=f"host:port[,...] [env: {ENV_ORCHESTRATOR}]"
)
@click.option("--api-key", envvar=ENV_API_KEY, default=None, help=f"Orchestrator API key [env: {ENV_API_KEY}]")
@click.option("--tasks", default="all", show_default=True, help="'all' or comma-separated task keys")
@click.option("--episodes", default=1, show_default=True, type=click.IntRange(min=1), help="Episodes per task")
@click.option("--concurrency", default=8, show_default=True, type=click.IntRange(min=1), help="Episodes at once")
@click.option("--policy", type=click.Choice(["reference", "openai"]), default="reference", show_default=True)
@click.option("--base-url", envvar="OPENAI_BASE_URL", default=None, help="OpenAI-compatible endpoint (--policy openai)")
@click.option("--model", default=None, help="Model name (--policy openai); key from OPENAI_API_KEY")
@click.option("--max-turns", default=0, show_default=True, help="Turn limit per episode (0: the task's)")
@click.option("--run-id", default="", help="Run id for the sessions (default: generated)")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=None, help="JSONL trajectories")
@click.option("--summary-json", type=click.Path(dir_okay=False, path_type=Path), default=None)
@click.option("--progress/--no-progress", default=True, show_default=True)
def rollout_command(**options: Any) -> None:
    """Run episodes concurrently with a policy and report rewards per environment."""
    config = RolloutConfig(**options)
    summary, _ = asyncio.run(run_rollout(config))
    print_summary(summary)
    if config.summary_json is not None:
        config.summary_json.write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    failed = summary["errors"] + summary["verifier_errors"]
    if failed:
        click.echo(f"{failed} episode(s) failed; see the trajectories for details", err=True)
    sys.exit(1 if failed else 0)
