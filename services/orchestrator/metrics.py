"""The orchestrator's Prometheus metrics (get-or-create, so several in-process servers share them)."""

from __future__ import annotations

from rlgate.runtime import metrics as m

SESSIONS = m.gauge("rlgate_orchestrator_sessions", "Sessions in the store by status (this run)", ["status"])
POOL_SIZE = m.gauge("rlgate_orchestrator_pool_size", "Idle warm-pool instances by env key", ["env_key"])
CREATES_IN_FLIGHT = m.gauge("rlgate_orchestrator_creates_in_flight", "Instance creates in flight")
CREATES_QUEUED = m.gauge(
    "rlgate_orchestrator_creates_queued", "Creates waiting for admission in this process", ["priority"]
)
CREATE_SLOTS_HELD = m.gauge("rlgate_orchestrator_create_slots_held", "Create admission slots this process holds")
CREATE_RATE = m.gauge(
    "rlgate_orchestrator_create_rate", "The provider account's shared create rate (creates/s) as last read"
)
CREATE_THROTTLES = m.counter(
    "rlgate_orchestrator_create_throttles_total", "Creates the provider refused for its rate or burst cap", []
)
PROVISION_SECONDS = m.histogram("rlgate_orchestrator_provision_seconds", "Instance create latency", ["outcome"])
RESET_SECONDS = m.histogram("rlgate_orchestrator_reset_seconds", "Instance manager reset latency", ["outcome"])
VERIFY_SECONDS = m.histogram("rlgate_orchestrator_verify_seconds", "Verification latency", ["status"])
VERIFY_OUTCOMES = m.counter("rlgate_orchestrator_verifications_total", "Verifier outcomes", ["status"])
REAPED = m.counter("rlgate_orchestrator_reaped_total", "Sessions reaped", ["reason"])
RECONCILED = m.counter(
    "rlgate_orchestrator_reconciled_total",
    "Reconciliation actions (orphan_deleted, session_resumed, session_lost)",
    ["action"],
)
POOL_DISCARDED = m.counter(
    "rlgate_orchestrator_pool_discarded_total",
    "Idle warm-pool instances deleted instead of handed out (aged out, failed its health check)",
    ["reason"],
)
POOL_HITS = m.counter("rlgate_orchestrator_pool_total", "Warm-pool hand-outs (hit) and misses", ["result"])
