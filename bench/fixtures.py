"""What the benchmarks start and talk to: the run context, local stacks, rlgate sessions, MCP clients.

`BenchContext` owns every process a run starts (stacks are stopped in `close`, also after a failure).
`Rlgate` drives the orchestrator and the gateway over grpc.aio with the generated stubs (one channel
each, shared by every session; the agent token rides per call). The MCP helpers build the baselines'
clients the way a user would: one persistent `mcp.Client`, or a fresh legacy session per call.
"""

from __future__ import annotations

import asyncio
import os
import platform
import ssl
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import grpc
import httpx2
import psutil
from mcp import Client
from mcp.client.streamable_http import streamable_http_client

from rlgate.core.convert import json_text
from rlgate.devtools.stack import LocalStack, StackSettings
from rlgate.v1 import orchestrator_pb2, orchestrator_pb2_grpc, toolgateway_pb2, toolgateway_pb2_grpc

BENCH_DIR = Path(__file__).resolve().parent


def run_dir(name: str) -> Path:
    """Where one run named `name` keeps its logs and raw data: bench/out/NAME-<UTC time> (not created here)."""
    return BENCH_DIR / "out" / f"{name}-{datetime.now(UTC).strftime('%Y%m%dT%H%M%S')}"


REPO_ROOT = BENCH_DIR.parent
RPC_TIMEOUT_S = 60.0  # every RPC and MCP call carries a deadline; a benchmark never hangs on a dead service
LINE_LIMIT = 64 * 2**20  # a helper's stdout line may carry every latency of a 10 s measurement
MAX_TURNS = 1_000_000  # sessions used for throughput runs must never reach their turn limit

# Each era's environment and the tool its benchmarks call: read-only, a real query on the instance's SQLite.
ERA_ENV = {"modern": "mailbox:v1", "legacy": "tracker:v1"}


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


# Orchestrator flags that worked around an open service issue (recorded in the entries that use it). Empty:
# reconciliation now judges every instance on the current intent and session before deleting it.
RECONCILE_WORKAROUND: list[str] = []

BENCH_TOOLS = {
    "mailbox:v1": ToolCall("read_message", {"message_id": 1}),
    "tracker:v1": ToolCall("get_issue", {"repo": "northwind/atlas-api", "number": 1}),
}


@dataclass
class BenchContext:
    """One benchmark run: its mode, its scratch directory, and the stacks it started."""

    quick: bool
    out_dir: Path
    stacks: dict[str, LocalStack] = field(default_factory=dict)
    prepared: dict[str, object] = field(default_factory=dict)  # what a benchmark's prepare() set up

    def size(self, quick: int, full: int) -> int:
        return quick if self.quick else full

    @property
    def rounds(self) -> int:
        """How many times rlgate and its baseline alternate (noise on a shared machine hits both): short,
        many rounds spread a slow minute over both sides better than a few long ones."""
        return 2 if self.quick else 6

    @property
    def duration_s(self) -> float:
        """Time budget of one measured path in one round (fewer samples on a slow machine, same wall time)."""
        return 2.0 if self.quick else 5.0

    async def stack(self, name: str = "default", **settings: Any) -> LocalStack:
        """A running local stack, started on first use with `settings` (StackSettings fields)."""
        running = self.stacks.get(name)
        if running is not None:
            return running
        env = {"RLGATE_LOG_LEVEL": "WARNING"} | dict(settings.pop("env", {}))
        stack = LocalStack(StackSettings(data_dir=self.out_dir / name, env=env, **settings))
        self.stacks[name] = stack  # registered before start: close() stops a half-started stack too
        await asyncio.to_thread(stack.start, 120.0)
        return stack

    async def stop_stack(self, name: str) -> None:
        stack = self.stacks.pop(name, None)
        if stack is not None:
            await asyncio.to_thread(stack.stop)

    async def close(self) -> None:
        for name in list(self.stacks):
            await self.stop_stack(name)


