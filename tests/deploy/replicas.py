"""Several replicas of the rlgate services as processes on loopback, for the multi-replica tests.

`Replicas` starts localfleet, N orchestrators and M gateways over one shared store (Redis), each as
`python -m rlgate.cli <service>` with its own log file, and guarantees they are all gone at teardown
(SIGTERM, then SIGKILL). Settings are passed as environment variables, each checked against the CLI's
config (`env_vars`), so a renamed setting fails here instead of being silently ignored.

`CountingProxy` sits in front of localfleet's control plane and counts requests per (method, path): it is
how the reconciliation test sees every DELETE an orchestrator sends, including ones localfleet would
answer idempotently.

Episodes for these tests: `solutions` (the tasks' reference solutions, from ListTasks with
`include_reference_solution`) and `run_episode` (one reference episode through the client, one tool call per
turn, recording what every call answered in an `Outcome` as it goes).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from google.rpc import error_details_pb2
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from rlgate import AsyncClient
from rlgate.devtools.healthcheck import EXIT_SERVING, check_grpc, check_http
from rlgate.policies import reference_solution
from rlgate.protocol import ToolCall, render_assistant_turn
from rlgate.runtime.config import env_vars
from rlgate.v1 import orchestrator_pb2
from tests.deploy.cli_contract import config_class
from tests.support.ports import free_port
from tests.support.wait import wait_until, wait_until_sync


def checked_env(command: str, settings: dict[str, Any]) -> dict[str, str]:
    """Settings as environment variables, refusing any the command's config does not declare."""
    known = set(env_vars(config_class(command)))
    unknown = sorted(set(settings) - known - {"FLEET_API_KEY", "FLEET_BASE_URL"})
    assert not unknown, f"`rlgate {command}` has no settings {unknown}"
    return {k: str(v).lower() if isinstance(v, bool) else str(v) for k, v in settings.items()}


