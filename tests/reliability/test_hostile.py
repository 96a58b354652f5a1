"""A hostile world: MCP upstreams that attack rlgate, in both MCP eras, and clients that send bytes no
well-behaved client would.

The upstream is `tests.support.hostile_mcp` (a separate process) behind the orchestrator's `mcp` provider: one
task per (era, attack, phase), each with its own endpoint URL. Per attack, every call must end with a clear
status or an `is_error` result (never INTERNAL or UNKNOWN) within a bound (a cap for attacks a size limit
ends, the caller's deadline for the drip), the gateway's and the orchestrator's RSS must stay bounded (psutil:
before, peak, after), and sessions on a well-behaved upstream must keep being served while the attack runs.

Then, with a raw HTTP/2 client (`h2`): an `authorization` header whose key has one stray 0xff byte, to both
servers; the key must appear in nothing the servers wrote. Tool names and upstream errors carrying line
breaks must not forge a log line (`Audit.forged_lines`, over every log file of the session).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import grpc
import httpx
import psutil
import pytest

from rlgate.devtools.stack import free_port
from rlgate.mcpclient.catalog import MAX_TOOLS
from rlgate.mcpclient.results import MAX_CONTENT_BLOCKS
from rlgate.mcpclient.transport import MAX_PAGE_BYTES
from rlgate.v1 import common_pb2, orchestrator_pb2, orchestrator_pb2_grpc, toolgateway_pb2, toolgateway_pb2_grpc
from tests.reliability.conftest import FULL, Figures
from tests.reliability.harness import API_KEY, REPO, Audit, AuditedStack, bearer, error_reason, start_stack
from tests.support.hostile_mcp import (
    BREAKS,
    CONTENT_ATTACKS,
    FORGED_LINE,
    FORGED_PREFIX,
    NEL_FORGED_PREFIX,
    TRANSPORT_ATTACKS,
    HostileMcp,
    Sizes,
)
from tests.support.wait import wait_until_sync

SC = grpc.StatusCode
ERA_NAMES = ("modern", "legacy")
PHASES = ("reset", "list", "call")
TOOLS_TIMEOUT_S = 30.0 if FULL else 8.0  # discovery bound (--tools-timeout-s): room for 10,000 tools on 2 busy cores
RESET_DEADLINE_S = 60.0 if FULL else 12.0
CALL_DEADLINE_S = 5.0
DRIP_DEADLINE_S = 2.5  # the drip is ended by the caller's deadline: a short one keeps the suite quick
CAPPED_S = 4.0  # attacks a size limit ends (not a deadline) must end within this
BENIGN_LATENCY_S = 3.0  # a call on a well-behaved upstream while an attack runs (two shared cores)
NEVER = {SC.INTERNAL, SC.UNKNOWN, SC.CANCELLED, SC.DATA_LOSS, SC.UNIMPLEMENTED}
# Sizes: quick in `make test`, full with RLGATE_FULL=1.
TOOLS = 50_000 if FULL else 10_000  # in the many-tools listing (50,000: 7.5 MB, past the page bound)
PAGE_TOOLS = MAX_PAGE_BYTES // 160  # tools of the hostile server's shape (~155 bytes) one page holds, nearly full
HOSTILE_ARGS = (
    ["--huge-bytes", str(1 << 30), "--tools", str(TOOLS), "--depth", "100000"]
    if FULL
    else ["--huge-bytes", str(100 << 20), "--tools", str(TOOLS), "--depth", "10000"]
)
RSS_PEAK_MB = 160.0  # growth over a case's start, at the sampled peak, in either plane
RSS_PEAK_PER_TOOL_KB = 8.0  # and for the many-tools listing, per tool on top (with room over what a parsed tool holds)
# The gateway's growth over the whole module, after every attack (freed memory a process keeps from the
# allocator counts too: a per-case "after" is not a leak measure, the module's end is)
RSS_KEPT_MB = 96.0
MAX_DETAIL_CHARS = 8192  # a status message (grpc-message) the caller sees
pytestmark = pytest.mark.timeout(1200 if FULL else 400)


# ---------------------------------------------------------------------------------------------------------
# The hostile upstream and the stack behind it


@dataclass
class Hostile:
    port: int
    nonce: str
    proc: subprocess.Popen[bytes]

    def url(self, era: str, attack: str, phase: str) -> str:
        return f"http://127.0.0.1:{self.port}/{era}/{attack}/{phase}/{self.nonce}/mcp"

    def stats(self) -> dict[str, Any]:
        return dict(httpx.get(f"http://127.0.0.1:{self.port}/stats", timeout=5.0).json())


def task_key(era: str, attack: str, phase: str) -> str:
    return f"hostile-{era}-{attack}-{phase}"


PAGE_TASK = "hostile-{era}-many-tools-page"  # the second server's many-tools listing


@functools.cache
def listing_bytes(tools: int) -> int:
    """The size of the hostile server's many-tools listing of `tools` tools (its tools/list reply body)."""
    body = {"jsonrpc": "2.0", "id": 1, "result": {"tools": HostileMcp(Sizes(tools=tools))._tools("many-tools"),
            "resultType": "complete", "ttlMs": 0, "cacheScope": "private"}}  # fmt: skip
    return len(json.dumps(body).encode())


