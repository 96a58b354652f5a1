"""Server reflection that resolves every symbol grpcurl asks for, methods included.

grpcio-reflection answers `file_containing_symbol` with `DescriptorPool.FindFileContainingSymbol`. The upb
pool (protobuf's default implementation) finds the file of a message, enum, enum value, extension,
field, oneof or service, but not of a service's method, so `rlgate.v1.OrchestratorService.Reset` came back
NOT_FOUND and `grpcurl describe <Service>.<Method>` failed with "Symbol not found" (health's
`grpc.health.v1.Health.Check` too). The C++ and Go reflection servers resolve methods; this servicer does as
well: a method's symbol is answered with its service's file, which defines the method.
"""

from __future__ import annotations

from collections.abc import Iterable

import grpc
from google.protobuf import descriptor_pool
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

SERVICE_NAME = reflection.SERVICE_NAME


def resolvable_symbol(pool: descriptor_pool.DescriptorPool, name: str) -> str:
    """`name` when the pool finds a file for it, else its service's name when `name` is a method of a
    service in the pool, else `name` unchanged (reflection answers NOT_FOUND)."""
    try:
        pool.FindFileContainingSymbol(name)
        return name
    except KeyError:
        pass
    service, _, method = name.rpartition(".")
    try:
        return service if method in pool.FindServiceByName(service).methods_by_name else name
    except KeyError:
        return name


class ReflectionServicer(reflection.aio.ReflectionServicer):
    """grpcio-reflection's asyncio servicer, with method symbols resolved."""

    # _file_containing_symbol and _pool are the servicer's private members, which its stubs leave out.
    def _file_containing_symbol(
        self, request: reflection_pb2.ServerReflectionRequest, fully_qualified_name: str
    ) -> reflection_pb2.ServerReflectionResponse:
        pool: descriptor_pool.DescriptorPool = self._pool  # type: ignore[attr-defined]
        symbol = resolvable_symbol(pool, fully_qualified_name)
        answer: reflection_pb2.ServerReflectionResponse = super()._file_containing_symbol(  # type: ignore[misc]
            request, symbol
        )
        return answer


def enable_server_reflection(service_names: Iterable[str], server: grpc.aio.Server) -> None:
    """Register reflection (v1alpha, what grpcurl speaks) for `service_names` plus reflection itself."""
    names = [*service_names, SERVICE_NAME]
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(ReflectionServicer(set(names)), server)
