"""Readiness: an orchestrator started before its provider stays NOT_SERVING and answers task-dependent
RPCs with UNAVAILABLE (TASKS_NOT_LOADED) until the task catalog loads in the background; then it serves."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_status import rpc_status

from rlgate.orchestrator.server import SERVICE_NAME
from rlgate.v1 import orchestrator_pb2
from tests.orchestrator.conftest import Running, fast_config, instances_of
from tests.support.localfleet import LocalfleetProcess
from tests.support.wait import wait_until

TASK = "mailbox-count-unread-from-kenji"


def error_reason(err: grpc.aio.AioRpcError) -> str:
    status = rpc_status.from_call(err)  # type: ignore[arg-type]
    assert status is not None
    for detail in status.details:
        info = error_details_pb2.ErrorInfo()
        if detail.Unpack(info):
            return info.reason
    return ""


async def test_not_serving_until_tasks_load(orchestrator_factory: Callable[..., Any]) -> None:
    lf = LocalfleetProcess()  # its port is reserved; the process starts later
    try:
        orch: Running = await orchestrator_factory(fast_config(lf, provider_timeout_s=2.0))
        health = health_pb2_grpc.HealthStub(orch.channel)

        async def serving(service: str = "") -> int:
            # types-grpcio-health-checking gives HealthStub no methods.
            reply = await health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)  # type: ignore[attr-defined]
            return int(reply.status)

        assert await serving() == health_pb2.HealthCheckResponse.NOT_SERVING
        assert await serving(SERVICE_NAME) == health_pb2.HealthCheckResponse.NOT_SERVING
        for call in (
            orch.stub.Reset(orchestrator_pb2.ResetRequest(task_key=TASK), timeout=10),
            orch.stub.ListTasks(orchestrator_pb2.ListTasksRequest(), timeout=10),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "tasks not loaded yet; retry" in (err.value.details() or "")
            assert error_reason(err.value) == "TASKS_NOT_LOADED"
        # Releasing does not wait for the catalog: Close answers for itself.
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await orch.stub.Close(orchestrator_pb2.CloseRequest(session_id="s-unknown"), timeout=10)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND

        await asyncio.to_thread(lf.start)

        async def ready() -> bool:
            return await serving() == health_pb2.HealthCheckResponse.SERVING

        await wait_until(ready, 90, "SERVING once the provider started", interval=0.2)
        assert await serving(SERVICE_NAME) == health_pb2.HealthCheckResponse.SERVING
        listed = await orch.stub.ListTasks(orchestrator_pb2.ListTasksRequest(), timeout=10)
        assert listed.total > 0
        reset = await orch.stub.Reset(orchestrator_pb2.ResetRequest(task_key=TASK), timeout=60)
        assert reset.tools
        await orch.stub.Close(orchestrator_pb2.CloseRequest(session_id=reset.session_id), timeout=30)
        await orch.handle.stop()
        assert instances_of(lf, orch.config.run_id) == []
        assert orch.handle.readiness is not None and orch.handle.readiness.done()
    finally:
        lf.stop()


async def test_ready_at_once_when_tasks_load_at_start(orch: Running) -> None:
    # types-grpcio-health-checking gives HealthStub no methods.
    reply = await health_pb2_grpc.HealthStub(orch.channel).Check(health_pb2.HealthCheckRequest(), timeout=10)  # type: ignore[attr-defined]
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    assert orch.handle.readiness is None
    assert (await orch.stub.ListTasks(orchestrator_pb2.ListTasksRequest(), timeout=10)).total > 0