@contextlib.contextmanager
def hostile_server(log: Path, args: list[str]) -> Iterator[Hostile]:
    """`tests.support.hostile_mcp` in a process of its own, serving."""
    port = free_port()
    with log.open("ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.hostile_mcp", "--port", str(port), *args],
            stdout=out, stderr=subprocess.STDOUT, cwd=str(REPO), start_new_session=True,
        )  # fmt: skip

    def healthy() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"hostile MCP server exited: {log.read_text()[-2000:]}")
        try:
            return httpx.get(f"http://127.0.0.1:{port}/health", timeout=1.0).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_until_sync(healthy, 60, "the hostile MCP server healthy", interval=0.1)
        yield Hostile(port, uuid.uuid4().hex[:8], proc)
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


@pytest.fixture(scope="module")
def hostile(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hostile]:
    with hostile_server(tmp_path_factory.mktemp("hostile-mcp") / "hostile-mcp.log", HOSTILE_ARGS) as server:
        yield server


@pytest.fixture(scope="module")
def hostile_page(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hostile]:
    """A second hostile server whose many-tools listing is one page just under the page bound."""
    log = tmp_path_factory.mktemp("hostile-mcp-page") / "hostile-mcp.log"
    with hostile_server(log, ["--tools", str(PAGE_TOOLS)]) as server:
        yield server


@pytest.fixture(scope="module")
def stack(
    tmp_path_factory: pytest.TempPathFactory, audit: Audit, hostile: Hostile, hostile_page: Hostile
) -> Iterator[AuditedStack]:
    data = tmp_path_factory.mktemp("hostile-stack")
    tasks = []
    for era in ERA_NAMES:
        tasks.append({
            "key": PAGE_TASK.format(era=era), "prompt": "Survive a full page.", "env_id": "hostile", "version": "v1",
            "mcp_endpoints": [hostile_page.url(era, "many-tools", "call")],
        })  # fmt: skip
        for attack in ("none", *TRANSPORT_ATTACKS, *CONTENT_ATTACKS):
            for phase in PHASES:
                tasks.append({
                    "key": task_key(era, attack, phase), "prompt": f"Survive {attack}.", "env_id": "hostile",
                    "version": "v1", "mcp_endpoints": [hostile.url(era, attack, phase)],
                })  # fmt: skip
    (data / "hostile-tasks.json").write_text(json.dumps({"tasks": tasks}))
    s = start_stack(
        data / "stack",
        audit,
        orchestrator_args=["--provider", "mcp", "--tasks-file", str(data / "hostile-tasks.json"),
                           "--tools-timeout-s", str(TOOLS_TIMEOUT_S)],
    )  # fmt: skip
    try:
        yield s
    finally:
        s.stop()


@dataclass
class Clients:
    orch: orchestrator_pb2_grpc.OrchestratorServiceStub
    gw: toolgateway_pb2_grpc.ToolGatewayServiceStub
    benign: dict[str, tuple[str, str]]  # era -> (session id, agent token) of a session on a well-behaved upstream
    channels: list[grpc.aio.Channel]


@pytest.fixture(scope="module")
def rss_at_start(stack: AuditedStack) -> dict[str, float]:
    """Both planes' RSS (MB) before the first attack."""
    return {name: psutil.Process(stack.procs[name].pid).memory_info().rss / 2**20
            for name in ("toolgateway", "orchestrator")}  # fmt: skip


@pytest.fixture
async def clients(stack: AuditedStack, rss_at_start: dict[str, float]) -> Any:
    orch_channel = grpc.aio.insecure_channel(stack.orchestrator_address)
    gw_channel = grpc.aio.insecure_channel(stack.gateway_address)
    c = Clients(
        orchestrator_pb2_grpc.OrchestratorServiceStub(orch_channel),
        toolgateway_pb2_grpc.ToolGatewayServiceStub(gw_channel),
        {},
        [orch_channel, gw_channel],
    )
    sessions = []
    for era in ERA_NAMES:
        reset = await c.orch.Reset(
            orchestrator_pb2.ResetRequest(task_key=task_key(era, "none", "call")), timeout=RESET_DEADLINE_S,
            metadata=stack.metadata(),
        )  # fmt: skip
        stack.audit.token(reset.agent_token)
        c.benign[era] = (reset.session_id, reset.agent_token)
        sessions.append(reset.session_id)
    try:
        yield c
    finally:
        for sid in sessions:
            await c.orch.Close(orchestrator_pb2.CloseRequest(session_id=sid), timeout=30.0, metadata=stack.metadata())
        for channel in c.channels:
            await channel.close()


# ---------------------------------------------------------------------------------------------------------
# Measuring one case


