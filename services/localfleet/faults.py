"""Fault injection: what each environment should do wrong, from a JSON file and changeable at runtime.

File / admin body format (every key optional, everything off by default)::

    {
      "instance_limit": 5,                  # account-wide running-instance limit (403 past it)
      "environments": {
        "*":          {"tool_latency_s": 0.2},          # applies to every environment
        "mailbox":    {"tool_error_rate": 0.5},          # by env_id ...
        "mailbox:v1": {"mcp_404": true}                  # ... or env_key (most specific wins, key by key)
      }
    }

Per-environment keys are the fields of `EnvFaults`. The registry is replaced (`set`) or merged (`merge`)
as a whole, so a test states the complete fault picture it wants.
"""

from __future__ import annotations

import dataclasses
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class EnvFaults:
    tool_latency_s: float = 0.0  # added before every tool call
    tool_error_rate: float = 0.0  # fraction of tool calls answered with is_error (tool not run)
    reset_hang: bool = False  # manager POST /reset never answers (until the client gives up)
    mcp_404: bool = False  # {root}mcp answers 404 (only {root}api/v1/mcp serves MCP)
    hang_tools: tuple[str, ...] = ()  # these tools ("*" = all) block until cancelled
    crash_tools: tuple[str, ...] = ()  # calling these tools ("*" = all) drops the TCP connection mid-call
    forget_sessions: bool = False  # legacy era: a session is forgotten after each tools/call it served
    instance_limit: int | None = None  # running instances of this environment allowed
    create_delay_s: float = 0.0  # POST /v1/env/instances takes this long
    max_inflight_creates: int | None = None  # more concurrent creates than this get 429 (Fleet's burst cap)
    create_rate: float = 0.0  # creates accepted per second (0: no limit); past it 429 with Retry-After
    placement_failure_rate: float = 0.0  # fraction of creates refused 503 "retryable": true (nothing created)
    create_reply_loss_rate: float = 0.0  # fraction of created instances whose reply is lost (connection dropped)

    def hangs(self, tool: str) -> bool:
        return "*" in self.hang_tools or tool in self.hang_tools

    def crashes(self, tool: str) -> bool:
        return "*" in self.crash_tools or tool in self.crash_tools


_FIELDS = {f.name: f for f in dataclasses.fields(EnvFaults)}
_FRACTIONS = frozenset({"tool_error_rate", "placement_failure_rate", "create_reply_loss_rate"})


class FaultError(ValueError):
    """A faults document that does not parse (unknown key, wrong type)."""


def _parse_env(name: str, raw: Any) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise FaultError(f"faults for {name!r} must be an object")
    out: dict[str, Any] = {}
    for key, value in raw.items():
        if key not in _FIELDS:
            raise FaultError(f"unknown fault {key!r} for {name!r}; known: {sorted(_FIELDS)}")
        default = _FIELDS[key].default
        if isinstance(default, tuple):
            if isinstance(value, str):
                value = [value]
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise FaultError(f"{name}.{key} must be a list of tool names")
            out[key] = tuple(value)
        elif isinstance(default, bool):
            if not isinstance(value, bool):
                raise FaultError(f"{name}.{key} must be true or false")
            out[key] = value
        elif key in ("instance_limit", "max_inflight_creates"):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                raise FaultError(f"{name}.{key} must be a non-negative integer or null")
            out[key] = value
        else:
            if not isinstance(value, int | float) or isinstance(value, bool) or value < 0:
                raise FaultError(f"{name}.{key} must be a non-negative number")
            if key in _FRACTIONS and value > 1:
                raise FaultError(f"{name}.{key} must be between 0 and 1")
            out[key] = float(value)
    return out


@dataclass
class FaultPlan:
    """A parsed faults document."""

    instance_limit: int | None = None
    environments: dict[str, dict[str, Any]] = field(default_factory=dict)

    @classmethod
    def parse(cls, doc: Any) -> FaultPlan:
        if doc is None:
            return cls()
        if not isinstance(doc, dict):
            raise FaultError("faults must be a JSON object")
        unknown = set(doc) - {"instance_limit", "environments"}
        if unknown:
            raise FaultError(f"unknown top-level fault keys: {sorted(unknown)}")
        limit = doc.get("instance_limit")
        if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 0):
            raise FaultError("instance_limit must be a non-negative integer or null")
        envs = doc.get("environments") or {}
        if not isinstance(envs, dict):
            raise FaultError("environments must be an object")
        return cls(limit, {str(k): _parse_env(str(k), v) for k, v in envs.items()})

    def to_json(self) -> dict[str, Any]:
        return {
            "instance_limit": self.instance_limit,
            "environments": {
                k: {n: list(v) if isinstance(v, tuple) else v for n, v in d.items()}
                for k, d in self.environments.items()
            },
        }


class FaultRegistry:
    """The live fault plan; lookups are cheap (called on every tool call)."""

    def __init__(self, plan: FaultPlan | None = None, rng: random.Random | None = None) -> None:
        self._plan = plan or FaultPlan()
        self._cache: dict[str, EnvFaults] = {}
        self.rng = rng or random.Random()

    @classmethod
    def from_file(cls, path: str) -> FaultRegistry:
        if not path:
            return cls()
        try:
            doc = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise FaultError(f"cannot read faults file {path}: {exc}") from exc
        return cls(FaultPlan.parse(doc))

    @property
    def plan(self) -> FaultPlan:
        return self._plan

    def set(self, doc: Any) -> None:
        self._plan = FaultPlan.parse(doc)
        self._cache.clear()

    def for_env(self, env_id: str, version: str) -> EnvFaults:
        key = f"{env_id}:{version}"
        hit = self._cache.get(key)
        if hit is None:
            merged: dict[str, Any] = {}
            for name in ("*", env_id, key):  # least to most specific
                merged.update(self._plan.environments.get(name, {}))
            hit = self._cache[key] = EnvFaults(**merged)
        return hit

    def instance_limit(self, default: int) -> int:
        return default if self._plan.instance_limit is None else self._plan.instance_limit

    def injected_error(self, faults: EnvFaults) -> bool:
        return self.chance(faults.tool_error_rate)

    def chance(self, rate: float) -> bool:
        """True with probability `rate` (a fault that strikes a fraction of calls)."""
        return rate > 0 and self.rng.random() < rate
