"""The health-check entry point against real servers: a grpc.aio server with grpc.health.v1 (the runtime's
own bootstrap) and a plain HTTP server standing in for localfleet's GET /health."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from threading import Thread

import pytest

from rlgate.devtools import healthcheck
from rlgate.runtime.grpc_server import RunningServer, start_server
from tests.support.ports import free_port


@pytest.fixture
async def grpc_server() -> AsyncIterator[RunningServer]:
    running = await start_server("127.0.0.1:0", lambda _server: ["rlgate.v1.Probe"])
    try:
        yield running
    finally:
        await running.server.stop(None)


class _Health(BaseHTTPRequestHandler):
    status = 200

    def do_GET(self) -> None:
        self.send_response(self.status if self.path == "/health" else 404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:  # quiet test output
        pass


@pytest.fixture
def http_server() -> Iterator[ThreadingHTTPServer]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    thread = Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


async def check(*args: str) -> int:
    return await asyncio.to_thread(healthcheck.main, [*args, "--quiet", "--timeout", "5"])


async def test_grpc_serving_not_serving_and_unknown_service(grpc_server: RunningServer) -> None:
    target = f"127.0.0.1:{grpc_server.port}"
    assert await check(target) == healthcheck.EXIT_SERVING
    assert await check(target, "--service", "rlgate.v1.Probe") == healthcheck.EXIT_SERVING
    assert await check(target, "--service", "no.such.Service") == healthcheck.EXIT_NOT_SERVING
    await grpc_server.set_serving(False)  # what shutdown does first
    assert await check(target) == healthcheck.EXIT_NOT_SERVING


async def test_unreachable_target_fails_within_the_timeout() -> None:
    port = free_port()  # nothing listens there
    loop = asyncio.get_running_loop()
    started = loop.time()
    code = await asyncio.to_thread(healthcheck.main, [f"127.0.0.1:{port}", "-q", "--timeout", "2"])
    assert code == healthcheck.EXIT_UNREACHABLE
    assert loop.time() - started < 30  # generous: a shared, slow machine


async def test_http_health(http_server: ThreadingHTTPServer) -> None:
    url = f"http://127.0.0.1:{http_server.server_address[1]}/health"
    assert await check(url) == healthcheck.EXIT_SERVING
    _Health.status = 503
    try:
        assert await check(url) == healthcheck.EXIT_NOT_SERVING
    finally:
        _Health.status = 200
    assert await check(f"http://127.0.0.1:{free_port()}/health") == healthcheck.EXIT_UNREACHABLE


async def test_cli_subcommand_exit_status(grpc_server: RunningServer) -> None:
    """`rlgate healthcheck` (the image's HEALTHCHECK) as a real process."""
    for target, expected in [(f"127.0.0.1:{grpc_server.port}", 0), (f"127.0.0.1:{free_port()}", 2)]:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "rlgate.cli",
            "healthcheck",
            target,
            "--timeout",
            "5",
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(proc.communicate(), 120)
        assert proc.returncode == expected, (out, err)
        assert target.encode() in out + err


def test_target_derived_from_the_container_command() -> None:
    env = {"RLGATE_TOOLGATEWAY_LISTEN": "0.0.0.0:6000", "RLGATE_LOCALFLEET_LISTEN": "0.0.0.0:7000"}
    argv = ["/opt/rlgate/bin/python", "/opt/rlgate/bin/rlgate"]
    assert healthcheck.target_for_command([*argv, "orchestrator"], {}) == "127.0.0.1:50051"
    assert healthcheck.target_for_command([*argv, "toolgateway"], env) == "127.0.0.1:6000"
    assert healthcheck.target_for_command([*argv, "localfleet"], env) == "http://127.0.0.1:7000/health"
    flagged = [*argv, "toolgateway", "--listen", "[::]:6100"]
    assert healthcheck.target_for_command(flagged, env) == "127.0.0.1:6100"
    assert healthcheck.target_for_command([*argv, "orchestrator", "--listen=127.0.0.9:1"], {}) == "127.0.0.9:1"
    with pytest.raises(ValueError):
        healthcheck.target_for_command([*argv, "--help"], env)


def test_bad_timeout_is_a_failure_not_a_traceback() -> None:
    assert healthcheck.main(["127.0.0.1:1", "-q", "--timeout", "0"]) == healthcheck.EXIT_UNREACHABLE


async def test_target_from_the_environment(grpc_server: RunningServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(healthcheck.TARGET_ENV, f"127.0.0.1:{grpc_server.port}")
    assert await asyncio.to_thread(healthcheck.main, ["-q"]) == healthcheck.EXIT_SERVING
