"""Fork by replay compares a replayed result with the log's summary of the logged one: its summary must be
the gateway's (`rlgate.mcpclient.results.summary` of the result the gateway passed on, a module both planes
import) for every kind of result, or a faithful replay would be reported as a mismatch."""

from __future__ import annotations

import base64

import mcp_types as mt
import pytest

from rlgate.mcpclient import results
from rlgate.orchestrator.replay import result_summary

PNG = base64.b64encode(b"\x89PNG\r\n\x1a\n" + b"\0" * 100).decode()

CASES = {
    "text": mt.CallToolResult(content=[mt.TextContent(type="text", text="Flagged 1 message.")]),
    "whitespace": mt.CallToolResult(content=[mt.TextContent(type="text", text="  a\n\n b\t c  ")]),
    "long text": mt.CallToolResult(content=[mt.TextContent(type="text", text="word " * 400)]),
    "two blocks": mt.CallToolResult(
        content=[mt.TextContent(type="text", text="first"), mt.TextContent(type="text", text="second")]
    ),
    "image and text": mt.CallToolResult(
        content=[mt.ImageContent(type="image", data=PNG, mime_type="image/png"), mt.TextContent(type="text", text="x")]
    ),
    "structured only": mt.CallToolResult(content=[], structured_content={"id": 7, "ok": True}),
    "error": mt.CallToolResult(content=[mt.TextContent(type="text", text="no note 9")], is_error=True),
}


@pytest.mark.parametrize("name", list(CASES))
def test_replay_summary_is_the_gateways(name: str) -> None:
    mcp_result = CASES[name]
    passed_on = results.truncate(results.tool_result(mcp_result, 1 << 20), 1 << 20)
    assert result_summary(mcp_result) == results.summary(passed_on)
    assert bool(mcp_result.is_error) == passed_on.is_error
