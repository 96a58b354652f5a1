"""Running the toolgateway: `start_gateway` (in-process, tests) and `run` (the `rlgate toolgateway` CLI)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field

import grpc

from rlgate.mcpclient.pool import PoolSettings, UpstreamPool
from rlgate.mcpclient.transport import HttpSettings
from rlgate.runtime import eventloop, tracing
from rlgate.runtime.config import redacted
from rlgate.runtime.grpc_server import RunningServer, serve_until_signal, start_server, watch_dependency
from rlgate.runtime.identity import process_identity
from rlgate.runtime.interceptors import Pipeline, ReplyBudget, RpcMetrics
from rlgate.runtime.logs import setup_logging
from rlgate.runtime.metrics import serve_metrics
from rlgate.runtime.settings import default_store_url
from rlgate.store import SessionStore, StoreError, open_store
from rlgate.toolgateway.config import GatewayConfig
from rlgate.toolgateway.service import GatewaySettings, ToolGateway
from rlgate.toolgateway.servicer import ToolGatewayServicer
from rlgate.v1 import orchestrator_pb2, toolgateway_pb2, toolgateway_pb2_grpc

log = logging.getLogger(__name__)
SERVICE_NAME = toolgateway_pb2.DESCRIPTOR.services_by_name["ToolGatewayService"].full_name
ORCHESTRATOR_SERVICE_NAME = orchestrator_pb2.DESCRIPTOR.services_by_name["OrchestratorService"].full_name


@dataclass
class GatewayHandle:
    """A running gateway: the gRPC server, its logic objects and the background tasks it owns."""

    server: RunningServer
    gateway: ToolGateway
    pool: UpstreamPool
    store: SessionStore
    config: GatewayConfig
    owns_store: bool
    metrics_port: int | None = None
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)
    _stopped: bool = False

    @property
    def port(self) -> int:
        return self.server.port

    @property
    def address(self) -> str:
        return self.server.address

    async def drain(self) -> None:
        await self.gateway.drain(self.config.drain_s)

    async def stop(self, grace: float | None = None) -> None:
        """Stop serving (in-flight RPCs get `grace` seconds), close upstream clients, cancel tasks."""
        if self._stopped:
            return
        self._stopped = True
        await self.server.shutdown(self.config.drain_s if grace is None else grace)
        await self.gateway.drain(2.0)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.pool.close()
        if self.owns_store:
            await self.store.close()


async def _heartbeat(store: SessionStore, owner: str, ttl_s: float) -> None:
    while True:
        try:
            await store.heartbeat_owner(owner, ttl_s)
        except StoreError:
            log.warning("owner heartbeat failed", exc_info=True)
        await asyncio.sleep(max(ttl_s / 3, 0.2))


async def start_gateway(config: GatewayConfig, store: SessionStore | None = None) -> GatewayHandle:
    """Start a gateway in this event loop (port 0 in `config.listen` picks a free port)."""
    owns_store = store is None
    if store is None:
        store = await open_store(config.store_url or default_store_url(config.data_dir))
    owner = process_identity("toolgateway")
    await store.heartbeat_owner(owner, config.owner_ttl_s)  # alive before the first claim
    pool = UpstreamPool(
        PoolSettings(
            upstream_timeout_s=config.upstream_timeout_s,
            client_idle_s=config.client_idle_s,
            tools_refresh_s=config.tools_refresh_s,
            janitor_interval_s=config.janitor_interval_s,
            common_link_sessions=config.upstream_common_sessions,
            http=HttpSettings.create(
                connect_timeout=config.connect_timeout_s,
                max_connections=config.upstream_max_connections,
                keepalive_s=config.upstream_keepalive_s,
                max_reply_bytes=config.upstream_max_reply_bytes,
            ),
        )
    )
    gateway = ToolGateway(
        store,
        pool,
        owner,
        GatewaySettings(
            call_timeout_s=config.call_timeout_s,
            upstream_timeout_s=config.upstream_timeout_s,
            max_output_bytes=config.max_output_bytes,
            max_arguments_bytes=config.max_arguments_bytes,
        ),
    )

    pool.start_janitor(store.sessions_open)

    def register(server: grpc.aio.Server) -> list[str]:
        toolgateway_pb2_grpc.add_ToolGatewayServiceServicer_to_server(ToolGatewayServicer(gateway), server)
        return [SERVICE_NAME]

    try:
        running = await start_server(
            config.listen,
            register,
            interceptors=[Pipeline(ReplyBudget(), metrics=RpcMetrics("toolgateway"))],
            tls_cert=config.tls_cert,
            tls_key=config.tls_key,
            plane="the toolgateway",
            elsewhere={
                ORCHESTRATOR_SERVICE_NAME: "the orchestrator"
                + (f" ({config.orchestrator_address})" if config.orchestrator_address else "")
            },
        )
    except BaseException:
        await pool.close()
        if owns_store:
            await store.close()
        raise
    handle = GatewayHandle(
        server=running, gateway=gateway, pool=pool, store=store, config=config, owns_store=owns_store
    )
    loop = asyncio.get_running_loop()
    handle._tasks.append(loop.create_task(_heartbeat(store, owner, config.owner_ttl_s), name="owner-heartbeat"))
    handle._tasks.append(
        loop.create_task(watch_dependency(running, "session store", store.health), name="store-health")
    )
    log.info("toolgateway owner %s on %s", owner, running.address)
    return handle


async def _main(config: GatewayConfig) -> None:
    handle = await start_gateway(config)
    handle.metrics_port = serve_metrics(config.metrics_listen)
    try:
        await serve_until_signal(handle.server, grace=config.drain_s, drain=handle.drain)
    finally:
        await handle.stop(grace=0)


def run(config: GatewayConfig) -> None:
    """The `rlgate toolgateway` command: serve until SIGTERM/SIGINT, then drain."""
    setup_logging(config.log_level, config.log_json, service="toolgateway")
    tracing.setup("rlgate-toolgateway", config.otlp_endpoint)
    log.info("toolgateway config: %s", redacted(config))
    try:
        with contextlib.suppress(KeyboardInterrupt):
            eventloop.run(_main(config))
    except StoreError as exc:  # e.g. a corrupt store refused at open: one line, no traceback
        raise SystemExit(f"rlgate toolgateway: {exc}") from None
