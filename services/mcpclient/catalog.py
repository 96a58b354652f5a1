"""Tool catalogs: MCP tools -> `ToolSpec`, the union of a session's endpoints, filters, listing every page.

Pure logic over `mcp_types.Tool` lists (listing needs an entered client, nothing else): both planes build the
tool list a session sees here, so Reset and ListTools return the same specs.

Precedence rule: endpoints are listed in the session's order (for Fleet/localfleet `{root}mcp` before
`{root}api/v1/mcp`). On a name collision the endpoint listed first wins; the losing tool is dropped (logged
at debug). Within an endpoint, tools keep the server's order, every page included. The result is
deterministic for a given set of upstream lists.
"""

from __future__ import annotations

import fnmatch
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import mcp_types as mt
from mcp import Client

from rlgate.convert import InvalidJsonValue, json_text
from rlgate.v1 import common_pb2

log = logging.getLogger(__name__)

COMPUTER_TOOL = "computer"
# Modalities whose agent acts through the screen: they see only the `computer` tool.
SCREEN_MODALITIES = frozenset({"computer_use", "browser_use"})
# "all" switches the modality filter off (bring-your-own MCP endpoints with a tool named `computer`).
NO_MODALITY_FILTER = "all"
MAX_PAGES = 100  # a paginator that never ends cannot hang discovery


@dataclass(frozen=True)
class CatalogTool:
    """One tool of a session, with the endpoint that owns it."""

    name: str
    endpoint: str
    tool: mt.Tool

    @property
    def input_schema(self) -> dict[str, Any]:
        return self.tool.input_schema or {"type": "object"}

    def spec(self) -> common_pb2.ToolSpec:
        return tool_spec(self.tool, self.endpoint)


@dataclass(frozen=True)
class ToolCatalog:
    """A session's tools in precedence order. `dropped`: endpoints left out and why (e.g. HTTP 404)."""

    tools: tuple[CatalogTool, ...] = ()
    dropped: Mapping[str, str] = field(default_factory=dict)

    def get(self, name: str) -> CatalogTool | None:
        for t in self.tools:
            if t.name == name:
                return t
        return None

    def names(self) -> list[str]:
        return [t.name for t in self.tools]

    def specs(self) -> list[common_pb2.ToolSpec]:
        return [t.spec() for t in self.tools]

    def filtered(self, tool_filter: Mapping[str, Any] | None, modality: str = "") -> ToolCatalog:
        keep = [t for t in self.tools if tool_allowed(t.name, tool_filter, modality)]
        return ToolCatalog(tools=tuple(keep), dropped=self.dropped)


def tool_spec(tool: mt.Tool, endpoint: str) -> common_pb2.ToolSpec:
    """An MCP `Tool` as the wire `ToolSpec`: schemas and annotations as JSON text of the values the upstream
    sent (integers stay integers)."""
    annotations = tool.annotations.model_dump(by_alias=True, exclude_none=True, mode="json") if tool.annotations else {}
    return common_pb2.ToolSpec(
        name=tool.name,
        title=tool.title or (tool.annotations.title if tool.annotations and tool.annotations.title else "") or "",
        description=tool.description or "",
        input_schema_json=json_text(tool.input_schema or {"type": "object"}),
        output_schema_json=json_text(tool.output_schema) if tool.output_schema is not None else "",
        annotations_json=json_text(annotations) if annotations else "",
        endpoint=endpoint,
    )


def union_tools(
    per_endpoint: Iterable[tuple[str, Sequence[mt.Tool]]], dropped: Mapping[str, str] | None = None
) -> ToolCatalog:
    """Union of several endpoints' tools; `per_endpoint` is in precedence order (first wins)."""
    seen: dict[str, str] = {}
    out: list[CatalogTool] = []
    for endpoint, tools in per_endpoint:
        for tool in tools:
            owner = seen.get(tool.name)
            if owner is not None:
                if owner != endpoint:
                    log.debug("tool %r of %s shadowed by %s (endpoint precedence)", tool.name, endpoint, owner)
                continue
            try:
                tool_spec(tool, endpoint)  # a schema JSON text cannot carry (too deep, NaN) would fail every list
            except InvalidJsonValue as exc:
                log.warning("tool %r of %s left out: %s", tool.name, endpoint, exc)
                continue
            seen[tool.name] = endpoint
            out.append(CatalogTool(name=tool.name, endpoint=endpoint, tool=tool))
    return ToolCatalog(tools=tuple(out), dropped=dict(dropped or {}))


def _matches(name: str, patterns: Iterable[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def tool_allowed(name: str, tool_filter: Mapping[str, Any] | None, modality: str = "") -> bool:
    """The task's modality filter plus allow/deny lists (exact names or shell-style globs).

    `tool_use` (and any other modality) never sees `computer`; `computer_use` / `browser_use` see only
    `computer`; `all` disables the modality filter. A non-empty `allow` keeps only matching names;
    `deny` removes matching names last."""
    tf = tool_filter or {}
    mode = str(tf.get("modality") or modality or "tool_use")
    if mode in SCREEN_MODALITIES:
        if name != COMPUTER_TOOL:
            return False
    elif mode != NO_MODALITY_FILTER and name == COMPUTER_TOOL:
        return False
    allow = [str(p) for p in tf.get("allow") or ()]
    if allow and not _matches(name, allow):
        return False
    deny = [str(p) for p in tf.get("deny") or ()]
    return not (deny and _matches(name, deny))


async def list_all_tools(client: Client, *, max_pages: int = MAX_PAGES) -> list[mt.Tool]:
    """Every page of `tools/list` from an entered `mcp.Client` (bypassing its response cache)."""
    tools: list[mt.Tool] = []
    cursor: str | None = None
    for _ in range(max_pages):
        page = await client.list_tools(cursor=cursor, cache_mode="refresh")
        tools.extend(page.tools)
        cursor = page.next_cursor
        if not cursor:
            return tools
    log.warning("tools/list did not end after %d pages; using what was listed", max_pages)
    return tools
