"""Connection-level exhaustion: idle TCP floods and half-open handshakes do not make a server unreachable.

A server holds at most `max_connections()` client connections (its open-file limit minus a headroom), drops
a connection that has not finished the HTTP/2 handshake within the handshake timeout, and keeps health
answering through it all.
"""

from __future__ import annotations

import asyncio
import resource
import socket
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rlgate.runtime.grpc_server import FD_HEADROOM, max_connections, start_server
from tests.reliability.conftest import FULL

IDLE_CONNECTIONS = 6000 if FULL else 1500


async def _health(address: str) -> int:
    async with grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)]) as channel:
        # types-grpcio-health-checking gives HealthStub no methods.
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5.0)  # type: ignore[attr-defined]
        return int(reply.status)


def _open_idle(port: int, count: int) -> list[socket.socket]:
    socks = []
    for _ in range(count):
        sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        socks.append(sock)
    return socks


def _closed_by_peer(sock: socket.socket) -> bool:
    sock.settimeout(0.05)
    try:
        return sock.recv(1) == b""
    except (TimeoutError, BlockingIOError):
        return False
    except OSError:
        return True


def _all_closed_within(socks: list[socket.socket], seconds: float) -> bool:
    """Polls with a bound (blocking reads with a short timeout, off the event loop)."""
    open_socks = list(socks)
    deadline = time.monotonic() + seconds
    while open_socks and time.monotonic() < deadline:
        open_socks = [s for s in open_socks if not _closed_by_peer(s)]
    return not open_socks


def test_max_connections_leaves_headroom_below_the_fd_limit() -> None:
    allowed = max_connections()
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert allowed == max(64, soft - FD_HEADROOM)


async def test_health_answers_while_thousands_of_idle_connections_are_open() -> None:
    running = await start_server("127.0.0.1:0", lambda server: [])
    socks: list[socket.socket] = []
    try:
        socks = await asyncio.to_thread(_open_idle, running.port, IDLE_CONNECTIONS)
        started = time.monotonic()
        assert await _health(running.address) == health_pb2.HealthCheckResponse.SERVING
        assert time.monotonic() - started < 5.0
    finally:
        for sock in socks:
            sock.close()
        await running.server.stop(None)


async def test_connections_that_never_handshake_are_dropped_and_their_slots_freed() -> None:
    # A cap of 40 connections and a 1 s handshake timeout: 40 silent sockets fill every slot, the server
    # drops them at the timeout, and a real client gets through afterwards.
    running = await start_server(
        "127.0.0.1:0",
        lambda server: [],
        options=[("grpc.max_allowed_incoming_connections", 40), ("grpc.server_handshake_timeout_ms", 1000)],
    )
    socks: list[socket.socket] = []
    try:
        socks = await asyncio.to_thread(_open_idle, running.port, 40)
        assert await asyncio.to_thread(_all_closed_within, socks, 15.0), "silent connections outlived the timeout"
        assert await _health(running.address) == health_pb2.HealthCheckResponse.SERVING
    finally:
        for sock in socks:
            sock.close()
        await running.server.stop(None)


@pytest.mark.parametrize("limit", [8])
async def test_calls_past_the_stream_limit_queue_instead_of_failing(limit: int) -> None:
    running = await start_server("127.0.0.1:0", lambda server: [], options=[("grpc.max_concurrent_streams", limit)])
    try:
        async with grpc.aio.insecure_channel(running.address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            replies = await asyncio.gather(
                # types-grpcio-health-checking gives HealthStub no methods.
                *(stub.Check(health_pb2.HealthCheckRequest(), timeout=10) for _ in range(limit * 8))  # type: ignore[attr-defined]
            )
        assert all(r.status == health_pb2.HealthCheckResponse.SERVING for r in replies)
    finally:
        await running.server.stop(None)
