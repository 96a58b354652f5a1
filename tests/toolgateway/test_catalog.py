"""The neutral catalog (MCP Tool -> ToolSpec, union with endpoint precedence, filters), and the gateway's argument
and result conversions (pure logic, no network)."""

from __future__ import annotations

import base64
import json
import time

import mcp_types as mt
import pytest

from rlgate.mcpclient import results
from rlgate.mcpclient.catalog import tool_allowed, tool_spec, union_tools
from rlgate.mcpclient.results import MAX_CONTENT_BLOCKS, summary, tool_result, truncate
from rlgate.toolgateway.arguments import arguments_problem
from rlgate.v1 import common_pb2

Kind = common_pb2.ToolErrorKind


def _tool(name: str, **schema: object) -> mt.Tool:
    return mt.Tool(name=name, input_schema={"type": "object", **schema})


def test_union_first_endpoint_wins_and_order_is_deterministic() -> None:
    a = [_tool("search"), _tool("send")]
    b = [_tool("computer"), _tool("send", description="shadowed")]
    cat = union_tools([("A", a), ("B", b)])
    assert [(t.name, t.endpoint) for t in cat.tools] == [("search", "A"), ("send", "A"), ("computer", "B")]
    assert union_tools([("A", a), ("B", b)]).names() == cat.names()
    assert union_tools([("B", b), ("A", a)]).get("send").endpoint == "B"  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("modality", "tool_filter", "visible"),
    [
        ("tool_use", {}, ["search", "send"]),
        ("", {"modality": "tool_use"}, ["search", "send"]),
        ("computer_use", {}, ["computer"]),
        ("tool_use", {"modality": "browser_use"}, ["computer"]),
        ("all", {}, ["search", "send", "computer"]),
        ("tool_use", {"allow": ["se*"]}, ["search", "send"]),
        ("tool_use", {"allow": ["search", "computer"]}, ["search"]),
        ("tool_use", {"deny": ["send"]}, ["search"]),
    ],
)
def test_modality_and_allow_deny(modality: str, tool_filter: dict, visible: list[str]) -> None:
    cat = union_tools([("A", [_tool("search"), _tool("send")]), ("B", [_tool("computer")])])
    assert cat.filtered(tool_filter, modality).names() == visible
    assert all(tool_allowed(n, tool_filter, modality) for n in visible)


def test_tool_spec_carries_the_upstream_json_exactly() -> None:
    big = 2**60  # past 2^53: a double could not hold it
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 1, "maximum": big}},
        "required": ["n"],
        "x-ratio": 0.5,
        "x-whole": 2.0,
    }
    # As the SDK parses a tools/list reply: from JSON text, so integers are ints and 2.0 stays a float.
    tool = mt.Tool.model_validate_json(
        json.dumps(
            {
                "name": "t",
                "title": "T",
                "description": "d",
                "inputSchema": schema,
                "outputSchema": {"type": "object", "properties": {"count": {"type": "integer", "minimum": 0}}},
                "annotations": {"readOnlyHint": True},
            }
        )
    )
    spec = union_tools([("E", [tool])]).specs()[0]
    assert (spec.name, spec.title, spec.description, spec.endpoint) == ("t", "T", "d", "E")
    assert json.loads(spec.input_schema_json) == schema
    assert f'"maximum":{big}' in spec.input_schema_json and '"minimum":1,' in spec.input_schema_json
    assert '"x-whole":2.0' in spec.input_schema_json  # a float stays a float
    assert json.loads(spec.output_schema_json)["properties"]["count"] == {"type": "integer", "minimum": 0}
    assert json.loads(spec.annotations_json) == {"readOnlyHint": True}
    assert spec == tool_spec(tool, "E")


def test_tool_spec_of_a_bare_tool() -> None:
    spec = tool_spec(mt.Tool(name="bare", input_schema={"type": "object"}), "E")
    assert json.loads(spec.input_schema_json) == {"type": "object"}
    assert (spec.output_schema_json, spec.annotations_json, spec.title) == ("", "", "")