@dataclass
class Probe:
    """One call of a case: what the caller saw."""

    rpc: str
    status: str
    seconds: float
    reason: str = ""
    detail: str = ""  # the status message's start
    detail_chars: int = 0
    result: str = ""  # CallTool: "ok", or the is_error kind and the start of its message


class PeakRss:
    """The highest RSS (MB) of the given processes while the block runs, sampled every 20 ms in a thread."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.procs = {name: psutil.Process(pid) for name, pid in pids.items()}
        self.before = self._sample()
        self.peak = dict(self.before)
        self.after: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> dict[str, float]:
        return {name: p.memory_info().rss / 2**20 for name, p in self.procs.items()}

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            for name, mb in self._sample().items():
                self.peak[name] = max(self.peak[name], mb)

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)
        self.after = self._sample()
        for name, mb in self.after.items():
            self.peak[name] = max(self.peak[name], mb)

    def figures(self) -> dict[str, dict[str, float]]:
        return {
            name: {"before_mb": round(self.before[name], 1), "peak_mb": round(self.peak[name], 1),
                   "after_mb": round(self.after[name], 1)}
            for name in self.procs
        }  # fmt: skip


async def probe(rpc: str, call: Awaitable[Any], audit: Audit) -> tuple[Probe, Any]:
    started = time.perf_counter()
    try:
        reply = await call
    except grpc.aio.AioRpcError as err:
        audit.error(f"hostile {rpc}", err)
        details = err.details() or ""
        seconds = round(time.perf_counter() - started, 3)
        return Probe(rpc, err.code().name, seconds, error_reason(err), details[:300], len(details)), None
    p = Probe(rpc, "OK", round(time.perf_counter() - started, 3))
    if isinstance(reply, toolgateway_pb2.CallToolResponse):
        r = reply.result
        kind = common_pb2.ToolErrorKind.Name(r.error_kind).removeprefix("TOOL_ERROR_KIND_")
        p.result = f"is_error {kind}: {r.error_message[:160]}" if r.is_error else "ok"
    return p, reply


@dataclass
class Case:
    """What one attack did: the probes, RSS of both planes, and the benign sessions' service meanwhile."""

    era: str
    attack: str
    phase: str
    probes: list[Probe] = field(default_factory=list)
    rss: dict[str, dict[str, float]] = field(default_factory=dict)
    benign_calls: int = 0
    benign_max_s: float = 0.0  # the slowest gateway CallTool of a benign session
    benign_orchestrator_max_s: float = 0.0  # the slowest orchestrator State of a benign session
    benign_failures: list[str] = field(default_factory=list)

    def status(self, rpc: str) -> str:
        return next((p.status for p in self.probes if p.rpc == rpc), "")


async def run_case(
    stack: AuditedStack, c: Clients, era: str, attack: str, phase: str,
    steps: Callable[[Case], Awaitable[None]],
) -> Case:  # fmt: skip
    """Run `steps` (the attack's calls) while the benign sessions of both eras call tools (gateway) and read
    their state (orchestrator) back to back."""
    case = Case(era, attack, phase)
    done = asyncio.Event()

    async def benign() -> None:
        while not done.is_set():
            for e, (session_id, token) in c.benign.items():
                p, reply = await probe(
                    "benign CallTool",
                    c.gw.CallTool(toolgateway_pb2.CallToolRequest(name="echo", arguments_json='{"text": "still here"}'),
                                  timeout=30.0, metadata=bearer(token)),
                    stack.audit,
                )  # fmt: skip
                case.benign_calls += 1
                case.benign_max_s = max(case.benign_max_s, p.seconds)
                if p.status != "OK" or reply.result.is_error:
                    case.benign_failures.append(f"{e}: {p.status} {p.result} {p.detail}")
                p, _ = await probe(
                    "benign State",
                    c.orch.State(orchestrator_pb2.StateRequest(session_id=session_id), timeout=30.0,
                                 metadata=stack.metadata()),
                    stack.audit,
                )  # fmt: skip
                case.benign_orchestrator_max_s = max(case.benign_orchestrator_max_s, p.seconds)
                if p.status != "OK":
                    case.benign_failures.append(f"{e} State: {p.status} {p.detail}")

    pids = {"toolgateway": stack.procs["toolgateway"].pid, "orchestrator": stack.procs["orchestrator"].pid}
    with PeakRss(pids) as rss:
        watcher = asyncio.create_task(benign())
        try:
            await steps(case)
        finally:
            done.set()
            await watcher
    case.rss = rss.figures()
    return case


def check(case: Case, figures: Figures, peak_mb: float = RSS_PEAK_MB, benign_s: float = BENIGN_LATENCY_S) -> None:
    """The promises every attack must keep."""
    figures.append("hostile", asdict(case))
    for p in case.probes:
        assert getattr(SC, p.status) not in NEVER, f"{case.attack}/{case.phase}/{case.era}: {p}"
        assert p.detail_chars <= MAX_DETAIL_CHARS, p  # an upstream's 4 MB error is not echoed whole
    assert case.benign_calls > 0 and case.benign_failures == [], case
    assert case.benign_max_s < benign_s, case
    assert case.benign_orchestrator_max_s < benign_s, case
    for name, mb in case.rss.items():
        assert mb["peak_mb"] - mb["before_mb"] < peak_mb, (name, case)


