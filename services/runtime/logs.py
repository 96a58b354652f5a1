"""Structured logging with a per-request trace id and session id carried in context variables.

Every log line written while serving an RPC carries the RPC's trace id and, once known, the session id.
`Pipeline` sets the trace id: the trace-id of the caller's W3C `traceparent`, else its
`x-rlgate-trace-id`, else the new trace's (tracing on) or a random one, so a line's trace id finds the
RPC's spans (rlgate.runtime.tracing). Secrets never reach logs: configs are logged through `config.redacted`,
and a URL in a message or a traceback is written without its userinfo and query (`redact.redact_urls`).

A log line is one line whatever a message contains: tool names, arguments and upstream errors are written
by agents and upstreams, so control characters in a message are escaped (a newline in a tool name cannot
forge a second log line). JSON lines get the same guarantee from JSON's own escaping.
"""

from __future__ import annotations

import contextvars
import json
import logging
import re
import sys
import time

from rlgate.core.redact import redact_urls

trace_id_var: contextvars.ContextVar[str] = contextvars.ContextVar("rlgate_trace_id", default="-")
session_id_var: contextvars.ContextVar[str] = contextvars.ContextVar("rlgate_session_id", default="-")

TRACE_HEADER = "x-rlgate-trace-id"


class _ContextFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.trace_id = trace_id_var.get()
        record.session_id = session_id_var.get()
        return True


# C0 and C1 controls (NEL, U+0085, ends a line for many readers) and the Unicode line/paragraph separators.
_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f-\x9f\u2028\u2029]")


def one_line(text: str) -> str:
    """`text` with control characters escaped (\\n, \\x1b, ...): safe to put on one log line."""
    return _CONTROL.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), text)


class _TextFormatter(logging.Formatter):
    """The plain-text format, with each message kept to one line (tracebacks still follow it)."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = one_line(record.message)
        return super().formatMessage(record)

    def format(self, record: logging.LogRecord) -> str:
        # The whole line, traceback included (another handler may have cached the record's traceback text).
        return redact_urls(super().format(record))


class _NoUndecodableMetadata(logging.Filter):
    """grpcio logs a metadata value it cannot decode as UTF-8 whole ("Invalid encoding on b'Bearer ...'"), so
    an API key or agent token with one stray byte would land in the log. The event is kept, the value dropped."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str) and record.msg.startswith("Invalid encoding"):
            record.msg = "Invalid encoding on a metadata value (the value is not logged)"
            record.args = ()
            record.exc_info = None
            record.exc_text = None
        return True


GRPC_CYTHON_LOGGER = "grpc._cython.cygrpc"


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": round(record.created, 3),
            "level": record.levelname,
            "logger": record.name,
            "msg": redact_urls(record.getMessage()),
            "trace_id": getattr(record, "trace_id", "-"),
            "session_id": getattr(record, "session_id", "-"),
        }
        if record.exc_info:
            entry["exc"] = redact_urls(self.formatException(record.exc_info))
        return json.dumps(entry)


def setup_logging(level: str = "INFO", json_format: bool = False, service: str = "rlgate") -> None:
    """Configure the root logger once per process (idempotent)."""
    root = logging.getLogger()
    for h in list(root.handlers):
        if getattr(h, "_rlgate", False):
            root.removeHandler(h)
    handler = logging.StreamHandler(sys.stderr)
    handler._rlgate = True  # type: ignore[attr-defined]
    handler.addFilter(_ContextFilter())
    if json_format:
        handler.setFormatter(_JsonFormatter())
    else:
        fmt = f"%(asctime)s %(levelname)s {service} %(name)s trace=%(trace_id)s session=%(session_id)s %(message)s"
        formatter = _TextFormatter(fmt)
        formatter.converter = time.gmtime
        handler.setFormatter(formatter)
    root.addHandler(handler)
    grpc_logger = logging.getLogger(GRPC_CYTHON_LOGGER)
    if not any(isinstance(f, _NoUndecodableMetadata) for f in grpc_logger.filters):
        grpc_logger.addFilter(_NoUndecodableMetadata())
    root.setLevel(level.upper())
    for noisy in ("httpx", "httpx2", "httpcore", "httpcore2", "mcp", "uvicorn.access"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
