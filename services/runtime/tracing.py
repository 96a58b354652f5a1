"""OpenTelemetry for both services: W3C trace context in, spans around the work, the context out to every
upstream (MCP calls, Fleet's HTTP API).

- In: `Pipeline` (its caller-trace step) reads `traceparent` / `tracestate` from a call's metadata (`incoming`). With a
  valid `traceparent`, its trace id is the trace id of the call's log lines; a caller that sends only
  `x-rlgate-trace-id` keeps it in the logs, and when that id is hex (at most 32 digits) a recording
  service's spans for the call carry it as their trace id (`CallerTraceIds`), so logs and traces agree.
- Spans: a SERVER span per RPC (the interceptor), `span(...)` / `traced(...)` around provisioning, the
  verifier and each upstream call. The mcp SDK adds its own CLIENT span per MCP request and writes the
  current context into the request's `_meta` (`traceparent`, `tracestate`; SEP-414).
- Out: `inject_headers` writes the current context as W3C headers (the MCP transport, Fleet's httpx client).

Off by default, and then cheap (under a microsecond per RPC, docs/observability.md): without an SDK tracer
provider no span is created (`recording()` is False, `span` returns one shared null context) and an arriving
`traceparent` is only parsed (once per episode) and passed on, so upstreams still see the caller's trace.
`setup` installs the SDK with an OTLP exporter when `--otlp-endpoint` / `RLGATE_OTLP_ENDPOINT` or the standard
`OTEL_EXPORTER_OTLP[_TRACES]_ENDPOINT` is set; the SDK and exporter are imported only then.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import os
import re
from collections.abc import Awaitable, Callable, Iterable, Iterator, MutableMapping
from contextvars import ContextVar
from typing import Any, NamedTuple, TypeVar

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import NonRecordingSpan, Span, SpanContext, SpanKind, StatusCode, TraceFlags, TraceState

from rlgate.runtime.logs import TRACE_HEADER

log = logging.getLogger(__name__)

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
TRACER_NAME = "rlgate"

MAX_HEADER = 512  # longer `traceparent` / `tracestate` values are ignored (as OpenTelemetry's propagator does)
# version 00: "00-<32 hex trace id>-<16 hex parent id>-<2 hex flags>"; later versions may append fields.
_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?")
_HEX_ID = re.compile(r"[0-9a-fA-F]{1,32}")
_OFF: contextlib.AbstractContextManager[Span] = contextlib.nullcontext(trace.INVALID_SPAN)

T = TypeVar("T")

_tracer: trace.Tracer | None = None  # the SDK's tracer, once a provider is installed
_on = False


def recording() -> bool:
    """Whether rlgate records spans: `setup` (or `use_global_provider`) found an SDK tracer provider. A flag,
    not a look-up of the global provider, which costs about a microsecond (it reads os.environ)."""
    return _on


def use_global_provider() -> bool:
    """Record spans through the global tracer provider, when one is installed (an application embedding
    the services that installed its own; `setup` calls this). Returns whether rlgate now records."""
    global _tracer, _on
    provider = trace.get_tracer_provider()
    if isinstance(provider, trace.ProxyTracerProvider):
        return False
    _tracer, _on = provider.get_tracer(TRACER_NAME), True
    return True


def span(
    name: str, attributes: dict[str, Any] | None = None, kind: SpanKind = SpanKind.INTERNAL
) -> contextlib.AbstractContextManager[Span]:
    """A span around a block, the current span inside it; a shared no-op when not recording (the block's
    `set_attribute` calls on it then do nothing). Exceptions are recorded and set the ERROR status."""
    if not recording():
        return _OFF
    assert _tracer is not None
    return _tracer.start_as_current_span(name, kind=kind, attributes=attributes)


def traced(name: str, **arguments: str) -> Callable[[Callable[..., Awaitable[T]]], Callable[..., Awaitable[T]]]:
    """A span around each call of an async function: `@traced("rlgate.provision", env_key="env_key")` also
    records the argument `env_key` as the attribute `rlgate.env_key`. When not recording, one extra await."""

    def decorate(fn: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
        params = list(inspect.signature(fn).parameters)
        where = {f"rlgate.{attr}": (param, params.index(param)) for attr, param in arguments.items()}

        @functools.wraps(fn)
        async def run(*args: Any, **kwargs: Any) -> T:
            if not recording():
                return await fn(*args, **kwargs)
            attributes = {}
            for attr, (param, index) in where.items():
                value = kwargs[param] if param in kwargs else args[index] if index < len(args) else None
                if isinstance(value, str | bool | int | float):
                    attributes[attr] = value
            with span(name, attributes):
                return await fn(*args, **kwargs)

        return run

    return decorate


def current_span() -> Span:
    """The current span (a no-op one when there is none)."""
    return trace.get_current_span()


def trace_id_of(span: Span) -> str:
    """A span's trace id as 32 hex digits ("" for an invalid span)."""
    ctx = span.get_span_context()
    return format(ctx.trace_id, "032x") if ctx.is_valid else ""


