"""The google.rpc.Status a failed call carries, for tests that check a server's rich errors."""

from __future__ import annotations

import grpc
from google.rpc import status_pb2
from grpc_status import rpc_status


def rich_status(err: grpc.RpcError) -> status_pb2.Status | None:
    """The status in the error's trailers (None without one). grpc_status reads it from any failed call: the
    blocking channel's errors and grpc.aio's AioRpcError alike, although its stubs accept only a grpc.Call."""
    status: status_pb2.Status | None = rpc_status.from_call(err)  # type: ignore[arg-type]
    return status
