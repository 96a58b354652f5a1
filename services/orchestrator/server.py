"""Starting the orchestrator: `start_orchestrator` (in-process, tests and embedding) and `run` (the CLI).

Auth: API keys (`authorization: Bearer`) when configured; refusing a non-loopback listen address without
keys unless `--insecure`. Optional TLS. Readiness: until the task catalog has loaded (the provider may start
after rlgate; the load is retried in the background) health is NOT_SERVING and every task-dependent RPC
answers UNAVAILABLE. SIGTERM drains, within `--drain-s`: at once health NOT_SERVING and every new RPC
answered UNAVAILABLE (reason SHUTTING_DOWN, RetryInfo: clients go to another replica); the RPCs already in
flight finish (an ending Step's scoring included), every open session of this run is closed (or handed
back), warm pools are emptied; then background loops are cancelled and whatever is still unfinished is
handed back (this process declared dead in the store, so its request records are taken over at once).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from rlgate.core.errors import Unavailable
from rlgate.orchestrator.config import OrchestratorConfig
from rlgate.orchestrator.service import Orchestrator
from rlgate.orchestrator.servicer import OrchestratorServicer
from rlgate.runtime import eventloop, tracing
from rlgate.runtime.config import is_loopback, redacted, split_host_port
from rlgate.runtime.grpc_server import RunningServer, serve_until_signal, start_server, watch_dependency
from rlgate.runtime.interceptors import (
    ApiKeys,
    Guard,
    Layer,
    Metadata,
    Pipeline,
    ReplyBudget,
    RpcMetrics,
)
from rlgate.runtime.logs import setup_logging
from rlgate.runtime.metrics import serve_metrics
from rlgate.store import SessionStore, StoreError
from rlgate.v1 import orchestrator_pb2, orchestrator_pb2_grpc, toolgateway_pb2

log = logging.getLogger(__name__)

SERVICE_NAME = orchestrator_pb2.DESCRIPTOR.services_by_name["OrchestratorService"].full_name
GATEWAY_SERVICE_NAME = toolgateway_pb2.DESCRIPTOR.services_by_name["ToolGatewayService"].full_name
# RPCs that need the task catalog (task lookups, verification, task info in answers). Close and
# CloseSessions do not: releasing instances must work whatever state the catalog is in.
TASK_DEPENDENT = frozenset(f"/{SERVICE_NAME}/{m}" for m in ("Reset", "Step", "State", "ListTasks", "ListSessions"))


class InsecureListenError(ValueError):
    """A non-loopback listen address without API keys and without --insecure."""


def check_listen(config: OrchestratorConfig) -> None:
    host, _ = split_host_port(config.listen)
    if not is_loopback(host) and not config.api_keys and not config.insecure:
        raise InsecureListenError(
            f"refusing to listen on {config.listen} without API keys; set --api-keys or pass --insecure"
        )


# What a drained replica answers: new RPCs, and those still running when the drain cuts them.
SHUTTING_DOWN = Unavailable(
    "the orchestrator is shutting down; retry on another replica", reason="SHUTTING_DOWN", retry_after_s=0.2
).to_grpc_status()


class Readiness(Layer):
    """Task-dependent RPCs answer UNAVAILABLE (reason TASKS_NOT_LOADED, RetryInfo) until `ready()`."""

    def __init__(self, ready: Callable[[], bool]) -> None:
        self._ready = ready
        self._refusal = Unavailable(
            "tasks not loaded yet; retry", reason="TASKS_NOT_LOADED", retry_after_s=2.0
        ).to_grpc_status()

    def guard(self, method: str) -> Guard | None:
        return self._check if method in TASK_DEPENDENT else None

    def _check(self, _context: grpc.aio.ServicerContext, _metadata: Metadata) -> grpc.Status | None:
        return None if self._ready() else self._refusal


class Drain(Layer):
    """Tracks the RPCs in flight. Once `draining()`, every new RPC is answered UNAVAILABLE (reason
    SHUTTING_DOWN, RetryInfo) so its client retries on another replica; `idle()` waits for the ones admitted
    before, and `cut()` answers those still running the same way (their work is cancelled: a Reset releases
    what it made, an ending Step's record stays PENDING for another replica to take over). The
    orchestrator's methods only: health and reflection answer throughout."""

    def __init__(self, draining: Callable[[], bool]) -> None:
        self._draining = draining
        self._calls: set[asyncio.Task[Any]] = set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._cut = False

    async def idle(self) -> None:
        await self._idle.wait()

    def cut(self) -> int:
        """Answer every RPC still in flight UNAVAILABLE (SHUTTING_DOWN); returns how many there were."""
        self._cut = True
        for task in self._calls:
            task.cancel()
        return len(self._calls)

    def guard(self, method: str) -> Guard | None:
        return self._check if method.startswith(f"/{SERVICE_NAME}/") else None

    def _check(self, _context: grpc.aio.ServicerContext, _metadata: Metadata) -> grpc.Status | None:
        return SHUTTING_DOWN if self._draining() else None

    def tracks(self, method: str) -> bool:
        return method.startswith(f"/{SERVICE_NAME}/")

    def start(self, context: grpc.aio.ServicerContext) -> asyncio.Task[Any]:
        task = asyncio.current_task()
        assert task is not None
        self._calls.add(task)
        self._idle.clear()
        return task

    def cancelled(self, token: asyncio.Task[Any]) -> grpc.Status | None:
        if not self._cut:
            return None  # the caller went away, or the server is stopping
        token.uncancel()  # cut by the drain: answered, not cancelled
        return SHUTTING_DOWN

    def finished(self, token: asyncio.Task[Any]) -> None:
        self._calls.discard(token)
        if not self._calls:
            self._idle.set()


async def _serve_when_ready(orchestrator: Orchestrator, server: RunningServer) -> None:
    """Health SERVING once the catalog has loaded (owned by the handle, cancelled on drain and stop)."""
    await orchestrator.wait_tasks_loaded()
    if orchestrator.episodes.admission.accepting:  # not draining meanwhile
        await server.set_serving(True)
        log.info("task catalog loaded: health SERVING")


@dataclass
class OrchestratorHandle:
    """A running orchestrator (in-process)."""

    config: OrchestratorConfig
    server: RunningServer
    orchestrator: Orchestrator
    gate: Drain
    readiness: asyncio.Task[None] | None = field(default=None, repr=False)
    store_health: asyncio.Task[None] | None = field(default=None, repr=False)

    @property
    def port(self) -> int:
        return self.server.port

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.server.port}"

    async def _stop_readiness(self) -> None:
        for task in (self.readiness, self.store_health):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, TimeoutError):
                    async with asyncio.timeout(5.0):
                        await task

    async def drain(self) -> None:
        """Refuse new RPCs, let those in flight finish, close (or hand back) sessions, empty pools."""
        self.orchestrator.episodes.admission.accepting = False  # the gate refuses from this instant
        await self._stop_readiness()
        await self.orchestrator.drain(self.gate)

    async def stop(self, *, drain: bool = True, grace: float | None = None) -> None:
        """Graceful stop (`drain`), the server stopped, background loops cancelled and what is unfinished
        handed back; within `grace` (default `drain_s`) plus small bounds."""
        try:
            if drain:
                await self.server.shutdown(self.config.drain_s if grace is None else grace, self.drain)
            else:
                await self._stop_readiness()
                await self.server.shutdown(2.0 if grace is None else grace)
        finally:
            await self.orchestrator.stop()


