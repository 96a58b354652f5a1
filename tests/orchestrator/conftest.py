"""Fixtures for orchestrator tests: a real localfleet (subprocess, driven through fleet-python), a real
SQLite store, the orchestrator in-process on 127.0.0.1:0, and a gRPC stub.

Each test gets its own `run_id`, so tests sharing one localfleet never see each other's instances.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from rlgate.core.convert import json_text
from rlgate.orchestrator.config import OrchestratorConfig
from rlgate.orchestrator.server import OrchestratorHandle, start_orchestrator
from rlgate.store import SessionStore
from rlgate.toolgateway.config import GatewayConfig
from rlgate.toolgateway.server import GatewayHandle, start_gateway
from rlgate.v1 import common_pb2, orchestrator_pb2_grpc, toolgateway_pb2, toolgateway_pb2_grpc
from tests.support.localfleet import LocalfleetProcess

REPO = Path(__file__).resolve().parents[2]
TASK_DIR = REPO / "services" / "localfleet" / "tasks"


def bundled_tasks() -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for path in sorted(TASK_DIR.glob("*.json")):
        data = json.loads(path.read_text())
        out.extend(data["tasks"] if isinstance(data, dict) else data)
    return out


def bundled_task(key: str) -> dict[str, Any]:
    """The bundled task `key`; a test over it fails, naming it, when it is no longer bundled (renamed or
    removed), rather than running fewer tasks."""
    tasks = {t["key"]: t for t in bundled_tasks()}
    assert key in tasks, f"task {key!r} is not among the {len(tasks)} bundled tasks in {TASK_DIR}: renamed?"
    return tasks[key]


def fast_config(localfleet: LocalfleetProcess, **overrides: Any) -> OrchestratorConfig:
    """Short timeouts and intervals so lifecycle behaviour shows within seconds."""
    base = OrchestratorConfig(
        listen="127.0.0.1:0",
        provider="fleet",
        fleet_base_url=localfleet.base_url,
        fleet_api_key="test",
        run_id=f"test-{uuid.uuid4().hex[:10]}",
        gateway_address="127.0.0.1:1",
        default_max_turns=10,
        provision_timeout_s=30.0,
        reset_timeout_s=3.0,
        verify_timeout_s=20.0,
        verify_retries=1,
        reconcile_interval_s=2.0,
        reap_interval_s=0.5,
        heartbeat_interval_s=60,
        instance_ttl_s=600,
        owner_ttl_s=3.0,
        drain_s=20.0,
        capacity_wait_s=5.0,
        provider_timeout_s=10.0,
        tools_timeout_s=15.0,
    )
    return replace(base, **overrides)


@dataclass
class Running:
    handle: OrchestratorHandle
    channel: grpc.aio.Channel
    stub: orchestrator_pb2_grpc.OrchestratorServiceStub

    @property
    def config(self) -> OrchestratorConfig:
        return self.handle.config


@pytest.fixture
async def orchestrator_factory(
    store: SessionStore,
) -> AsyncIterator[Callable[[OrchestratorConfig], Any]]:
    """Start orchestrators on the test's store; every one is stopped (drained) at teardown."""
    started: list[Running] = []

    async def start(config: OrchestratorConfig) -> Running:
        handle = await start_orchestrator(config, store)
        channel = grpc.aio.insecure_channel(handle.address)
        running = Running(handle, channel, orchestrator_pb2_grpc.OrchestratorServiceStub(channel))
        started.append(running)
        return running

    yield start
    for running in started:
        await running.channel.close()
        await running.handle.stop()


@pytest.fixture
async def orch(orchestrator_factory: Callable[[OrchestratorConfig], Any], lf: LocalfleetProcess) -> Running:
    running: Running = await orchestrator_factory(fast_config(lf))
    return running


def instances_of(lf: LocalfleetProcess, run_id: str) -> list[dict[str, Any]]:
    """Live instances localfleet holds for a run (through its control plane, as Fleet would answer)."""
    r = httpx.get(
        f"{lf.base_url}/v1/env/instances",
        params={"run_id": run_id},
        headers={"Authorization": "Bearer test"},
        timeout=10,
    )
    r.raise_for_status()
    return [i for i in r.json() if i.get("status") in ("pending", "running") and i.get("run_id") == run_id]


@pytest.fixture
async def gateway(store: SessionStore) -> AsyncIterator[GatewayHandle]:
    """The real toolgateway on the test's store (agent tokens minted by the orchestrator work there)."""
    handle = await start_gateway(GatewayConfig(listen="127.0.0.1:0"), store)
    try:
        yield handle
    finally:
        await handle.stop()


async def call_tool(address: str, token: str, name: str, arguments: dict[str, Any]) -> common_pb2.ToolResult:
    """CallTool with `arguments` as exact JSON text (integers stay integers)."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = toolgateway_pb2_grpc.ToolGatewayServiceStub(channel)
        response: toolgateway_pb2.CallToolResponse = await stub.CallTool(
            toolgateway_pb2.CallToolRequest(name=name, arguments_json=json_text(arguments)),
            metadata=[("authorization", f"Bearer {token}")],
            timeout=30,
        )
        return response.result


def result_text(result: common_pb2.ToolResult) -> str:
    return "".join(block.text.text for block in result.content if block.HasField("text"))


async def list_tools_code(gateway: GatewayHandle, token: str) -> grpc.StatusCode:
    """How ListTools answers an agent token (OK when it works)."""
    async with grpc.aio.insecure_channel(gateway.address) as channel:
        try:
            await toolgateway_pb2_grpc.ToolGatewayServiceStub(channel).ListTools(
                toolgateway_pb2.ListToolsRequest(), metadata=[("authorization", f"Bearer {token}")], timeout=30
            )
        except grpc.aio.AioRpcError as err:
            return err.code()
    return grpc.StatusCode.OK
