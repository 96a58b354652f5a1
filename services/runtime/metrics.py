"""Prometheus metrics: get-or-create helpers (safe when several servers share one process, as in tests)
and a side HTTP endpoint serving `/metrics`."""

from __future__ import annotations

import logging
from typing import Any

from prometheus_client import REGISTRY, Counter, Gauge, Histogram, start_http_server

log = logging.getLogger(__name__)

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


def _existing(name: str) -> Any | None:
    return REGISTRY._names_to_collectors.get(name)  # type: ignore[attr-defined]


def counter(name: str, doc: str, labels: list[str]) -> Counter:
    found = _existing(name.removesuffix("_total")) or _existing(name)
    return found if found is not None else Counter(name, doc, labels)  # type: ignore[return-value]


def gauge(name: str, doc: str, labels: list[str] | None = None) -> Gauge:
    found = _existing(name)
    return found if found is not None else Gauge(name, doc, labels or [])  # type: ignore[return-value]


def histogram(name: str, doc: str, labels: list[str]) -> Histogram:
    found = _existing(name)
    return found if found is not None else Histogram(name, doc, labels, buckets=LATENCY_BUCKETS)  # type: ignore[return-value]


def serve_metrics(listen: str) -> int | None:
    """Start the `/metrics` side port (HOST:PORT; empty disables). Returns the bound port."""
    if not listen:
        return None
    from rlgate.runtime.config import split_host_port

    host, port = split_host_port(listen)
    server, _thread = start_http_server(port, addr=host)
    bound = int(server.server_address[1])
    log.info("metrics on http://%s:%d/metrics", host, bound)
    return bound
