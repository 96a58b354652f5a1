"""Orchestrator configuration: every flag of `rlgate orchestrator` and its environment variable."""

from __future__ import annotations

from dataclasses import dataclass

from rlgate.runtime.config import SettingError, setting


@dataclass
class OrchestratorConfig:
    listen: str = setting("127.0.0.1:50051", "RLGATE_ORCHESTRATOR_LISTEN", "gRPC listen address HOST:PORT")
    store_url: str = setting(
        "",
        "RLGATE_STORE_URL",
        "Session store URL: sqlite:///path.db or redis://host:port/db (empty: SQLite under the data dir)",
    )
    data_dir: str = setting(".rlgate", "RLGATE_DATA_DIR", "Directory for the default SQLite store")
    provider: str = setting("fleet", "RLGATE_PROVIDER", "Instance provider: fleet (Fleet or localfleet) or mcp")
    fleet_base_url: str = setting(
        "http://127.0.0.1:8765", "FLEET_BASE_URL", "Fleet control-plane URL (localfleet by default)"
    )
    fleet_api_key: str = setting("localfleet", "FLEET_API_KEY", "Fleet API key", secret=True)
    tasks_file: str = setting(
        "", "RLGATE_TASKS_FILE", "Task JSON file in Fleet's format (empty: load tasks from the provider)"
    )
    gateway_address: str = setting(
        "127.0.0.1:50052",
        "RLGATE_GATEWAY_ADDRESS",
        "Toolgateway address handed to clients in Reset; several, comma-separated (toolgateway processes on one "
        "host, one per core): each session is handed one of them, always the same",
    )
    api_keys: list[str] = setting(  # noqa: RUF009
        [],
        "RLGATE_API_KEYS",
        "API keys accepted as 'authorization: Bearer'",
        secret=True,
    )
    insecure: bool = setting(False, "RLGATE_INSECURE", "Allow listening on a non-loopback address without API keys")
    tls_cert: str = setting("", "RLGATE_TLS_CERT", "PEM certificate for TLS (with --tls-key)")
    tls_key: str = setting("", "RLGATE_TLS_KEY", "PEM private key for TLS")
    run_id: str = setting(
        "",
        "RLGATE_RUN_ID",
        "Run id tagged on every instance (empty: rlgate-<id of the store>, made once and kept "
        "in the store, so deployments with their own stores never share one)",
    )
    default_max_turns: int = setting(20, "RLGATE_DEFAULT_MAX_TURNS", "Turn limit when a task sets none")
    max_sessions: int = setting(1000, "RLGATE_MAX_SESSIONS", "Open sessions allowed at once")
    max_fork_branches: int = setting(16, "RLGATE_MAX_FORK_BRANCHES", "Branches one Fork may make (its count)")
    session_ttl_s: float = setting(3600.0, "RLGATE_SESSION_TTL_S", "Session lifetime before it is reaped")
    idle_timeout_s: float = setting(900.0, "RLGATE_IDLE_TIMEOUT_S", "Reap sessions idle this long")
    instance_ttl_s: int = setting(
        0,
        "RLGATE_INSTANCE_TTL_S",
        "ttl_seconds on every instance (dies even if the store is lost); 0: the provider's default by modality "
        "(fleet: 1800 for computer_use/browser_use, 900 for tool_use)",
    )
    heartbeat_interval_s: int = setting(
        60, "RLGATE_HEARTBEAT_INTERVAL_S", "heartbeat_interval on every instance; heartbeats sent at half of it"
    )
    provision_timeout_s: float = setting(120.0, "RLGATE_PROVISION_TIMEOUT_S", "Timeout of one instance create")
    reset_timeout_s: float = setting(10.0, "RLGATE_RESET_TIMEOUT_S", "Timeout of the manager's /reset")
    verify_timeout_s: float = setting(60.0, "RLGATE_VERIFY_TIMEOUT_S", "Timeout of one verifier run")
    verify_retries: int = setting(2, "RLGATE_VERIFY_RETRIES", "Retries of a verifier infrastructure failure")
    max_concurrent_creates: int = setting(
        16,
        "RLGATE_MAX_CONCURRENT_CREATES",
        "Instance creates in flight on the provider account, across every replica on the store (Fleet's burst cap)",
    )
    create_rate: float = setting(
        20.0, "RLGATE_CREATE_RATE", "Instance creates per second on the provider account, across every replica"
    )
    create_burst: float = setting(
        16.0, "RLGATE_CREATE_BURST", "Creates that may start at once after a quiet spell (the rate's bucket size)"
    )
    create_rate_min: float = setting(
        1.0, "RLGATE_CREATE_RATE_MIN", "The floor a provider's throttling cuts the create rate down to"
    )
    create_rate_recovery: float = setting(
        2.0,
        "RLGATE_CREATE_RATE_RECOVERY",
        "After a throttle, the create rate climbs back by this many creates/s every second",
    )
    create_queue_wait_s: float = setting(
        60.0,
        "RLGATE_CREATE_QUEUE_WAIT_S",
        "Longest a create waits for admission (never past the Reset's deadline), then RESOURCE_EXHAUSTED",
    )
    create_queue_max: int = setting(
        4096, "RLGATE_CREATE_QUEUE_MAX", "Creates one process queues for admission at most (then RESOURCE_EXHAUSTED)"
    )
    create_account: str = setting(
        "",
        "RLGATE_CREATE_ACCOUNT",
        "Name of the provider account whose create limits replicas share (empty: derived from the provider, its "
        "URL and API key)",
    )
    warm_pool: str = setting("", "RLGATE_WARM_POOL", "Warm pool targets, e.g. 'mailbox:v1=4,tracker:v1=2'")
    pool_max_age_s: float = setting(
        300.0,
        "RLGATE_POOL_MAX_AGE_S",
        "A warm-pool instance idle longer than this is deleted and replaced, never handed out (0: no bound; keep "
        "it well under the instance TTL)",
    )
    reconcile_interval_s: float = setting(
        30.0, "RLGATE_RECONCILE_INTERVAL_S", "How often to reconcile the store with the provider"
    )
    retention_s: float = setting(86400.0, "RLGATE_RETENTION_S", "Keep closed sessions and records this long")
    drain_s: float = setting(20.0, "RLGATE_DRAIN_S", "Shutdown: time to close sessions and finish RPCs")
    mcp_envs: str = setting(
        "",
        "RLGATE_MCP_ENVS",
        "mcp provider: MCP environments NAME=URL[|URL...], comma-separated, e.g. "
        "'calc=http://127.0.0.1:9000/mcp|http://127.0.0.1:9001/mcp'; endpoint order is precedence on tool-name "
        "collisions; every URL must be http(s) with a path (checked at start)",
    )
    pool_on_close: bool = setting(
        False, "RLGATE_POOL_ON_CLOSE", "Close resets an instance back into its warm pool (when below target)"
    )
    capacity_wait_s: float = setting(
        30.0, "RLGATE_CAPACITY_WAIT_S", "At the instance limit, a Reset without a deadline waits this long"
    )
    provider_timeout_s: float = setting(
        15.0, "RLGATE_PROVIDER_TIMEOUT_S", "Timeout of one control-plane call (delete, list, heartbeat)"
    )
    health_timeout_s: float = setting(5.0, "RLGATE_HEALTH_TIMEOUT_S", "Warm-pool hand-out health check timeout")
    tools_timeout_s: float = setting(20.0, "RLGATE_TOOLS_TIMEOUT_S", "Tool discovery (MCP tools/list) timeout")
    tools_refresh_s: float = setting(
        300.0, "RLGATE_TOOLS_REFRESH_S", "Maximum age of a cached tool list for Reset (the toolgateway's setting)"
    )
    reap_interval_s: float = setting(5.0, "RLGATE_REAP_INTERVAL_S", "How often TTL/idle reaping runs")
    owner_ttl_s: float = setting(
        15.0, "RLGATE_OWNER_TTL_S", "This process counts as dead in the store this long after its last beat"
    )
    shutdown_mode: str = setting(
        "close",
        "RLGATE_SHUTDOWN_MODE",
        "On SIGTERM: 'close' every open session of this run (instances deleted) or "
        "'handoff' (leave sessions to other replicas of the same run_id)",
    )
    metrics_listen: str = setting("", "RLGATE_ORCHESTRATOR_METRICS", "Prometheus /metrics HOST:PORT (empty: off)")
    log_level: str = setting("INFO", "RLGATE_LOG_LEVEL", "Log level")
    log_json: bool = setting(False, "RLGATE_LOG_JSON", "Log as JSON lines")
    otlp_endpoint: str = setting(
        "",
        "RLGATE_OTLP_ENDPOINT",
        "OpenTelemetry: export spans over OTLP/gRPC to this endpoint, e.g. http://collector:4317 (empty: the "
        "standard OTEL_EXPORTER_OTLP_ENDPOINT if set, else tracing off)",
    )

    def __post_init__(self) -> None:
        if self.mcp_envs:  # a mistyped endpoint fails the start, rather than leaving its environment without it
            from rlgate.orchestrator.providers.mcp import parse_mcp_envs

            try:
                parse_mcp_envs(self.mcp_envs)
            except ValueError as exc:
                raise SettingError("mcp_envs", str(exc)) from None