@asynccontextmanager
async def child_process(
    argv: list[str],
    log_path: Path,
    env: Mapping[str, str] | None = None,
    ready_timeout_s: float = 120.0,
    stdin: bool = False,
) -> AsyncIterator[tuple[asyncio.subprocess.Process, str]]:
    """Start a helper process that prints one ready line (e.g. its port) on stdout; stop it on exit.

    With `stdin`, the helper also gets a pipe to read requests from (see bench/openenv_side.py drive).
    """
    await asyncio.to_thread(log_path.parent.mkdir, parents=True, exist_ok=True)
    log = await asyncio.to_thread(log_path.open, "ab")
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdout=asyncio.subprocess.PIPE,
            stderr=log,
            stdin=asyncio.subprocess.PIPE if stdin else None,
            cwd=REPO_ROOT,
            env=None if env is None else dict(env),
            limit=LINE_LIMIT,
        )
    finally:
        log.close()
    try:
        assert proc.stdout is not None
        try:
            line = await asyncio.wait_for(proc.stdout.readline(), ready_timeout_s)
        except TimeoutError:
            line = b""
        if not line.strip():
            tail = (await asyncio.to_thread(log_path.read_text, errors="replace"))[-2000:]
            raise BenchError(f"{argv[:3]} did not get ready; log {log_path}:\n{tail}")
        yield proc, line.decode().strip()
    finally:
        await stop_process(proc)


async def stop_process(proc: asyncio.subprocess.Process, timeout_s: float = 15.0) -> None:
    if proc.stdin is not None:
        proc.stdin.close()
    if proc.returncode is None:
        proc.terminate()
        try:
            await asyncio.wait_for(proc.wait(), timeout_s)
        except TimeoutError:
            proc.kill()
            await proc.wait()


def machine_info() -> dict[str, Any]:
    """What the figures were measured on (they only compare within one run; absolute times move)."""
    freq = psutil.cpu_freq()
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": model or platform.processor(),
        "cores": os.cpu_count(),
        "cpu_mhz": round(freq.current) if freq else None,
        "memory_gb": round(psutil.virtual_memory().total / 2**30, 1),
        "python": platform.python_version(),
        "os": f"{platform.system()} {platform.release()}",
        "load_avg_1m": round(os.getloadavg()[0], 2),
    }


