"""Toolgateway configuration: every flag of `rlgate toolgateway` and its environment variable."""

from __future__ import annotations

from dataclasses import dataclass

from rlgate.runtime.config import setting


@dataclass
class GatewayConfig:
    listen: str = setting("127.0.0.1:50052", "RLGATE_TOOLGATEWAY_LISTEN", "gRPC listen address HOST:PORT")
    store_url: str = setting(
        "",
        "RLGATE_STORE_URL",
        "Session store URL: sqlite:///path.db or redis://host:port/db (empty: SQLite under the data dir)",
    )
    data_dir: str = setting(".rlgate", "RLGATE_DATA_DIR", "Directory for the default SQLite store")
    tls_cert: str = setting("", "RLGATE_TLS_CERT", "PEM certificate for TLS (with --tls-key)")
    tls_key: str = setting("", "RLGATE_TLS_KEY", "PEM private key for TLS")
    orchestrator_address: str = setting(
        "",
        "RLGATE_TOOLGATEWAY_ORCHESTRATOR_ADDRESS",
        "The orchestrator's address, named to callers that send it orchestrator methods (empty: not named)",
    )
    call_timeout_s: float = setting(
        60.0, "RLGATE_CALL_TIMEOUT_S", "Upstream call timeout when the caller sets no gRPC deadline"
    )
    max_output_bytes: int = setting(262144, "RLGATE_MAX_OUTPUT_BYTES", "Tool output above this is truncated")
    max_arguments_bytes: int = setting(
        1048576,
        "RLGATE_MAX_ARGUMENTS_BYTES",
        "CallTool arguments larger than this are INVALID_ARGUMENT (checked before parsing)",
    )
    client_idle_s: float = setting(300.0, "RLGATE_CLIENT_IDLE_S", "Close upstream MCP clients idle this long")
    tools_refresh_s: float = setting(
        300.0, "RLGATE_TOOLS_REFRESH_S", "Maximum age of a cached tool list (re-listed on next use)"
    )
    upstream_timeout_s: float = setting(
        30.0, "RLGATE_UPSTREAM_TIMEOUT_S", "MCP handshake and tools/list timeout per upstream endpoint"
    )
    connect_timeout_s: float = setting(10.0, "RLGATE_UPSTREAM_CONNECT_TIMEOUT_S", "TCP/TLS connect timeout upstream")
    upstream_max_connections: int = setting(
        8,
        "RLGATE_UPSTREAM_MAX_CONNECTIONS",
        "HTTP connections per upstream MCP client (concurrent calls of one session endpoint beyond this queue)",
    )
    upstream_common_sessions: int = setting(
        256,
        "RLGATE_UPSTREAM_COMMON_SESSIONS",
        "Sessions on a stateless-era (2026-07-28) URL that share one upstream MCP client (one handshake and "
        "tool listing); up to twice as many of their calls run at once (calls beyond those queue)",
    )
    upstream_keepalive_s: float = setting(
        4.0,
        "RLGATE_UPSTREAM_KEEPALIVE_S",
        "Reuse an idle upstream connection at most this long (counted from its last request for 2026-07-28 "
        "tool calls, from its last response otherwise); keep it below the "
        "upstream servers' idle timeout (uvicorn: 5 s), or a call racing the server's close is reported "
        "OUTCOME_UNKNOWN",
    )
    upstream_max_reply_bytes: int = setting(
        8 * 2**20,
        "RLGATE_UPSTREAM_MAX_REPLY_BYTES",
        "Largest upstream MCP reply read, in either MCP era: a longer one is cut off, its connection dropped, "
        "and the call answers TOOL_FAILED (the tool ran; its output is lost)",
    )
    janitor_interval_s: float = setting(
        1.0, "RLGATE_JANITOR_INTERVAL_S", "How often idle or closed sessions' upstream clients are looked for"
    )
    owner_ttl_s: float = setting(
        6.0, "RLGATE_OWNER_TTL_S", "Liveness lease of this process for in-flight request records (heartbeat: TTL/3)"
    )
    metrics_listen: str = setting("", "RLGATE_TOOLGATEWAY_METRICS", "Prometheus /metrics HOST:PORT (empty: off)")
    drain_s: float = setting(10.0, "RLGATE_DRAIN_S", "Shutdown: time to finish in-flight calls")
    log_level: str = setting("INFO", "RLGATE_LOG_LEVEL", "Log level")
    log_json: bool = setting(False, "RLGATE_LOG_JSON", "Log as JSON lines")
    otlp_endpoint: str = setting(
        "",
        "RLGATE_OTLP_ENDPOINT",
        "OpenTelemetry: export spans over OTLP/gRPC to this endpoint, e.g. http://collector:4317 (empty: the "
        "standard OTEL_EXPORTER_OTLP_ENDPOINT if set, else tracing off)",
    )
