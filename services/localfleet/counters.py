"""What clients did to localfleet, counted for tests (GET /_admin/counters, reset with DELETE)."""

from __future__ import annotations

from collections import Counter
from typing import Any

# Names every test can rely on (always present in the snapshot, 0 when nothing happened).
GLOBAL_NAMES = (
    "tcp_connections",
    "http_requests",
    "instances_created",
    "instances_deleted",
    "instances_expired",
    "verifier_runs",
)
ENV_NAMES = (
    "mcp_handshakes",
    "mcp_initialize",
    "mcp_discover",
    "mcp_tools_list",
    "tool_calls",
    "tool_errors_injected",
    "cancellations",
    "crashes",
    "sessions_forgotten",
    "mcp_404",
    "resets",
    "reset_hangs",
)


class Counters:
    """Global counters plus the same per-environment counters summed over environments."""

    def __init__(self) -> None:
        self._global: Counter[str] = Counter()
        self._env: dict[str, Counter[str]] = {}
        self._methods: Counter[str] = Counter()

    def inc(self, name: str, n: int = 1) -> None:
        self._global[name] += n

    def peak(self, name: str, value: int) -> None:
        """Keep the largest `value` seen (a high-water mark)."""
        self._global[name] = max(self._global[name], value)

    def inc_env(self, env_id: str, name: str, n: int = 1) -> None:
        self._env.setdefault(env_id, Counter())[name] += n
        self._global[name] += n

    def mcp_method(self, env_id: str, method: str) -> None:
        """One JSON-RPC message on an MCP endpoint."""
        self._methods[method] += 1
        if method == "initialize":
            self.inc_env(env_id, "mcp_initialize")
            self.inc_env(env_id, "mcp_handshakes")
        elif method == "server/discover":
            self.inc_env(env_id, "mcp_discover")
            self.inc_env(env_id, "mcp_handshakes")
        elif method == "tools/list":
            self.inc_env(env_id, "mcp_tools_list")

    def reset(self) -> None:
        self._global.clear()
        self._env.clear()
        self._methods.clear()

    def snapshot(self) -> dict[str, Any]:
        out: dict[str, Any] = {name: self._global.get(name, 0) for name in (*GLOBAL_NAMES, *ENV_NAMES)}
        out.update({k: v for k, v in self._global.items() if k not in out})
        out["mcp_methods"] = dict(self._methods)
        out["by_env"] = {env: {name: c.get(name, 0) for name in ENV_NAMES} for env, c in self._env.items()}
        return out
