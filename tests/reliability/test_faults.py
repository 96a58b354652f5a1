"""Faults, in both MCP eras (mailbox: modern stateless; tracker: legacy initialize + session id).

Each scenario injects one fault with localfleet's fault plan or by killing a process, and records what the
caller saw (status, latency), whether the episode completed after client retries (reference solution ->
reward 1.0), whether any tool ran twice (localfleet's tool-call counter against the distinct request ids
sent, and the session's tool-call log) and how many instances were left after the sessions were closed.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pytest

from rlgate import AsyncClient, RetryPolicy, RlgateError
from rlgate.core.convert import parse_json_object
from rlgate.store import RequestState, call_scope, open_store
from rlgate.v1 import common_pb2, orchestrator_pb2
from tests.reliability.conftest import Figures
from tests.reliability.harness import (
    API_KEY,
    ERAS,
    Audit,
    AuditedStack,
    faulty_task_key,
    reference_solution,
    start_stack,
)
from tests.support.redis import RedisServer
from tests.support.wait import wait_until

TASKS = {"modern": "mailbox-count-unread-from-kenji", "legacy": "tracker-who-is-assigned"}
RESET_TIMEOUT_S = 2.0
VERIFY_TIMEOUT_S = 4.0
GATEWAY_OWNER_TTL_S = 2.0
DOWN_DEADLINE_S = 8.0  # the caller's deadline while localfleet is down (the orchestrator retries within it)
STACK_ARGS: dict[str, list[str]] = {
    "orchestrator_args": [
        "--reset-timeout-s",
        str(RESET_TIMEOUT_S),
        "--verify-timeout-s",
        str(VERIFY_TIMEOUT_S),
        "--verify-retries",
        "1",
        "--reconcile-interval-s",
        "2",
        "--owner-ttl-s",
        "3",
        "--provider-timeout-s",
        "5",
    ],
    "gateway_args": ["--owner-ttl-s", str(GATEWAY_OWNER_TTL_S)],
}
RETRYING = RetryPolicy(max_attempts=60, initial_backoff=0.2, max_backoff=1.0)
ONCE = RetryPolicy(max_attempts=1)
eras = pytest.mark.parametrize("era", ["modern", "legacy"])


def creating(stack: AuditedStack, era: str) -> bool:
    """Whether localfleet holds a create of the era's environment in progress."""
    return any(i["status"] == "pending" and i["env_key"] == ERAS[era] for i in stack.admin.instances())


@dataclass
class Outcome:
    """One row of docs/reliability.md's fault table."""

    fault: str
    era: str
    caller_saw: list[str] = field(default_factory=list)  # status of each observed attempt ("OK", "UNAVAILABLE")
    latency_s: float = 0.0  # of the faulted call, first attempt
    recovered_s: float = 0.0  # from the fault until the episode could go on
    completed: bool = False
    reward: float | None = None
    tool_ran_twice: bool = False
    instances_left: int = -1
    notes: str = ""


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, audit: Audit) -> Iterator[AuditedStack]:
    s = start_stack(tmp_path_factory.mktemp("faults"), audit, **STACK_ARGS)  # type: ignore[arg-type]
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture
async def client(stack: AuditedStack) -> AsyncIterator[AsyncClient]:
    stack.admin.clear_faults()
    c = AsyncClient(stack.orchestrator_address, api_key=API_KEY, retry=RETRYING)
    try:
        yield c
    finally:
        await c.close()
        stack.admin.clear_faults()


async def timed(awaitable: Awaitable[Any]) -> tuple[str, float, Any]:
    """(status name, seconds, result or error) of one call."""
    start = time.perf_counter()
    try:
        result = await awaitable
        status = "OK"
    except RlgateError as exc:
        result, status = exc, exc.code.name if exc.code else "ERROR"
    return status, time.perf_counter() - start, result


def rid() -> str:
    return f"rel-{uuid.uuid4().hex[:16]}"


_SOLUTIONS: dict[str, tuple[list[tuple[str, dict[str, Any]]], str | None]] = {}


async def solution(client: AsyncClient, task_key: str) -> tuple[list[tuple[str, dict[str, Any]]], str | None]:
    """A task's reference solution (tool calls, final answer): only ListTasks hands it out, on request."""
    if task_key not in _SOLUTIONS:
        for task in await client.list_tasks(include_reference_solution=True, timeout=30.0):
            _SOLUTIONS[task.key] = reference_solution(task)
    return _SOLUTIONS[task_key]