# -- in: a call's metadata ------------------------------------------------------------------------------
class Remote(NamedTuple):
    """A caller's trace: its span context, a context with it as the current span, its trace id (32 hex)."""

    parent: SpanContext
    context: otel_context.Context
    trace_id: str


def parse_traceparent(value: str, state: str | None = None) -> SpanContext | None:
    """The remote span context a W3C `traceparent` (and `tracestate`) names, or None when it is not valid:
    malformed, version ff, an all-zero id, or version 00 with extra fields."""
    match = _TRACEPARENT.fullmatch(value.strip()) if len(value) <= MAX_HEADER else None
    if match is None:
        return None
    version, trace_hex, span_hex, flags, rest = match.groups()
    if version == "ff" or (version == "00" and rest):
        return None
    trace_id, span_id = int(trace_hex, 16), int(span_hex, 16)
    if not trace_id or not span_id:
        return None
    trace_state = TraceState.from_header([state]) if state and len(state) <= MAX_HEADER else None
    return SpanContext(
        trace_id, span_id, is_remote=True, trace_flags=TraceFlags(int(flags, 16)), trace_state=trace_state
    )


@functools.lru_cache(maxsize=1024)
def remote(traceparent: str, tracestate: str | None = None) -> Remote | None:
    """The caller's trace from its W3C headers, or None when `traceparent` is not valid. Cached: every call
    of an episode carries the same headers (its span's), and parsing costs a few microseconds. Both
    strings are at most `MAX_HEADER` characters where it matters, so the cache stays small."""
    parent = parse_traceparent(traceparent, tracestate)
    if parent is None:
        return None
    return Remote(parent, trace.set_span_in_context(NonRecordingSpan(parent)), format(parent.trace_id, "032x"))


def incoming(metadata: Iterable[tuple[str, str | bytes]] | None) -> tuple[str | None, Remote | None]:
    """(`x-rlgate-trace-id` or None, the caller's trace from `traceparent` / `tracestate` or None) of a
    call's metadata."""
    header = parent = state = None
    for key, value in metadata or ():
        if key == TRACE_HEADER:
            header = (value if isinstance(value, str) else value.decode("latin-1"))[:64]
        elif key == TRACEPARENT:
            parent = value if isinstance(value, str) else value.decode("latin-1")
        elif key == TRACESTATE:
            state = value if isinstance(value, str) else value.decode("latin-1")
    if parent is None or len(parent) > MAX_HEADER:
        return header, None
    return header, remote(parent, state if state and len(state) <= MAX_HEADER else None)


_caller_trace_id: ContextVar[int] = ContextVar("rlgate_caller_trace_id", default=0)
_ROOT = otel_context.Context()


def caller_trace_id(header: str | None) -> int:
    """`x-rlgate-trace-id` as a W3C trace id (0 when it is not 1-32 hex digits, or all zeros)."""
    return int(header, 16) if header and _HEX_ID.fullmatch(header) else 0


def _id_generator() -> Any:
    from opentelemetry.sdk.trace.id_generator import RandomIdGenerator

    class CallerTraceIds(RandomIdGenerator):
        """A root span started while a call's `x-rlgate-trace-id` is set (`_caller_trace_id`) takes that id
        as its trace id, so a caller without OpenTelemetry still gets one trace per episode, under the id
        its log lines show."""

        def generate_trace_id(self) -> int:
            return _caller_trace_id.get() or super().generate_trace_id()

        def is_trace_id_random(self) -> bool:
            return False

    return CallerTraceIds()


_SERVER_FAULTS = frozenset({"UNKNOWN", "DEADLINE_EXCEEDED", "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS"})


