"""The gateway as a real process (`python -m rlgate.cli toolgateway`): crash recovery and memory per session."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import psutil
import pytest

from rlgate.store import SessionStore
from rlgate.v1 import common_pb2, toolgateway_pb2, toolgateway_pb2_grpc
from tests.support.localfleet import REPO, LocalfleetProcess
from tests.support.ports import free_port, wait_for_port
from tests.support.wait import wait_until
from tests.toolgateway.conftest import create_instance, make_session
from tests.toolgateway.test_gateway import call

Kind = common_pb2.ToolErrorKind


class GatewayProcess:
    def __init__(self, db: Path, log: Path) -> None:
        self.db, self.log_path = db, log
        self.port = free_port()
        self.metrics_port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> GatewayProcess:
        args = [
            sys.executable,
            "-m",
            "rlgate.cli",
            "toolgateway",
            "--listen",
            self.address,
            "--store-url",
            f"sqlite:///{self.db}",
            "--owner-ttl-s",
            "1.5",
            "--log-level",
            "WARNING",
            "--drain-s",
            "1",
            "--metrics-listen",
            f"127.0.0.1:{self.metrics_port}",
        ]
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                args, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(REPO), start_new_session=True
            )
        wait_for_port(self.port, timeout=60)
        return self

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)

    def stop(self) -> int | None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                return self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.kill()
        return None if self.proc is None else self.proc.returncode

    def rss(self) -> int:
        assert self.proc is not None
        return int(psutil.Process(self.proc.pid).memory_info().rss)

    async def settled_rss(self) -> int:
        """RSS once the work still running after the replies (closings, logging) has ended: two readings
        0.2 s apart within 1 MB of each other."""
        last = self.rss()

        def steady() -> int:
            nonlocal last
            previous, last = last, self.rss()
            return last if abs(last - previous) < 1_000_000 else 0

        return int(await wait_until(steady, 10, "the gateway's RSS settled", interval=0.2))


@pytest.fixture
def gateway_proc(tmp_path: Path, store: SessionStore) -> Iterator[GatewayProcess]:
    # `store` (same file) is opened first so the schema exists before two processes race to create it.
    gp = GatewayProcess(tmp_path / "store.db", tmp_path / "gateway.log")
    try:
        yield gp
    finally:
        gp.stop()


async def test_sigkilled_gateway_answers_retry_with_outcome_unknown(
    gateway_proc: GatewayProcess, store: SessionStore, lf: LocalfleetProcess, era: str
) -> None:
    lf.set_faults({"environments": {era: {"hang_tools": ["hang"]}}})
    s = await make_session(store, lf, era)
    await asyncio.to_thread(gateway_proc.start)
    async with grpc.aio.insecure_channel(gateway_proc.address) as channel:
        stub = toolgateway_pb2_grpc.ToolGatewayServiceStub(channel)
        assert (await call(stub, s, "add", {"n": 1})).result.content[0].text.text == "2 (int)"
        before = lf.counters()["by_env"][era]["tool_calls"]
        in_flight = asyncio.create_task(call(stub, s, "hang", request_id="crash-1", timeout=30))
        await wait_until(lambda: lf.counters()["by_env"][era]["tool_calls"] == before + 1, 30, "the call upstream")
        gateway_proc.kill()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await in_flight
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    await asyncio.to_thread(gateway_proc.start)  # a new process: new owner id, same store
    async with grpc.aio.insecure_channel(gateway_proc.address) as channel:
        stub = toolgateway_pb2_grpc.ToolGatewayServiceStub(channel)
        retry = await call(stub, s, "hang", request_id="crash-1", timeout=20)
        assert retry.result.is_error and retry.result.error_kind == Kind.TOOL_ERROR_KIND_OUTCOME_UNKNOWN
        again = await call(stub, s, "hang", request_id="crash-1", timeout=20)
        assert again.result.error_kind == Kind.TOOL_ERROR_KIND_OUTCOME_UNKNOWN and again.replayed  # recorded once
        assert lf.counters()["by_env"][era]["tool_calls"] == before + 1  # never a second execution
        assert (await call(stub, s, "add", {"n": 2})).result.content[0].text.text == "3 (int)"
    async with httpx.AsyncClient() as http:
        metrics = (await http.get(f"http://127.0.0.1:{gateway_proc.metrics_port}/metrics", timeout=10)).text
    assert 'rlgate_toolgateway_call_errors_total{kind="OUTCOME_UNKNOWN"} 1.0' in metrics
    assert 'rlgate_toolgateway_calls_total{endpoint="mcp",outcome="ok",tool="add"} 1.0' in metrics
    assert "rlgate_toolgateway_upstream_clients 1.0" in metrics  # {root}mcp only: the aggregator was closed
    assert 'rlgate_toolgateway_call_seconds_count{endpoint="mcp",tool="add"} 1.0' in metrics
    assert gateway_proc.stop() == 0  # SIGTERM: graceful drain, exit 0


@pytest.mark.slow
async def test_two_hundred_sessions_memory(
    gateway_proc: GatewayProcess, store: SessionStore, lf: LocalfleetProcess, era: str
) -> None:
    instances = [create_instance(lf, era) for _ in range(4)]
    sessions = [await make_session(store, lf, era, instance=instances[i % 4]) for i in range(201)]
    await asyncio.to_thread(gateway_proc.start)
    async with grpc.aio.insecure_channel(gateway_proc.address) as channel:
        stub = toolgateway_pb2_grpc.ToolGatewayServiceStub(channel)

        async def touch(i: int) -> None:
            resp = await stub.ListTools(toolgateway_pb2.ListToolsRequest(), metadata=sessions[i].metadata, timeout=60)
            assert len(resp.tools) == 7
            await call(stub, sessions[i], "add", {"n": i})  # both endpoints listed, one called

        await touch(200)  # warm: imports, first connections, gRPC buffers
        base = await gateway_proc.settled_rss()
        start = time.monotonic()
        for chunk in range(0, 200, 25):
            await asyncio.gather(*(touch(i) for i in range(chunk, chunk + 25)))
        elapsed = time.monotonic() - start
        added = await gateway_proc.settled_rss() - base
        # Both endpoints are listed, but only `{root}mcp` owns a tool_use tool: one client per session stays.
        print(
            f"\n{era}: 200 sessions (200 upstream clients) added {added / 1e6:.1f} MB RSS "
            f"({added / 200 / 1e3:.0f} KB per session), opened in {elapsed:.1f}s"
        )
        assert added <= 25e6