class Run:
    """An episode of one of the reference tasks, driven by hand so faults can land between its steps."""

    def __init__(self, stack: AuditedStack, client: AsyncClient, era: str, audit: Audit) -> None:
        self.stack, self.client, self.era, self.audit = stack, client, era, audit
        self.env_id = ERAS[era]
        self.sent: set[str] = set()  # request ids sent to CallTool
        self.reruns = 0  # of them, run twice by the gateway as it may (read-only after a dead gateway)
        self.reset: orchestrator_pb2.ResetResponse | None = None
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.final: str | None = None
        self.tool_calls_before = stack.admin.env_counter(self.env_id, "tool_calls")

    async def start(self, task_key: str = "", request_id: str | None = None, deadline_s: float = 90.0) -> None:
        self.reset = await self.client.reset(
            task_key=task_key or TASKS[self.era], request_id=request_id or rid(), timeout=deadline_s
        )
        self.audit.token(self.reset.agent_token)
        self.calls, self.final = await solution(self.client, self.reset.task.key)

    @property
    def session_id(self) -> str:
        assert self.reset is not None
        return self.reset.session_id

    async def call(
        self,
        name: str,
        args: dict[str, Any],
        request_id: str | None = None,
        *,
        client: AsyncClient | None = None,
        deadline_s: float = 30.0,
    ) -> Any:
        assert self.reset is not None
        request_id = request_id or rid()
        self.sent.add(request_id)
        return await (client or self.client).call_tool(
            self.reset.agent_token,
            name,
            args,
            request_id=request_id,
            gateway=self.reset.gateway_address,
            timeout=deadline_s,
        )

    async def solve(self) -> orchestrator_pb2.StepResponse:
        """The reference solution's tool calls, then the final answer (or done)."""
        for name, args in self.calls:
            reply = await self.call(name, args)
            assert not reply.result.is_error, reply.result.error_message
        fields: dict[str, Any] = {"final_answer": self.final} if self.final is not None else {"done": True}
        return await self.client.step(self.session_id, request_id=rid(), timeout=60.0, **fields)

    async def log_ids_unique(self) -> bool:
        state = await self.client.state(self.session_id, include_tool_calls=True)
        ids = [e.request_id for e in state.tool_calls if e.request_id]
        self.reruns = sum(e.infra_fault == "tool_reruns" for e in state.tool_calls)
        return len(ids) == len(set(ids))

    async def close(self) -> None:
        if self.reset is not None:
            await self.client.close_session(self.session_id, timeout=30.0)


def ran_twice(runs: list[Run]) -> bool:
    """More upstream tool executions (localfleet's counter, per environment, since the first run started)
    than distinct request ids the runs sent, plus the reruns the gateway logged (a read-only or idempotent
    tool run again after its gateway died: the one second run allowed; `log_ids_unique` counts them)."""
    for env_id in {r.env_id for r in runs}:
        mine = [r for r in runs if r.env_id == env_id]
        before = min(r.tool_calls_before for r in mine)
        sent = set().union(*(r.sent for r in mine))
        allowed = len(sent) + sum(r.reruns for r in mine)
        if mine[0].stack.admin.env_counter(env_id, "tool_calls") - before > allowed:
            return True
    return False


async def finish(
    outcome: Outcome, runs: list[Run], stack: AuditedStack, figures: Figures, step: orchestrator_pb2.StepResponse | None
) -> Outcome:
    """Fill the common columns, close everything, count instances left, record the row."""
    if step is not None:
        outcome.completed = step.done and step.verification.status == common_pb2.VERIFICATION_STATUS_OK
        outcome.reward = step.reward if step.HasField("reward") else None
    unique = [await r.log_ids_unique() for r in runs if r.reset is not None]  # counts each run's reruns too
    outcome.tool_ran_twice = ran_twice(runs) or not all(unique)
    for r in runs:
        await r.close()
    stack.admin.clear_faults()
    outcome.instances_left = await asyncio.to_thread(stack.admin.wait_instances, 0, 20.0)
    figures.append("faults", asdict(outcome))
    return outcome


def assert_promises(o: Outcome, *, reward: float | None = 1.0) -> None:
    assert not o.tool_ran_twice, o
    assert o.instances_left == 0, o
    if reward is not None:
        assert o.completed and o.reward == reward, o


# ---------------------------------------------------------------------------------------------------------


