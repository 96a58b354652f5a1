"""The google.rpc.Status a failed call carries, for tests that check a server's rich errors."""

from __future__ import annotations

from typing import TypeVar

import grpc
from google.protobuf.message import Message
from google.rpc import status_pb2
from grpc_status import rpc_status

M = TypeVar("M", bound=Message)


def rich_status(err: grpc.RpcError) -> status_pb2.Status | None:
    """The status in the error's trailers (None without one). grpc_status reads it from any failed call: the
    blocking channel's errors and grpc.aio's AioRpcError alike, although its stubs accept only a grpc.Call."""
    status: status_pb2.Status | None = rpc_status.from_call(err)  # type: ignore[arg-type]
    return status


def detail(err: grpc.RpcError, kind: type[M]) -> M:
    """The first detail of that type (ErrorInfo, RetryInfo, BadRequest...) in the error's status."""
    status = rich_status(err)
    for item in status.details if status is not None else ():
        found = kind()
        if item.Unpack(found):  # False for a detail of another type
            return found
    raise AssertionError(f"no {kind.__name__} in {err}")
