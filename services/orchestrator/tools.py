"""Tool lists for Reset, cached per (environment version, tool filter).

Every instance of `env_id:version` serves the same tools, so the orchestrator discovers them once (through
`rlgate.mcpclient`, as the gateway lists them: every page, union with endpoint precedence, modality filter)
and reuses the list, instead of opening MCP clients on every Reset. Specs name the endpoint that owns each
tool; the cache keeps the endpoint's *position* and substitutes the session's own URL at that position.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Sequence
from typing import Any

from rlgate.mcpclient.discovery import discover_tools
from rlgate.runtime.errors import Unavailable
from rlgate.v1 import common_pb2

log = logging.getLogger(__name__)


class ToolCache:
    def __init__(self, timeout_s: float) -> None:
        self._timeout = timeout_s
        self._entries: dict[str, list[tuple[common_pb2.ToolSpec, int]]] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    @staticmethod
    def key(env_key: str, tool_filter: dict[str, Any], endpoints: Sequence[str], per_instance: bool) -> str:
        parts: dict[str, Any] = {"env": env_key, "filter": tool_filter}
        if not per_instance:  # bring-your-own endpoints: the URLs are the identity
            parts["endpoints"] = list(endpoints)
        return json.dumps(parts, sort_keys=True)

    def invalidate(self, env_key: str | None = None) -> None:
        if env_key is None:
            self._entries.clear()
        else:
            self._entries = {k: v for k, v in self._entries.items() if json.loads(k)["env"] != env_key}

    async def get(
        self, env_key: str, endpoints: Sequence[str], tool_filter: dict[str, Any], *, per_instance: bool = True
    ) -> list[common_pb2.ToolSpec]:
        key = self.key(env_key, tool_filter, endpoints, per_instance)
        cached = self._entries.get(key)
        if cached is None:
            lock = self._locks.setdefault(key, asyncio.Lock())
            async with lock:  # one discovery per key, however many Resets arrive at once
                cached = self._entries.get(key)
                if cached is None:
                    cached = await self._discover(endpoints, tool_filter)
                    self._entries[key] = cached
        out = []
        for spec, index in cached:
            copy = common_pb2.ToolSpec()
            copy.CopyFrom(spec)
            copy.endpoint = endpoints[index] if 0 <= index < len(endpoints) else spec.endpoint
            out.append(copy)
        return out

    async def _discover(
        self, endpoints: Sequence[str], tool_filter: dict[str, Any]
    ) -> list[tuple[common_pb2.ToolSpec, int]]:
        try:
            catalog = await asyncio.wait_for(
                discover_tools(list(endpoints), timeout=self._timeout, tool_filter=tool_filter), self._timeout + 1
            )
        except Exception as exc:
            raise Unavailable(f"tool discovery failed: {exc}", reason="TOOLS_UNAVAILABLE", retry_after_s=2.0) from exc
        specs = catalog.specs()
        if not specs:
            raise Unavailable(
                f"no tools found at {list(endpoints)} (dropped: {dict(catalog.dropped)})",
                reason="TOOLS_UNAVAILABLE",
                retry_after_s=2.0,
            )
        index = {url: i for i, url in enumerate(endpoints)}
        return [(spec, index.get(spec.endpoint, -1)) for spec in specs]
