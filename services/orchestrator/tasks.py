"""Tasks: Fleet's task JSON normalised into `TaskDef`, and the catalog ListTasks pages through.

Fleet's format: `key`, `prompt`, `env_id` (or `env_key`/`environment_id`/`env`), `version`, `task_modality`,
`verifier_code`/`verifier_func`/`verifier.code` (`def verify(env, final_answer=None)`), `metadata`
(may hold a reference solution), `env_variables`. rlgate also reads `max_turns`, `modality`, `expected_answer`
(top level or in metadata; an answer key, never returned), `tool_filter` (`allow` / `deny` tool-name patterns)
and, for the mcp provider, `mcp_endpoints` (top level or in metadata). A task file is a JSON array
of tasks or `{"tasks": [...], "envs": {NAME: {"modality": ..., "tool_filter": ...}}}` (`envs`: the mcp
provider's per-environment settings).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import urllib.parse
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from rlgate.core.errors import InvalidArgument, NotFound, clip
from rlgate.orchestrator.limits import MAX_KEY
from rlgate.orchestrator.providers.base import TaskDef

MODALITIES = ("tool_use", "computer_use", "browser_use")
NO_MODALITY_FILTER = "all"  # bring-your-own endpoints: every tool, `computer` included (the gateway's word)
_MODALITY_KEYS = ("task_modality", "modality")


def split_env_key(env_key: str) -> tuple[str, str]:
    """'mailbox:v1' -> ('mailbox', 'v1'); 'mailbox' -> ('mailbox', '')."""
    env_id, _, version = env_key.partition(":")
    return env_id, version


def endpoint_url(url: Any, what: str) -> str:
    """An MCP endpoint as given by a user, checked: an http(s) URL with a host and a path (ValueError, one line
    naming `what`, otherwise). A URL without a path is almost always a forgotten `/mcp`."""
    text = str(url).strip()
    try:
        parts = urllib.parse.urlsplit(text)
        parts.port  # noqa: B018 (raises on a port that is not a number)
    except ValueError as exc:
        raise ValueError(f"{what}: {text!r} is not a URL ({exc})") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{what}: {text!r} is not an http(s) URL (want http://HOST:PORT/PATH, e.g. .../mcp)")
    if parts.path in ("", "/"):
        raise ValueError(f"{what}: {text!r} has no path (an MCP endpoint is a path such as {text.rstrip('/')}/mcp)")
    return text


def tool_filter_of(obj: Any, what: str) -> dict[str, list[str]]:
    """`{"allow": [...], "deny": [...]}` (tool names or shell-style globs), checked; empty lists left out."""
    if obj is None:
        return {}
    if not isinstance(obj, dict) or set(obj) - {"allow", "deny"}:
        raise ValueError(f"{what}: tool_filter must be an object with 'allow' and/or 'deny' lists")
    out: dict[str, list[str]] = {}
    for name in ("allow", "deny"):
        patterns = obj.get(name) or []
        if not isinstance(patterns, list) or not all(isinstance(p, str) and p for p in patterns):
            raise ValueError(f"{what}: tool_filter.{name} must be a list of tool names or globs")
        if patterns:
            out[name] = list(patterns)
    return out


def explicit_modality(obj: dict[str, Any]) -> str:
    """The modality a task entry names itself (top level, then metadata), or ""."""
    metadata = obj.get("metadata")
    for source in (obj, metadata if isinstance(metadata, dict) else {}):
        for name in _MODALITY_KEYS:
            if source.get(name):
                return str(source[name])
    return ""


def task_from_json(obj: dict[str, Any]) -> TaskDef:
    """One task from Fleet's task JSON (a file entry or a `/v1/tasks` item)."""
    if not isinstance(obj, dict):
        raise ValueError(f"task entry must be an object, got {type(obj).__name__}")
    key = obj.get("key") or obj.get("task_key") or obj.get("id")
    if not key:
        raise ValueError("task entry without 'key'")
    if len(str(key)) > MAX_KEY:  # a Reset could never name it (task_key is at most MAX_KEY characters)
        raise ValueError(f"task key {clip(key)!r} exceeds {MAX_KEY} characters")
    raw_env = str(obj.get("env_id") or obj.get("env_key") or obj.get("environment_id") or obj.get("env") or "")
    env_id, env_version = split_env_key(raw_env)
    if not env_id:
        raise ValueError(f"task {key!r} has no env_id")
    version = str(obj.get("version") or obj.get("env_version") or env_version or "")
    metadata = obj.get("metadata") or {}
    if not isinstance(metadata, dict):
        metadata = {"value": metadata}
    metadata = dict(metadata)
    # An answer key: kept out of the metadata every answer carries (TaskInfo.metadata_json).
    expected = obj["expected_answer"] if "expected_answer" in obj else metadata.get("expected_answer")
    metadata.pop("expected_answer", None)
    verifier = obj.get("verifier")
    code = (
        obj.get("verifier_code")
        or obj.get("verifier_func")
        or (verifier.get("code") if isinstance(verifier, dict) else None)
        or ""
    )
    endpoints = obj.get("mcp_endpoints") or metadata.get("mcp_endpoints") or []
    if not isinstance(endpoints, list):
        raise ValueError(f"task {key!r}: mcp_endpoints must be a list of URLs")
    max_turns = obj.get("max_turns") or metadata.get("max_turns") or 0
    return TaskDef(
        key=str(key),
        env_id=env_id,
        version=version,
        prompt=str(obj.get("prompt") or ""),
        modality=explicit_modality(obj) or "tool_use",
        max_turns=int(max_turns),
        metadata=metadata,
        env_variables=dict(obj.get("env_variables") or {}),
        verifier_code=str(code),
        mcp_endpoints=[endpoint_url(e, f"task {key!r} mcp_endpoints") for e in endpoints],
        expected_answer=expected,
        tool_filter=tool_filter_of(obj.get("tool_filter"), f"task {key!r}"),
    )


