"""Cross-cutting concerns as grpc.aio server interceptors, so handlers hold only their RPC's logic.

- `ContextInterceptor`: the caller's trace (W3C `traceparent`, else `x-rlgate-trace-id`) into the logging
  context and, when tracing is on, a SERVER span per RPC (`rlgate.runtime.tracing`); an arriving trace is
  passed on to upstreams either way. Unexpected exceptions become INTERNAL with a generic message (details
  stay in the server log, never secrets in the reply).
- `ApiKeyInterceptor`: `authorization: Bearer <key>` checked against configured keys (constant-time, by hash).
- `MetricsInterceptor`: RPC counts by method and status code, latency histograms (Prometheus).
- `ReplyBudgetInterceptor`: a budget of reply bytes a connection may leave unread (see its docstring).

rlgate's services are unary only; what these wrap is a unary-unary handler, and a handler of another kind is
refused (UNIMPLEMENTED, and an error in the log) rather than passed on unchecked. Health's and reflection's
streams are the exception: they pass through untouched, and both are exempt from auth so probes and
grpcurl `list` work.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, TypeAlias, TypeGuard, cast

import grpc
from grpc._cython import cygrpc  # type: ignore[attr-defined]  # private: not in grpc's stubs
from opentelemetry import context as otel_context

from rlgate.core.errors import ResourceExhausted, clip
from rlgate.runtime import tracing
from rlgate.runtime.auth import bearer_token, session_of_token, token_hash
from rlgate.runtime.grpc_server import MAX_STREAMS_PER_CONNECTION
from rlgate.runtime.logs import session_id_var, trace_id_var

log = logging.getLogger(__name__)

EXEMPT_PREFIXES = ("/grpc.health.v1.", "/grpc.reflection.")

Handler = Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]
MethodHandler: TypeAlias = "grpc.RpcMethodHandler[Any, Any]"
# What an interceptor is handed: the next one's handler, None for a method nobody serves.
Continuation: TypeAlias = Callable[[grpc.HandlerCallDetails], Awaitable["MethodHandler | None"]]


def behaviour_of(handler: MethodHandler) -> Handler:
    """A unary-unary handler's behaviour. grpc's stubs type it for the blocking server (a plain function of a
    grpc.ServicerContext); under grpc.aio it is a coroutine function of an aio context."""
    return cast(Handler, handler.unary_unary)


def wrap_behaviour(handler: MethodHandler | None, wrap: Callable[[Handler], Handler]) -> MethodHandler | None:
    """Wrap the behaviour of a unary-unary handler (the only kind rlgate serves). Any other kind is refused
    (None: UNIMPLEMENTED): returned unwrapped, it would skip whatever check the wrapper adds."""
    if not _unary(handler):
        return None
    return grpc.unary_unary_rpc_method_handler(
        wrap(behaviour_of(handler)),
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


class _PerMethod(grpc.aio.ServerInterceptor):
    """An interceptor that wraps the handler of every unary method it serves (`_build`), except those under
    `exempt`. Interceptors run on every RPC; the wrapped handler is built once per method (and again only
    when the inner handler changes), so their cost is a dict lookup. Per-call data comes from the context."""

    exempt: tuple[str, ...] = ()

    def __init__(self) -> None:
        self._wrapped: dict[str, tuple[MethodHandler, MethodHandler | None]] = {}

    async def intercept_service(
        self,
        continuation: Continuation,
        details: grpc.HandlerCallDetails,
    ) -> MethodHandler | None:
        handler = await continuation(details)
        if handler is None:
            return None
        method = details.method
        unary = _unary(handler)
        if method.startswith(EXEMPT_PREFIXES if not unary else self.exempt):
            return handler  # health's and reflection's streams; the unary methods this interceptor exempts
        hit = self._wrapped.get(method)
        if hit is not None and hit[0] is handler:
            return hit[1]
        wrapped = self._build(method, handler) if unary else refused_stream(method, handler)
        self._wrapped[method] = (handler, wrapped)
        return wrapped

    def _build(self, method: str, handler: MethodHandler) -> MethodHandler | None:
        raise NotImplementedError


def refused_stream(method: str, handler: MethodHandler) -> MethodHandler:
    """A handler of `handler`'s (streaming) kind that answers UNIMPLEMENTED: the interceptors wrap unary
    behaviour only, so a stream passed on would skip every check they add (auth, parsing, budgets)."""
    message = (
        f"{method} is a streaming method: rlgate serves unary RPCs only, and its interceptors cannot check a "
        "stream, so it is refused"
    )
    log.error("%s (a servicer registered a handler of a kind rlgate does not serve)", message)

    async def refuse(_request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, message)

    kinds = (
        (handler.unary_stream, grpc.unary_stream_rpc_method_handler),
        (handler.stream_unary, grpc.stream_unary_rpc_method_handler),
        (handler.stream_stream, grpc.stream_stream_rpc_method_handler),
    )
    make = next((make for behaviour, make in kinds if behaviour is not None), grpc.stream_stream_rpc_method_handler)
    return make(
        cast(Any, refuse),
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


def _unary(handler: MethodHandler | None) -> TypeGuard[MethodHandler]:
    return bool(
        handler is not None
        and handler.unary_unary is not None
        and not handler.request_streaming
        and not handler.response_streaming
    )


def ended_code(context: grpc.aio.ServicerContext, exc: BaseException | None = None) -> str | None:
    """The status the caller already has when its RPC ended before the handler answered: DEADLINE_EXCEEDED
    once the deadline passed, CANCELLED when the handler was cancelled or its answer could not be sent (the
    caller left; grpc cancels a handler whose RPC ended); None while the RPC is live. What metrics and logs
    record, so a deadline race under load is not counted (and logged with a traceback) as a bug."""
    remaining = context.time_remaining()
    if remaining is not None and remaining <= 0:
        return "DEADLINE_EXCEEDED"
    # ExecuteBatchError: an answer for an RPC that already ended.
    if isinstance(exc, asyncio.CancelledError | cygrpc.ExecuteBatchError):
        return "CANCELLED"
    return None


class ContextInterceptor(_PerMethod):
    """Takes on the caller's trace (log trace id, span, context passed on), parses the request, and turns
    unexpected exceptions into a clean INTERNAL.

    Must be the first (outermost) interceptor: it takes over request parsing, so that bytes that are not a
    valid message (corrupt, another RPC's message, nested past protobuf's depth limit) are the caller's
    INVALID_ARGUMENT instead of grpc's own UNKNOWN "Exception deserializing request". Unary RPCs only:
    health's and reflection's streams pass through as they are."""

    def _build(self, method: str, handler: MethodHandler) -> MethodHandler:
        inner = behaviour_of(handler)
        parse = handler.request_deserializer
        service, _, name = method.lstrip("/").rpartition("/")
        span_name = method.lstrip("/")
        span_attributes = {"rpc.system": "grpc", "rpc.service": service, "rpc.method": name}

        async def run(raw: Any, context: grpc.aio.ServicerContext, trace: str) -> Any:
            try:
                request = parse(raw) if parse is not None else raw
            except Exception as exc:
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"request is not a valid message for {method} ({type(exc).__name__})",
                )
            try:
                return await inner(request, context)
            except grpc.aio.AbortError:
                raise
            except Exception as exc:
                if (ended := ended_code(context, exc)) is not None:  # the caller has its status: no bug, no answer
                    log.info("%s ended %s before its handler: %s: %s", method, ended, type(exc).__name__, clip(exc))
                    raise asyncio.CancelledError from exc  # grpc notes a cancelled handler at debug
                log.exception("unhandled error in %s", method)
                tracing.current_span().record_exception(exc)
                await context.abort(grpc.StatusCode.INTERNAL, f"internal error (trace id {trace})")

        async def behaviour(raw: Any, context: grpc.aio.ServicerContext) -> Any:
            header, remote = tracing.incoming(context.invocation_metadata())
            session_id_var.set("-")
            if tracing.recording():
                parent = remote.parent if remote is not None else None
                with tracing.server_span(span_name, span_attributes, parent, header) as span:
                    trace = remote.trace_id if remote else header or tracing.trace_id_of(span)
                    trace_id_var.set(trace)
                    if remote is None and header:
                        span.set_attribute("rlgate.trace_id", header)
                    try:
                        return await run(raw, context, trace)
                    finally:
                        tracing.end_rpc(span, context.code(), session_id_var.get())
            if remote is None:  # nothing to pass on
                trace = header or os.urandom(16).hex()
                trace_id_var.set(trace)
                return await run(raw, context, trace)
            trace_id_var.set(remote.trace_id)
            token = otel_context.attach(remote.context)  # the mcp SDK and the transports pass it on
            try:
                return await run(raw, context, remote.trace_id)
            finally:
                otel_context.detach(token)

        return grpc.unary_unary_rpc_method_handler(
            behaviour, request_deserializer=None, response_serializer=handler.response_serializer
        )


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Requires `authorization: Bearer <api key>` on every non-exempt RPC when keys are configured, and
    refuses an agent token always (UNAUTHENTICATED)."""

    def __init__(self, api_keys: Iterable[str]) -> None:
        self._hashes = [token_hash(k) for k in api_keys if k]

    @property
    def enabled(self) -> bool:
        return bool(self._hashes)

    async def intercept_service(
        self,
        continuation: Continuation,
        details: grpc.HandlerCallDetails,
    ) -> MethodHandler | None:
        handler = await continuation(details)
        if details.method.startswith(EXEMPT_PREFIXES):
            return handler
        token = bearer_token(details.invocation_metadata)
        if token is not None and session_of_token(token) is not None:
            # An agent token never reaches the orchestration plane, with or without API keys (RFC 001).
            reason = "an agent token cannot call the orchestration plane; use an API key"
        elif not self._hashes or (
            token is not None and any(hmac.compare_digest(token_hash(token), h) for h in self._hashes)
        ):
            return handler
        else:
            reason = "missing API key (authorization: Bearer <key>)" if token is None else "invalid API key"

        def wrap(_inner: Handler) -> Handler:
            async def deny(_request: Any, context: grpc.aio.ServicerContext) -> Any:
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, reason)

            return deny

        return wrap_behaviour(handler, wrap)


