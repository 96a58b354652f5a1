"""rlgate's own servers for the compliance suite: localfleet as a process, and an orchestrator and a
toolgateway in this process on 127.0.0.1:0, on one SQLite store, served from an event loop in a background
thread so the compliance classes can drive them with plain synchronous gRPC channels."""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from rlgate.orchestrator.config import OrchestratorConfig
from rlgate.orchestrator.server import OrchestratorHandle, start_orchestrator
from rlgate.store import SessionStore
from rlgate.store.sqlite import SqliteStore
from rlgate.toolgateway.config import GatewayConfig
from rlgate.toolgateway.server import GatewayHandle, start_gateway
from tests.support.localfleet import LocalfleetProcess

T = TypeVar("T")
START_TIMEOUT_S = 120.0


class LoopThread:
    """An event loop running in a daemon thread; `run` waits for a coroutine scheduled on it."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="compliance-servers", daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = START_TIMEOUT_S) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        if not self._thread.is_alive():
            self.loop.close()


@dataclass
class Servers:
    store: SessionStore
    gateway: GatewayHandle
    orchestrator: OrchestratorHandle

    @property
    def orchestrator_address(self) -> str:
        return self.orchestrator.address

    @property
    def gateway_address(self) -> str:
        return self.gateway.address

    async def stop(self) -> None:
        await self.orchestrator.stop()  # first: it closes its sessions while the instances' fleet is up
        await self.gateway.stop(grace=0)
        await self.store.close()


async def start_servers(localfleet: LocalfleetProcess, data_dir: Path, **orchestrator: Any) -> Servers:
    """Gateway, then the orchestrator that hands out the gateway's address; `orchestrator` overrides its
    config (api_keys, session_ttl_s, ...). Returns once the task catalog is loaded."""
    store = await SqliteStore.open(str(data_dir / "store.db"))
    gateway = await start_gateway(
        GatewayConfig(listen="127.0.0.1:0", call_timeout_s=30.0, upstream_timeout_s=15.0, drain_s=1.0), store
    )
    config = OrchestratorConfig(
        listen="127.0.0.1:0",
        provider="fleet",
        fleet_base_url=localfleet.base_url,
        fleet_api_key="test",
        run_id=f"compliance-{uuid.uuid4().hex[:10]}",  # this stack's instances only
        gateway_address=gateway.address,
        provision_timeout_s=30.0,
        verify_timeout_s=20.0,
        verify_retries=1,
        reap_interval_s=0.5,
        drain_s=10.0,
        capacity_wait_s=5.0,
        provider_timeout_s=10.0,
        tools_timeout_s=15.0,
        **orchestrator,
    )
    try:
        handle = await start_orchestrator(config, store)
    except BaseException:
        await gateway.stop(grace=0)
        await store.close()
        raise
    servers = Servers(store, gateway, handle)
    try:
        await asyncio.wait_for(handle.orchestrator.wait_tasks_loaded(), START_TIMEOUT_S)
    except BaseException:
        await servers.stop()
        raise
    return servers