@dataclass
class EnvSettings:
    """An environment's settings from a task file's `envs` (the mcp provider's per-environment options)."""

    modality: str = ""  # "": each task's own, else tool_use
    tool_filter: dict[str, list[str]] = field(default_factory=dict)


@dataclass
class TaskFile:
    entries: list[dict[str, Any]]
    envs: dict[str, EnvSettings]


def parse_task_file(text: str) -> TaskFile:
    """A task file: a JSON array of tasks, or `{"tasks": [...], "envs": {NAME: {...}}}`."""
    data = json.loads(text)
    envs: dict[str, EnvSettings] = {}
    if isinstance(data, dict):
        unknown = set(data) - {"tasks", "envs"}
        if unknown:
            raise ValueError(f"task file: unknown top-level key(s) {sorted(unknown)} (want 'tasks', 'envs')")
        raw_envs = data.get("envs") or {}
        if not isinstance(raw_envs, dict):
            raise ValueError("task file: 'envs' must be an object {NAME: {modality, tool_filter}}")
        for name, raw in raw_envs.items():
            if not isinstance(raw, dict) or set(raw) - {"modality", "tool_filter"}:
                raise ValueError(f"task file: envs.{name} must be an object with 'modality' and/or 'tool_filter'")
            modality = str(raw.get("modality") or "")
            if modality and modality not in (*MODALITIES, NO_MODALITY_FILTER):
                raise ValueError(
                    f"task file: envs.{name}.modality {modality!r} is not one of "
                    f"{', '.join((*MODALITIES, NO_MODALITY_FILTER))}"
                )
            envs[str(name)] = EnvSettings(modality, tool_filter_of(raw.get("tool_filter"), f"envs.{name}"))
        data = data.get("tasks") or []
    if not isinstance(data, list):
        raise ValueError("task file must be a JSON array or an object with a 'tasks' array")
    return TaskFile(entries=data, envs=envs)


def task_entries(text: str) -> list[dict[str, Any]]:
    """The task objects of a task file (see `parse_task_file`)."""
    return parse_task_file(text).entries


def env_matches(task: TaskDef, env_key: str) -> bool:
    env_id, version = split_env_key(env_key)
    return task.env_id == env_id and (not version or task.version == version)


class TaskCatalog:
    """The tasks this orchestrator runs, by key, with stable paging."""

    def __init__(self, tasks: Iterable[TaskDef] = ()) -> None:
        self._tasks: dict[str, TaskDef] = {}
        self.replace(tasks)

    def replace(self, tasks: Iterable[TaskDef]) -> None:
        self._tasks = {t.key: t for t in sorted(tasks, key=lambda t: t.key)}

    def __len__(self) -> int:
        return len(self._tasks)

    def all(self) -> list[TaskDef]:
        return list(self._tasks.values())

    def get(self, key: str) -> TaskDef:
        task = self._tasks.get(key)
        if task is None:
            raise NotFound(
                f"unknown task_key {clip(key)!r} (see ListTasks)", reason="TASK_NOT_FOUND", metadata={"task_key": key}
            )
        return task

    def known_env(self, env_key: str) -> bool:
        return any(env_matches(t, env_key) for t in self._tasks.values())

    def page(self, env_key: str, page_size: int, page_token: str) -> tuple[list[TaskDef], str, int]:
        """(tasks after the token, next token or "", total matching)."""
        size = validate_page_size(page_size)
        after = decode_token(page_token, scope=f"tasks:{env_key}") if page_token else ""
        matching = [t for t in self._tasks.values() if not env_key or env_matches(t, env_key)]
        rest = [t for t in matching if t.key > after]
        page = rest[:size]
        next_token = encode_token(page[-1].key, scope=f"tasks:{env_key}") if len(rest) > size else ""
        return page, next_token, len(matching)


def validate_page_size(page_size: int, field: str = "page_size") -> int:
    if page_size == 0:
        return 100
    if not 1 <= page_size <= 1000:
        raise InvalidArgument(field, f"must be 1..1000 (or 0 for 100), got {page_size}")
    return page_size


def _scope_digest(scope: str) -> str:
    """The query a token belongs to, in a fixed size (the filters themselves may be long)."""
    return hashlib.sha256(scope.encode("utf-8", "surrogatepass")).hexdigest()[:16]


def encode_token(position: str, *, scope: str) -> str:
    """An opaque page token bound to the query it came from (at most `limits.MAX_PAGE_TOKEN` characters
    for any position of up to `limits.MAX_KEY` characters)."""
    raw = json.dumps({"p": position, "s": _scope_digest(scope)}, separators=(",", ":"), ensure_ascii=False)
    return base64.urlsafe_b64encode(raw.encode("utf-8", "surrogatepass")).decode().rstrip("=")


def decode_token(token: str, *, scope: str, field: str = "page_token") -> str:
    try:
        padded = token + "=" * (-len(token) % 4)
        data = json.loads(base64.urlsafe_b64decode(padded.encode()).decode("utf-8", "surrogatepass"))
        if not isinstance(data, dict) or not isinstance(data.get("p"), str):
            raise ValueError("not a page token")
    except (ValueError, binascii.Error, UnicodeDecodeError) as exc:
        raise InvalidArgument(field, "not a token returned by this RPC") from exc
    if data.get("s") != _scope_digest(scope):
        raise InvalidArgument(field, "token belongs to a different query (filters changed)")
    return str(data["p"])