def test_a_tool_whose_schema_json_text_cannot_carry_is_left_out() -> None:
    deep: dict[str, object] = {"type": "object"}
    for _ in range(80):  # deeper than convert.MAX_JSON_TEXT_DEPTH
        deep = {"type": "object", "properties": {"x": deep}}
    cat = union_tools([("E", [mt.Tool(name="deep", input_schema=deep), _tool("ok")])])
    assert cat.names() == ["ok"]


SCHEMA = {
    "type": "object",
    "properties": {"n": {"type": "integer"}, "x": {"type": "number"}},
    "required": ["n"],
}


def test_invalid_arguments_message_names_the_problem() -> None:
    problem = arguments_problem("t", {"n": 5.5}, SCHEMA)
    assert "$.n" in problem and "integer" in problem and "t" in problem
    assert "'n' is a required property" in arguments_problem("t", {}, SCHEMA)
    assert arguments_problem("t", {"n": 2}, SCHEMA) == ""


def test_result_conversion_all_block_kinds() -> None:
    png = b"\x89PNG\r\n\x1a\n" + bytes(range(20))
    res = mt.CallToolResult(
        content=[
            mt.TextContent(text="hello"),
            mt.ImageContent(data=base64.b64encode(png).decode(), mime_type="image/png"),
            mt.AudioContent(data=base64.b64encode(b"RIFF").decode(), mime_type="audio/wav"),
            mt.ResourceLink(uri="file:///a.txt", name="a", mime_type="text/plain", size=3),
            mt.EmbeddedResource(resource=mt.TextResourceContents(uri="mem://x", text="inner")),
            mt.EmbeddedResource(
                resource=mt.BlobResourceContents(uri="mem://y", blob=base64.b64encode(b"\0\1").decode())
            ),
        ],
        structured_content={"count": 2, "items": ["a"]},
    )
    out = tool_result(res)
    kinds = [b.WhichOneof("kind") for b in out.content]
    assert kinds == ["text", "image", "audio", "resource_link", "resource", "resource"]
    assert out.content[1].image.data == png and out.content[1].image.mime_type == "image/png"
    assert out.content[3].resource_link.size == 3
    assert out.content[4].resource.text == "inner" and out.content[5].resource.blob == b"\0\1"
    assert json.loads(out.structured_content_json) == {"count": 2, "items": ["a"]}
    assert not out.is_error and out.error_kind == Kind.TOOL_ERROR_KIND_UNSPECIFIED
    assert "[image: image/png" in summary(out)


def test_tool_failure_becomes_tool_failed() -> None:
    out = tool_result(mt.CallToolResult(content=[mt.TextContent(text="Error executing tool x: boom")], is_error=True))
    assert out.is_error and out.error_kind == Kind.TOOL_ERROR_KIND_TOOL_FAILED and "boom" in out.error_message


def test_truncation_marks_and_keeps_within_limit() -> None:
    big = tool_result(mt.CallToolResult(content=[mt.TextContent(text="é" * 1000), mt.TextContent(text="tail")]))
    out = truncate(big, 100)
    assert out.error_kind == Kind.TOOL_ERROR_KIND_OUTPUT_TRUNCATED and not out.is_error
    assert "truncated" in out.content[0].text.text and len(out.content[0].text.text.split("\n…")[0].encode()) <= 100
    assert "truncated" in out.error_message
    small = tool_result(mt.CallToolResult(content=[mt.TextContent(text="ok")]))
    assert truncate(small, 100) == small