async def reset(stack: AuditedStack, c: Clients, case: Case, key: str) -> orchestrator_pb2.ResetResponse | None:
    p, reply = await probe(
        "Reset",
        c.orch.Reset(orchestrator_pb2.ResetRequest(task_key=key), timeout=RESET_DEADLINE_S, metadata=stack.metadata()),
        stack.audit,
    )
    case.probes.append(p)
    if reply is not None:
        stack.audit.token(reply.agent_token)
        p.result = f"{len(reply.tools)} tools"
    return reply  # type: ignore[no-any-return]


async def close(stack: AuditedStack, c: Clients, session: orchestrator_pb2.ResetResponse | None) -> None:
    if session is not None:
        await c.orch.Close(orchestrator_pb2.CloseRequest(session_id=session.session_id), timeout=30.0,
                           metadata=stack.metadata())  # fmt: skip


async def call_tool(
    stack: AuditedStack, c: Clients, case: Case, token: str, name: str, arguments: dict[str, Any] | str,
    deadline_s: float = CALL_DEADLINE_S,
) -> toolgateway_pb2.CallToolResponse | None:  # fmt: skip
    text = arguments if isinstance(arguments, str) else json.dumps(arguments)
    p, reply = await probe(
        f"CallTool {name[:40]!r}",
        c.gw.CallTool(toolgateway_pb2.CallToolRequest(name=name, arguments_json=text, request_id=uuid.uuid4().hex),
                      timeout=deadline_s, metadata=bearer(token)),
        stack.audit,
    )  # fmt: skip
    case.probes.append(p)
    return reply  # type: ignore[no-any-return]


async def list_tools(
    stack: AuditedStack, c: Clients, case: Case, token: str, deadline_s: float = CALL_DEADLINE_S
) -> toolgateway_pb2.ListToolsResponse:
    p, reply = await probe(
        "ListTools", c.gw.ListTools(toolgateway_pb2.ListToolsRequest(), timeout=deadline_s,
                                    metadata=bearer(token)), stack.audit
    )  # fmt: skip
    if reply is not None:
        p.result = f"{len(reply.tools)} tools"
    case.probes.append(p)
    return reply  # type: ignore[no-any-return]


# ---------------------------------------------------------------------------------------------------------
# Transport attacks: endless, huge, drip, SSE without newlines, giant and big errors; in each phase


