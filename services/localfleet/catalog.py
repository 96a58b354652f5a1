"""The environments localfleet hosts, and their seed templates (built once per environment per process)."""

from __future__ import annotations

import asyncio
import os
import sqlite3
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from rlgate.localfleet.environments.base import EnvironmentSpec


class UnknownEnvironment(LookupError):
    """No environment (or version) by that key; the message is the one the SDK maps to its error class."""


class Catalog:
    """Environments by env_id and version, with one seeded template database each."""

    def __init__(self, specs: Iterable[EnvironmentSpec], template_dir: Path) -> None:
        self.specs: dict[str, EnvironmentSpec] = {}
        for spec in specs:
            if spec.env_key in self.specs:
                raise ValueError(f"environment {spec.env_key} registered twice")
            if spec.mcp_era not in ("modern", "legacy"):
                raise ValueError(f"{spec.env_key}: mcp_era must be 'modern' or 'legacy', not {spec.mcp_era!r}")
            self.specs[spec.env_key] = spec
        self.template_dir = template_dir
        self._templates: dict[str, Path] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    def resolve(self, env_id: str, version: str | None) -> EnvironmentSpec:
        """`env_id` + optional version ('v1' or '1') -> spec; a missing version means the newest."""
        versions = sorted((s for s in self.specs.values() if s.env_id == env_id), key=lambda s: s.version)
        if not versions:
            raise UnknownEnvironment(f"Environment '{env_id}' not found")
        if not version:
            return versions[-1]
        for candidate in (version, version.lstrip("v"), f"v{version}"):
            spec = self.specs.get(f"{env_id}:{candidate}")
            if spec is not None:
                return spec
        raise UnknownEnvironment(f"Version '{version}' not found for environment '{env_id}'")

    def resolve_key(self, env_key: str) -> EnvironmentSpec:
        env_id, _, version = env_key.partition(":")
        return self.resolve(env_id, version or None)

    def describe(self, env_id: str) -> dict[str, Any]:
        """The control plane's `Environment` model for one env_id."""
        versions = sorted((s for s in self.specs.values() if s.env_id == env_id), key=lambda s: s.version)
        if not versions:
            raise UnknownEnvironment(f"Environment '{env_id}' not found")
        newest = versions[-1]
        return {
            "env_key": env_id,
            "name": newest.name,
            "description": newest.description,
            "default_version": newest.version,
            "versions": {s.version: s.version for s in versions},
            "mcp_era": newest.mcp_era,
        }

    def env_ids(self) -> list[str]:
        return sorted({s.env_id for s in self.specs.values()})

    async def template(self, spec: EnvironmentSpec) -> Path:
        """The seeded database every instance of `spec` starts from (built on first use)."""
        path = self._templates.get(spec.env_key)
        if path is not None:
            return path
        lock = self._locks.setdefault(spec.env_key, asyncio.Lock())
        async with lock:
            path = self._templates.get(spec.env_key)
            if path is None:
                path = await asyncio.to_thread(self._build_template, spec)
                self._templates[spec.env_key] = path
        return path

    def _build_template(self, spec: EnvironmentSpec) -> Path:
        # Rebuilt once per process (seeds are deterministic, and a stale file from older code must not win).
        self.template_dir.mkdir(parents=True, exist_ok=True)
        final = self.template_dir / f"{spec.env_id}-{spec.version}.db"
        tmp = final.with_suffix(f".tmp{os.getpid()}")
        tmp.unlink(missing_ok=True)
        conn = sqlite3.connect(tmp)
        try:
            conn.executescript(spec.schema_sql)
            spec.seed(conn)
            conn.commit()
        finally:
            conn.close()
        os.replace(tmp, final)
        return final
