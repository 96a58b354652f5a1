"""grpc.aio server bootstrap shared by the orchestrator and the toolgateway.

`start_server` binds a listen address (port 0 picks a free port), registers the services plus
`grpc.health.v1` and server reflection (`rlgate.runtime.reflection`: methods resolve too, so `grpcurl
describe Service.Method` works), and installs the interceptors. `RunningServer.shutdown` is the
graceful path used on SIGTERM/SIGINT: health goes NOT_SERVING first (load balancers stop sending), the
service's own drain hook runs, then in-flight RPCs get what is left of `grace` before the server stops.
`grace` bounds the whole shutdown (plus a small margin), so a process told to stop exits on time.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import signal
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from rlgate.runtime.reflection import enable_server_reflection

log = logging.getLogger(__name__)

# Every per-connection resource has a bound, so no client (hostile or just stuck) can take a server down:
# - streams: at most MAX_STREAMS_PER_CONNECTION calls in flight per connection (a client with more queues
#   them itself); what a client that never reads its replies can make the server hold for it is bounded
#   by the reply budget (`interceptors.ReplyBudget`: new calls refused past it);
# - connections: a TCP connection that has not finished the HTTP/2 handshake within 10 s is dropped, an
#   idle one after 5 minutes, and past `max_connections()` new ones are refused, which leaves file
#   descriptors for the store, upstream calls and a health probe;
# - keepalive: pings more often than every 10 s without data are refused (ping floods end the connection).
MAX_STREAMS_PER_CONNECTION = 1024
MIN_STOP_GRACE_S = 0.5  # in-flight RPCs always get this long to answer, even when the drain used all of grace
STOP_MARGIN_S = 5.0  # beyond the grace, how long stopping the server itself may take before it is abandoned
FD_HEADROOM = 512  # descriptors kept back from client connections (store, upstreams, logs, probes)
DEFAULT_OPTIONS: list[tuple[str, int | str]] = [
    ("grpc.max_receive_message_length", 16 * 1024 * 1024),
    ("grpc.max_send_message_length", 16 * 1024 * 1024),
    ("grpc.max_concurrent_streams", MAX_STREAMS_PER_CONNECTION),
    ("grpc.server_handshake_timeout_ms", 10_000),
    ("grpc.max_connection_idle_ms", 300_000),
    ("grpc.keepalive_time_ms", 60_000),
    ("grpc.keepalive_timeout_ms", 20_000),
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ("grpc.http2.max_ping_strikes", 2),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.so_reuseport", 0),
    # Clients reconnect (and re-resolve DNS) every few minutes, so replicas an autoscaler adds get traffic;
    # in-flight calls get a long grace (verifier runs and provisioning can take minutes).
    ("grpc.max_connection_age_ms", 300_000),
    ("grpc.max_connection_age_grace_ms", 180_000),
]


def max_connections() -> int:
    """Raise this process's open-file limit to its hard limit and return how many client connections the
    server may hold: the limit minus `FD_HEADROOM`, so health and the service's own I/O always find a
    descriptor while thousands of idle connections are open."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        target = 1 << 20 if hard == resource.RLIM_INFINITY else hard
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass  # keep the soft limit we have
    return max(64, soft - FD_HEADROOM)