@contextlib.contextmanager
def server_span(
    name: str, attributes: dict[str, Any], parent: SpanContext | None, header: str | None
) -> Iterator[Span]:
    """The SERVER span of one RPC (only when recording): a child of `parent`, else a root whose trace id is
    the caller's `x-rlgate-trace-id` when that is hex."""
    assert _tracer is not None
    token = _caller_trace_id.set(caller_trace_id(header)) if parent is None and header else None
    try:
        started = _tracer.start_span(
            name,
            # Never an ambient context: an RPC's trace is its caller's, or a new one.
            context=trace.set_span_in_context(NonRecordingSpan(parent)) if parent is not None else _ROOT,
            kind=SpanKind.SERVER,
            attributes=attributes,
        )
    finally:
        if token is not None:
            _caller_trace_id.reset(token)
    with trace.use_span(started, end_on_exit=True, record_exception=False, set_status_on_exception=False):
        yield started


def end_rpc(span: Span, code: Any, session_id: str) -> None:
    """Record a finished RPC's status (grpc.StatusCode or None for OK) and session on its span."""
    name = getattr(code, "name", "OK")
    span.set_attribute("rpc.grpc.status_code", code.value[0] if code is not None else 0)
    if session_id and session_id != "-":
        span.set_attribute("rlgate.session_id", session_id)
    if name in _SERVER_FAULTS:
        span.set_status(StatusCode.ERROR, name)


# -- out: headers --------------------------------------------------------------------------------------
def inject_headers(headers: MutableMapping[str, str]) -> None:
    """Write the current span context as W3C `traceparent` / `tracestate` headers (nothing when there is
    none): a context check when tracing is off and no trace came in."""
    ctx = trace.get_current_span().get_span_context()
    if ctx.is_valid:
        headers[TRACEPARENT] = _traceparent(ctx.trace_id, ctx.span_id, ctx.trace_flags)
        if ctx.trace_state:
            headers[TRACESTATE] = ctx.trace_state.to_header()


@functools.lru_cache(maxsize=1024)
def _traceparent(trace_id: int, span_id: int, flags: int) -> str:
    # Cached: a trace passed on unchanged (tracing off) has the same header on every upstream request,
    # and formatting a 128-bit id costs most of a microsecond.
    return f"00-{trace_id:032x}-{span_id:016x}-{flags:02x}"


async def httpx_request_hook(request: Any) -> None:
    """An httpx `event_hooks={"request": [...]}` entry: W3C headers on every request of the client (Fleet)."""
    inject_headers(request.headers)


# -- setup ---------------------------------------------------------------------------------------------
def otlp_endpoint(configured: str = "", environ: MutableMapping[str, str] | None = None) -> str:
    """Where spans go: the configured endpoint, else OpenTelemetry's standard variables; "" means off
    (also when OTEL_SDK_DISABLED=true)."""
    env = os.environ if environ is None else environ
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return ""
    return configured or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "")


def setup(service: str, endpoint: str = "", *, exporter: Any = None) -> bool:
    """Install the OpenTelemetry SDK as the global tracer provider, exporting over OTLP/gRPC to `endpoint`
    (see `otlp_endpoint`) in batches, or to `exporter` span by span (tests). Returns whether tracing is on.
    Nothing is imported or installed when neither is given: the services then run on the API's no-op tracer.
    `service` is the resource's service.name unless OTEL_SERVICE_NAME says otherwise."""
    target = "" if exporter is not None else otlp_endpoint(endpoint)
    if exporter is None and not target:
        return False
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

    named = {} if os.environ.get("OTEL_SERVICE_NAME") else {"service.name": service}  # the operator's name wins
    provider = TracerProvider(resource=Resource.create(named), id_generator=_id_generator())
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    else:
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        except ImportError:
            log.error("tracing off: the OTLP exporter is not installed (pip install 'rlgate[server]')")
            return False
        # The exporter reads OTEL_EXPORTER_OTLP_* (headers, certificates, timeout, compression) itself.
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=target)))
    trace.set_tracer_provider(provider)  # the SDK flushes and shuts it down at exit
    if trace.get_tracer_provider() is not provider:
        log.warning("tracing: another tracer provider was installed first; its spans go where it sends them")
        provider.shutdown()
        return use_global_provider()
    use_global_provider()
    log.info("tracing on: spans exported to %s", target or type(exporter).__name__)
    return True
