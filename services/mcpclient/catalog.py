"""Tool catalogs: MCP tools -> `ToolSpec`, the union of a session's endpoints, filters, listing every page.

Pure logic over `mcp_types.Tool` lists (listing needs an entered client, nothing else): both planes build the
tool list a session sees here, so Reset and ListTools return the same specs.

Precedence rule: endpoints are listed in the session's order (for Fleet/localfleet `{root}mcp` before
`{root}api/v1/mcp`). On a name collision the endpoint listed first wins; the losing tool is dropped (logged
at debug). Within an endpoint, tools keep the server's order, every page included. The result is
deterministic for a given set of upstream lists.

Bounds: an upstream chooses what it lists, so a listing is cut to MAX_TOOLS tools and MAX_LISTING_BYTES of
specs (MAX_PAGES pages at most, and no page after the one that left out MAX_LEFT_OUT tools), and a tool is
left out when its spec is larger than MAX_TOOL_BYTES, its
schemas are JSON text cannot carry (nested past its depth bound, NaN), or its name is one CallTool refuses.
Left-out tools are logged once per distinct listing (one warning naming a few of them) and remembered by
name (`ToolList.left_out`), so a call of one is told why. One page's reply is bounded before the SDK parses
it (`transport.MAX_PAGE_BYTES`; a larger page refuses the listing). The specs are made once per listing,
page by page off the event loop (a schema of megabytes takes seconds to walk), and kept with the tools.
"""

from __future__ import annotations

import asyncio
import fnmatch
import hashlib
import logging
import re
import weakref
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import mcp_types as mt
from mcp import Client

from rlgate.core.convert import InvalidJsonValue, json_text
from rlgate.core.errors import clip
from rlgate.core.redact import public_url
from rlgate.v1 import common_pb2

log = logging.getLogger(__name__)

COMPUTER_TOOL = "computer"
# Modalities whose agent acts through the screen: they see only the `computer` tool.
SCREEN_MODALITIES = frozenset({"computer_use", "browser_use"})
# "all" switches the modality filter off (bring-your-own MCP endpoints with a tool named `computer`).
NO_MODALITY_FILTER = "all"
TOOL_NAME = re.compile(r"[A-Za-z0-9._-]{1,128}")  # MCP SEP-986, as toolgateway.proto states
MAX_PAGES = 100  # a paginator that never ends cannot hang discovery
MAX_TOOLS = 10_000  # tools kept of one listing, and of a session's union
MAX_TOOL_BYTES = 256 * 1024  # one tool's spec: name, description, schemas and annotations
MAX_LISTING_BYTES = 8 * 1024 * 1024  # specs kept of one listing, and of a session's union (gRPC sends 16 MiB)
NAMED_IN_WARNING = 5  # left-out tools a warning names
# Left-out tools remembered by name (and why) per listing; a listing that leaves out more stops after the page
# that reached it. Left-out tools add nothing to MAX_TOOLS or MAX_LISTING_BYTES, so without this an upstream
# listing only tools it cannot serve would make every page be parsed and every name kept.
MAX_LEFT_OUT = 1_000
ANY_OBJECT: Mapping[str, Any] = {"type": "object"}  # the input schema of a tool that declares none


@dataclass(frozen=True)
class _Prepared:
    """What a listed tool becomes, made once: its spec without an endpoint, or why it is left out, and a
    digest of the whole tool (`listing_key`)."""

    spec: common_pb2.ToolSpec | None
    size: int
    problem: str
    digest: bytes = b""


# mt.Tool -> its _Prepared, for as long as the tool lives (keyed by id, the weak reference drops the entry).
_prepared: dict[int, tuple[weakref.ref[mt.Tool], _Prepared]] = {}
_warned: OrderedDict[str, None] = OrderedDict()  # digests of left-out summaries already logged at warning


class ToolList(list[mt.Tool]):
    """One endpoint's listing as `list_all_tools` returns it: the tools kept, and the ones left out by name
    with the reason (a call of one is told why)."""

    left_out: dict[str, str]

    def __init__(self, tools: Iterable[mt.Tool] = (), left_out: Mapping[str, str] | None = None) -> None:
        super().__init__(tools)
        self.left_out = dict(left_out or {})


@dataclass(frozen=True)
class CatalogTool:
    """One tool of a session, with the endpoint that owns it and its wire spec (made once)."""

    name: str
    endpoint: str
    tool: mt.Tool
    wire: common_pb2.ToolSpec | None = field(default=None, compare=False, repr=False)

    @property
    def input_schema(self) -> Mapping[str, Any]:
        return self.tool.input_schema or ANY_OBJECT

    def spec(self) -> common_pb2.ToolSpec:
        return self.wire if self.wire is not None else tool_spec(self.tool, self.endpoint)

    @property
    def may_run_again(self) -> bool:
        """Whether its upstream says running it twice does no harm: annotated `readOnlyHint: true` or
        `idempotentHint: true` (hints the upstream vouches for; rlgate has nothing better to go on)."""
        hints = self.tool.annotations
        return hints is not None and (hints.read_only_hint is True or hints.idempotent_hint is True)


