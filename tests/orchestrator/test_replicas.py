"""Two orchestrator replicas on one Redis store: any replica serves any session; one reconciles."""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from rlgate.orchestrator.server import start_orchestrator
from rlgate.store import open_store
from rlgate.v1 import common_pb2, orchestrator_pb2, orchestrator_pb2_grpc
from tests.orchestrator.conftest import fast_config, instances_of
from tests.support.localfleet import LocalfleetProcess

pytestmark = pytest.mark.redis

TASK = "mailbox-count-unread-from-kenji"


async def test_replicas_share_sessions_over_redis(lf: LocalfleetProcess, redis_server: Any) -> None:
    config = fast_config(lf)
    store_a = await open_store(redis_server.url)
    store_b = await open_store(redis_server.url)
    a = await start_orchestrator(config, store_a)
    b = await start_orchestrator(config, store_b)
    try:
        async with grpc.aio.insecure_channel(a.address) as ca, grpc.aio.insecure_channel(b.address) as cb:
            stub_a = orchestrator_pb2_grpc.OrchestratorServiceStub(ca)
            stub_b = orchestrator_pb2_grpc.OrchestratorServiceStub(cb)
            reset = await stub_a.Reset(orchestrator_pb2.ResetRequest(task_key=TASK, request_id="rep-1"), timeout=60)
            again = await stub_b.Reset(orchestrator_pb2.ResetRequest(task_key=TASK, request_id="rep-1"), timeout=60)
            assert again.session_id == reset.session_id  # request_id dedupe across replicas
            step = await stub_b.Step(
                orchestrator_pb2.StepRequest(session_id=reset.session_id, final_answer="3"), timeout=60
            )
            assert step.verification.status == common_pb2.VERIFICATION_STATUS_OK and step.reward == 1.0
            state = await stub_a.State(orchestrator_pb2.StateRequest(session_id=reset.session_id), timeout=10)
            assert state.session.reward == 1.0
            ran = [(await a.orchestrator.reconciler.run_once()).ran, (await b.orchestrator.reconciler.run_once()).ran]
            assert ran.count(True) == 1  # the lease admits one reconciler
            closed = await stub_b.Close(orchestrator_pb2.CloseRequest(session_id=reset.session_id), timeout=30)
            assert not closed.already_closed
            assert (
                await stub_a.Close(orchestrator_pb2.CloseRequest(session_id=reset.session_id), timeout=30)
            ).already_closed
        assert instances_of(lf, config.run_id) == []
    finally:
        await a.stop()
        await b.stop()
        await store_a.close()
        await store_b.close()