@eras
async def test_upstream_killed_mid_call(
    stack: AuditedStack, client: AsyncClient, audit: Audit, figures: Figures, era: str
) -> None:
    """The MCP connection drops mid-call: UNAVAILABLE fast, a retry of the same request_id answers
    OUTCOME_UNKNOWN without running the tool again, a new call works without restarting anything."""
    run = Run(stack, client, era, audit)
    await run.start()
    name, args = run.calls[0]
    stack.admin.set_faults({"environments": {run.env_id: {"crash_tools": [name]}}})
    first = rid()
    once = AsyncClient(stack.orchestrator_address, api_key=API_KEY, retry=ONCE)
    try:
        status, latency, _ = await timed(run.call(name, args, first, client=once, deadline_s=20.0))
    finally:
        await once.close()
    outcome = Outcome("upstream MCP connection dropped mid-call", era, [status], round(latency, 3))
    assert status == "UNAVAILABLE" and latency < 10.0, (status, latency)
    stack.admin.clear_faults()
    started = time.perf_counter()
    retry_status, _, replay = await timed(run.call(name, args, first))
    kind = common_pb2.ToolErrorKind.Name(replay.result.error_kind) if retry_status == "OK" else ""
    outcome.caller_saw.append(f"retry same id: {retry_status} {kind}")
    assert retry_status == "OK" and replay.result.error_kind == common_pb2.TOOL_ERROR_KIND_OUTCOME_UNKNOWN
    step = await run.solve()
    outcome.recovered_s = round(time.perf_counter() - started, 3)
    assert_promises(await finish(outcome, [run], stack, figures, step))


@eras
async def test_sessions_forgotten(
    stack: AuditedStack, client: AsyncClient, audit: Audit, figures: Figures, era: str
) -> None:
    """The MCP server forgets its sessions after every call (and once more on demand): calls keep working."""
    run = Run(stack, client, era, audit)
    await run.start()
    name, args = run.calls[0]
    stack.admin.set_faults({"environments": {run.env_id: {"forget_sessions": True}}})
    handshakes = stack.admin.env_counter(run.env_id, "mcp_handshakes")
    statuses, latencies = [], []
    for _ in range(3):
        status, latency, reply = await timed(run.call(name, args))
        statuses.append(status if status != "OK" or not reply.result.is_error else "OK is_error")
        latencies.append(latency)
    await asyncio.to_thread(stack.admin._http.post, "/_admin/forget_sessions")
    status, latency, _ = await timed(run.call(name, args))
    statuses.append(status)
    latencies.append(latency)
    rebuilds = stack.admin.env_counter(run.env_id, "mcp_handshakes") - handshakes
    outcome = Outcome(
        "MCP sessions forgotten after every call",
        era,
        sorted(set(statuses)),
        round(max(latencies), 3),
        notes=f"{rebuilds} upstream handshakes for 4 calls",
    )
    assert statuses == ["OK"] * 4, statuses
    step = await run.solve()
    assert_promises(await finish(outcome, [run], stack, figures, step))


@eras
async def test_reset_hanging(
    stack: AuditedStack, client: AsyncClient, audit: Audit, figures: Figures, era: str
) -> None:
    """/reset hangs: on a fresh instance the episode goes on after the reset timeout; on a reused instance
    (next episode) the instance is replaced, so no episode starts on dirty state."""
    env_id = ERAS[era]
    stack.admin.set_faults({"environments": {env_id: {"reset_hang": True}}})
    run = Run(stack, client, era, audit)
    status, latency, _ = await timed(run.start())
    outcome = Outcome("manager /reset hangs", era, [f"fresh: {status}"], round(latency, 3))
    assert status == "OK" and latency < RESET_TIMEOUT_S + 20, (status, latency)
    first_instance = (await client.state(run.session_id)).session.instance.instance_id
    status2, latency2, second = await timed(client.reset(session_id=run.session_id, request_id=rid(), timeout=90.0))
    outcome.caller_saw.append(f"reused: {status2}")
    assert status2 == "OK", second
    audit.token(second.agent_token)
    run.reset = second
    now_instance = (await client.state(run.session_id)).session.instance.instance_id
    outcome.notes = (
        f"next episode {latency2:.1f}s; instance replaced: {now_instance != first_instance}; "
        f"old instance live: {any(i['instance_id'] == first_instance for i in stack.admin.instances())}"
    )
    assert now_instance != first_instance
    stack.admin.clear_faults()
    step = await run.solve()
    assert_promises(await finish(outcome, [run], stack, figures, step))


