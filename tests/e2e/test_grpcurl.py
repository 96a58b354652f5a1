"""Plays grpcurl: knowing only an address, discover services by reflection, fetch their file descriptors,
build requests from JSON and call RPCs on both servers — no proto files, no generated code."""

from __future__ import annotations

import json
from typing import Any

import grpc
import pytest
from google.protobuf import descriptor_pool, json_format, message_factory
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from rlgate.runtime.stack import LocalStack


class ReflectionClient:
    """A tiny grpcurl: `list`, `describe` and JSON calls through server reflection."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.insecure_channel(address)
        self.db = ProtoReflectionDescriptorDatabase(self.channel)
        self.pool = descriptor_pool.DescriptorPool(self.db)

    def services(self) -> list[str]:
        return sorted(self.db.get_services())

    def methods(self, service: str) -> list[str]:
        return [m.name for m in self.pool.FindServiceByName(service).methods]

    def call(self, method: str, body: dict[str, Any], metadata: list[tuple[str, str]] | None = None) -> dict[str, Any]:
        service_name, _, method_name = method.rpartition("/")
        descriptor = self.pool.FindServiceByName(service_name).methods_by_name[method_name]
        request_cls = message_factory.GetMessageClass(descriptor.input_type)
        response_cls = message_factory.GetMessageClass(descriptor.output_type)
        request = json_format.Parse(json.dumps(body), request_cls())
        rpc = self.channel.unary_unary(
            f"/{service_name}/{method_name}",
            request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=response_cls.FromString,
        )
        reply = rpc(request, timeout=60, metadata=metadata or [])
        return json_format.MessageToDict(reply)

    def close(self) -> None:
        self.channel.close()


@pytest.fixture
def orchestrator(stack: LocalStack):  # type: ignore[no-untyped-def]
    client = ReflectionClient(stack.orchestrator_address)
    yield client
    client.close()


@pytest.fixture
def gateway(stack: LocalStack):  # type: ignore[no-untyped-def]
    client = ReflectionClient(stack.gateway_address)
    yield client
    client.close()


def test_list_services_by_reflection(orchestrator: ReflectionClient, gateway: ReflectionClient) -> None:
    assert "rlgate.v1.OrchestratorService" in orchestrator.services()
    assert "grpc.health.v1.Health" in orchestrator.services()
    assert "rlgate.v1.ToolGatewayService" in gateway.services()
    assert "rlgate.v1.OrchestratorService" not in gateway.services()
    own = [s for s in gateway.services() if s.startswith("rlgate.")]
    assert own == ["rlgate.v1.ToolGatewayService"]
    assert sorted(gateway.methods("rlgate.v1.ToolGatewayService")) == ["CallTool", "CallToolStream", "ListTools"]


def test_json_calls_on_both_servers(orchestrator: ReflectionClient, gateway: ReflectionClient) -> None:
    tasks = orchestrator.call("rlgate.v1.OrchestratorService/ListTasks", {"pageSize": 5})
    assert len(tasks["tasks"]) == 5 and tasks["nextPageToken"]
    task_key = tasks["tasks"][0]["key"]
    reset = orchestrator.call("rlgate.v1.OrchestratorService/Reset", {"taskKey": task_key, "requestId": "grpcurl-1"})
    try:
        token = reset["agentToken"]
        listed = gateway.call("rlgate.v1.ToolGatewayService/ListTools", {},
                              metadata=[("authorization", f"Bearer {token}")])
        assert {t["name"] for t in listed["tools"]} == {t["name"] for t in reset["tools"]}
        with pytest.raises(grpc.RpcError) as denied:
            gateway.call("rlgate.v1.ToolGatewayService/ListTools", {})
        assert denied.value.code() == grpc.StatusCode.UNAUTHENTICATED
        health = orchestrator.call("grpc.health.v1.Health/Check", {})
        assert health["status"] == "SERVING"
    finally:
        orchestrator.call("rlgate.v1.OrchestratorService/Close", {"sessionId": reset["sessionId"]})
