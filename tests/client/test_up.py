"""`rlgate up` as a user runs it, a real process with its three services: it stops every child (sessions
closed, instances deleted) on SIGINT after its output pipe broke, and on SIGHUP; a `kill -9` of it leaves no
service running (the instances it left are reaped like any crash's); a taken port stops it before it says
anything is up; a service that dies under it is restarted on its port and a session carries on."""

from __future__ import annotations

import functools
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

import rlgate
from rlgate.devtools.stack import LocalStack, StackSettings
from rlgate.v1 import common_pb2
from tests.client.test_stack import _skyrl_episode
from tests.support.ports import free_port
from tests.support.wait import wait_until_sync

pytestmark = pytest.mark.slow

BANNER_END = "Ctrl-C stops everything"


@dataclass
class Up:
    proc: subprocess.Popen[bytes]
    data_dir: Path
    ports: dict[str, int]
    output: list[str]

    @property
    def orchestrator(self) -> str:
        return f"127.0.0.1:{self.ports['ORCHESTRATOR']}"

    def children(self) -> list[psutil.Process]:
        return psutil.Process(self.proc.pid).children(recursive=True)

    def read_until(self, marker: str, timeout: float = 120.0) -> None:
        """Read stdout lines until one contains `marker` (the process must not exit first)."""
        assert self.proc.stdout is not None
        end = time.monotonic() + timeout
        while not any(marker in line for line in self.output):
            assert time.monotonic() < end, f"no {marker!r} within {timeout}s:\n" + "".join(self.output)
            ready, _, _ = select.select([self.proc.stdout], [], [], 1.0)
            if ready:
                line = self.proc.stdout.readline().decode(errors="replace")
                assert line, "rlgate up exited:\n" + "".join(self.output) + self.log_tails()
                self.output.append(line)

    def log_tails(self) -> str:
        logs = sorted((self.data_dir / "logs").glob("*.log"))
        return "".join(f"\n--- {p.name}\n" + "\n".join(p.read_text().splitlines()[-15:]) for p in logs)


def instances(data_dir: Path) -> list[Path]:
    """localfleet's live instances on disk (each keeps an instance.json until it is deleted)."""
    return sorted((data_dir / "localfleet").rglob("instance.json"))


def port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


@pytest.fixture
def up(tmp_path: Path) -> Iterator[Up]:
    """`rlgate up` on free ports, its banner read, one session open (so an instance exists)."""
    ports = {"ORCHESTRATOR": free_port(), "TOOLGATEWAY": free_port(), "LOCALFLEET": free_port()}
    env = {**os.environ, "RLGATE_DATA_DIR": str(tmp_path / "data")}
    env.update({f"RLGATE_{name}_PORT": str(port) for name, port in ports.items()})
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlgate.cli", "up"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, bufsize=0
    )  # unbuffered: select() sees every line not yet read
    running = Up(proc, tmp_path / "data", ports, [])
    try:
        running.read_until(BANNER_END)
        assert len(running.children()) >= 3
        with rlgate.Client(running.orchestrator) as client:
            task = next(iter(client.list_tasks())).key
            client.reset(task_key=task)
        assert instances(running.data_dir)
        yield running
    finally:
        if proc.poll() is None:
            for child in running.children():
                child.kill()
            proc.kill()
        proc.wait(30)


def assert_all_gone(up: Up, children: list[psutil.Process]) -> None:
    _gone, alive = psutil.wait_procs(children, timeout=30)
    assert not alive, [p.cmdline() for p in alive]
    for port in up.ports.values():
        wait_until_sync(functools.partial(port_free, port), 10, f"port {port} released")


def test_sigint_after_the_output_pipe_broke_stops_everything(up: Up) -> None:
    children = up.children()
    assert up.proc.stdout is not None
    up.proc.stdout.close()  # `| tee` died: the next write raises BrokenPipeError
    up.proc.send_signal(signal.SIGINT)
    assert up.proc.wait(90) == 0
    assert_all_gone(up, children)
    assert instances(up.data_dir) == []


def test_sighup_stops_everything(up: Up) -> None:
    children = up.children()
    up.proc.send_signal(signal.SIGHUP)
    up.read_until("stopping...")
    assert up.proc.wait(90) == 0
    assert_all_gone(up, children)
    assert instances(up.data_dir) == []


def test_kill_9_leaves_no_service_and_the_reaper_deletes_its_instances(up: Up) -> None:
    children = up.children()
    up.proc.kill()
    up.proc.wait(10)
    assert_all_gone(up, children)
    assert instances(up.data_dir)  # left behind, as by any crash
    # The next stack on the same store reaps what the dead one left.
    env = {"RLGATE_IDLE_TIMEOUT_S": "1", "RLGATE_REAP_INTERVAL_S": "0.5", "RLGATE_OWNER_TTL_S": "1"}
    settings = StackSettings(data_dir=up.data_dir, env=env)
    with LocalStack(settings):
        wait_until_sync(lambda: not instances(up.data_dir), 60, "the dead stack's instances reaped")