@pytest.mark.parametrize("kind", ["raises", "hangs"])
@eras
async def test_verifier_faults(
    stack: AuditedStack, client: AsyncClient, audit: Audit, figures: Figures, era: str, kind: str
) -> None:
    """A verifier that raises is ERROR, one that hangs is TIMEOUT within rlgate's timeout; no reward either
    way (never a silent 0)."""
    run = Run(stack, client, era, audit)
    await run.start(faulty_task_key(ERAS[era], kind))
    status, latency, step = await timed(
        client.step(run.session_id, final_answer="done", request_id=rid(), timeout=60.0)
    )
    assert status == "OK", step
    verdict = common_pb2.VerificationStatus.Name(step.verification.status)
    outcome = Outcome(
        f"verifier {kind}",
        era,
        [f"Step OK, {verdict}"],
        round(latency, 3),
        notes=f"reward set: {step.HasField('reward')}; attempts {step.verification.attempts}",
    )
    expected = common_pb2.VERIFICATION_STATUS_ERROR if kind == "raises" else common_pb2.VERIFICATION_STATUS_TIMEOUT
    assert step.done and step.verification.status == expected, step
    assert not step.HasField("reward")
    assert latency < VERIFY_TIMEOUT_S + 10
    outcome.completed = True  # the episode ended with an honest verdict
    assert_promises(await finish(outcome, [run], stack, figures, None), reward=None)


@pytest.mark.parametrize(("era", "when"), [("modern", "before"), ("legacy", "mid-create")])
async def test_localfleet_down_while_provisioning(
    stack: AuditedStack, client: AsyncClient, audit: Audit, figures: Figures, era: str, when: str
) -> None:
    """localfleet is down (before the create, or killed mid-create): Reset fails with a retryable status;
    retried with its request_id once localfleet is back, it returns a working session, and nothing leaks."""
    run = Run(stack, client, era, audit)
    request_id = rid()
    if when == "before":
        stack.kill("localfleet")
        once = AsyncClient(stack.orchestrator_address, api_key=API_KEY, retry=ONCE)
        try:
            status, latency, err = await timed(
                once.reset(task_key=TASKS[era], request_id=request_id, timeout=DOWN_DEADLINE_S)
            )
        finally:
            await once.close()
        outcome = Outcome(
            "localfleet down while provisioning",
            era,
            [status],
            round(latency, 3),
            notes=f"caller deadline {DOWN_DEADLINE_S:g}s",
        )
        assert status in ("UNAVAILABLE", "DEADLINE_EXCEEDED"), err
        assert latency < DOWN_DEADLINE_S + 5.0  # the caller's deadline (room for a loaded machine)
    else:
        stack.admin.set_faults({"environments": {ERAS[era]: {"create_delay_s": 3.0}}})
        once = AsyncClient(stack.orchestrator_address, api_key=API_KEY, retry=ONCE)
        try:
            pending = asyncio.ensure_future(
                timed(once.reset(task_key=TASKS[era], request_id=request_id, timeout=DOWN_DEADLINE_S))
            )
            await wait_until(lambda: asyncio.to_thread(creating, stack, era), 30, "the create waiting in localfleet")
            stack.kill("localfleet")
            status, latency, err = await pending
        finally:
            await once.close()
        outcome = Outcome(
            "localfleet killed mid-create",
            era,
            [status],
            round(latency, 3),
            notes=f"caller deadline {DOWN_DEADLINE_S:g}s",
        )
        assert status in ("UNAVAILABLE", "DEADLINE_EXCEEDED"), err
        assert latency < DOWN_DEADLINE_S + 5.0  # the caller's deadline (room for a loaded machine)
    started = time.perf_counter()
    restart = asyncio.ensure_future(asyncio.to_thread(stack.start_service, "localfleet"))
    await run.start(request_id=request_id, deadline_s=120.0)  # the client retries until localfleet is back
    await restart
    outcome.caller_saw.append("retry same request_id: OK")
    outcome.recovered_s = round(time.perf_counter() - started, 3)
    stack.admin.clear_faults()
    step = await run.solve()
    assert_promises(await finish(outcome, [run], stack, figures, step))


