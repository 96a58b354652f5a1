"""Structured logging with a per-request trace id and session id carried in context variables.

Every log line written while serving an RPC carries the caller's `x-rlgate-trace-id` (or a generated one)
and, once known, the session id. Secrets never reach logs: configs are logged through `config.redacted`.
"""

from __future__ import annotations

import contextvars
import json
import logging
import sys
import time

trace_id_var: contextvars.ContextVar[str] = contextvars.ContextVar("rlgate_trace_id", default="-")
session_id_var: contextvars.ContextVar[str] = contextvars.ContextVar("rlgate_session_id", default="-")

TRACE_HEADER = "x-rlgate-trace-id"


class _ContextFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.trace_id = trace_id_var.get()
        record.session_id = session_id_var.get()
        return True


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": round(record.created, 3),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
            "trace_id": getattr(record, "trace_id", "-"),
            "session_id": getattr(record, "session_id", "-"),
        }
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
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
        formatter = logging.Formatter(fmt)
        formatter.converter = time.gmtime
        handler.setFormatter(formatter)
    root.addHandler(handler)
    root.setLevel(level.upper())
    for noisy in ("httpx", "httpx2", "httpcore", "httpcore2", "mcp", "uvicorn.access"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