class RpcMetrics:
    """RPC counts by method and status code and latency histograms of one service (Prometheus)."""

    def __init__(self, service: str) -> None:
        from rlgate.runtime import metrics

        self._calls = metrics.counter("rlgate_grpc_requests_total", "gRPC requests", ["service", "method", "code"])
        self._latency = metrics.histogram("rlgate_grpc_request_seconds", "gRPC request latency", ["service", "method"])
        self._service = service

    def method(self, method: str) -> Callable[[str, float], None]:
        """`observe(code_name, seconds)` for one method (label lookups done once, not per call)."""
        latency = self._latency.labels(self._service, method)
        calls: dict[str, Any] = {}

        def observe(code: str, seconds: float) -> None:
            child = calls.get(code)
            if child is None:
                child = calls[code] = self._calls.labels(self._service, method, code)
            child.inc()
            latency.observe(seconds)

        return observe


class MetricsInterceptor(_PerMethod):
    """Counts unary RPCs by method and status code and observes their latency (`RpcMetrics`)."""

    def __init__(self, service: str) -> None:
        super().__init__()
        self._metrics = RpcMetrics(service)

    def _build(self, full_method: str, handler: MethodHandler) -> MethodHandler | None:
        observe = self._metrics.method(full_method.rsplit("/", 1)[-1])

        def wrap(inner: Handler) -> Handler:
            async def behaviour(request: Any, context: grpc.aio.ServicerContext) -> Any:
                start = time.perf_counter()
                code = "OK"
                try:
                    response = await inner(request, context)
                    code = ended_code(context) or "OK"  # an answer after the deadline is never sent
                    return response
                except grpc.aio.AbortError:
                    c = context.code()
                    code = c.name if isinstance(c, grpc.StatusCode) else "UNKNOWN"
                    raise
                except BaseException as exc:
                    code = ended_code(context, exc) or "INTERNAL"
                    raise
                finally:
                    observe(code, time.perf_counter() - start)

            return behaviour

        return wrap_behaviour(handler, wrap)


