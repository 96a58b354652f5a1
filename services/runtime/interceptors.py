"""Cross-cutting concerns of a server's RPCs, composed into one grpc.aio interceptor, so handlers hold only
their RPC's logic.

grpc.aio runs every interceptor's `intercept_service` on every RPC, and every behaviour an interceptor wraps
around a handler is one more coroutine per call, passed through again each time the handler resumes. So a
server has one interceptor, `Pipeline`, which builds each method's behaviour once (again only when the
method's handler changes) from named pieces, and makes the per-call decisions (the call's credentials, its
connection's unread replies, readiness, draining) inside that behaviour, in one coroutine per call:

- the call itself (`Pipeline`, outermost): the caller's trace (W3C `traceparent`, else `x-rlgate-trace-id`)
  into the logging context and, when tracing is on, a SERVER span per RPC (`rlgate.runtime.tracing`); an
  arriving trace is passed on to upstreams either way. The request parsed (bytes that are not a valid
  message: INVALID_ARGUMENT) and the reply serialized. Unexpected exceptions become INTERNAL with a generic
  message (details stay in the server log, never secrets in the reply). With `RpcMetrics`: counts by method
  and status code and latency, of the status the caller saw, refusals included.
- `Layer`s, in order: each may refuse a call before any work (`Layer.guard`) and keep book of the calls it
  lets on (`Layer.tracks`). Here: `ReplyBudget` (a budget of reply bytes a connection may leave unread) and
  `ApiKeys` (`authorization: Bearer <key>` checked against configured keys); a service adds its own (the
  orchestrator's readiness and drain).

rlgate's services are unary only; what a pipeline composes is a unary-unary handler, and a handler of
another kind is refused (UNIMPLEMENTED, and an error in the log) rather than passed on unchecked. Health's
and reflection's streams are the exception: they pass through untouched. Health and reflection
(`EXEMPT_PREFIXES`) are exempt from auth and the reply budget, so probes and grpcurl `list` work.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
import time
from collections.abc import Awaitable, Callable, Iterable
from contextvars import Token
from dataclasses import dataclass
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
# Methods whose built behaviour a pipeline keeps. A server serves a few dozen; past this (a caller naming
# methods nobody serves, each answered by a new UNIMPLEMENTED handler) behaviours are built per call.
MAX_BUILT_METHODS = 256

Handler = Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]
MethodHandler: TypeAlias = "grpc.RpcMethodHandler[Any, Any]"
# What an interceptor is handed: the next one's handler, None for a method nobody serves.
Continuation: TypeAlias = Callable[[grpc.HandlerCallDetails], Awaitable["MethodHandler | None"]]
# A call's metadata (a tuple of pairs at run time; grpc's stubs type it as their own Metadata).
Metadata: TypeAlias = Iterable[tuple[str, str | bytes]]
# A layer's check of one call (its context and metadata): the status refusing it, or None to let it on.
Guard: TypeAlias = Callable[[grpc.aio.ServicerContext, Metadata], "grpc.Status | None"]


def behaviour_of(handler: MethodHandler) -> Handler:
    """A unary-unary handler's behaviour. grpc's stubs type it for the blocking server (a plain function of a
    grpc.ServicerContext); under grpc.aio it is a coroutine function of an aio context."""
    return cast(Handler, handler.unary_unary)


@dataclass(frozen=True)
class Refusal(grpc.Status):
    """A status without rich details, in the form `context.abort_with_status` takes (a guard's answer)."""

    code: grpc.StatusCode
    details: str
    trailing_metadata: tuple[tuple[str, str | bytes], ...] = ()


class Layer:
    """One cross-cutting concern of a `Pipeline`, asked once per unary method (never per call) what it adds
    to that method's calls; the default adds nothing. A layer has no coroutine of its own: the pipeline's one
    coroutine per call runs its checks and its bookkeeping.

    - `guard(method)`: the check every call passes before any work. Guards run in the pipeline's order; the
      first refusal answers the call.
    - `tracks(method)`: whether the layer keeps book of the calls its guards let on. Then `start` runs before
      the handler (what it returns, the call's token, is handed to the others), `cancelled` if the handler
      was cancelled, `finished` once it ended however, and `answered` with its reply's serialized size."""

    def guard(self, method: str) -> Guard | None:
        """The check of every call of `method` (None: nothing to check)."""
        return None

    def tracks(self, method: str) -> bool:
        """Whether this layer keeps book of the calls of `method`."""
        return False

    def start(self, context: grpc.aio.ServicerContext) -> Any:
        """A call let on by every guard, before its handler runs: the call's token."""
        return None

    def cancelled(self, token: Any) -> grpc.Status | None:
        """The handler was cancelled: the status to answer instead, or None (it stays cancelled)."""
        return None

    def finished(self, token: Any) -> None:
        """The handler ended (answered, failed or cancelled)."""

    def answered(self, token: Any, size: int) -> None:
        """The handler answered, `size` bytes once serialized."""


class Pipeline(grpc.aio.ServerInterceptor):
    """A server's one interceptor: per unary method, one behaviour that takes on the caller's trace, parses
    the request, runs `layers`' guards and bookkeeping around the handler, serializes the reply, turns the
    unexpected into INTERNAL and counts in `metrics` the status the caller saw. See the module docstring.

    Args:
        layers: the concerns between the call and the handler, in order (the first one's guard is checked
            first).
        metrics: the RPC metrics to count calls in (None: not counted).
    """

    def __init__(self, *layers: Layer, metrics: RpcMetrics | None = None) -> None:
        self._layers = layers
        self._metrics = metrics
        self._built: dict[str, tuple[MethodHandler, MethodHandler]] = {}

    async def intercept_service(
        self,
        continuation: Continuation,
        details: grpc.HandlerCallDetails,
    ) -> MethodHandler | None:
        handler = await continuation(details)
        if handler is None:
            return None
        method = details.method
        hit = self._built.get(method)
        if hit is not None and hit[0] is handler:
            return hit[1]
        built = self._build(method, handler)
        if hit is not None or len(self._built) < MAX_BUILT_METHODS:
            self._built[method] = (handler, built)
        return built

    def _build(self, method: str, handler: MethodHandler) -> MethodHandler:
        if _unary(handler):
            return self._compose(method, handler)
        if method.startswith(EXEMPT_PREFIXES):
            return handler  # health's and reflection's streams
        return refused_stream(method, handler)

    def _compose(self, method: str, handler: MethodHandler) -> MethodHandler:
        inner = behaviour_of(handler)
        guards = tuple(guard for layer in self._layers if (guard := layer.guard(method)) is not None)
        trackers = tuple(layer for layer in self._layers if layer.tracks(method))
        parse = handler.request_deserializer
        serialize = handler.response_serializer
        observe = self._metrics.method(method.rsplit("/", 1)[-1]) if self._metrics is not None else None
        service, _, name = method.lstrip("/").rpartition("/")
        span_name = method.lstrip("/")
        span_attributes = {"rpc.system": "grpc", "rpc.service": service, "rpc.method": name}

        # The call, one coroutine: the caller's trace, parsing, the guards, the handler and the layers'
        # bookkeeping, the reply serialized (once: its size is what the reply budget counts), the status the
        # caller saw.
        async def answer(raw: Any, context: grpc.aio.ServicerContext) -> Any:
            metadata = context.invocation_metadata() or ()
            start = time.perf_counter()
            code = "OK"
            with _CallerTrace(context, metadata, span_name, span_attributes) as trace:
                try:
                    try:
                        request = parse(raw) if parse is not None else raw
                    except Exception as exc:
                        await context.abort(
                            grpc.StatusCode.INVALID_ARGUMENT,
                            f"request is not a valid message for {method} ({type(exc).__name__})",
                        )
                    for guard in guards:
                        if (refusal := guard(context, metadata)) is not None:
                            await context.abort_with_status(refusal)
                    tokens = [layer.start(context) for layer in trackers]
                    try:
                        response = await inner(request, context)
                    except asyncio.CancelledError:
                        for layer, token in zip(trackers, tokens, strict=True):
                            if (instead := layer.cancelled(token)) is not None:
                                await context.abort_with_status(instead)
                        raise
                    finally:
                        for layer, token in zip(trackers, tokens, strict=True):
                            layer.finished(token)
                    reply = serialize(response) if serialize is not None else response
                    for layer, token in zip(trackers, tokens, strict=True):
                        layer.answered(token, len(reply))
                    code = ended_code(context) or "OK"  # an answer after the deadline is never sent
                    return reply
                except grpc.aio.AbortError:
                    status = context.code()
                    code = status.name if isinstance(status, grpc.StatusCode) else "UNKNOWN"
                    raise
                except Exception as exc:
                    if (ended := ended_code(context, exc)) is not None:  # the caller has its status: no bug, no answer
                        code = ended
                        log.info("%s ended %s before its handler: %s: %s", method, ended, type(exc).__name__, clip(exc))
                        raise asyncio.CancelledError from exc  # grpc notes a cancelled handler at debug
                    code = "INTERNAL"
                    log.exception("unhandled error in %s", method)
                    tracing.current_span().record_exception(exc)
                    await context.abort(grpc.StatusCode.INTERNAL, f"internal error (trace id {trace})")
                except BaseException as exc:  # cancelled: the caller left, its deadline passed, or the server stops
                    code = ended_code(context, exc) or "INTERNAL"
                    raise
                finally:
                    if observe is not None:
                        observe(code, time.perf_counter() - start)

        # Bytes both ways: `answer` parses (grpc's own parsing would answer UNKNOWN) and serializes.
        return grpc.unary_unary_rpc_method_handler(answer, request_deserializer=None, response_serializer=None)


class _CallerTrace:
    """The caller's trace for the length of one call, a `with` block rather than a coroutine: on entry the
    trace id (the caller's trace, else its `x-rlgate-trace-id`, else a new one) goes into the logging context
    and, with tracing on, a SERVER span starts (`tracing.server_span`); else an arriving trace is attached,
    for upstream calls to pass on. On exit the span gets the call's status and ends, or the trace is
    detached."""

    __slots__ = ("attributes", "context", "metadata", "name", "span", "spanning", "token")

    def __init__(
        self, context: grpc.aio.ServicerContext, metadata: Metadata, name: str, attributes: dict[str, Any]
    ) -> None:
        self.context = context
        self.metadata = metadata
        self.name = name
        self.attributes = attributes
        self.spanning: contextlib.AbstractContextManager[Any] | None = None
        self.span: Any = None
        self.token: Token[otel_context.Context] | None = None

    def __enter__(self) -> str:
        header, remote = tracing.incoming(self.metadata)
        session_id_var.set("-")
        if tracing.recording():
            parent = remote.parent if remote is not None else None
            self.spanning = tracing.server_span(self.name, self.attributes, parent, header)
            span = self.span = self.spanning.__enter__()
            trace = remote.trace_id if remote else header or tracing.trace_id_of(span)
            if remote is None and header:
                span.set_attribute("rlgate.trace_id", header)
        elif remote is None:  # nothing to pass on
            trace = header or os.urandom(16).hex()
        else:
            trace = remote.trace_id
            self.token = otel_context.attach(remote.context)  # the mcp SDK and the transports pass it on
        trace_id_var.set(trace)
        return trace

    def __exit__(self, *exc: Any) -> None:
        if self.spanning is not None:
            try:
                tracing.end_rpc(self.span, self.context.code(), session_id_var.get())
            finally:
                self.spanning.__exit__(*exc)
        elif self.token is not None:
            otel_context.detach(self.token)


def refused_stream(method: str, handler: MethodHandler) -> MethodHandler:
    """A handler of `handler`'s (streaming) kind that answers UNIMPLEMENTED: a pipeline composes unary
    behaviour only, so a stream passed on would skip every check it adds (auth, parsing, budgets)."""
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


class ApiKeys(Layer):
    """Requires `authorization: Bearer <api key>` on every non-exempt RPC when keys are configured, and
    refuses an agent token always (UNAUTHENTICATED)."""

    AGENT_TOKEN = Refusal(
        # An agent token never reaches the orchestration plane, with or without API keys (RFC 001).
        grpc.StatusCode.UNAUTHENTICATED,
        "an agent token cannot call the orchestration plane; use an API key",
    )
    MISSING = Refusal(grpc.StatusCode.UNAUTHENTICATED, "missing API key (authorization: Bearer <key>)")
    INVALID = Refusal(grpc.StatusCode.UNAUTHENTICATED, "invalid API key")

    def __init__(self, api_keys: Iterable[str]) -> None:
        self._hashes = [token_hash(k) for k in api_keys if k]

    @property
    def enabled(self) -> bool:
        return bool(self._hashes)

    def guard(self, method: str) -> Guard | None:
        return None if method.startswith(EXEMPT_PREFIXES) else self._check

    def _check(self, _context: grpc.aio.ServicerContext, metadata: Metadata) -> grpc.Status | None:
        token = bearer_token(metadata)
        if token is not None and session_of_token(token) is not None:
            return self.AGENT_TOKEN
        if not self._hashes or (
            token is not None and any(hmac.compare_digest(token_hash(token), h) for h in self._hashes)
        ):
            return None
        return self.MISSING if token is None else self.INVALID


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


class ReplyBudget(Layer):
    """A budget of reply bytes a connection may leave unread.

    A unary reply the handler has produced stays in the server (the message, its serialized bytes, the
    transport's copy) until the client's HTTP/2 flow-control window lets it out; a client that never sends a
    WINDOW_UPDATE makes the server hold every reply of every stream it opens, for as long as the connection
    lives. Per connection (`context.peer()`: the client's ip:port) this keeps the bytes of replies produced
    whose RPC has not ended: added when the handler returns, released by grpc's done callback when the RPC
    ends (delivered, cancelled, or the connection dropped). A new RPC on a connection at or over `budget` is
    refused before any work with RESOURCE_EXHAUSTED (reason REPLY_BUDGET) and a RetryInfo, so a CallTool with
    a request_id is never run and then refused. Connections with nothing pending have no entry. Health and
    reflection are exempt.

    The check is at admission, so calls admitted together (before any of their replies exists) can take a
    connection past the budget by their replies; the stream limit bounds those.

    The first layer of a pipeline: its refusal comes before any other, and is counted as what the caller saw."""

    def __init__(self, budget: int = REPLY_BUDGET_BYTES) -> None:
        self.budget = budget
        self.ledger = ReplyLedger()

    def guard(self, method: str) -> Guard | None:
        return None if method.startswith(EXEMPT_PREFIXES) else self._admit

    def _admit(self, context: grpc.aio.ServicerContext, _metadata: Metadata) -> grpc.Status | None:
        peer = context.peer()
        if (pending := self.ledger.pending(peer)) < self.budget:
            return None
        return ResourceExhausted(
            f"this connection has {pending} bytes of replies unread (the budget is {self.budget} bytes "
            "per connection); read them, or retry later",
            subject=f"connection {peer}",
            reason="REPLY_BUDGET",
            metadata={"pending_bytes": pending, "budget_bytes": self.budget},
            retry_after_s=RETRY_AFTER_S,
        ).to_grpc_status()

    def tracks(self, method: str) -> bool:
        return not method.startswith(EXEMPT_PREFIXES)

    def start(self, context: grpc.aio.ServicerContext) -> _HeldReply:
        held = _HeldReply(self.ledger, context.peer())
        # Registered before the handler runs: an RPC that ends first (cancelled) is never counted.
        context.add_done_callback(cast(Any, held.release))  # grpc's stubs ask for a class where any callable works
        return held

    def answered(self, token: _HeldReply, size: int) -> None:
        token.hold(size)


class _HeldReply:
    """The bytes one call's reply holds on its connection's entry of the ledger, from the handler's answer
    until the RPC ends (`release`, grpc's done callback)."""

    __slots__ = ("ended", "ledger", "peer", "size")

    def __init__(self, ledger: ReplyLedger, peer: str) -> None:
        self.ledger = ledger
        self.peer = peer
        self.size = 0
        self.ended = False

    def hold(self, size: int) -> None:
        if not self.ended:
            self.size = size
            self.ledger.add(self.peer, size)

    def release(self, _context: grpc.aio.ServicerContext) -> None:
        self.ended = True
        if self.size:
            self.ledger.release(self.peer, self.size)