@dataclass(frozen=True)
class ToolCatalog:
    """A session's tools in precedence order. `dropped`: endpoints left out and why (e.g. HTTP 404);
    `left_out`: tools left out by name and why (too large, a name CallTool refuses, ...)."""

    tools: tuple[CatalogTool, ...] = ()
    dropped: Mapping[str, str] = field(default_factory=dict)
    left_out: Mapping[str, str] = field(default_factory=dict)

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
        return ToolCatalog(tools=tuple(keep), dropped=self.dropped, left_out=self.left_out)


def tool_spec(tool: mt.Tool, endpoint: str) -> common_pb2.ToolSpec:
    """An MCP `Tool` as the wire `ToolSpec`: schemas and annotations as JSON text of the values the upstream
    sent (integers stay integers). Raises InvalidJsonValue for a schema JSON text cannot carry."""
    annotations = tool.annotations.model_dump(by_alias=True, exclude_none=True, mode="json") if tool.annotations else {}
    return common_pb2.ToolSpec(
        name=tool.name,
        title=tool.title or (tool.annotations.title if tool.annotations and tool.annotations.title else "") or "",
        description=tool.description or "",
        input_schema_json=json_text(tool.input_schema or ANY_OBJECT),
        output_schema_json=json_text(tool.output_schema) if tool.output_schema is not None else "",
        annotations_json=json_text(annotations) if annotations else "",
        endpoint=public_url(endpoint),
    )


def _json_size(value: Any, budget: int) -> int:
    """A lower bound of `value`'s size as compact JSON text, counted only up to `budget` (more: budget + 1).
    Walked in Python, so a worker thread doing it lets the event loop run; `json.dumps` of a schema of
    megabytes holds the interpreter for the whole text."""
    size = 0
    stack = [value]
    while stack:
        node = stack.pop()
        if isinstance(node, str):
            size += len(node) + 2
        elif isinstance(node, Mapping):
            size += 1 + sum(len(str(k)) + 4 for k in node)
            stack.extend(node.values())
        elif isinstance(node, list | tuple):
            size += 1 + len(node)
            stack.extend(node)
        else:
            size += 4  # a number, true, false or null: at least one character and its comma
        if size > budget:
            return budget + 1
    return size


def _prepare_one(tool: mt.Tool) -> _Prepared:
    if not TOOL_NAME.fullmatch(tool.name):
        return _Prepared(None, 0, "its name is not 1-128 characters of [A-Za-z0-9._-], so CallTool could not call it")
    parts = (tool.title or "", tool.description or "", tool.input_schema, tool.output_schema)
    if _json_size(parts, MAX_TOOL_BYTES) > MAX_TOOL_BYTES:
        return _Prepared(None, 0, f"its spec is larger than {MAX_TOOL_BYTES} bytes")
    try:
        spec = tool_spec(tool, "")
    except InvalidJsonValue as exc:  # "<path> is nested deeper than ..." / "<path> is nan; ...": the path may be long
        where, _, what = str(exc).partition(" is ")
        return _Prepared(None, 0, f"its schema cannot be passed on as JSON text: {clip(where)} is {clip(what, 200)}")
    size = spec.ByteSize()
    if size > MAX_TOOL_BYTES:
        return _Prepared(None, size, f"its spec is {size} bytes, larger than {MAX_TOOL_BYTES}")
    digest = hashlib.sha256(tool.model_dump_json(by_alias=True, exclude_none=True).encode()).digest()
    return _Prepared(spec, size, "", digest)


def _remember(tool: mt.Tool, prepared: _Prepared) -> _Prepared:
    key = id(tool)

    def forget(_ref: weakref.ref[mt.Tool]) -> None:
        _prepared.pop(key, None)

    _prepared[key] = (weakref.ref(tool, forget), prepared)
    return prepared


def _prepared_of(tool: mt.Tool) -> _Prepared:
    hit = _prepared.get(id(tool))
    if hit is not None and hit[0]() is tool:
        return hit[1]
    return _remember(tool, _prepare_one(tool))  # a tool not listed by `list_all_tools` (tests, callers' lists)


def listing_key(tools: Sequence[mt.Tool]) -> str:
    """A digest of a listing (every tool whole, and what was left out), from the digests made with the specs:
    identical listings (sessions of one environment) share one parsed copy, and telling them apart costs a
    lookup per tool instead of serializing every schema on the event loop."""
    h = hashlib.sha256()
    for tool in tools:
        h.update(_prepared_of(tool).digest or tool.name.encode())
    for name, why in sorted(getattr(tools, "left_out", {}).items()):
        h.update(f"\0{name}\0{why}".encode())
    return h.hexdigest()


def _warn_left_out(left_out: Mapping[str, str], what: str) -> None:
    """One warning per distinct set of left-out tools (every session listing the same endpoint would repeat
    it), naming a few of them with the reason; repeats go to debug."""
    named = list(left_out.items())[:NAMED_IN_WARNING]
    text = "; ".join(f"{clip(name)!r}: {why}" for name, why in named)
    if len(left_out) > len(named):
        text += f"; and {len(left_out) - len(named)} more"
    digest = hashlib.sha256(text.encode()).hexdigest()
    level = logging.DEBUG if digest in _warned else logging.WARNING
    _warned[digest] = None
    _warned.move_to_end(digest)
    while len(_warned) > 1024:
        _warned.popitem(last=False)
    log.log(level, "%s: %d tools left out: %s", what, len(left_out), text)