def test_blocks_past_the_count_become_one_note() -> None:
    """Empty blocks add no bytes for the output limit to cut: the count bounds what an upstream makes the
    gateway convert and hold."""
    many = mt.CallToolResult(content=[mt.TextContent(text="") for _ in range(MAX_CONTENT_BLOCKS + 5000)])
    out = truncate(tool_result(many, 262144), 262144)
    assert len(out.content) == MAX_CONTENT_BLOCKS + 1
    assert out.content[-1].text.text == f"[5000 more content blocks omitted by rlgate: at most {MAX_CONTENT_BLOCKS}]"
    assert not out.is_error and out.error_kind == Kind.TOOL_ERROR_KIND_OUTPUT_TRUNCATED
    assert "5000 content blocks" in out.error_message
    # A tool's failure stays TOOL_FAILED with its own text; the note is still there.
    boom: list[mt.ContentBlock] = [mt.TextContent(text="boom")] * (MAX_CONTENT_BLOCKS + 1)
    failed = tool_result(mt.CallToolResult(content=boom, is_error=True))
    assert failed.error_kind == Kind.TOOL_ERROR_KIND_TOOL_FAILED
    assert "more content blocks omitted" in failed.content[-1].text.text


def test_structured_content_past_the_limit_is_dropped_unconverted(monkeypatch: pytest.MonkeyPatch) -> None:
    """The exact conversion walks every value on the event loop: for content `truncate` would drop, it never
    runs. Under the limit it does, and integers stay integers."""
    walked: list[object] = []

    def json_text(value: object) -> str:
        walked.append(value)
        return json.dumps(value)

    monkeypatch.setattr(results, "json_text", json_text)
    big = tool_result(mt.CallToolResult(content=[], structured_content={"a": [0] * 100_000}), 1000)
    assert big.structured_content_json == "" and walked == []
    assert big.error_kind == Kind.TOOL_ERROR_KIND_OUTPUT_TRUNCATED
    assert "structured content (200007 bytes)" in big.error_message
    # Cut again by the byte limit: both cuts are named.
    text_and_numbers = mt.CallToolResult(content=[mt.TextContent(text="x" * 2000)], structured_content={"a": [0] * 999})
    both = truncate(tool_result(text_and_numbers, 1000), 1000)
    assert "structured content" in both.error_message and "output exceeded 1000 bytes" in both.error_message
    small = tool_result(mt.CallToolResult(content=[], structured_content={"n": 3}), 1000)
    assert small.structured_content_json == '{"n": 3}' and small.error_kind == Kind.TOOL_ERROR_KIND_UNSPECIFIED


def test_summary_reads_a_bounded_number_of_blocks() -> None:
    """A result of many empty blocks (each adds nothing to the text) is summarised in time linear in what it
    reads, not quadratic in the blocks."""
    empty = common_pb2.ToolResult(
        content=[common_pb2.ContentBlock(text=common_pb2.TextContent(text="")) for _ in range(50_000)],
        structured_content_json='{"k":1}',
    )
    started = time.perf_counter()
    assert summary(empty) == '{"k":1}'
    assert time.perf_counter() - started < 10.0  # generous (a loaded machine): quadratic here took minutes
    words = common_pb2.ToolResult(content=[common_pb2.ContentBlock(text=common_pb2.TextContent(text="word"))] * 300)
    assert summary(words) == " ".join(["word"] * 100)[:499] + "…"
    img = tool_result(
        mt.CallToolResult(content=[mt.ImageContent(data=base64.b64encode(b"x" * 500).decode(), mime_type="image/png")])
    )
    cut = truncate(img, 100)
    assert cut.content[0].WhichOneof("kind") == "text" and "omitted" in cut.content[0].text.text


@pytest.mark.parametrize(
    ("folder", "described"),
    [
        ({"type": ["string", "null"]}, "folder?: string|null"),
        ({"anyOf": [{"type": "string"}, {"type": "null"}], "default": None}, "folder?: string|null"),
        ({"oneOf": [{"type": "integer"}, {"enum": ["all"]}]}, "folder?: integer|one of 'all'"),
        ({"anyOf": [{"type": "string"}, {}]}, "folder?: any"),  # an alternative that allows anything
    ],
)
def test_a_union_of_types_is_described_as_that_union(folder: dict[str, object], described: str) -> None:
    schema = {"type": "object", "properties": {"folder": folder, "n": {"type": "integer"}}, "required": ["n"]}
    problem = arguments_problem("t", {"n": "twelve"}, schema)
    assert f"Expected {{{described}, n: integer}}" in problem, problem