@dataclass
class Service:
    """One service process."""

    name: str  # e.g. "orchestrator-1"
    command: str  # orchestrator | toolgateway | localfleet
    port: int
    env: dict[str, str]
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        environ = {k: v for k, v in os.environ.items() if not k.startswith(("RLGATE_", "FLEET_"))}
        environ.update(self.env, PYTHONUNBUFFERED="1")
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "rlgate.cli", self.command],
                env=environ,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def ready(self) -> bool:
        if self.command == "localfleet":
            return check_http(f"{self.url}/health", timeout=2.0)[0] == EXIT_SERVING
        return check_grpc(self.address, timeout=2.0)[0] == EXIT_SERVING

    def wait_ready(self, timeout: float = 120.0) -> None:
        def up() -> bool:
            if self.proc is None or self.proc.poll() is not None:
                code = None if self.proc is None else self.proc.returncode
                raise RuntimeError(f"{self.name} exited ({code}):\n{self.tail()}")
            return self.ready()

        wait_until_sync(up, timeout, f"{self.name} ready", interval=0.2, explain=self.tail)

    def kill(self) -> None:
        """SIGKILL: a crash, nothing cleaned up."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)

    def stop(self, timeout: float = 30.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(30)

    def terminate(self, timeout: float) -> tuple[int | None, float]:
        """SIGTERM (a graceful stop) and wait up to `timeout`: (exit code or None if still running, seconds
        from the signal to the exit). Blocking: call through asyncio.to_thread."""
        assert self.proc is not None and self.proc.poll() is None, f"{self.name} is not running"
        sent = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        try:
            code: int | None = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            code = None
        return code, time.monotonic() - sent

    def tail(self, lines: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


@dataclass
class Replicas:
    """localfleet + orchestrators + gateways over one store."""

    directory: Path
    store_url: str
    run_id: str
    orchestrators: int = 2
    gateways: int = 2
    orchestrator_settings: dict[str, Any] = field(default_factory=dict)
    gateway_settings: dict[str, Any] = field(default_factory=dict)
    fleet_url: str = ""  # where orchestrators reach the control plane (default: localfleet itself)
    services: dict[str, Service] = field(default_factory=dict)

    def __post_init__(self) -> None:
        (self.directory / "logs").mkdir(parents=True, exist_ok=True)
        lf_port = free_port()
        self._add(
            "localfleet",
            "localfleet",
            lf_port,
            {
                "RLGATE_LOCALFLEET_LISTEN": f"127.0.0.1:{lf_port}",
                "RLGATE_LOCALFLEET_DATA_DIR": self.directory / "localfleet",
            },
        )
        gateway_ports = [free_port() for _ in range(self.gateways)]
        for i, port in enumerate(gateway_ports, 1):
            self._add(
                f"toolgateway-{i}",
                "toolgateway",
                port,
                {
                    "RLGATE_TOOLGATEWAY_LISTEN": f"127.0.0.1:{port}",
                    "RLGATE_STORE_URL": self.store_url,
                    "RLGATE_DATA_DIR": self.directory / f"toolgateway-{i}",
                    **self.gateway_settings,
                },
            )
        for i in range(1, self.orchestrators + 1):
            port = free_port()
            self._add(
                f"orchestrator-{i}",
                "orchestrator",
                port,
                {
                    "RLGATE_ORCHESTRATOR_LISTEN": f"127.0.0.1:{port}",
                    "RLGATE_STORE_URL": self.store_url,
                    "RLGATE_DATA_DIR": self.directory / f"orchestrator-{i}",
                    "RLGATE_RUN_ID": self.run_id,
                    "FLEET_BASE_URL": self.fleet_url or f"http://127.0.0.1:{lf_port}",
                    "FLEET_API_KEY": "localfleet",
                    # Each orchestrator hands out "its" gateway; any gateway serves any session.
                    "RLGATE_GATEWAY_ADDRESS": f"127.0.0.1:{gateway_ports[(i - 1) % len(gateway_ports)]}",
                    **self.orchestrator_settings,
                },
            )

    def _add(self, name: str, command: str, port: int, settings: dict[str, Any]) -> None:
        self.services[name] = Service(
            name, command, port, checked_env(command, settings), self.directory / "logs" / f"{name}.log"
        )

    def named(self, command: str) -> list[Service]:
        return [s for s in self.services.values() if s.command == command]

    @property
    def localfleet(self) -> Service:
        return self.services["localfleet"]

    def start(self, names: list[str] | None = None) -> None:
        """Start services (all by default): localfleet first (orchestrators load tasks from it), then the
        replicas of each plane at once, waiting until each is ready."""
        chosen = [self.services[n] for n in names] if names else list(self.services.values())
        try:
            for wave in (["localfleet"], ["toolgateway", "orchestrator"]):
                batch = [s for s in chosen if s.command in wave]
                for svc in batch:
                    svc.start()
                for svc in batch:
                    svc.wait_ready()
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Orchestrators first (they close what they own while localfleet is up), localfleet last."""
        order = [*self.named("orchestrator"), *self.named("toolgateway"), *self.named("localfleet")]
        for svc in order:
            svc.stop()

    def logs(self) -> str:
        return "\n".join(f"----- {s.name}\n{s.tail(30)}" for s in self.services.values())

    # -- localfleet's test routes (blocking: call through asyncio.to_thread) ------------------------------
    def counters(self) -> dict[str, Any]:
        with urllib.request.urlopen(f"{self.localfleet.url}/_admin/counters", timeout=10) as reply:
            data: dict[str, Any] = json.loads(reply.read())
            return data

    def instances(self, run_id: str | None = None) -> list[dict[str, Any]]:
        query = f"?run_id={run_id}" if run_id else ""
        request = urllib.request.Request(
            f"{self.localfleet.url}/v1/env/instances{query}", headers={"Authorization": "Bearer localfleet"}
        )
        with urllib.request.urlopen(request, timeout=10) as reply:
            data: list[dict[str, Any]] = json.loads(reply.read())
            return [i for i in data if i.get("status") not in ("stopped", "terminated")]


