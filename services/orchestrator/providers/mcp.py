"""The `mcp` provider: your own MCP servers, no instance manager.

Environments are named endpoint lists (`--mcp-envs 'NAME=URL|URL,...'`, or `rlgate up --mcp NAME=URL|URL`),
checked at start: every URL must be http(s) with a host and a path. Endpoint order is precedence: on a
tool-name collision the endpoint listed first wins. A task may bring its own endpoints (`mcp_endpoints`).
There is nothing to create, reset or delete: Reset registers a session (after listing the endpoints' tools,
which is where an unreachable endpoint shows), Close forgets it.

Per environment, a task file's `envs` sets the modality and allow / deny tool filters; a task adds its own
(its `allow`, when given, replaces the environment's; `deny` patterns of both apply). Scoring is what the task
defines: verifier code (run in a subprocess with the episode's final answer and tool-call log), else an
`expected_answer` compared with the final answer (case and whitespace normalised; a list: any of them);
without either, verification is SKIPPED.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from rlgate.orchestrator.providers.base import (
    EnvNotFound,
    InstanceHandle,
    Provider,
    TaskDef,
    VerifierRun,
)
from rlgate.orchestrator.providers.code_verifier import run_verifier_code
from rlgate.orchestrator.tasks import EnvSettings, endpoint_url, explicit_modality, parse_task_file


def parse_mcp_envs(spec: str | Sequence[str]) -> dict[str, list[str]]:
    """'calc=http://127.0.0.1:9000/mcp|http://127.0.0.1:9001/mcp,other=...' (or a list of such parts) ->
    {env_key: [urls]}. ValueError, one line naming the part, for anything malformed."""
    parts = spec.split(",") if isinstance(spec, str) else [p for item in spec for p in item.split(",")]
    out: dict[str, list[str]] = {}
    for part in parts:
        part = part.strip()
        if not part:
            continue
        key, sep, urls = part.partition("=")
        key = key.strip()
        if not sep or not key or not urls.strip():
            raise ValueError(f"MCP environment {part!r}: want NAME=URL[|URL...]")
        if key in out:
            raise ValueError(f"MCP environment {key!r} is defined twice")
        out[key] = [endpoint_url(u, f"MCP environment {key!r}") for u in urls.split("|") if u.strip()]
    return out


def merge_filters(env: dict[str, list[str]], task: dict[str, list[str]]) -> dict[str, list[str]]:
    """The task's `allow` (when given) replaces the environment's; both `deny` lists apply."""
    out: dict[str, list[str]] = {}
    allow = task.get("allow") or env.get("allow")
    if allow:
        out["allow"] = list(allow)
    deny = [*env.get("deny", []), *(p for p in task.get("deny", []) if p not in env.get("deny", []))]
    if deny:
        out["deny"] = deny
    return out


def _normalised(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value)
    return re.sub(r"\s+", " ", text).strip().casefold()


class McpProvider(Provider):
    name = "mcp"
    manages_instances = False

    def __init__(self, envs: dict[str, list[str]], settings: dict[str, EnvSettings] | None = None) -> None:
        self._envs = envs
        self._settings = dict(settings or {})

    async def load_tasks(self, *, timeout_s: float) -> list[TaskDef]:
        return []  # no task file: no tasks (Reset by env key still works)

    async def parse_task_file(self, text: str) -> list[TaskDef]:
        """Tasks, and the file's `envs` settings (an environment's modality is its tasks' default)."""
        parsed = parse_task_file(text)
        self._settings.update(parsed.envs)
        tasks = []
        for entry in parsed.entries:
            task = await self.parse_task(entry)
            env = self._env_settings(task.env_key)
            if env.modality and not explicit_modality(entry):
                task.modality = env.modality
            if not task.mcp_endpoints:
                self.endpoints_for(task.env_key, task)  # a task of no defined environment fails the load
            tasks.append(task)
        return tasks

    def _env_settings(self, env_key: str) -> EnvSettings:
        return self._settings.get(env_key) or self._settings.get(env_key.partition(":")[0]) or EnvSettings()

    def session_filter(self, env_key: str, task: TaskDef | None) -> dict[str, Any]:
        env = self._env_settings(env_key)
        modality = task.modality if task else (env.modality or "tool_use")
        return {"modality": modality, **merge_filters(env.tool_filter, task.tool_filter if task else {})}

    def can_verify(self, task: TaskDef) -> bool:
        return bool(task.verifier_code) or task.expected_answer is not None

    def wants_tool_calls(self, task: TaskDef) -> bool:
        return bool(task.verifier_code)

    def endpoints_for(self, env_key: str, task: TaskDef | None) -> list[str]:
        if task is not None and task.mcp_endpoints:
            return list(task.mcp_endpoints)
        endpoints = self._envs.get(env_key) or self._envs.get(env_key.partition(":")[0])
        if not endpoints:
            known = ", ".join(sorted(self._envs)) or "none"
            raise EnvNotFound(f"no MCP endpoints defined for {env_key!r} (defined: {known}; --mcp NAME=URL)")
        return list(endpoints)

    async def create(
        self,
        env_key: str,
        *,
        env_variables: dict[str, Any],
        run_id: str,
        ttl_s: int,
        heartbeat_interval_s: int,
        timeout_s: float,
        modality: str = "tool_use",
    ) -> InstanceHandle:
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

    async def verify(
        self,
        task: TaskDef,
        handle: InstanceHandle,
        final_answer: str | None,
        *,
        timeout_s: float,
        tool_calls: Sequence[Any] | None = None,
    ) -> VerifierRun:
        if task.verifier_code:
            payload = {
                "final_answer": final_answer,
                "tool_calls": [_call_record(c) for c in tool_calls or ()],
                "env": {
                    "env_key": handle.env_key,
                    "endpoints": list(handle.endpoints),
                    "task_key": task.key,
                    "metadata": task.metadata,
                    "expected_answer": task.expected_answer,
                },
            }
            return await run_verifier_code(task.verifier_code, payload, timeout_s)
        expected = task.expected_answer
        if expected is None:
            return VerifierRun(success=False, message="task defines no scoring")
        accepted = expected if isinstance(expected, list) else [expected]
        got = _normalised(final_answer or "")
        return VerifierRun(success=True, score=1.0 if any(got == _normalised(a) for a in accepted) else 0.0)


def _call_record(entry: Any) -> dict[str, Any]:
    """A tool-call log entry as the verifier sees it (JSON)."""
    return {
        "tool": entry.tool,
        "arguments": entry.arguments,
        "is_error": entry.is_error,
        "error_kind": entry.error_kind,
        "result_summary": entry.result_summary,
        "endpoint": entry.endpoint,
        "request_id": entry.request_id,
        "duration_ms": entry.duration_ms,
    }