@dataclass
class RunningServer:
    """A started grpc.aio server and its health servicer."""

    server: grpc.aio.Server
    port: int
    health: health.aio.HealthServicer
    service_names: list[str]
    _stopped: asyncio.Event = field(default_factory=asyncio.Event)
    _down: set[str] = field(default_factory=set)  # dependencies (and "ready") that keep health NOT_SERVING

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def stopping(self) -> bool:
        """Shutdown has begun: health stays NOT_SERVING from here on."""
        return self._stopped.is_set()

    async def set_serving(self, serving: bool) -> None:
        """The service is ready (or not). Health is SERVING only while it is ready, no dependency is down
        (`set_dependency`) and shutdown has not begun."""
        await self.set_dependency("ready", serving)

    async def set_dependency(self, name: str, ok: bool) -> None:
        """Record whether `name` (the service's readiness, its store, ...) is usable, and publish health."""
        if ok:
            self._down.discard(name)
        else:
            self._down.add(name)
        serving = not self._down and not self.stopping
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for service in [*self.service_names, ""]:
            await self.health.set(service, status)

    async def shutdown(self, grace: float = 5.0, drain: Callable[[], Awaitable[None]] | None = None) -> None:
        """Health NOT_SERVING, run `drain`, stop accepting, give in-flight RPCs what is left of `grace` (at
        least `MIN_STOP_GRACE_S`). Every step is bounded: the whole takes at most `grace` plus
        `MIN_STOP_GRACE_S + 2 * STOP_MARGIN_S`."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        loop = asyncio.get_running_loop()
        end = loop.time() + grace
        try:
            async with asyncio.timeout(STOP_MARGIN_S):
                await self.set_serving(False)
        except TimeoutError:
            log.error("shutdown: setting health NOT_SERVING took longer than %.1fs", STOP_MARGIN_S)
        if drain is not None:
            try:
                async with asyncio.timeout(max(0.0, end - loop.time())):
                    await drain()
            except TimeoutError:
                log.error("shutdown: the drain hook did not finish within the grace of %.1fs", grace)
            except Exception:
                log.exception("drain hook failed")
        remaining = max(MIN_STOP_GRACE_S, end - loop.time())
        try:
            async with asyncio.timeout(remaining + STOP_MARGIN_S):
                await self.server.stop(remaining)
        except TimeoutError:
            log.error("shutdown: the server did not stop within %.1fs; going on", remaining + STOP_MARGIN_S)

    async def wait_stopped(self) -> None:
        await self.server.wait_for_termination()


async def watch_dependency(
    running: RunningServer,
    name: str,
    probe: Callable[[], Awaitable[None]],
    *,
    interval_s: float = 5.0,
    timeout_s: float = 10.0,
) -> None:
    """Probe a dependency every `interval_s` (each probe bounded by `timeout_s`): health turns NOT_SERVING
    while it fails and SERVING again once it passes, so load balancers and `rlgate healthcheck` see a store
    that cannot be read or written (corrupt, disk full, unreachable). Run it as a task the service owns."""
    failing = False
    while True:
        try:
            async with asyncio.timeout(timeout_s):
                await probe()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if not failing:
                log.error("%s is failing: %s; health NOT_SERVING until it recovers", name, exc)
            failing = True
            await running.set_dependency(name, False)
        else:
            if failing:
                log.warning("%s recovered; health follows readiness again", name)
            failing = False
            await running.set_dependency(name, True)
        await asyncio.sleep(interval_s)


def server_credentials(tls_cert: str, tls_key: str) -> grpc.ServerCredentials | None:
    """TLS credentials from PEM files, or None for plaintext."""
    if not tls_cert and not tls_key:
        return None
    if not (tls_cert and tls_key):
        raise ValueError("TLS needs both a certificate and a key")
    return grpc.ssl_server_credentials([(Path(tls_key).read_bytes(), Path(tls_cert).read_bytes())])


class ServedElsewhere(grpc.GenericRpcHandler):
    """Registered after every service, so it answers only methods this server does not serve: UNIMPLEMENTED
    naming where the method is served (a CallTool sent to the orchestrator names the toolgateway), rather
    than gRPC's bare "Method not found!".

    Args:
        plane: this server's name, as the message calls it ("the orchestrator").
        own: the services this server serves (full names).
        elsewhere: full service name -> where it is served, e.g. "the toolgateway (127.0.0.1:50052)".
    """

    def __init__(self, plane: str, own: Sequence[str], elsewhere: Mapping[str, str]) -> None:
        self.plane = plane
        self.own = list(own)
        self.elsewhere = dict(elsewhere)

    def message(self, method: str) -> str:
        service, _, name = method.strip("/").partition("/")
        if service in self.elsewhere:
            return f"{service}/{name} is served by {self.elsewhere[service]}, not by {self.plane} at this address"
        return f"{method} is not a method of {self.plane}, which serves {', '.join(self.own)}"

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        text = self.message(str(handler_call_details.method))

        # unary, as every rlgate method is (the interceptors refuse streaming handlers); the request stays bytes
        async def refuse(_request: bytes, context: grpc.aio.ServicerContext) -> None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, text)

        return grpc.unary_unary_rpc_method_handler(refuse)


async def start_server(
    listen: str,
    register: Callable[[grpc.aio.Server], Sequence[str]],
    *,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    tls_cert: str = "",
    tls_key: str = "",
    options: Sequence[tuple[str, int | str]] = (),
    serving: bool = True,
    plane: str = "this server",
    elsewhere: Mapping[str, str] | None = None,
) -> RunningServer:
    """Create, register and start a server. `register` adds servicers and returns their full names.
    `serving=False` starts with health NOT_SERVING (the service flips it once it is ready). A method it does
    not serve is UNIMPLEMENTED naming `plane` and, for a service in `elsewhere`, where that one is served."""
    limits = [*DEFAULT_OPTIONS, ("grpc.max_allowed_incoming_connections", max_connections())]
    server = grpc.aio.server(interceptors=list(interceptors), options=[*limits, *options])
    names = list(register(server))
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    enable_server_reflection([*names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name], server)
    server.add_generic_rpc_handlers((ServedElsewhere(plane, names, elsewhere or {}),))  # last: only what is left
    creds = server_credentials(tls_cert, tls_key)
    port = server.add_secure_port(listen, creds) if creds else server.add_insecure_port(listen)
    if port == 0:
        raise OSError(f"could not bind {listen}")
    await server.start()
    running = RunningServer(server=server, port=port, health=health_servicer, service_names=names)
    await running.set_serving(serving)
    log.info("listening on %s (port %d): %s", listen, port, ", ".join(names))
    return running


async def serve_until_signal(
    running: RunningServer, *, grace: float, drain: Callable[[], Awaitable[None]] | None = None
) -> None:
    """Block until SIGTERM/SIGINT, then shut down gracefully."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    waiter = asyncio.create_task(running.wait_stopped())
    stopper = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait({waiter, stopper}, return_when=asyncio.FIRST_COMPLETED)
        if stop.is_set():
            log.info("signal received: draining (grace %.1fs)", grace)
            await running.shutdown(grace, drain)
    finally:
        for task in (waiter, stopper):
            task.cancel()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