def _take_page(
    tools: Sequence[mt.Tool], count: int, size: int, left_out: dict[str, str]
) -> tuple[list[mt.Tool], int, int]:
    """The tools of a page that fit after `count` tools and `size` bytes were kept, each with its spec made
    and remembered; the others into `left_out`. Runs on a worker thread: it walks every schema."""
    fits, count, size = _kept(((tool, _prepare_one(tool)) for tool in tools), count, size, left_out)
    for tool, prepared in fits:
        _remember(tool, prepared)
    return [tool for tool, _ in fits], count, size


def _kept(
    tools: Iterable[tuple[mt.Tool, _Prepared]], count: int, size: int, left_out: dict[str, str]
) -> tuple[list[tuple[mt.Tool, _Prepared]], int, int]:
    """The tools that fit after `count` tools and `size` bytes were kept; the others into `left_out`."""
    out: list[tuple[mt.Tool, _Prepared]] = []
    for tool, prepared in tools:
        if prepared.problem:
            _leave_out(left_out, tool.name, prepared.problem)
        elif count >= MAX_TOOLS:
            _leave_out(left_out, tool.name, f"listed past {MAX_TOOLS} tools")
        elif size + prepared.size > MAX_LISTING_BYTES:
            _leave_out(left_out, tool.name, f"listed past {MAX_LISTING_BYTES} bytes of tool specs")
        else:
            out.append((tool, prepared))
            count += 1
            size += prepared.size
    return out, count, size


def _leave_out(left_out: dict[str, str], name: str, why: str) -> None:
    """Remember a left-out tool, up to MAX_LEFT_OUT of them (one past that is not named: a call of it is an
    unknown tool)."""
    if len(left_out) < MAX_LEFT_OUT:
        left_out[name] = why


def union_tools(
    per_endpoint: Iterable[tuple[str, Sequence[mt.Tool]]], dropped: Mapping[str, str] | None = None
) -> ToolCatalog:
    """Union of several endpoints' tools; `per_endpoint` is in precedence order (first wins). Bounded like
    one listing (MAX_TOOLS, MAX_LISTING_BYTES) and without the tools no listing could serve."""
    seen: dict[str, str] = {}
    out: list[CatalogTool] = []
    left_out: dict[str, str] = {}
    fresh: dict[str, str] = {}  # left out here (not already by the listing, which logged them)
    count = size = 0
    for endpoint, tools in per_endpoint:
        left_out.update(getattr(tools, "left_out", {}))
        unique: list[tuple[mt.Tool, _Prepared]] = []
        for tool in tools:
            owner = seen.get(tool.name)
            if owner is not None:
                if owner != endpoint:
                    log.debug("tool %r of %s shadowed by %s (endpoint precedence)", clip(tool.name), endpoint, owner)
                continue
            seen[tool.name] = endpoint
            unique.append((tool, _prepared_of(tool)))
        kept, count, size = _kept(unique, count, size, fresh)
        shown = public_url(endpoint)  # an agent sees no key the URL carries
        for tool, prepared in kept:
            assert prepared.spec is not None
            wire = common_pb2.ToolSpec(endpoint=shown)
            wire.MergeFrom(prepared.spec)
            out.append(CatalogTool(name=tool.name, endpoint=endpoint, tool=tool, wire=wire))
    if fresh:
        _warn_left_out(fresh, "session tools")
        left_out.update(fresh)
    return ToolCatalog(tools=tuple(out), dropped=dict(dropped or {}), left_out=left_out)


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


async def list_all_tools(client: Client, *, max_pages: int = MAX_PAGES) -> ToolList:
    """Every page of `tools/list` from an entered `mcp.Client` (bypassing its response cache), bounded:
    at most `max_pages` pages, MAX_TOOLS tools and MAX_LISTING_BYTES of specs, each tool's spec made on a
    worker thread and kept with it; tools that cannot be served are left out with one warning."""
    kept: list[mt.Tool] = []
    left_out: dict[str, str] = {}
    count = size = 0
    cursor: str | None = None
    for _ in range(max_pages):
        page = await client.list_tools(cursor=cursor, cache_mode="refresh")
        fits, count, size = await asyncio.to_thread(_take_page, page.tools, count, size, left_out)
        kept.extend(fits)
        cursor = page.next_cursor
        if not cursor:
            break
        if count >= MAX_TOOLS or size >= MAX_LISTING_BYTES or len(left_out) >= MAX_LEFT_OUT:
            left_out["(later pages)"] = (
                f"not listed: the listing reached {count} tools, {size} bytes and {len(left_out)} tools left out"
            )
            break
    else:
        left_out["(later pages)"] = f"not listed: tools/list did not end after {max_pages} pages"
    if left_out:
        _warn_left_out(left_out, "tools/list")
    return ToolList(kept, left_out)