def interceptors(
    config: OrchestratorConfig, ready: Callable[[], bool] = lambda: True, gate: Drain | None = None
) -> Sequence[grpc.aio.ServerInterceptor]:
    """The orchestrator's one interceptor: its RPCs' concerns in order (the first refusal answers a call)."""
    layers: list[Layer] = [ReplyBudget(), ApiKeys(config.api_keys)]
    if gate is not None:
        layers.append(gate)
    layers.append(Readiness(ready))
    return [Pipeline(*layers, metrics=RpcMetrics("orchestrator"))]


async def start_orchestrator(config: OrchestratorConfig, store: SessionStore | None = None) -> OrchestratorHandle:
    """Start the orchestrator in this event loop. `store`: a shared store (not closed on stop); None opens
    `config.store_url` (closed on stop)."""
    check_listen(config)
    orchestrator = await Orchestrator.create(config, store)
    config = orchestrator.config  # the run id resolved
    gate = Drain(lambda: orchestrator.draining)
    try:
        await orchestrator.start()

        def register(server: grpc.aio.Server) -> list[str]:
            orchestrator_pb2_grpc.add_OrchestratorServiceServicer_to_server(
                OrchestratorServicer(config, orchestrator.episodes), server
            )
            return [SERVICE_NAME]

        running = await start_server(
            config.listen,
            register,
            interceptors=interceptors(config, lambda: orchestrator.tasks_loaded, gate),
            tls_cert=config.tls_cert,
            tls_key=config.tls_key,
            serving=orchestrator.tasks_loaded,
            plane="the orchestrator",
            elsewhere={GATEWAY_SERVICE_NAME: f"the toolgateway ({config.gateway_address.replace(',', ', ')})"},
        )
    except BaseException:
        await orchestrator.stop()
        raise
    handle = OrchestratorHandle(config=config, server=running, orchestrator=orchestrator, gate=gate)
    handle.store_health = asyncio.create_task(
        watch_dependency(running, "session store", orchestrator.store.health), name="store-health"
    )
    if not orchestrator.tasks_loaded:
        log.warning("task catalog not loaded yet: health NOT_SERVING until it is")
        handle.readiness = asyncio.create_task(_serve_when_ready(orchestrator, running), name="readiness")
    return handle


def run(config: OrchestratorConfig) -> None:
    """`rlgate orchestrator`: serve until SIGTERM/SIGINT, then drain."""
    setup_logging(config.log_level, config.log_json, service="orchestrator")
    tracing.setup("rlgate-orchestrator", config.otlp_endpoint)
    try:
        check_listen(config)
    except InsecureListenError as exc:
        raise SystemExit(f"rlgate orchestrator: {exc}") from None
    log.info("config: %s", redacted(config))

    async def main() -> None:
        serve_metrics(config.metrics_listen)
        handle = await start_orchestrator(config)
        try:
            await serve_until_signal(handle.server, grace=config.drain_s, drain=handle.drain)
        finally:
            await handle.stop(drain=False)  # the server has stopped: loops cancelled, the rest handed back

    try:
        eventloop.run(main())
    except StoreError as exc:  # e.g. a corrupt store refused at open: one line, no traceback
        raise SystemExit(f"rlgate orchestrator: {exc}") from None
