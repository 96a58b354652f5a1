"""Draining a replica without losing an episode (in process, two replicas on one store).

On shutdown a replica refuses every new RPC at once (UNAVAILABLE, reason SHUTTING_DOWN, RetryInfo), lets an
ending Step in flight finish its scoring (another replica then replays the recorded ending), and an ending
cut by the drain is handed back: the retry on the other replica answers with the episode's ending, never
FAILED_PRECONDITION. The process-level test (SIGTERM across two replicas on Redis) is test_drain_replicas.py.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rlgate.store import SessionStatus, SessionStore
from rlgate.v1 import common_pb2, orchestrator_pb2
from tests.orchestrator.conftest import Running, fast_config
from tests.support.localfleet import LocalfleetProcess
from tests.support.statuses import detail
from tests.support.wait import wait_until

TASK = "mailbox-count-unread-from-kenji"
ANSWER = "3"
BOUND_S = 10.0  # how long anything that should happen "at once" may take on a loaded machine


def hold_scoring(orch: Running) -> tuple[asyncio.Event, asyncio.Event]:
    """Make `orch`'s verifier wait: (entered, release). Scoring starts when it is released."""
    verifier = orch.handle.orchestrator.episodes.endings.verifier
    run = verifier.run
    entered, release = asyncio.Event(), asyncio.Event()

    async def held(*args: Any, **kwargs: Any) -> Any:
        entered.set()
        await release.wait()
        return await run(*args, **kwargs)

    verifier.run = held  # type: ignore[method-assign]
    return entered, release


async def refused(orch: Running) -> grpc.aio.AioRpcError:
    """The first answer of `orch` that is a refusal (polled: shutdown begins in another task)."""

    async def refusal() -> grpc.aio.AioRpcError | None:
        try:
            await orch.stub.ListTasks(orchestrator_pb2.ListTasksRequest(page_size=1), timeout=5)
        except grpc.aio.AioRpcError as err:
            return err
        return None

    err: grpc.aio.AioRpcError = await wait_until(refusal, BOUND_S, "a refusal once shutdown began", interval=0.02)
    return err


def ending(session_id: str, request_id: str) -> orchestrator_pb2.StepRequest:
    return orchestrator_pb2.StepRequest(session_id=session_id, final_answer=ANSWER, request_id=request_id)


async def test_shutdown_refuses_new_rpcs_at_once_and_lets_an_ending_finish(
    lf: LocalfleetProcess, orchestrator_factory: Callable[..., Any], store: SessionStore
) -> None:
    config = fast_config(lf, shutdown_mode="handoff", drain_s=20.0)
    a: Running = await orchestrator_factory(config)
    b: Running = await orchestrator_factory(config)
    reset = await a.stub.Reset(orchestrator_pb2.ResetRequest(task_key=TASK, request_id="r-finish"), timeout=60)
    entered, release = hold_scoring(a)
    step = asyncio.ensure_future(a.stub.Step(ending(reset.session_id, "end-finish"), timeout=60))
    await asyncio.wait_for(entered.wait(), BOUND_S)

    stopping = asyncio.create_task(a.handle.stop())
    err = await refused(a)
    assert err.code() == grpc.StatusCode.UNAVAILABLE, err
    assert detail(err, error_details_pb2.ErrorInfo).reason == "SHUTTING_DOWN"
    assert detail(err, error_details_pb2.RetryInfo).retry_delay.ToTimedelta().total_seconds() > 0
    # types-grpcio-health-checking gives HealthStub no methods.
    health = await health_pb2_grpc.HealthStub(a.channel).Check(health_pb2.HealthCheckRequest(), timeout=5)  # type: ignore[attr-defined]
    assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING
    assert not stopping.done()  # the drain waits for the ending in flight ...

    release.set()  # ... which finishes and answers its caller
    answer = await asyncio.wait_for(step, BOUND_S)
    assert answer.done and answer.reward == 1.0, answer
    await asyncio.wait_for(stopping, BOUND_S)
    # The other replica replays the recorded ending.
    assert await b.stub.Step(ending(reset.session_id, "end-finish"), timeout=30) == answer
    session = await store.get_session(reset.session_id)
    assert session is not None and session.status == SessionStatus.DONE and session.reward == 1.0


@pytest.mark.parametrize("drain_s", [1.0])
async def test_an_ending_cut_by_the_drain_is_taken_over_by_another_replica(
    lf: LocalfleetProcess, orchestrator_factory: Callable[..., Any], store: SessionStore, drain_s: float
) -> None:
    config = fast_config(lf, shutdown_mode="handoff", drain_s=drain_s)
    a: Running = await orchestrator_factory(config)
    b: Running = await orchestrator_factory(config)
    reset = await a.stub.Reset(orchestrator_pb2.ResetRequest(task_key=TASK, request_id="r-cut"), timeout=60)
    entered, _never = hold_scoring(a)
    step = asyncio.ensure_future(a.stub.Step(ending(reset.session_id, "end-cut"), timeout=60))
    await asyncio.wait_for(entered.wait(), BOUND_S)

    started = time.monotonic()
    await a.handle.stop()  # the scoring never finishes: the drain cuts the call and hands its record back
    took = time.monotonic() - started
    assert took < drain_s + 5.0, f"stop took {took:.1f}s with drain_s={drain_s}"
    with pytest.raises(grpc.aio.AioRpcError) as cut:
        await asyncio.wait_for(step, BOUND_S)
    assert cut.value.code() == grpc.StatusCode.UNAVAILABLE, cut.value  # a client retries it elsewhere
    assert detail(cut.value, error_details_pb2.ErrorInfo).reason == "SHUTTING_DOWN"

    # The retry on the other replica takes the ending over and scores it: the episode's ending, not
    # FAILED_PRECONDITION.
    answer = await b.stub.Step(ending(reset.session_id, "end-cut"), timeout=60)
    assert answer.done and answer.reward == 1.0, answer
    assert answer.verification.status == common_pb2.VERIFICATION_STATUS_OK
    assert await b.stub.Step(ending(reset.session_id, "end-cut"), timeout=30) == answer  # now recorded
    session = await store.get_session(reset.session_id)
    assert session is not None and session.status == SessionStatus.DONE and session.reward == 1.0