class CountingProxy:
    """A loopback HTTP proxy that forwards everything to `upstream` and counts (method, path)."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.rstrip("/")
        self.port = free_port()
        self.requests: Counter[tuple[str, str]] = Counter()
        self._client = httpx.AsyncClient(base_url=self.upstream, timeout=httpx.Timeout(60.0))
        app = Starlette(
            routes=[Route("/{path:path}", self._forward, methods=["GET", "POST", "PUT", "PATCH", "DELETE"])]
        )
        self._server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="off")
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _forward(self, request: Request) -> Response:
        self.requests[(request.method, request.url.path)] += 1
        headers = {k: v for k, v in request.headers.items() if k.lower() not in {"host", "content-length"}}
        reply = await self._client.request(
            request.method, request.url.path, params=request.query_params, headers=headers, content=await request.body()
        )
        drop = {"content-length", "transfer-encoding", "connection", "content-encoding"}
        return Response(
            reply.content, reply.status_code, {k: v for k, v in reply.headers.items() if k.lower() not in drop}
        )

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[CountingProxy]:
        task = asyncio.create_task(self._server.serve())

        def started() -> bool:
            if task.done():
                task.result()  # raises why it stopped
            return bool(self._server.started)

        try:
            await wait_until(started, 30, "the counting proxy started")
            yield self
        finally:
            self._server.should_exit = True
            with contextlib.suppress(asyncio.CancelledError, TimeoutError):
                await asyncio.wait_for(task, 30)
            await self._client.aclose()


# ---- reference episodes --------------------------------------------------------------------------------
EPISODE_BOUND_S = 90.0  # one reference episode, retries through a replica's crash or drain included


@dataclass
class Solution:
    task_key: str
    calls: list[ToolCall]
    final_answer: str | None


async def solutions(client: AsyncClient) -> list[Solution]:
    """Every task's reference solution with at least one tool call (ListTasks with the answer keys)."""
    tasks = await client.list_tasks(include_reference_solution=True)
    found = []
    for task in tasks:
        if not task.reference_solution_json:
            continue
        ref = reference_solution(task)
        calls = [ToolCall(str(c["name"]), dict(c.get("arguments") or {})) for c in ref.get("tool_calls") or []]
        answer = ref.get("final_answer")
        if calls:
            found.append(Solution(task.key, calls, None if answer is None else str(answer)))
    assert found, f"no task with a reference solution among {len(tasks)} tasks"
    return found


@dataclass
class Outcome:
    session_id: str = ""
    reward: float | None = None
    verification: str = ""
    # request_id -> error kind of the answer; None while in flight or when the call raised (outcome unknown)
    calls: dict[str, int | None] = field(default_factory=dict)


async def run_episode(
    client: AsyncClient, solution: Solution, index: int, outcome: Outcome, run_id: str, label: str
) -> Outcome:
    """The reference solution, one tool call per turn (each turn's text as a model would write it), then
    the final answer. `outcome` is filled in as the episode goes, so even an episode that raises accounts
    for every call it sent. An episode that takes longer than `EPISODE_BOUND_S` raises TimeoutError (a stuck
    call shows as that episode's failure instead of a hung test)."""
    async with asyncio.timeout(EPISODE_BOUND_S):
        return await _episode(client, solution, index, outcome, run_id, label)


async def _episode(
    client: AsyncClient, solution: Solution, index: int, outcome: Outcome, run_id: str, label: str
) -> Outcome:
    ep = client.episode(
        task_key=solution.task_key,
        max_turns=len(solution.calls) + 2,
        run_id=run_id,
        labels={"test": label, "episode": str(index)},
    )
    async with ep:
        outcome.session_id = ep.session_id
        for i, call in enumerate(solution.calls):
            request_id = f"ep{index}-call{i}-{uuid.uuid4().hex[:8]}"
            outcome.calls[request_id] = None
            reply = await ep.call_tool(call.name, call.arguments, request_id=request_id)
            outcome.calls[request_id] = reply.result.error_kind
            summary = orchestrator_pb2.ToolCallSummary(
                name=call.name,
                request_id=request_id,
                is_error=reply.result.is_error,
                error_kind=reply.result.error_kind,
            )
            step = await ep.step(assistant_text=render_assistant_turn([call]), tool_calls=[summary])
            assert not step.done, f"{solution.task_key}: ended early ({step.done_reason})"
            assert step.turn == i + 1, f"{outcome.session_id}: turn {i + 1} counted as {step.turn}"
        final = await ep.turn(render_assistant_turn([], solution.final_answer, done=True))
        assert final.done and final.turn == len(solution.calls) + 1, final.step
        outcome.reward = final.reward
        outcome.verification = final.verification_status
    return outcome


def reason_of(err: BaseException) -> str:
    """The ErrorInfo reason a client error carries ("" without one)."""
    status = getattr(err, "rich_status", None)
    for detail in getattr(status, "details", ()):
        info = error_details_pb2.ErrorInfo()
        if detail.Unpack(info):
            return info.reason
    return ""
