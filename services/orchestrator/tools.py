"""Tool lists for Reset, cached per (environment version, tool filter) for at most `refresh_s`.

Every instance of `env_id:version` serves the same tools, so the orchestrator discovers them once (through
`rlgate.mcpclient`, as the gateway lists them: every page, union with endpoint precedence, modality and
allow / deny filter) and reuses the list, instead of opening MCP clients on every Reset. A list older than
`refresh_s` (the gateway's `tools_refresh_s`) is discovered again on its next use, so Reset follows a server
that changed its tools. Specs name the endpoint that owns each tool; the cache keeps the endpoint's
*position* and substitutes the session's own URL at that position.

Bring-your-own endpoints (`per_instance=False`, the mcp provider) are the user's configuration, so a wrong
one is said at once: an endpoint that answers 404 (a mistyped path) or that nothing listens on (connection
refused, unknown host) is `FAILED_PRECONDITION` naming its URL. Other failures (timeouts, errors the server
answered) are retried a few times within `timeout_s`, then `UNAVAILABLE`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time
import urllib.parse
from collections.abc import Sequence
from typing import Any

import mcp_types as mt

from rlgate.core.errors import FailedPrecondition, Unavailable
from rlgate.core.redact import public_url
from rlgate.mcpclient.catalog import NO_MODALITY_FILTER, union_tools
from rlgate.mcpclient.discovery import discover_tools
from rlgate.v1 import common_pb2

log = logging.getLogger(__name__)

ATTEMPTS = 3  # bring-your-own endpoints: tries of a transient failure, within one discovery timeout
BACKOFF_S = 0.2
PROBE_TIMEOUT_S = 1.0
UNFILTERED = {"modality": NO_MODALITY_FILTER}  # one endpoint's every tool; the union is filtered


class ToolCache:
    def __init__(self, timeout_s: float, refresh_s: float = 300.0) -> None:
        self._timeout = timeout_s
        self._refresh = refresh_s
        self._entries: dict[str, tuple[float, list[tuple[common_pb2.ToolSpec, int]]]] = {}
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

    def _fresh(self, key: str) -> list[tuple[common_pb2.ToolSpec, int]] | None:
        entry = self._entries.get(key)
        if entry is None or time.monotonic() - entry[0] >= self._refresh:
            return None
        return entry[1]

    async def get(
        self, env_key: str, endpoints: Sequence[str], tool_filter: dict[str, Any], *, per_instance: bool = True
    ) -> list[common_pb2.ToolSpec]:
        key = self.key(env_key, tool_filter, endpoints, per_instance)
        cached = self._fresh(key)
        if cached is None:
            lock = self._locks.setdefault(key, asyncio.Lock())
            async with lock:  # one discovery per key, however many Resets arrive at once
                cached = self._fresh(key)
                if cached is None:
                    cached = await self._discover(endpoints, tool_filter, per_instance)
                    self._entries[key] = (time.monotonic(), cached)
        out = []
        shown = [public_url(url) for url in endpoints]  # once per Reset, not once per tool
        for spec, index in cached:
            copy = common_pb2.ToolSpec()
            copy.CopyFrom(spec)
            copy.endpoint = shown[index] if 0 <= index < len(shown) else spec.endpoint
            out.append(copy)
        return out

    async def _discover(
        self, endpoints: Sequence[str], tool_filter: dict[str, Any], per_instance: bool
    ) -> list[tuple[common_pb2.ToolSpec, int]]:
        if per_instance:
            try:
                catalog = await asyncio.wait_for(
                    discover_tools(list(endpoints), timeout=self._timeout, tool_filter=tool_filter), self._timeout + 1
                )
            except Exception as exc:
                raise Unavailable(
                    f"tool discovery failed: {exc}", reason="TOOLS_UNAVAILABLE", retry_after_s=2.0
                ) from exc
        else:
            try:  # the first wrong endpoint answers; the other listings are cancelled
                async with asyncio.TaskGroup() as group:
                    listings = [group.create_task(self._list_own(url)) for url in endpoints]
            except BaseExceptionGroup as failed:
                raise failed.exceptions[0] from None
            per_endpoint = [(url, listing.result()) for url, listing in zip(endpoints, listings, strict=True)]
            catalog = union_tools(per_endpoint).filtered(tool_filter)
        specs = catalog.specs()
        if not specs and not per_instance:  # every endpoint answered: the filter (configuration) left nothing
            raise FailedPrecondition(
                f"no tools left at {list(endpoints)} after the tool filter {tool_filter}",
                reason="NO_TOOLS",
                metadata={"endpoints": " ".join(endpoints)},
            )
        if not specs:
            raise Unavailable(
                f"no tools found at {list(endpoints)} (dropped: {dict(catalog.dropped)}; filter: {tool_filter})",
                reason="TOOLS_UNAVAILABLE",
                retry_after_s=2.0,
            )
        index = {public_url(url): i for i, url in enumerate(endpoints)}  # specs name endpoints in public form
        return [(spec, index.get(spec.endpoint, -1)) for spec in specs]

    async def _list_own(self, url: str) -> list[mt.Tool]:
        """One bring-your-own endpoint's tools (unfiltered): a wrong endpoint is FAILED_PRECONDITION at once,
        a transient failure is tried again (at most ATTEMPTS times, within the discovery timeout)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._timeout
        delay = BACKOFF_S
        for attempt in range(1, ATTEMPTS + 1):
            remaining = deadline - loop.time()
            try:
                catalog = await asyncio.wait_for(
                    discover_tools([url], timeout=remaining, tool_filter=UNFILTERED), remaining + 1
                )
            except Exception as exc:
                if (refused := await _refused(url)) is not None:
                    raise FailedPrecondition(
                        f"MCP endpoint {url} is unreachable ({refused}); is its server running?",
                        reason="MCP_ENDPOINT_UNREACHABLE",
                        metadata={"endpoint": url},
                    ) from exc
                if attempt == ATTEMPTS or deadline - loop.time() < delay:
                    raise Unavailable(
                        f"MCP endpoint {url} failed (after {attempt} attempt(s)): {exc}",
                        reason="TOOLS_UNAVAILABLE",
                        metadata={"endpoint": url},
                        retry_after_s=2.0,
                    ) from exc
                log.info("listing tools of %s failed (attempt %d, retrying): %s", url, attempt, exc)
                await asyncio.sleep(delay)
                delay *= 2
                continue
            if url in catalog.dropped:  # it answered 404: a path with no MCP server (discovery drops those)
                raise FailedPrecondition(
                    f"MCP endpoint {url} answered 404 Not Found: no MCP server at this path (check the URL's path)",
                    reason="MCP_ENDPOINT_NOT_FOUND",
                    metadata={"endpoint": url},
                )
            return [t.tool for t in catalog.tools]
        raise AssertionError("unreachable")


async def _refused(url: str) -> str | None:
    """Why nothing can be reached at `url`'s host and port (refused, unknown host), or None when a TCP
    connection opens (or the probe cannot tell in time): the failure was something else."""
    parts = urllib.parse.urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(parts.hostname, port), PROBE_TIMEOUT_S)
    except (ConnectionRefusedError, socket.gaierror) as exc:
        return "connection refused" if isinstance(exc, ConnectionRefusedError) else f"unknown host: {exc}"
    except (OSError, TimeoutError):
        return None
    writer.close()
    return None