def rss_kb(pids: Mapping[str, int]) -> dict[str, int]:
    """Resident set size in KiB of each named process."""
    return {name: psutil.Process(pid).memory_info().rss // 1024 for name, pid in pids.items()}


def service_pids(stack: LocalStack, *names: str) -> dict[str, int]:
    return {name: stack.procs[name].pid for name in names}


class BenchError(RuntimeError):
    """A measured path did not do what it should (error result, wrong status): no figure is reported."""


@dataclass
class Session:
    session_id: str
    token: str  # the episode's agent token
    metadata: tuple[tuple[str, str], ...]  # the agent token as call metadata for the gateway
    reset_ms: float
    tools: list[str]


class Rlgate:
    """Orchestrator + gateway stubs over one grpc.aio channel each (what a trainer process holds)."""

    def __init__(self, stack: LocalStack) -> None:
        self.stack = stack
        self._orch_channel = grpc.aio.insecure_channel(stack.orchestrator_address)
        self._gw_channel = grpc.aio.insecure_channel(stack.gateway_address)
        self.orchestrator = orchestrator_pb2_grpc.OrchestratorServiceStub(self._orch_channel)
        self.gateway = toolgateway_pb2_grpc.ToolGatewayServiceStub(self._gw_channel)

    async def close(self) -> None:
        await self._orch_channel.close()
        await self._gw_channel.close()

    async def __aenter__(self) -> Rlgate:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def reset(self, env_key: str = "", max_turns: int = MAX_TURNS, task_key: str = "") -> Session:
        """A new session on `env_key` (a plain instance), or on the task `task_key` (its modality decides the
        instance's image: computer_use tasks get a screen)."""
        t0 = time.perf_counter()
        reply = await self.orchestrator.Reset(
            orchestrator_pb2.ResetRequest(
                request_id=uuid.uuid4().hex, env_key=env_key, task_key=task_key, max_turns=max_turns
            ),
            timeout=RPC_TIMEOUT_S * 3,
        )
        reset_ms = (time.perf_counter() - t0) * 1e3
        if reply.gateway_address and reply.gateway_address != self.stack.gateway_address:
            raise BenchError(
                f"Reset handed out gateway {reply.gateway_address}, stack runs {self.stack.gateway_address}"
            )
        return Session(
            reply.session_id,
            reply.agent_token,
            (("authorization", f"Bearer {reply.agent_token}"),),
            reset_ms,
            [t.name for t in reply.tools],
        )

    async def list_tools(self, session: Session) -> list[str]:
        reply = await self.gateway.ListTools(
            toolgateway_pb2.ListToolsRequest(), metadata=session.metadata, timeout=RPC_TIMEOUT_S
        )
        return [t.name for t in reply.tools]

    async def call_tool(self, session: Session, call: ToolCall) -> toolgateway_pb2.CallToolResponse:
        # The generated service stubs are untyped: the reply's type is named here.
        reply: toolgateway_pb2.CallToolResponse = await self.gateway.CallTool(
            toolgateway_pb2.CallToolRequest(
                request_id=uuid.uuid4().hex, name=call.name, arguments_json=json_text(call.arguments)
            ),
            metadata=session.metadata,
            timeout=RPC_TIMEOUT_S,
        )
        if reply.result.is_error:
            raise BenchError(f"gateway CallTool {call.name} returned an error: {reply.result.error_message!r}")
        return reply

    async def step(
        self, session: Session, call: ToolCall | None = None, done: bool = False
    ) -> orchestrator_pb2.StepResponse:
        calls = (
            []
            if call is None
            else [
                orchestrator_pb2.ToolCallSummary(
                    name=call.name, arguments_json=json_text(call.arguments), request_id=uuid.uuid4().hex
                )
            ]
        )
        reply: orchestrator_pb2.StepResponse = await self.orchestrator.Step(
            orchestrator_pb2.StepRequest(
                request_id=uuid.uuid4().hex,
                session_id=session.session_id,
                assistant_text="thinking... calling a tool",
                tool_calls=calls,
                done=done,
            ),
            timeout=RPC_TIMEOUT_S,
        )
        return reply

    async def close_session(self, session: Session) -> None:
        await self.orchestrator.Close(
            orchestrator_pb2.CloseRequest(session_id=session.session_id), timeout=RPC_TIMEOUT_S
        )

    async def mcp_url(self, session: Session, aggregator: bool = False) -> str:
        """The instance endpoint that serves the app's tools (`{root}mcp`), or with `aggregator` the one that
        also serves the `computer` tool of a screen instance (`{root}api/v1/mcp`), from the session's State."""
        reply: orchestrator_pb2.StateResponse = await self.orchestrator.State(
            orchestrator_pb2.StateRequest(session_id=session.session_id), timeout=RPC_TIMEOUT_S
        )
        endpoints = list(reply.session.instance.mcp_endpoints)
        if not endpoints:
            raise BenchError(f"session {session.session_id} reports no MCP endpoint")
        chosen = [e for e in endpoints if e.rstrip("/").endswith("api/v1/mcp") == aggregator]
        if aggregator and not chosen:
            raise BenchError(f"session {session.session_id} reports no aggregator endpoint: {endpoints}")
        return (chosen or endpoints)[0]


def mcp_http(verify: ssl.SSLContext | bool = True) -> httpx2.AsyncClient:
    return httpx2.AsyncClient(timeout=httpx2.Timeout(30.0, read=RPC_TIMEOUT_S), verify=verify)


@asynccontextmanager
async def persistent_mcp(url: str, mode: str = "auto") -> AsyncIterator[Client]:
    """One long-lived mcp 2.x client (the direct baseline: no gateway in between)."""
    async with (
        mcp_http() as http,
        Client(streamable_http_client(url, http_client=http), mode=mode, read_timeout_seconds=RPC_TIMEOUT_S) as client,
    ):
        yield client


async def per_call_session(url: str, call: ToolCall, ssl_context: ssl.SSLContext) -> None:
    """The reference Fleet integration's pattern: a fresh legacy-era session (initialize, call, close).

    The SSL context is built once and shared, so the baseline pays no TLS setup (it is plain HTTP on
    loopback anyway); what it pays is the handshake, the extra round trips and the teardown per call.
    """
    async with (
        mcp_http(ssl_context) as http,
        Client(
            streamable_http_client(url, http_client=http), mode="legacy", read_timeout_seconds=RPC_TIMEOUT_S
        ) as client,
    ):
        result = await client.call_tool(call.name, call.arguments)
        if result.is_error:
            raise BenchError(f"direct call {call.name} returned an error: {result.content!r}")


async def direct_call(client: Client, call: ToolCall) -> None:
    result = await client.call_tool(call.name, call.arguments)
    if result.is_error:
        raise BenchError(f"direct call {call.name} returned an error: {result.content!r}")