# The bytes of replies a connection may leave unread before its new RPCs are refused. A client that reads
# must never meet it: a trainer multiplexes up to MAX_STREAMS_PER_CONNECTION calls over one channel, and when
# its CallTools all finish together on a link slower than the server, each next call arrives while the other
# replies are still leaving. So it is sized for every other stream holding a CallTool reply at the gateway's
# output limit (256 KiB) plus a quarter for the rest of the reply; what a client that never reads makes a
# server hold is this times the server's overhead per held reply, instead of the stream limit times the send
# limit (16 MiB).
REPLY_BUDGET_BYTES = MAX_STREAMS_PER_CONNECTION * 320 * 2**10
RETRY_AFTER_S = 1.0  # refused before any work: a retry is safe once the client has read its replies


class ReplyLedger:
    """Bytes of replies produced but not yet delivered, per peer. Entries at 0 are removed."""

    def __init__(self) -> None:
        self._pending: dict[str, int] = {}

    def pending(self, peer: str) -> int:
        return self._pending.get(peer, 0)

    def add(self, peer: str, size: int) -> None:
        self._pending[peer] = self._pending.get(peer, 0) + size

    def release(self, peer: str, size: int) -> None:
        left = self._pending.get(peer, 0) - size
        if left > 0:
            self._pending[peer] = left
        else:
            self._pending.pop(peer, None)

    def __len__(self) -> int:
        return len(self._pending)