@eras
async def test_slow_creates(stack: AuditedStack, client: AsyncClient, audit: Audit, figures: Figures, era: str) -> None:
    """Creates take 2 s: Resets wait, the orchestrator stays responsive (State of another session is fast)."""
    probe = Run(stack, client, era, audit)
    await probe.start()
    stack.admin.set_faults({"environments": {ERAS[era]: {"create_delay_s": 2.0}}})
    runs = [Run(stack, client, era, audit) for _ in range(4)]
    resets = asyncio.gather(*(timed(r.start()) for r in runs))
    state_latencies: list[float] = []
    while not resets.done():
        _, lat, _ = await timed(client.state(probe.session_id))
        state_latencies.append(lat)
        await asyncio.sleep(0.1)
    results = await resets
    statuses = sorted({s for s, _, _ in results})
    outcome = Outcome(
        "slow instance creates (2 s)",
        era,
        statuses,
        round(max(lat for _, lat, _ in results), 3),
        notes=f"State during creates: max {max(state_latencies) * 1000:.0f} ms over {len(state_latencies)} calls",
    )
    assert statuses == ["OK"]
    assert max(state_latencies) < 3.0, state_latencies  # generous: the machine is shared
    stack.admin.clear_faults()
    steps = [await r.solve() for r in [probe, *runs]]
    assert all(s.reward == 1.0 for s in steps)
    assert_promises(await finish(outcome, [probe, *runs], stack, figures, steps[0]))


@eras
async def test_orchestrator_sigkill_mid_episode(
    stack: AuditedStack, client: AsyncClient, audit: Audit, figures: Figures, era: str
) -> None:
    """SIGKILL the orchestrator between turns and while a Reset is provisioning; restart it: the running
    episode finishes with reward 1.0, the in-flight Reset retried with its request_id returns a working
    session, and reconciliation leaves no orphan instance."""
    run = Run(stack, client, era, audit)
    await run.start()
    name, args = run.calls[0]
    await run.call(name, args)  # one turn's tool call before the crash
    stack.admin.set_faults({"environments": {ERAS[era]: {"create_delay_s": 3.0}}})
    inflight = Run(stack, client, era, audit)
    inflight_id = rid()
    once = AsyncClient(stack.orchestrator_address, api_key=API_KEY, retry=ONCE)
    try:
        pending = asyncio.ensure_future(timed(once.reset(task_key=TASKS[era], request_id=inflight_id, timeout=30.0)))
        await wait_until(lambda: asyncio.to_thread(creating, stack, era), 30, "the create waiting in localfleet")
        stack.kill("orchestrator")
        status, latency, _ = await pending
    finally:
        await once.close()
    outcome = Outcome(
        "orchestrator SIGKILLed mid-episode and mid-Reset", era, [f"in-flight Reset: {status}"], round(latency, 3)
    )
    started = time.perf_counter()
    restart = asyncio.ensure_future(asyncio.to_thread(stack.start_service, "orchestrator"))
    fields: dict[str, Any] = {"final_answer": run.final} if run.final is not None else {"done": True}
    step = await client.step(run.session_id, request_id=rid(), timeout=120.0, **fields)  # retried until it is back
    await restart
    outcome.recovered_s = round(time.perf_counter() - started, 3)
    stack.admin.clear_faults()
    await inflight.start(request_id=inflight_id, deadline_s=120.0)
    inflight_step = await inflight.solve()
    outcome.caller_saw.append("after restart: Step OK, retried Reset OK")
    outcome.notes = f"in-flight Reset's session finished with reward {inflight_step.reward}"
    assert inflight_step.reward == 1.0
    assert_promises(await finish(outcome, [run, inflight], stack, figures, step))


