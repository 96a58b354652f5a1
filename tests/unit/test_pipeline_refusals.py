"""The orchestrator's pipeline refuses as its interceptors did, one refusal kind at a time and in their order:
reply budget (RESOURCE_EXHAUSTED, REPLY_BUDGET), then API keys (UNAUTHENTICATED), then draining
(UNAVAILABLE, SHUTTING_DOWN), then readiness (UNAVAILABLE, TASKS_NOT_LOADED, task-dependent RPCs only);
a refused call never reaches its handler, and the metrics count each one as the caller saw it. Health
answers throughout, with no key.

A real grpc.aio server on loopback with the orchestrator's layers (`rlgate.orchestrator.server`) in one
`Pipeline`, around a servicer whose State and Close answer at once."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import REGISTRY

from rlgate.orchestrator.server import SERVICE_NAME, Drain, Readiness
from rlgate.runtime.auth import mint_agent_token
from rlgate.runtime.interceptors import ApiKeys, Pipeline, ReplyBudget, RpcMetrics
from rlgate.v1 import orchestrator_pb2, orchestrator_pb2_grpc
from tests.support.statuses import detail

KEY = "k-pipeline"


class Servicer(orchestrator_pb2_grpc.OrchestratorServiceServicer):
    def __init__(self) -> None:
        self.runs: list[str] = []

    async def State(
        self, request: orchestrator_pb2.StateRequest, context: grpc.aio.ServicerContext
    ) -> orchestrator_pb2.StateResponse:
        self.runs.append("State")
        return orchestrator_pb2.StateResponse()

    async def Close(
        self, request: orchestrator_pb2.CloseRequest, context: grpc.aio.ServicerContext
    ) -> orchestrator_pb2.CloseResponse:
        self.runs.append("Close")
        return orchestrator_pb2.CloseResponse()


@dataclass
class Server:
    address: str
    servicer: Servicer
    budget: ReplyBudget
    service: str
    flags: dict[str, bool] = field(default_factory=lambda: {"draining": False, "ready": True})


@pytest.fixture
async def server() -> AsyncIterator[Server]:
    service = f"pipeline-{uuid.uuid4().hex[:8]}"  # metrics of this test only
    flags = {"draining": False, "ready": True}
    budget = ReplyBudget()
    layers = (budget, ApiKeys([KEY]), Drain(lambda: flags["draining"]), Readiness(lambda: flags["ready"]))
    aio = grpc.aio.server(interceptors=[Pipeline(*layers, metrics=RpcMetrics(service))])
    servicer = Servicer()
    orchestrator_pb2_grpc.add_OrchestratorServiceServicer_to_server(servicer, aio)
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), aio)
    port = aio.add_insecure_port("127.0.0.1:0")
    await aio.start()
    yield Server(f"127.0.0.1:{port}", servicer, budget, service, flags)
    await aio.stop(0)


def count(server: Server, method: str, code: str) -> float:
    labels = {"service": server.service, "method": method, "code": code}
    return REGISTRY.get_sample_value("rlgate_grpc_requests_total", labels) or 0.0


async def call(server: Server, method: str, token: str | None) -> grpc.aio.AioRpcError | None:
    metadata = [("authorization", f"Bearer {token}")] if token is not None else []
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = orchestrator_pb2_grpc.OrchestratorServiceStub(channel)
        try:
            if method == "State":
                await stub.State(orchestrator_pb2.StateRequest(session_id="s"), metadata=metadata, timeout=5)
            else:
                await stub.Close(orchestrator_pb2.CloseRequest(session_id="s"), metadata=metadata, timeout=5)
        except grpc.aio.AioRpcError as err:
            return err
    return None


# (budget bytes, draining, ready, method, token): (code, ErrorInfo reason or a phrase of the details)
CASES = {
    "budget first": ((0, True, False, "State", None), ("RESOURCE_EXHAUSTED", "REPLY_BUDGET")),
    "no key": ((None, True, False, "State", None), ("UNAUTHENTICATED", "missing API key")),
    "wrong key": ((None, True, False, "State", "nope"), ("UNAUTHENTICATED", "invalid API key")),
    "agent token": ((None, False, True, "State", mint_agent_token("s-1")), ("UNAUTHENTICATED", "agent token")),
    "draining before readiness": ((None, True, False, "State", KEY), ("UNAVAILABLE", "SHUTTING_DOWN")),
    "draining, any method": ((None, True, True, "Close", KEY), ("UNAVAILABLE", "SHUTTING_DOWN")),
    "not ready": ((None, False, False, "State", KEY), ("UNAVAILABLE", "TASKS_NOT_LOADED")),
    "not ready, Close needs no catalog": ((None, False, False, "Close", KEY), ("OK", "")),
    "served": ((None, False, True, "State", KEY), ("OK", "")),
}


@pytest.mark.parametrize(("given", "expected"), list(CASES.values()), ids=list(CASES))
async def test_each_refusal_answers_as_before_and_is_counted(
    server: Server,
    given: tuple[int | None, bool, bool, str, str | None],
    expected: tuple[str, str],
) -> None:
    budget, draining, ready, method, token = given
    code, why = expected
    if budget is not None:
        server.budget.budget = budget
    server.flags.update(draining=draining, ready=ready)
    err = await call(server, method, token)
    if code == "OK":
        assert err is None
        assert server.servicer.runs == [method]
    else:
        assert err is not None and err.code().name == code, err
        assert server.servicer.runs == []  # refused before any work
        if why.isupper():
            assert detail(err, error_details_pb2.ErrorInfo).reason == why
            assert detail(err, error_details_pb2.RetryInfo).retry_delay.ToTimedelta().total_seconds() > 0
        else:
            assert why in (err.details() or "")
        assert token is None or token not in (err.details() or "")
    assert count(server, method, code) == 1.0


async def test_health_and_bad_bytes(server: Server) -> None:
    """Health answers with no key, at a zero budget and while draining (exempt); bytes that are not a
    request are INVALID_ARGUMENT once admitted, and counted."""
    server.budget.budget = 0
    server.flags.update(draining=True, ready=False)
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        # types-grpcio-health-checking gives HealthStub no methods.
        reply = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)  # type: ignore[attr-defined]
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        server.budget.budget = 2**20
        server.flags.update(draining=False, ready=True)
        raw: grpc.aio.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary(f"/{SERVICE_NAME}/State")
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await raw(b"\xff\xff\xff", metadata=[("authorization", f"Bearer {KEY}")], timeout=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert server.servicer.runs == []
    assert count(server, "State", "INVALID_ARGUMENT") == 1.0
    assert len(server.budget.ledger) == 0
