"""The `mcp` provider: bring-your-own MCP endpoints, no instance manager.

Endpoints come from the task (`mcp_endpoints`, top level or in metadata) or from the orchestrator's
`--mcp-envs` definition (`env_key=url|url,...`). There is nothing to create, reset or delete: Reset only
registers a session, and scoring is whatever the task defines: `metadata.expected_answer` compares the
final answer (normalised: case and surrounding whitespace); without it verification is SKIPPED.
"""

from __future__ import annotations

import json
from typing import Any

from rlgate.orchestrator.providers.base import (
    EnvNotFound,
    InstanceHandle,
    Provider,
    TaskDef,
    VerifierRun,
)


def parse_mcp_envs(spec: str) -> dict[str, list[str]]:
    """'calc:v1=http://127.0.0.1:9000/mcp|http://127.0.0.1:9001/mcp,other=...' -> {env_key: [urls]}."""
    out: dict[str, list[str]] = {}
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        key, sep, urls = part.partition("=")
        if not sep or not key.strip() or not urls.strip():
            raise ValueError(f"bad mcp env definition {part!r} (want env_key=url|url)")
        out[key.strip()] = [u.strip() for u in urls.split("|") if u.strip()]
    return out


class McpProvider(Provider):
    name = "mcp"
    manages_instances = False

    def __init__(self, envs: dict[str, list[str]]) -> None:
        self._envs = envs

    async def load_tasks(self, *, timeout_s: float) -> list[TaskDef]:
        return []  # tasks come from --tasks-file

    def can_verify(self, task: TaskDef) -> bool:
        return "expected_answer" in task.metadata

    def endpoints_for(self, env_key: str, task: TaskDef | None) -> list[str]:
        if task is not None and task.mcp_endpoints:
            return list(task.mcp_endpoints)
        endpoints = self._envs.get(env_key) or self._envs.get(env_key.partition(":")[0])
        if not endpoints:
            raise EnvNotFound(f"no MCP endpoints defined for {env_key!r} (task mcp_endpoints or --mcp-envs)")
        return list(endpoints)

    async def create(self, env_key: str, *, env_variables: dict[str, Any], run_id: str, ttl_s: int,
                     heartbeat_interval_s: int, timeout_s: float) -> InstanceHandle:
        raise EnvNotFound("the mcp provider does not create instances")

    async def reset(self, handle: InstanceHandle, *, timeout_s: float) -> None:
        return None  # no instance manager: nothing to restore

    async def health(self, handle: InstanceHandle, *, timeout_s: float) -> bool:
        return True

    async def delete(self, instance_id: str, *, timeout_s: float) -> None:
        return None

    async def heartbeat(self, instance_id: str, *, timeout_s: float) -> None:
        return None

    async def list_instances(self, run_id: str, *, timeout_s: float) -> list[InstanceHandle]:
        return []

    async def verify(self, task: TaskDef, handle: InstanceHandle, final_answer: str | None, *,
                     timeout_s: float) -> VerifierRun:
        expected = task.metadata.get("expected_answer")
        if expected is None:
            return VerifierRun(success=False, message="task defines no scoring")
        got = (final_answer or "").strip().lower()
        want = (expected if isinstance(expected, str) else json.dumps(expected)).strip().lower()
        return VerifierRun(success=True, score=1.0 if got == want else 0.0)