class ReplyBudgetInterceptor(_PerMethod):
    """A budget of reply bytes a connection may leave unread.

    A unary reply the handler has produced stays in the server (the message, its serialized bytes, the
    transport's copy) until the client's HTTP/2 flow-control window lets it out; a client that never sends a
    WINDOW_UPDATE makes the server hold every reply of every stream it opens, for as long as the connection
    lives. Per connection (`context.peer()`: the client's ip:port) this keeps the bytes of replies produced
    whose RPC has not ended: added when the handler returns, released by grpc's done callback when the RPC
    ends (delivered, cancelled, or the connection dropped). A new RPC on a connection at or over `budget` is
    refused before any work with RESOURCE_EXHAUSTED (reason REPLY_BUDGET) and a RetryInfo, so a CallTool with
    a request_id is never run and then refused. Connections with nothing pending have no entry. Health and
    reflection pass through.

    The check is at admission, so calls admitted together (before any of their replies exists) can take a
    connection past the budget by their replies; the stream limit bounds those.

    Goes inside `MetricsInterceptor`, so a refusal is counted as what the caller saw."""

    exempt = EXEMPT_PREFIXES

    def __init__(self, budget: int = REPLY_BUDGET_BYTES) -> None:
        super().__init__()
        self.budget = budget
        self.ledger = ReplyLedger()

    def _build(self, method: str, handler: MethodHandler) -> MethodHandler | None:
        return wrap_behaviour(handler, self._counted)

    def _counted(self, inner: Handler) -> Handler:
        ledger, budget = self.ledger, self.budget

        async def behaviour(request: Any, context: grpc.aio.ServicerContext) -> Any:
            peer = context.peer()
            if (pending := ledger.pending(peer)) >= budget:
                await context.abort_with_status(
                    ResourceExhausted(
                        f"this connection has {pending} bytes of replies unread (the budget is {budget} bytes "
                        "per connection); read them, or retry later",
                        subject=f"connection {peer}",
                        reason="REPLY_BUDGET",
                        metadata={"pending_bytes": pending, "budget_bytes": budget},
                        retry_after_s=RETRY_AFTER_S,
                    ).to_grpc_status()
                )
            held = 0
            ended = False

            def done(_context: grpc.aio.ServicerContext) -> None:
                nonlocal ended
                ended = True
                if held:
                    ledger.release(peer, held)

            # Registered before the handler runs: an RPC that ends first (cancelled) is never counted.
            context.add_done_callback(cast(Any, done))  # grpc's stubs ask for a class where any callable works
            response = await inner(request, context)
            if not ended:
                held = response.ByteSize()
                ledger.add(peer, held)
            return response

        return behaviour
