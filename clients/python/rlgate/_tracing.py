"""W3C trace context from the client, through OpenTelemetry when `opentelemetry-api` is installed (the base
install works without it: calls then carry only `x-rlgate-trace-id`).

- `trace_metadata`: one call's trace id and metadata. When an OpenTelemetry span is current, its W3C `traceparent`
  (and `tracestate`) go with the call and its trace id is the call's `x-rlgate-trace-id`, so the services'
  log lines show the trace id of the trace.
- `EpisodeTrace`: one trace per episode. An `Episode` starts a span "episode" (a child of the caller's
  current span, if any) and makes it current around each of its calls (Reset, ListTools, CallTool, Step,
  State, Close), so the services' spans of the episode, and the upstream calls they make, form one trace.
  Without an OpenTelemetry SDK in the caller the span is not valid; the episode then keeps one
  `x-rlgate-trace-id` (32 hex digits), which a tracing service uses as the trace id of its spans.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

try:
    from opentelemetry import context as otel_context
    from opentelemetry import trace
except ImportError:  # the base install: no OpenTelemetry
    trace = None  # type: ignore[assignment]

TRACE_HEADER = "x-rlgate-trace-id"


def new_trace_id() -> str:
    """A random trace id: 32 hex digits, a valid W3C trace id."""
    # 128 random bits from the OS as hex; a uuid4 would build an int and a UUID object around them per call.
    return os.urandom(16).hex()


def trace_metadata(trace_id: str | None) -> tuple[str, list[tuple[str, str]]]:
    """One call's trace id and metadata: `x-rlgate-trace-id` (`trace_id`, else a new one) and, when an
    OpenTelemetry span is current, its W3C context; then the span's trace id is the call's trace id, whatever
    `trace_id` says."""
    if trace is not None:
        ctx = trace.get_current_span().get_span_context()
        if ctx.is_valid:
            span_trace_id = f"{ctx.trace_id:032x}"
            metadata = [
                (TRACE_HEADER, span_trace_id),
                ("traceparent", f"00-{span_trace_id}-{ctx.span_id:016x}-{ctx.trace_flags:02x}"),
            ]
            if ctx.trace_state:
                metadata.append(("tracestate", ctx.trace_state.to_header()))
            return span_trace_id, metadata
    trace_id = trace_id or new_trace_id()
    return trace_id, [(TRACE_HEADER, trace_id)]


class EpisodeTrace:
    """The span of one episode (see the module docstring); every method is a no-op without OpenTelemetry."""

    def __init__(self) -> None:
        self._span: Any = None
        self._context: Any = None

    def start(self, attributes: dict[str, str]) -> str:
        """End the previous episode's span and start this one's; its trace id ("" when it is not valid)."""
        self.end()
        if trace is None:
            return ""
        span = trace.get_tracer("rlgate.client").start_span("episode", attributes=attributes)
        ctx = span.get_span_context()
        if not ctx.is_valid:
            return ""
        self._span, self._context = span, trace.set_span_in_context(span)
        return f"{ctx.trace_id:032x}"

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """The episode's span is current inside the block (the calls made there carry it)."""
        if self._context is None:
            yield
            return
        token = otel_context.attach(self._context)
        try:
            yield
        finally:
            otel_context.detach(token)

    def set(self, key: str, value: str | int | float | bool) -> None:
        if self._span is not None:
            self._span.set_attribute(key, value)

    def end(self, error: BaseException | None = None) -> None:
        span, self._span, self._context = self._span, None, None
        if span is None:
            return
        if error is not None:
            span.record_exception(error)
            span.set_status(trace.StatusCode.ERROR, f"{type(error).__name__}: {error}")
        span.end()
