"""rlgate.protocol: rendering and lenient parsing of the Hermes/Qwen tool-call text protocol."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlgate import protocol
from rlgate.core.convert import InvalidJsonValue
from rlgate.protocol import ToolCall, parse_assistant_text, render_assistant_turn, render_tool_call
from rlgate.v1 import common_pb2

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers()  # any size: the protocol and the wire (JSON text) keep integers exact
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=30)
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12,
)
arguments = st.dictionaries(st.text(max_size=12), json_values, max_size=5)
names = st.from_regex(r"[A-Za-z][A-Za-z0-9._-]{0,40}", fullmatch=True)
calls = st.builds(ToolCall, name=names, arguments=arguments)
prose = st.text(max_size=80).filter(lambda s: "<" not in s)

FAST = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FAST
@given(call=calls)
def test_render_then_parse_gives_the_call_back(call: ToolCall) -> None:
    turn = parse_assistant_text(render_tool_call(call))
    assert turn.errors == []
    assert turn.tool_calls == [call]
    assert not turn.done


@FAST
@given(batch=st.lists(calls, min_size=1, max_size=4), before=prose, between=prose, answer=prose)
def test_several_calls_with_prose_and_a_final_answer(
    batch: list[ToolCall], before: str, between: str, answer: str
) -> None:
    text = before + between.join(render_tool_call(c) for c in batch) + "\n" + protocol.render_final_answer(answer)
    turn = parse_assistant_text(text)
    assert turn.tool_calls == batch
    assert turn.final_answer == answer.strip()
    assert turn.done and turn.errors == []


@FAST
@given(text=st.text(max_size=400))
def test_arbitrary_text_never_raises(text: str) -> None:
    turn = parse_assistant_text(text)
    assert isinstance(turn.errors, list)


@FAST
@given(
    pieces=st.lists(
        st.sampled_from(
            [
                "<tool_call>",
                "</tool_call>",
                "{",
                "}",
                '"name"',
                ":",
                '"x"',
                ",",
                "<final_answer>",
                "<think>",
                "[",
                "<done/>",
            ]
        )
        | st.text(max_size=5),
        max_size=40,
    )
)
def test_tag_soup_never_raises(pieces: list[str]) -> None:
    parse_assistant_text("".join(pieces))


@FAST
@given(call=calls, missing=st.integers(min_value=1, max_value=3), close_tag=st.booleans(), spelling=st.booleans())
def test_messy_variants_still_parse(call: ToolCall, missing: int, close_tag: bool, spelling: bool) -> None:
    payload = {"tool" if spelling else "name": call.name, "params" if spelling else "arguments": call.arguments}
    body = json.dumps(payload, ensure_ascii=False)
    # Only the closing braces that the object itself ends with can go missing.
    trailing = len(body) - len(body.rstrip("}"))
    body = body[: len(body) - min(missing, trailing)]
    text = "Let me do that.\n<tool_call>\n" + body + ("\n</tool_call>" if close_tag else "") + "\nDone for now."
    turn = parse_assistant_text(text)
    assert turn.tool_calls == [call], turn.errors


def test_missing_closing_tag_then_next_call() -> None:
    text = '<tool_call>{"name": "a", "arguments": {}}\n<tool_call>{"name": "b", "arguments": {"k": 1}}'
    assert parse_assistant_text(text).tool_calls == [ToolCall("a", {}), ToolCall("b", {"k": 1})]


def test_missing_braces_before_closing_tag() -> None:
    text = '<tool_call>{"name": "search", "arguments": {"q": {"deep": [1, 2]</tool_call>'
    assert parse_assistant_text(text).tool_calls == [ToolCall("search", {"q": {"deep": [1, 2]}})]


def test_four_missing_braces_is_an_error_observation() -> None:
    turn = parse_assistant_text('<tool_call>{"name": "a", "arguments": {"b": {"c": {"d": 1')
    assert turn.tool_calls == [] and len(turn.errors) == 1
    assert "tool call #1" in turn.errors[0]


def test_openai_function_shape_and_string_arguments() -> None:
    text = '<tool_call>{"type": "function", "function": {"name": "f", "arguments": "{\\"x\\": 2}"}}</tool_call>'
    assert parse_assistant_text(text).tool_calls == [ToolCall("f", {"x": 2})]


def test_code_fence_inside_the_tag() -> None:
    text = '<tool_call>\n```json\n{"name": "f", "arguments": {"x": 1}}\n```\n</tool_call>'
    assert parse_assistant_text(text).tool_calls == [ToolCall("f", {"x": 1})]


def test_think_blocks_are_ignored() -> None:
    text = '<think>maybe <tool_call>{"name": "no", "arguments": {}}</tool_call></think><tool_call>{"name": "yes"}'
    assert parse_assistant_text(text).tool_calls == [ToolCall("yes", {})]
    prefilled = 'I should call no</think>\n<tool_call>{"name": "yes", "arguments": {}}</tool_call>'
    assert parse_assistant_text(prefilled).tool_calls == [ToolCall("yes", {})]


def test_bad_shapes_are_errors_not_exceptions() -> None:
    for text in [
        "<tool_call>[1, 2]</tool_call>",
        '<tool_call>{"arguments": {}}</tool_call>',
        '<tool_call>{"name": "a", "arguments": [1]}</tool_call>',
        '<tool_call>{"name": "a", "arguments": {"x": NaN}}</tool_call>',
        '<tool_call>{"name": "a", "arguments": "not json"}</tool_call>',
        "<tool_call></tool_call>",
        "<tool_call>" + "[" * 5000,
    ]:
        turn = parse_assistant_text(text)
        assert turn.tool_calls == [] and len(turn.errors) == 1, text


def test_done_and_final_answer_conventions() -> None:
    assert parse_assistant_text("all set <done/>").done
    assert parse_assistant_text("<done>").final_answer is None
    turn = parse_assistant_text("<final_answer> 42 ")
    assert turn.final_answer == "42" and turn.done
    plain = parse_assistant_text("just prose")
    assert plain.empty and not plain.done


def test_render_assistant_turn_round_trip() -> None:
    call = ToolCall("send", {"to": "a@b.c", "n": 3})
    turn = parse_assistant_text(render_assistant_turn([call], "ok"))
    assert turn.tool_calls == [call] and turn.final_answer == "ok"


def _tools_block(text: str) -> list[str]:
    return text.split("<tools>\n", 1)[1].split("\n</tools>", 1)[0].splitlines()


def test_system_prompt_lists_tools_from_protos_and_dicts() -> None:
    spec = common_pb2.ToolSpec(name="search", description="Find mail", input_schema_json='{"type":"object"}')
    text = protocol.render_system_prompt([spec, {"name": "other", "parameters": {"type": "object"}}])
    assert [json.loads(line)["function"]["name"] for line in _tools_block(text)] == ["search", "other"]
    assert "<tool_call>" in text and "<final_answer>" in text


def test_system_prompt_shows_integer_schema_keywords_as_integers() -> None:
    """The schema as the MCP server wrote it: a model trained on `"default": 3.0` would meet `3` in
    deployment (Struct made every number a double)."""
    schema = {
        "type": "object",
        "properties": {
            "limit": {"type": "integer", "default": 3, "minimum": 1, "maximum": 2**60},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 40}, "minItems": 1, "maxItems": 5},
            "ratio": {"type": "number", "default": 0.5},
        },
        "required": ["tags"],
    }
    spec = common_pb2.ToolSpec(name="search", input_schema_json=json.dumps(schema, separators=(",", ":")))
    text = protocol.render_system_prompt([spec])
    (line,) = _tools_block(text)
    assert json.loads(line)["function"]["parameters"] == schema
    for shown in ('"default": 3,', '"minItems": 1,', '"maxLength": 40}', '"maximum": 1152921504606846976}'):
        assert shown in line, shown
    assert "3.0" not in line and "1.0" not in line and "40.0" not in line
    assert '"default": 0.5' in line


def test_tool_without_a_schema_gets_an_empty_object_schema() -> None:
    spec = protocol.tool_spec_dict(common_pb2.ToolSpec(name="ping"))
    assert spec["parameters"] == {"type": "object", "properties": {}}


def test_a_schema_that_is_not_json_names_the_tool() -> None:
    with pytest.raises(InvalidJsonValue, match="input_schema_json of tool 'broken'"):
        protocol.tool_spec_dict(common_pb2.ToolSpec(name="broken", input_schema_json="{nope"))


def test_render_tool_result_notes_images_and_errors() -> None:
    result = common_pb2.ToolResult(
        content=[
            common_pb2.ContentBlock(text=common_pb2.TextContent(text="hello")),
            common_pb2.ContentBlock(image=common_pb2.ImageContent(data=b"\x89PNG....", mime_type="image/png")),
        ]
    )
    assert protocol.render_tool_result(result) == "hello\n[image: image/png, 8 bytes]"
    error = common_pb2.ToolResult(
        is_error=True, error_kind=common_pb2.TOOL_ERROR_KIND_OUTCOME_UNKNOWN, error_message="owner died"
    )
    assert protocol.render_tool_result(error) == "Error (outcome unknown): owner died"
    written = '{"n":2,"big":1152921504606846976,"r":1.5}'
    structured = common_pb2.ToolResult(structured_content_json=written)
    assert protocol.render_tool_result(structured) == written  # as the tool wrote it
    text_wins = common_pb2.ToolResult(
        content=[common_pb2.ContentBlock(text=common_pb2.TextContent(text="2 items"))], structured_content_json="{}"
    )
    assert protocol.render_tool_result(text_wins) == "2 items"
    message = protocol.tool_response_message(["a", "b"])
    assert message.role == "user"
    assert message.content == "<tool_response>\na\n</tool_response>\n<tool_response>\nb\n</tool_response>"


def test_finite_floats_survive() -> None:
    call = ToolCall("f", {"x": 1e308, "y": -0.0, "z": math.pi})
    assert parse_assistant_text(render_tool_call(call)).tool_calls == [call]


def test_big_integers_parse_exactly() -> None:
    (call,) = parse_assistant_text('<tool_call>{"name": "f", "arguments": {"n": 1152921504606846977}}').tool_calls
    assert call.arguments == {"n": 2**60 + 1} and type(call.arguments["n"]) is int


def test_arguments_the_client_could_not_send_are_errors() -> None:
    """What parses is sendable: arguments nested past the JSON text depth bound are an observation here, not
    an InvalidArgument from call_tool that would end the rollout."""
    deep: dict = {}
    inner = deep
    for _ in range(70):
        inner["a"] = {}
        inner = inner["a"]
    turn = parse_assistant_text(render_tool_call(ToolCall("f", deep)))
    assert turn.tool_calls == [] and "nested deeper" in turn.errors[0]
    assert protocol.call_error("f", {"x": [1, 2]}) is None
    assert "must be a JSON object" in (protocol.call_error("f", [1]) or "")