@eras
async def test_gateway_sigkill_mid_call(
    stack: AuditedStack, client: AsyncClient, audit: Audit, figures: Figures, era: str
) -> None:
    """SIGKILL the gateway while a tool call hangs upstream; restart it: the caller saw UNAVAILABLE, the
    retry of the same request_id answers OUTCOME_UNKNOWN (the tool is not run again) or, for a tool its
    server annotates read-only or idempotent, runs it again and answers its result; either way the episode
    counts the fault, and finishes."""
    run = Run(stack, client, era, audit)
    await run.start()
    name, args = run.calls[0]
    stack.admin.set_faults({"environments": {run.env_id: {"hang_tools": [name]}}})
    first = rid()
    calls = stack.admin.env_counter(run.env_id, "tool_calls")

    def reached_upstream() -> bool:
        return stack.admin.env_counter(run.env_id, "tool_calls") > calls

    once = AsyncClient(stack.orchestrator_address, api_key=API_KEY, retry=ONCE)
    try:
        pending = asyncio.ensure_future(timed(run.call(name, args, first, client=once, deadline_s=30.0)))
        await wait_until(lambda: asyncio.to_thread(reached_upstream), 10, "the call hanging upstream")
        stack.kill("toolgateway")
        status, latency, _ = await pending
    finally:
        await once.close()
    outcome = Outcome("toolgateway SIGKILLed mid-call", era, [status], round(latency, 3))
    assert status == "UNAVAILABLE", status
    started = time.perf_counter()
    await asyncio.to_thread(stack.start_service, "toolgateway")
    stack.admin.clear_faults()
    # The dead gateway's claim stays PENDING under its owner until that owner's heartbeat lapses.
    store = await open_store(stack.store_url)
    try:
        claim = await store.get_request(call_scope(run.session_id), first)
        assert claim is not None and claim.state == RequestState.PENDING, claim
        dead_owner = claim.owner

        async def lapsed() -> bool:
            return not await store.owner_alive(dead_owner)

        await wait_until(lapsed, 3 * GATEWAY_OWNER_TTL_S, "the dead gateway's owner lease lapsed")
    finally:
        await store.close()
    assert run.reset is not None
    spec = next(t for t in run.reset.tools if t.name == name)
    hints = parse_json_object(spec.annotations_json, "annotations_json") if spec.annotations_json else {}
    rerun = hints.get("readOnlyHint") is True or hints.get("idempotentHint") is True
    retry_status, _, replay = await timed(run.call(name, args, first))
    kind = common_pb2.ToolErrorKind.Name(replay.result.error_kind) if retry_status == "OK" else ""
    outcome.caller_saw.append(f"retry same id: {retry_status} {kind}{' (read-only: run again)' if rerun else ''}")
    assert retry_status == "OK", retry_status
    if rerun:
        assert not replay.result.is_error, replay
    else:
        assert replay.result.error_kind == common_pb2.TOOL_ERROR_KIND_OUTCOME_UNKNOWN, replay
    step = await run.solve()
    assert (step.infra_faults.tool_reruns, step.infra_faults.outcome_unknown) == ((1, 0) if rerun else (0, 1))
    outcome.recovered_s = round(time.perf_counter() - started, 3)
    assert_promises(await finish(outcome, [run], stack, figures, step))


async def test_redis_restarted_mid_run(tmp_path: Path, audit: Audit, figures: Figures) -> None:
    """A stack on Redis (append-only): the Redis server SIGKILLed and restarted between and during turns;
    episodes of both eras complete after client retries and the store's invariants hold."""
    redis = await asyncio.to_thread(RedisServer.launch, tmp_path / "redis")
    stack = await asyncio.to_thread(lambda: start_stack(tmp_path / "stack", audit, store_url=redis.url, **STACK_ARGS))  # type: ignore[arg-type]
    client = AsyncClient(stack.orchestrator_address, api_key=API_KEY, retry=RETRYING)
    try:
        for era in ("modern", "legacy"):
            run = Run(stack, client, era, audit)
            await run.start()
            name, args = run.calls[0]
            outage = asyncio.ensure_future(redis.restart_async(kill=True, down_for=1.5))
            await wait_until(lambda: asyncio.to_thread(lambda: not redis.answers()), 5, "Redis down")
            once = AsyncClient(stack.orchestrator_address, api_key=API_KEY, retry=ONCE)
            try:
                status, latency, _ = await timed(run.call(name, args, client=once, deadline_s=10.0))
            finally:
                await once.close()
            started = time.perf_counter()
            await outage
            outcome = Outcome(
                "Redis SIGKILLed and restarted mid-episode",
                era,
                [f"CallTool during outage: {status}"],
                round(latency, 3),
            )
            assert status in ("OK", "UNAVAILABLE"), status
            step = await run.solve()
            outcome.recovered_s = round(time.perf_counter() - started, 3)
            await finish(outcome, [run], stack, figures, step)
            assert_promises(outcome)
        store = await open_store(redis.url)
        try:
            problems = await store.check_invariants()
        finally:
            await store.close()
        figures.record("redis", "store_invariant_problems", problems)
        assert problems == []
    finally:
        await client.close()
        await asyncio.to_thread(stack.stop)
        redis.close()
