"""Task files (`services/localfleet/tasks/*.json`, Fleet's task JSON) and their `/v1/tasks` form."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

TASKS_DIR = Path(__file__).parent / "tasks"


def load_tasks(directory: Path | None = None) -> list[dict[str, Any]]:
    """Every task of every `*.json` file (a list, or `{"tasks": [...]}`), in file then list order.

    Task files are trusted code: their `verifier_code` is executed by localfleet.
    """
    tasks: list[dict[str, Any]] = []
    seen: set[str] = set()
    for path in sorted((directory or TASKS_DIR).glob("*.json")):
        doc = json.loads(path.read_text())
        items = doc.get("tasks", []) if isinstance(doc, dict) else doc
        if not isinstance(items, list):
            raise ValueError(f"{path}: expected a list of tasks or {{'tasks': [...]}}")
        for task in items:
            key = task.get("key") or task.get("task_key")
            if not key:
                raise ValueError(f"{path}: a task has no key")
            if key in seen:
                raise ValueError(f"{path}: duplicate task key {key!r}")
            seen.add(key)
            tasks.append(task)
    return tasks


def task_response(task: dict[str, Any], created_at: str) -> dict[str, Any]:
    """A task in the control plane's `TaskResponse` shape (what `Fleet.load_tasks()` parses)."""
    code = task.get("verifier_code") or task.get("verifier_func") or (task.get("verifier") or {}).get("code")
    key = task.get("key") or task["task_key"]
    out: dict[str, Any] = {
        "key": key,
        "prompt": task["prompt"],
        "team_id": "localfleet",
        "environment_id": task.get("env_id") or task.get("env_key", "").partition(":")[0],
        "created_at": created_at,
        "version": task.get("version"),
        "env_variables": task.get("env_variables") or {},
        "metadata": {**(task.get("metadata") or {}), "task_modality": task.get("task_modality", "tool_use")},
        "verifier_func": code,
        "task_modality": task.get("task_modality", "tool_use"),
    }
    if code:
        out["verifier_id"] = key
        out["verifier"] = {
            "verifier_id": key,
            "key": key,
            "version": 1,
            "sha256": hashlib.sha256(code.encode()).hexdigest(),
            "code": code,
            "created_at": created_at,
        }
    return out