@pytest.mark.parametrize("service", ["toolgateway", "orchestrator"])
def test_a_killed_service_is_restarted_and_a_session_carries_on(up: Up, service: str) -> None:
    """Killed mid-session, the service comes back on its port; the client's calls made meanwhile are
    delayed (retried), not failed, and the same session goes on to its close."""
    with rlgate.Client(up.orchestrator) as client:
        task = next(iter(client.list_tasks())).key
        with client.episode(task_key=task) as episode:
            victim = next(p for p in up.children() if f"rlgate.cli {service} " in " ".join(p.cmdline()))
            victim.kill()
            # Straight away, while it is down: retried until the restart answers.
            assert episode.list_tools()
            assert client.state(episode.session_id).session.status == common_pb2.SESSION_STATUS_ACTIVE
            up.read_until(f"{service} restarted")
            assert up.proc.poll() is None
        assert client.state(episode.session_id).session.status == common_pb2.SESSION_STATUS_CLOSED
    replacement = next(p for p in up.children() if f"rlgate.cli {service} " in " ".join(p.cmdline()))
    assert replacement.pid != victim.pid
    assert f"127.0.0.1:{up.ports[service.upper()]}" in replacement.cmdline()


def _read_only_tools(orchestrator: str, tasks: list[common_pb2.TaskInfo]) -> set[str]:
    """The tools of the tasks' environments that their upstream annotates read-only or idempotent: a call
    of one that a dead gateway cut is run again, never answered OUTCOME_UNKNOWN."""
    names = set()
    with rlgate.Client(orchestrator) as client:
        for task in {t.env_id: t for t in tasks}.values():
            with client.episode(task_key=task.key) as episode:
                for tool in episode.tools:
                    hints = json.loads(tool.annotations_json or "{}")
                    if hints.get("readOnlyHint") or hints.get("idempotentHint"):
                        names.add(tool.name)
    return names


SKYRL_THREADS = 32  # SkyRL's default max_env_workers
TOOL_LATENCY_S = 0.5  # localfleet holds every tool call this long: calls are in flight when the kill comes


@pytest.mark.parametrize("service", ["toolgateway", "orchestrator"])
def test_skyrl_threads_ride_through_a_restart(up: Up, service: str) -> None:
    """32 SkyRL-style threads play reference solutions while a service is SIGKILLed under `rlgate up` with
    tool calls in flight: every episode finishes with a verdict and none raises out of `init` or `step`; no
    read-only call reaches the model as OUTCOME_UNKNOWN; every episode whose tool call was cut (the gateway's
    log says so) carries the fault marker in its steps' metadata, and its metrics count it under
    `infra_faults`, apart from `tool_errors`. An episode nothing cut scores 1.0."""
    with rlgate.Client(up.orchestrator) as client:
        tasks = [t for t in client.list_tasks(include_reference_solution=True) if t.modality != "computer_use"]
    read_only = _read_only_tools(up.orchestrator, tasks)
    assert read_only
    jobs = (tasks * SKYRL_THREADS)[:SKYRL_THREADS]
    admin = f"http://127.0.0.1:{up.ports['LOCALFLEET']}/_admin"
    httpx.put(f"{admin}/faults", json={"environments": {"*": {"tool_latency_s": TOOL_LATENCY_S}}}).raise_for_status()
    tool_calls_before = int(httpx.get(f"{admin}/counters").raise_for_status().json()["tool_calls"])
    traces: list[dict[str, Any]] = [{} for _ in jobs]
    run_id = f"restart-{service}"
    with ThreadPoolExecutor(max_workers=SKYRL_THREADS) as pool:
        futures = [
            pool.submit(_skyrl_episode, up.orchestrator, task, run_id, trace=trace)
            for task, trace in zip(jobs, traces, strict=True)
        ]

        def calls_in_flight() -> bool:
            started = int(httpx.get(f"{admin}/counters").json()["tool_calls"])
            return started >= tool_calls_before + SKYRL_THREADS // 2

        wait_until_sync(calls_in_flight, 120, "the threads' tool calls under way")
        assert not all(f.done() for f in futures)
        victim = next(p for p in up.children() if f"rlgate.cli {service} " in " ".join(p.cmdline()))
        victim.kill()
        outs = [f.result(timeout=600) for f in futures]  # raises what an episode raised
    up.read_until(f"{service} restarted")

    cut = faulted = 0
    with rlgate.Client(up.orchestrator) as client:
        for task, out, trace in zip(jobs, outs, traces, strict=True):
            assert out["done"] and out["metadata"]["verification_status"] == "OK", (task.key, out["metadata"])
            for step in trace["steps"]:
                for call in step["metadata"]["tool_call"] or []:
                    if call["name"] in read_only:
                        assert call["error_kind"] != "TOOL_ERROR_KIND_OUTCOME_UNKNOWN", (task.key, call)
            logged = [e.infra_fault for e in client.state(trace["session_id"], include_tool_calls=True).tool_calls]
            marker = out["metadata"]["infra_faults"]  # the episode's faults so far, on its last step
            metrics = trace["metrics"]
            calls = [c for step in trace["steps"] for c in step["metadata"]["tool_call"] or []]
            errors = [c for c in calls if c["is_error"]]
            unknown = [c for c in errors if c["error_kind"] == "TOOL_ERROR_KIND_OUTCOME_UNKNOWN"]
            detail = (task.key, metrics, calls, logged)
            for kind in ("outcome_unknown", "tool_reruns"):
                assert marker[kind] == logged.count(kind) == metrics[f"infra_faults/{kind}"], detail
            assert len(unknown) == marker["outcome_unknown"], detail
            # The cut calls are infra_faults, never tool_errors (a later call may fail for real: a cut
            # create_folder that never ran leaves the move into that folder failing, the model's to see).
            assert metrics["tool_errors"] == len(errors) - len(unknown), detail
            assert metrics["infra_faults"] == marker["total"], detail
            if any(logged):
                cut += 1
                assert marker["total"] > 0, detail
            else:
                assert not errors, detail
            if not unknown:  # only a cut call that may not have run can change what the episode scores
                assert out["reward"] == 1.0, detail
            faulted += marker["total"] > 0
    assert faulted >= 1, "no episode met the kill (its client would have retried a call)"
    if service == "toolgateway":
        assert cut >= 1, "no episode had a tool call in flight when the gateway died"


