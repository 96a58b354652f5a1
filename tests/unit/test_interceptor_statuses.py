"""The status a caller saw is what the interceptors count and log: a handler whose deadline passed or whose
caller left is DEADLINE_EXCEEDED / CANCELLED (never INTERNAL, never a traceback), however it ends: cancelled
at the deadline, answering after it (an abort that cannot be sent, a late return, an exception), or cut off
by the caller. A bug while the RPC is live stays INTERNAL with its traceback.

A real grpc.aio server on loopback with a `Pipeline` counting in `RpcMetrics` around one raw-bytes
method whose request names what the handler does."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from prometheus_client import REGISTRY

from rlgate.runtime.interceptors import Pipeline, RpcMetrics

DEADLINE_S = 0.3
LATE_S = 0.6  # past the deadline


class Handler:
    """The method's behaviour by request; `started` and `finished` let a test wait for the server's side."""

    def __init__(self) -> None:
        self.started = asyncio.Event()
        self.finished = asyncio.Event()
        self.blocking = threading.Event()  # set: a blocked handler goes on

    async def __call__(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        self.started.set()
        try:
            return await self._run(request.decode(), context)
        finally:
            self.finished.set()

    async def _run(self, kind: str, context: grpc.aio.ServicerContext) -> bytes:
        if kind == "wait":  # cancelled by grpc at the deadline, or when the caller leaves
            await asyncio.sleep(30)
        elif kind == "shielded-abort":  # the deadline passes in a section that must finish, then it answers
            await asyncio.shield(asyncio.sleep(LATE_S))
            await context.abort(grpc.StatusCode.UNAVAILABLE, "too late")
        elif kind.startswith("blocked"):  # the loop is busy past the deadline (a burst), then it answers
            self.blocking.wait(LATE_S)
            if kind == "blocked-abort":
                await context.abort(grpc.StatusCode.UNAVAILABLE, "too late")
            if kind == "blocked-raise":
                raise TimeoutError("a store call timed out")
        elif kind == "bug":
            raise ValueError("a bug")
        return b"ok"


def counts(service: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for family in REGISTRY.collect():
        if family.name == "rlgate_grpc_requests":
            for sample in family.samples:
                if sample.name.endswith("_total") and sample.labels.get("service") == service:
                    out[sample.labels["code"]] = sample.value
    return out


class Server:
    def __init__(self, handler: Handler, service: str, address: str, server: grpc.aio.Server) -> None:
        self.handler = handler
        self.service = service
        self.address = address
        self.server = server


@pytest.fixture
async def server() -> AsyncIterator[Server]:
    service = f"statuses-{uuid.uuid4().hex[:8]}"  # metrics of this test only
    handler = Handler()
    aio = grpc.aio.server(interceptors=[Pipeline(metrics=RpcMetrics(service))])
    method: grpc.RpcMethodHandler[bytes, bytes] = grpc.unary_unary_rpc_method_handler(handler)
    aio.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("t.S", {"M": method})])
    port = aio.add_insecure_port("127.0.0.1:0")
    await aio.start()
    yield Server(handler, service, f"127.0.0.1:{port}", aio)
    handler.blocking.set()
    await aio.stop(0)


def raw_method(channel: grpc.aio.Channel) -> grpc.aio.UnaryUnaryMultiCallable[bytes, bytes]:
    """The test method, bytes both ways (no serializers)."""
    return channel.unary_unary("/t.S/M")


async def call(server: Server, kind: str, timeout: float | None = DEADLINE_S) -> grpc.StatusCode:  # noqa: ASYNC109
    async with grpc.aio.insecure_channel(server.address) as channel:
        try:
            await raw_method(channel)(kind.encode(), timeout=timeout)
        except grpc.aio.AioRpcError as err:
            return err.code()
    return grpc.StatusCode.OK


async def settled(server: Server, code: str) -> dict[str, float]:
    """The counts once the handler counted `code` (the server's side ends after the caller's)."""
    await asyncio.wait_for(server.handler.finished.wait(), 10)
    for _ in range(500):  # bounded: the interceptor counts right after the handler returns
        found = counts(server.service)
        if found.get(code):
            return found
        await asyncio.sleep(0.01)
    return counts(server.service)


def problems(caplog: pytest.LogCaptureFixture) -> list[str]:
    """Log records at ERROR or with a traceback: what a deadline race must not leave."""
    return [f"{r.name}: {r.getMessage()}" for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]


@pytest.mark.parametrize("kind", ["wait", "shielded-abort", "blocked-abort", "blocked-return", "blocked-raise"])
async def test_a_handler_past_its_deadline_counts_deadline_exceeded(
    server: Server, caplog: pytest.LogCaptureFixture, kind: str
) -> None:
    with caplog.at_level(logging.DEBUG):
        assert await call(server, kind) == grpc.StatusCode.DEADLINE_EXCEEDED
        found = await settled(server, "DEADLINE_EXCEEDED")
    assert found == {"DEADLINE_EXCEEDED": 1.0}, found
    assert problems(caplog) == []


async def test_a_handler_whose_caller_left_counts_cancelled(server: Server, caplog: pytest.LogCaptureFixture) -> None:
    async with grpc.aio.insecure_channel(server.address) as channel:
        with caplog.at_level(logging.DEBUG):
            pending: Any = raw_method(channel)(b"wait")
            await asyncio.wait_for(server.handler.started.wait(), 10)
            pending.cancel()
            found = await settled(server, "CANCELLED")
    assert found == {"CANCELLED": 1.0}, found
    assert problems(caplog) == []


async def test_a_bug_while_the_rpc_is_live_is_internal_with_its_traceback(
    server: Server, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO):
        started = time.monotonic()
        assert await call(server, "bug", timeout=10) == grpc.StatusCode.INTERNAL
        found = await settled(server, "INTERNAL")
    assert found == {"INTERNAL": 1.0} and time.monotonic() - started < 5
    tracebacks = [r for r in caplog.records if r.exc_info]
    assert len(tracebacks) == 1 and "unhandled error in /t.S/M" in tracebacks[0].getMessage()
