"""Every `tools/list` page is walked (an in-process low-level MCP server that pages its tools)."""

from __future__ import annotations

from typing import Any

import mcp_types as mt
from mcp import Client
from mcp.server import Server

from rlgate.mcpclient.catalog import MAX_LEFT_OUT, MAX_PAGES, list_all_tools, union_tools

TOOLS = [mt.Tool(name=f"t{i:02d}", input_schema={"type": "object"}) for i in range(25)]


def paged_server(page_size: int, *, endless: bool = False) -> Server[Any]:
    async def list_tools(_ctx: Any, params: mt.PaginatedRequestParams | None) -> mt.ListToolsResult:
        start = int(params.cursor) if params is not None and params.cursor else 0
        page = TOOLS[start % len(TOOLS) : start % len(TOOLS) + page_size]
        more = endless or start + page_size < len(TOOLS)
        return mt.ListToolsResult(tools=page, next_cursor=str(start + page_size) if more else None)

    return Server("paged", on_list_tools=list_tools)


async def test_every_page_is_listed_in_order() -> None:
    for mode in ("auto", "legacy"):
        async with Client(paged_server(4), mode=mode) as client:
            tools = await list_all_tools(client)
        assert [t.name for t in tools] == [t.name for t in TOOLS], mode
        assert union_tools([("E", tools)]).names() == [t.name for t in TOOLS]


async def test_endless_pagination_is_capped() -> None:
    async with Client(paged_server(1, endless=True)) as client:
        tools = await list_all_tools(client, max_pages=7)
    assert len(tools) == 7 and MAX_PAGES == 100


async def test_a_listing_of_tools_that_cannot_be_served_stops_at_the_left_out_bound() -> None:
    """Left-out tools add nothing to the tool or byte bounds: a listing of only names CallTool refuses ends
    after the page that left out MAX_LEFT_OUT of them, with at most that many remembered."""
    pages = []

    async def list_tools(_ctx: Any, params: mt.PaginatedRequestParams | None) -> mt.ListToolsResult:
        page = int(params.cursor) if params is not None and params.cursor else 0
        pages.append(page)
        bad = [mt.Tool(name=f"bad name {page}-{i}", input_schema={"type": "object"}) for i in range(400)]
        return mt.ListToolsResult(tools=[*bad, mt.Tool(name=f"ok{page}", input_schema={"type": "object"})],
                                  next_cursor=str(page + 1))  # fmt: skip

    async with Client(Server("bad", on_list_tools=list_tools)) as client:
        tools = await list_all_tools(client)
    assert pages == [0, 1, 2]  # 400 + 400 + 400 left out: past the bound after the third page, not 100 pages
    assert [t.name for t in tools] == ["ok0", "ok1", "ok2"]
    assert len(tools.left_out) == MAX_LEFT_OUT + 1 and "(later pages)" in tools.left_out
