"""JSON <-> Struct conversion limits: what cannot travel is refused with a clear error, never a DecodeError."""

from __future__ import annotations

import math
from typing import Any

import pytest

from rlgate.core.convert import (
    MAX_JSON_DEPTH,
    MAX_JSON_TEXT_DEPTH,
    JsonTooDeepError,
    NonFiniteNumberError,
    ensure_json,
    json_from_struct,
    struct_from_dict,
)
from rlgate.protocol import parse_assistant_text
from rlgate.v1 import toolgateway_pb2


def nested(depth: int) -> dict[str, Any]:
    value: dict[str, Any] = {"leaf": 1}
    for _ in range(depth - 1):
        value = {"a": value}
    return value


def test_roundtrip_at_the_depth_limit_is_deliverable() -> None:
    arguments = nested(MAX_JSON_DEPTH)
    request = toolgateway_pb2.CallToolRequest(name="t", arguments=struct_from_dict(arguments))
    parsed = toolgateway_pb2.CallToolRequest.FromString(request.SerializeToString())
    assert json_from_struct(parsed.arguments) == arguments


def test_too_deep_is_refused_before_protobuf_sees_it() -> None:
    with pytest.raises(JsonTooDeepError, match="nested deeper"):
        struct_from_dict(nested(MAX_JSON_DEPTH + 1))
    with pytest.raises(JsonTooDeepError):
        deep_list: Any = 1
        for _ in range(MAX_JSON_DEPTH):
            deep_list = [deep_list]
        ensure_json({"list": deep_list})
    with pytest.raises(NonFiniteNumberError, match=r"\$\.x\[1\]"):
        ensure_json({"x": [1.0, math.nan]})


def test_model_text_with_undeliverable_arguments_is_an_error_observation() -> None:
    import json

    # Arguments travel as JSON text: deeper than it may nest is what cannot be delivered.
    text = '<tool_call>{"name": "list_folders", "arguments": ' + json.dumps(nested(MAX_JSON_TEXT_DEPTH + 1))
    text += "}</tool_call>"
    turn = parse_assistant_text(text)
    assert not turn.tool_calls
    assert turn.errors and "nested deeper" in turn.errors[0]


def test_json_text_refuses_a_lone_surrogate_instead_of_failing_to_encode_later() -> None:
    from rlgate.core.convert import InvalidJsonValue, json_text

    with pytest.raises(InvalidJsonValue, match="surrogate"):
        json_text({"q": "model wrote \ud800"})
    assert json_text({"q": "ünïcode"}) == '{"q":"ünïcode"}'


@pytest.mark.parametrize("text", ['{"a": "\\ud800"}', '{"a": 1e999}', '{"\\udc00": 1}', "[-1e400]"])
def test_parse_json_text_refuses_json_that_cannot_be_written_back(text: str) -> None:
    from rlgate.core.convert import InvalidJsonValue, parse_json_text

    with pytest.raises(InvalidJsonValue):
        parse_json_text(text)
    assert parse_json_text('{"a": "\\ud83d\\ude00", "b": 1.5e300}') == {"a": "😀", "b": 1.5e300}