def test_a_service_that_keeps_failing_stops_the_stack_with_its_log(up: Up) -> None:
    """The toolgateway killed and its port taken: every restart fails to bind, its budget runs out, and
    `rlgate up` stops everything, exiting 1 with the end of the gateway's log."""
    children = up.children()
    victim = next(p for p in children if "rlgate.cli toolgateway " in " ".join(p.cmdline()))
    victim.kill()
    victim.wait(10)
    with socket.socket() as holder:
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        holder.bind(("127.0.0.1", up.ports["TOOLGATEWAY"]))
        holder.listen()
        up.read_until("toolgateway exited with", timeout=120)
        up.read_until("times within", timeout=180)
        assert up.proc.stdout is not None
        up.output.append(up.proc.stdout.read().decode(errors="replace"))  # the log's tail, to the end
        assert up.proc.wait(90) == 1
    text = "".join(up.output)
    assert "; stopping. Log:" in text and "address already in use" in text.lower(), text
    psutil.wait_procs(children, timeout=30)
    assert not [p for p in children if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def test_supervisor_restarts_with_backoff_until_its_budget_is_spent(tmp_path: Path) -> None:
    from rlgate.core.backoff import Backoff
    from rlgate.devtools.stack import Supervisor

    now = [0.0]
    stack = LocalStack(StackSettings(data_dir=tmp_path))
    supervisor = Supervisor(stack, backoff=Backoff(1.0, 4.0, jitter=0), budget=3, window_s=60, clock=lambda: now[0])
    assert [supervisor.restart_delay("toolgateway") for _ in range(3)] == [1.0, 2.0, 4.0]
    assert supervisor.restart_delay("toolgateway") is None  # a fourth exit within the window: failing for good
    assert supervisor.restart_delay("orchestrator") == 1.0  # each service has its own budget
    now[0] = 61.0  # exits older than the window are forgiven
    assert supervisor.restart_delay("toolgateway") == 1.0


def test_a_taken_port_stops_up_before_any_banner(tmp_path: Path) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        env = {
            **os.environ,
            "RLGATE_DATA_DIR": str(tmp_path / "data"),
            "RLGATE_ORCHESTRATOR_PORT": str(port),
            "RLGATE_TOOLGATEWAY_PORT": "0",
            "RLGATE_LOCALFLEET_PORT": "0",
        }
        done = subprocess.run(
            [sys.executable, "-m", "rlgate.cli", "up"], capture_output=True, text=True, env=env, timeout=60
        )
    assert done.returncode != 0
    assert "up" not in done.stdout.lower(), done.stdout
    assert f"port {port}" in done.stderr and "RLGATE_ORCHESTRATOR_PORT" in done.stderr, done.stderr
    assert not (tmp_path / "data" / "logs" / "orchestrator.log").exists()  # nothing was started
