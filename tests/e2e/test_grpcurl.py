"""What grpcurl asks server reflection, answered by `start_server`'s reflection in process: no grpcurl binary,
no stack, so it runs where the binary cannot (test_readme_grpcurl.py runs the real grpcurl against a stack).

grpcurl resolves `describe pkg.Service.Method` with `file_containing_symbol` on the method's full name; the
default (upb) descriptor pool finds no file for a method, so rlgate's servicer answers with the service's."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import grpc
from google.protobuf import descriptor_pb2
from google.protobuf.descriptor import ServiceDescriptor
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from rlgate.runtime.grpc_server import start_server
from rlgate.v1 import orchestrator_pb2, orchestrator_pb2_grpc, toolgateway_pb2, toolgateway_pb2_grpc

if TYPE_CHECKING:
    from google._upb._message import ServiceDescriptor as UpbServiceDescriptor

# health's stubs type its descriptors as protobuf's C (upb) ones, rlgate's generated .pyi as the Python ones.
SERVICES: list[ServiceDescriptor | UpbServiceDescriptor] = [
    orchestrator_pb2.DESCRIPTOR.services_by_name["OrchestratorService"],
    toolgateway_pb2.DESCRIPTOR.services_by_name["ToolGatewayService"],
    health_pb2.DESCRIPTOR.services_by_name["Health"],
]


def _register(server: grpc.aio.Server) -> list[str]:
    orchestrator_pb2_grpc.add_OrchestratorServiceServicer_to_server(
        orchestrator_pb2_grpc.OrchestratorServiceServicer(), server
    )
    toolgateway_pb2_grpc.add_ToolGatewayServiceServicer_to_server(
        toolgateway_pb2_grpc.ToolGatewayServiceServicer(), server
    )
    return [s.full_name for s in SERVICES[:2]]


async def _ask(
    address: str, requests: list[reflection_pb2.ServerReflectionRequest]
) -> list[reflection_pb2.ServerReflectionResponse]:
    async def stream() -> AsyncIterator[reflection_pb2.ServerReflectionRequest]:
        for request in requests:
            yield request

    async with grpc.aio.insecure_channel(address) as channel:
        # types-grpcio-reflection: the stub takes a blocking channel only, its method is binascii.Incomplete.
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)  # type: ignore[arg-type]
        return [reply async for reply in stub.ServerReflectionInfo(stream(), timeout=10)]  # type: ignore[operator]


def _files(reply: reflection_pb2.ServerReflectionResponse) -> dict[str, descriptor_pb2.FileDescriptorProto]:
    protos = [
        descriptor_pb2.FileDescriptorProto.FromString(raw)
        for raw in reply.file_descriptor_response.file_descriptor_proto
    ]
    return {p.name: p for p in protos}


async def test_every_method_resolves_to_its_services_file() -> None:
    running = await start_server("127.0.0.1:0", _register)
    try:
        symbols = [(m.full_name, s) for s in SERVICES for m in s.methods]
        replies = await _ask(
            running.address,
            [reflection_pb2.ServerReflectionRequest(file_containing_symbol=name) for name, _ in symbols],
        )
        for (name, service), reply in zip(symbols, replies, strict=True):
            assert reply.WhichOneof("message_response") == "file_descriptor_response", name
            files = _files(reply)
            defined = files[service.file.name]  # the service's file, with its dependencies alongside
            assert service.name in [s.name for s in defined.service], name
            assert set(files) >= {d.name for d in service.file.dependencies}, name
    finally:
        await running.shutdown(grace=0)


async def test_unknown_symbols_are_not_found_and_services_listed() -> None:
    running = await start_server("127.0.0.1:0", _register)
    try:
        unknown = ["rlgate.v1.OrchestratorService.Nope", "rlgate.v1.Nope.Reset", "Reset", ""]
        replies = await _ask(
            running.address,
            [
                *(reflection_pb2.ServerReflectionRequest(file_containing_symbol=name) for name in unknown),
                reflection_pb2.ServerReflectionRequest(list_services=""),
            ],
        )
        for name, reply in zip(unknown, replies, strict=False):
            assert reply.error_response.error_code == grpc.StatusCode.NOT_FOUND.value[0], name
        listed = sorted(s.name for s in replies[-1].list_services_response.service)
        assert listed == sorted([*(s.full_name for s in SERVICES), "grpc.reflection.v1alpha.ServerReflection"])
    finally:
        await running.shutdown(grace=0)
