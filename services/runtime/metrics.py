"""Prometheus metrics: get-or-create helpers (safe when several servers share one process, as in tests)
and a side HTTP endpoint serving `/metrics`."""

from __future__ import annotations

import logging
from typing import TypeVar

from prometheus_client import REGISTRY, Counter, Gauge, Histogram, start_http_server
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)

C = TypeVar("C", bound=Collector)

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


def _existing(kind: type[C], *names: str) -> C | None:
    """The collector of that kind already registered under one of `names` (another server in this process
    made it). One of another kind is not returned: creating ours then fails naming the duplicate."""
    for name in names:
        found = REGISTRY._names_to_collectors.get(name)
        if isinstance(found, kind):
            return found
    return None


def counter(name: str, doc: str, labels: list[str]) -> Counter:
    return _existing(Counter, name.removesuffix("_total"), name) or Counter(name, doc, labels)


def gauge(name: str, doc: str, labels: list[str] | None = None) -> Gauge:
    return _existing(Gauge, name) or Gauge(name, doc, labels or [])


def histogram(name: str, doc: str, labels: list[str]) -> Histogram:
    return _existing(Histogram, name) or Histogram(name, doc, labels, buckets=LATENCY_BUCKETS)


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