@pytest.mark.parametrize("phase", PHASES)
@pytest.mark.parametrize("attack", TRANSPORT_ATTACKS)
@pytest.mark.parametrize("era", ERA_NAMES)
async def test_transport_attack(
    stack: AuditedStack, clients: Clients, figures: Figures, era: str, attack: str, phase: str
) -> None:
    deadline = DRIP_DEADLINE_S if attack == "drip" else CALL_DEADLINE_S

    async def steps(case: Case) -> None:
        session = await reset(stack, clients, case, task_key(era, attack, phase))
        try:
            if session is not None:
                await list_tools(stack, clients, case, session.agent_token, deadline)
                await call_tool(stack, clients, case, session.agent_token, "echo", {"text": "hi"}, deadline)
        finally:
            await close(stack, clients, session)

    case = await run_case(stack, clients, era, attack, phase, steps)
    check(case, figures)
    # where the attack lands, the call fails with a clear status (or, for a tool call, an is_error result)
    # ended by a limit, not by the caller's deadline; only the drip is ended by a deadline
    hit = {"reset": "Reset", "list": "ListTools", "call": "CallTool 'echo'"}[phase]
    attacked = next(p for p in case.probes if p.rpc == hit)
    if phase == "call" and attacked.status == "OK":
        assert attacked.result.startswith("is_error"), case
    else:
        assert attacked.status in {"UNAVAILABLE", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED"}, case
    bound = (TOOLS_TIMEOUT_S if phase == "reset" else deadline) + 1.0
    assert attacked.seconds < (bound if attack == "drip" else CAPPED_S), case
    if phase != "reset":  # the attack did not reach the orchestrator's Reset
        assert case.status("Reset") == "OK", case


# ---------------------------------------------------------------------------------------------------------
# Content attacks: schemas, tool counts, tool names, structured content


@pytest.mark.parametrize("attack", ["deep-schema", "deepish-schema"])
@pytest.mark.parametrize("era", ERA_NAMES)
async def test_deep_schema(stack: AuditedStack, clients: Clients, figures: Figures, era: str, attack: str) -> None:
    """A tool whose input schema nests 10,000 deep (past the JSON parser's recursion limit: the whole listing
    cannot be read), or 100 deep (parseable, past rlgate's JSON text bound of 64: that tool is left out and
    the others work)."""
    listed: list[str] = []

    async def steps(case: Case) -> None:
        session = await reset(stack, clients, case, task_key(era, attack, "call"))
        try:
            if session is not None:
                listed.extend(t.name for t in session.tools)
                await list_tools(stack, clients, case, session.agent_token)
                for name in ("deep", "deepish", "echo"):
                    await call_tool(stack, clients, case, session.agent_token, name, {"a": {"a": {}}})
        finally:
            await close(stack, clients, session)

    case = await run_case(stack, clients, era, attack, "call", steps)
    check(case, figures)
    if attack == "deepish-schema" or case.status("Reset") == "OK":
        assert case.status("Reset") == "OK" and case.status("ListTools") == "OK", case
        assert listed == ["echo"], listed  # the over-deep tool left out, the rest served
        assert [p.result[:21] for p in case.probes if p.rpc.startswith("CallTool 'deep")] == [
            "is_error UNKNOWN_TOOL"
        ] * 2, case
        assert [p.result for p in case.probes if p.rpc == "CallTool 'echo'"] == ["ok"], case
    else:
        assert case.status("Reset") == "UNAVAILABLE", case


REF_CALLS: list[tuple[str, dict[str, Any]]] = [
    ("self_ref", {"child": {"child": {"child": {}}}}),
    ("ref_loop", {"x": 1}),
    ("ref_itself", {}),
    ("ref_nowhere", {"x": 1}),
]


async def ref_cycle_case(stack: AuditedStack, c: Clients, era: str, calls: list[tuple[str, dict[str, Any]]]) -> Case:
    async def steps(case: Case) -> None:
        session = await reset(stack, c, case, task_key(era, "ref-cycle", "call"))
        try:
            if session is not None:
                await list_tools(stack, c, case, session.agent_token)
                for name, arguments in calls:
                    await call_tool(stack, c, case, session.agent_token, name, arguments)
                await call_tool(stack, c, case, session.agent_token, "echo", {"text": "after"})
        finally:
            await close(stack, c, session)

    return await run_case(stack, c, era, "ref-cycle", "call", steps)


@pytest.mark.parametrize("era", ERA_NAMES)
async def test_ref_cycle_schemas_listed(stack: AuditedStack, clients: Clients, figures: Figures, era: str) -> None:
    """Schemas whose $refs loop (root self-reference, a two-step cycle, a ref to itself, a dangling ref) are
    listed as sent (JSON text, never resolved), and the root self-reference is checked like any schema."""
    case = await ref_cycle_case(stack, clients, era, REF_CALLS[:1])
    check(case, figures)
    assert case.status("Reset") == "OK" and case.status("ListTools") == "OK", case
    assert [p.result[:26] for p in case.probes if p.rpc.startswith("CallTool")] == [
        "is_error INVALID_ARGUMENTS", "ok"
    ], case  # fmt: skip


@pytest.mark.parametrize("era", ERA_NAMES)
async def test_ref_cycle_schemas_called(stack: AuditedStack, clients: Clients, figures: Figures, era: str) -> None:
    """Calling the tools whose $refs loop (a -> b -> a, a definition that is a reference to itself) or point
    nowhere: the arguments cannot be checked, so the tool is not called and the agent is told why (an is_error
    result), never INTERNAL. (Found by this suite: these answered INTERNAL with a RecursionError.)"""
    case = await ref_cycle_case(stack, clients, era, REF_CALLS[1:])
    check(case, figures)
    called = [p for p in case.probes if p.rpc.startswith("CallTool") and p.rpc != "CallTool 'echo'"]
    assert len(called) == 3 and all(p.status == "OK" and p.result.startswith("is_error") for p in called), case
    assert [p.result for p in case.probes if p.rpc == "CallTool 'echo'"] == ["ok"], case


MANY_TOOLS: dict[str, Case] = {}  # "<era> <attack>" -> the case, for the stall judgement
STALL_S = 1.0  # how long another session may wait for either plane while one session's tools are listed


async def many_tools_case(
    stack: AuditedStack, c: Clients, figures: Figures, era: str, key: str, label: str
) -> tuple[Case, dict[str, int]]:
    """Reset on a many-tools upstream, ListTools, a call of the last tool listed (while the benign sessions
    call), kept for the stall judgement."""
    counts: dict[str, int] = {}

    async def steps(case: Case) -> None:
        session = await reset(stack, c, case, key)
        try:
            if session is not None:
                counts["reset"] = len(session.tools)
                listed = await list_tools(stack, c, case, session.agent_token, RESET_DEADLINE_S)
                counts["list"] = len(listed.tools) if listed is not None else -1
                await call_tool(stack, c, case, session.agent_token, session.tools[-1].name, {"n": 10**9})
        finally:
            await close(stack, c, session)

    case = await run_case(stack, c, era, label, "call", steps)
    MANY_TOOLS[f"{era} {label}"] = case
    figures.record(
        "hostile_many_tools", f"{era} {label}", {"counts": counts, "probes": [asdict(p) for p in case.probes]}
    )
    return case, counts


@pytest.mark.parametrize("era", ERA_NAMES)
async def test_many_tools(stack: AuditedStack, clients: Clients, figures: Figures, era: str) -> None:
    """10,000 tools in one page (1.5 MB): Reset and ListTools return them all, the last one is callable. The full
    set's 50,000 (7.5 MB: inside the 8 MiB reply limit, past the page bound, MAX_PAGE_BYTES): refused before the
    SDK parses it (it would hold the event loop for seconds), Reset UNAVAILABLE naming the bound."""
    case, counts = await many_tools_case(
        stack, clients, figures, era, task_key(era, "many-tools", "call"), "many-tools"
    )
    # other sessions' waits are judged by test_many_tools_do_not_stall_other_sessions: here "never a hang"
    check(case, figures, RSS_PEAK_MB + TOOLS * RSS_PEAK_PER_TOOL_KB / 1024, benign_s=RESET_DEADLINE_S)
    if listing_bytes(TOOLS) > MAX_PAGE_BYTES:
        [refused] = case.probes
        assert refused.status == "UNAVAILABLE" and f"larger than {MAX_PAGE_BYTES} bytes" in refused.detail, case
    else:
        assert case.status("Reset") == "OK" and counts["reset"] == counts["list"] == TOOLS, case


@pytest.mark.parametrize("era", ERA_NAMES)
async def test_a_full_page_of_tools(stack: AuditedStack, clients: Clients, figures: Figures, era: str) -> None:
    """A page just under MAX_PAGE_BYTES (~13,000 tools: the most the SDK may parse in one go): read, the first
    MAX_TOOLS kept (the catalog's cut), the last of those callable."""
    assert listing_bytes(PAGE_TOOLS) <= MAX_PAGE_BYTES
    case, counts = await many_tools_case(stack, clients, figures, era, PAGE_TASK.format(era=era), "full-page")
    check(case, figures, RSS_PEAK_MB + PAGE_TOOLS * RSS_PEAK_PER_TOOL_KB / 1024, benign_s=RESET_DEADLINE_S)
    assert case.status("Reset") == "OK" and counts["reset"] == counts["list"] == MAX_TOOLS, case
    assert [p.result for p in case.probes if p.rpc.startswith("CallTool")] == ["ok"], case


@pytest.mark.parametrize("era", ERA_NAMES)
def test_many_tools_do_not_stall_other_sessions(era: str) -> None:
    """While test_many_tools and test_a_full_page_of_tools listed (or refused) their tools, the benign sessions'
    calls on both planes answered within STALL_S."""
    if not FULL:  # the quick set runs amid `make test`: a busy machine's wait is a figure, not a verdict
        pytest.skip("judged in the full set; test_many_tools and test_a_full_page_of_tools record the quick figures")
    cases = [case for key, case in MANY_TOOLS.items() if key.startswith(f"{era} ")]
    if not cases:
        pytest.skip("test_many_tools and test_a_full_page_of_tools did not run")
    for case in cases:
        assert max(case.benign_max_s, case.benign_orchestrator_max_s) < STALL_S, case


@pytest.mark.parametrize("era", ERA_NAMES)
async def test_nested_structured_content(stack: AuditedStack, clients: Clients, figures: Figures, era: str) -> None:
    """structuredContent nested 10,000 deep (past the SDK's JSON parser: the reply cannot be read, an is_error
    result) and 100 deep (read, past rlgate's JSON bound of 64: the result without it, and a note)."""
    replies: dict[str, Any] = {}

    async def steps(case: Case) -> None:
        session = await reset(stack, clients, case, task_key(era, "nested-structured", "call"))
        try:
            if session is not None:
                for text in ("deep", "deepish"):
                    replies[text] = await call_tool(stack, clients, case, session.agent_token, "echo", {"text": text})
        finally:
            await close(stack, clients, session)

    case = await run_case(stack, clients, era, "nested-structured", "call", steps)
    check(case, figures)
    assert all(p.status == "OK" for p in case.probes), case
    deep, deepish = replies["deep"].result, replies["deepish"].result
    assert deep.is_error and deep.error_kind == common_pb2.TOOL_ERROR_KIND_TOOL_FAILED, deep
    assert not deepish.is_error and deepish.structured_content_json == "", deepish
    assert "structured content omitted" in deepish.content[-1].text.text, deepish


@pytest.mark.parametrize("era", ERA_NAMES)
@pytest.mark.parametrize("attack", ["many-blocks", "big-structured"])
async def test_results_large_in_count_or_structure(
    stack: AuditedStack, clients: Clients, figures: Figures, era: str, attack: str
) -> None:
    """Results under the reply cap that cost the gateway by their shape: 20,000 empty content blocks (no
    bytes for the output limit to cut) and structured content of 200,000 numbers (over the output limit).
    Each is answered with what fits and OUTPUT_TRUNCATED, and other sessions' calls go on meanwhile."""
    replies: dict[str, Any] = {}

    async def steps(case: Case) -> None:
        session = await reset(stack, clients, case, task_key(era, attack, "call"))
        try:
            if session is not None:
                replies["call"] = await call_tool(stack, clients, case, session.agent_token, "echo", {"text": "x"})
        finally:
            await close(stack, clients, session)

    case = await run_case(stack, clients, era, attack, "call", steps)
    check(case, figures)
    assert all(p.status == "OK" for p in case.probes), case
    result = replies["call"].result
    assert not result.is_error, result.error_message
    assert result.error_kind == common_pb2.TOOL_ERROR_KIND_OUTPUT_TRUNCATED, result.error_message
    if attack == "many-blocks":
        assert len(result.content) == MAX_CONTENT_BLOCKS + 1, len(result.content)
        assert "more content blocks omitted" in result.content[-1].text.text
    else:
        assert result.structured_content_json == "" and [b.text.text for b in result.content] == ["big"]
        assert "structured content" in result.error_message


@pytest.mark.parametrize("era", ERA_NAMES)
async def test_server_error_code(stack: AuditedStack, clients: Clients, figures: Figures, era: str) -> None:
    """The upstream answers tools/call with a JSON-RPC error -32000 ('Server error: database is locked'): the
    tool answered, so the agent gets an is_error result with the message."""

    async def steps(case: Case) -> None:
        session = await reset(stack, clients, case, task_key(era, "server-error", "call"))
        try:
            if session is not None:
                await call_tool(stack, clients, case, session.agent_token, "echo", {"text": "x"})
        finally:
            await close(stack, clients, session)

    case = await run_case(stack, clients, era, "server-error", "call", steps)
    check(case, figures)
    called = next(p for p in case.probes if p.rpc == "CallTool 'echo'")
    assert called.status == "OK" and called.result.startswith("is_error TOOL_FAILED"), case
    assert "database is locked" in called.result, case


@pytest.mark.parametrize("era", ERA_NAMES)
async def test_forged_names_and_errors(stack: AuditedStack, clients: Clients, figures: Figures, era: str) -> None:
    """Tool names, descriptions and tool errors from the upstream, and tool names from the agent, carrying
    every line break a log reader may honour followed by a forged log line (test_no_forged_log_line scans)."""

    async def steps(case: Case) -> None:
        session = await reset(stack, clients, case, task_key(era, "forged-names", "call"))
        try:
            if session is not None:
                token = session.agent_token
                await list_tools(stack, clients, case, token)
                for brk in BREAKS:  # the agent side: refused by the tool-name check
                    await call_tool(stack, clients, case, token, f"echo{brk}{FORGED_LINE}", {})
                # the upstream's own names, if listed at all (never callable: not tool names rlgate accepts)
                for tool in [t.name for t in session.tools if t.name != "echo"][:3]:
                    await call_tool(stack, clients, case, token, tool, {})
                for i in range(len(BREAKS)):  # tool errors, logged by the gateway
                    await call_tool(stack, clients, case, token, "echo", {"text": str(i)})
        finally:
            await close(stack, clients, session)

    case = await run_case(stack, clients, era, "forged-names", "call", steps)
    check(case, figures)
    assert case.status("Reset") == "OK" and case.status("ListTools") == "OK", case
    named = [p for p in case.probes if p.rpc.startswith("CallTool") and p.rpc != "CallTool 'echo'"]
    assert len(named) >= len(BREAKS) and {p.status for p in named} == {"INVALID_ARGUMENT"}, case
    errors = [p.result for p in case.probes if p.rpc == "CallTool 'echo'"]
    assert len(errors) == len(BREAKS) and all(e.startswith("is_error TOOL_FAILED") for e in errors), case


# ---------------------------------------------------------------------------------------------------------
# Bytes no gRPC client sends: an authorization header with a stray 0xff byte, over raw HTTP/2


def h2_call(address: str, path: str, authorization: bytes, timeout: float = 10.0) -> dict[str, str]:
    """One unary gRPC call (an empty message) over a raw HTTP/2 connection, with an `authorization` value no
    gRPC library would send. Returns the response headers and trailers; {} when the stream was reset."""
    import h2.config
    import h2.connection
    import h2.events

    host, port = address.rsplit(":", 1)
    config = h2.config.H2Configuration(client_side=True, header_encoding=None, validate_outbound_headers=False)
    conn = h2.connection.H2Connection(config)
    out: dict[str, str] = {}
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        conn.initiate_connection()
        stream = conn.get_next_available_stream_id()
        headers = [(b":method", b"POST"), (b":scheme", b"http"), (b":path", path.encode()),
                   (b":authority", address.encode()), (b"content-type", b"application/grpc"), (b"te", b"trailers"),
                   (b"authorization", authorization)]  # fmt: skip
        conn.send_headers(stream, headers)
        conn.send_data(stream, b"\x00\x00\x00\x00\x00", end_stream=True)  # an empty message, uncompressed
        sock.sendall(conn.data_to_send())
        deadline = time.monotonic() + timeout
        ended = False
        while not ended and time.monotonic() < deadline:
            data = sock.recv(65536)
            if not data:
                break
            for event in conn.receive_data(data):
                if isinstance(event, h2.events.ResponseReceived | h2.events.TrailersReceived):
                    out.update({k.decode("latin-1"): v.decode("latin-1") for k, v in event.headers})
                elif isinstance(event, h2.events.DataReceived):
                    conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                elif isinstance(event, h2.events.StreamEnded | h2.events.StreamReset | h2.events.ConnectionTerminated):
                    ended = True
            sock.sendall(conn.data_to_send())
    return out


def with_stray_byte(key: str, audit: Audit, label: str) -> bytes:
    """`key` with a 0xff byte in its middle; both halves (16+ characters each) become secrets the audit
    looks for."""
    middle = len(key) // 2
    left, right = key[:middle], key[middle:]
    assert len(left) >= 16 and len(right) >= 16
    audit.secret(left, f"{label} (before the 0xff)")
    audit.secret(right, f"{label} (after the 0xff)")
    return left.encode() + b"\xff" + right.encode()


def test_invalid_utf8_authorization_is_never_logged(tmp_path: Path, figures: Figures) -> None:
    """`authorization: Bearer <key with a stray 0xff>` to both servers: UNAUTHENTICATED, and neither half of the
    key appears in anything the servers wrote (their log files: Python logging and grpc core's stderr).

    A stack of its own with an audit of its own: while the finding stands, the key it leaks would otherwise
    fail the session-wide secret scan (test_security) for a reason this test already names."""
    audit = Audit()
    stack = start_stack(tmp_path / "stack", audit)
    try:
        session = orchestrator_pb2_grpc.OrchestratorServiceStub(
            grpc.insecure_channel(stack.orchestrator_address)
        ).Reset(orchestrator_pb2.ResetRequest(env_key="mailbox:v1"), timeout=60.0, metadata=stack.metadata())
        session_part, _, secret = audit.token(session.agent_token).rpartition(".")
        cases = {
            "orchestrator ListTasks": (stack.orchestrator_address, "/rlgate.v1.OrchestratorService/ListTasks",
                                       with_stray_byte(API_KEY, audit, "API key")),
            "toolgateway ListTools": (stack.gateway_address, "/rlgate.v1.ToolGatewayService/ListTools",
                                      session_part.encode() + b"." + with_stray_byte(secret, audit, "agent token")),
        }  # fmt: skip
        answers = {}
        for name, (address, path, key) in cases.items():
            reply = h2_call(address, path, b"Bearer " + key)
            answers[name] = {"grpc-status": reply.get("grpc-status", ""), "grpc-message": reply.get("grpc-message", "")}
            audit.texts.append((f"raw h2 {name}", json.dumps(reply)))
    finally:
        stack.stop()  # what the servers wrote about those calls is in their logs once they have stopped
    leaks = audit.leaks()
    figures.record("hostile_wire", "invalid_utf8_authorization", {"answers": answers, "leaks": leaks})
    assert {a["grpc-status"] for a in answers.values()} == {str(SC.UNAUTHENTICATED.value[0])}, answers
    assert leaks == [], leaks


async def test_nel_does_not_forge_a_log_line(stack: AuditedStack, clients: Clients, figures: Figures) -> None:
    """A tool error whose text is 'failed<U+0085><forged log line>': the gateway logs it on one line."""

    async def steps(case: Case) -> None:
        session = await reset(stack, clients, case, task_key("modern", "forged-names", "call"))
        try:
            if session is not None:
                await call_tool(stack, clients, case, session.agent_token, "echo", {"text": "nel"})
        finally:
            await close(stack, clients, session)

    case = await run_case(stack, clients, "modern", "forged-names", "call", steps)
    check(case, figures)
    forged = stack.audit.forged_lines(NEL_FORGED_PREFIX)
    assert forged == [], forged


def test_gateway_memory_after_every_attack(
    stack: AuditedStack, rss_at_start: dict[str, float], figures: Figures
) -> None:
    """After every attack above, the gateway is back near where it started: nothing an upstream sent stayed."""
    now = {name: psutil.Process(stack.procs[name].pid).memory_info().rss / 2**20 for name in rss_at_start}
    figures.record("hostile_wire", "rss_module_mb", {n: {"start": round(rss_at_start[n], 1), "end": round(now[n], 1)}
                                                      for n in now})  # fmt: skip
    assert now["toolgateway"] - rss_at_start["toolgateway"] < RSS_KEPT_MB, (rss_at_start, now)


def test_no_forged_log_line(audit: Audit, figures: Figures) -> None:
    """No line of any log the suite's servers wrote so far starts with the forged prefix (test_security's
    final scan repeats this over the whole session)."""
    forged = audit.forged_lines(FORGED_PREFIX)
    figures.record("hostile_wire", "forged_log_lines", {"log_files": len(audit.log_files), "forged": forged[:10]})
    assert forged == [], forged
