"""JSON is exact through the gateway: schemas, arguments and structured results keep their integers (2^60
included), in ListTools, CallTool and the tool-call log; an upstream's JSON-RPC error message is passed on."""

from __future__ import annotations

import json
from typing import Any

from rlgate.core.convert import struct_from_dict
from rlgate.store import SessionStore
from rlgate.v1 import common_pb2, toolgateway_pb2
from rlgate.v1.toolgateway_pb2_grpc import ToolGatewayServiceStub as Stub
from tests.toolgateway.conftest import AgentSession, ExactUpstream, byo_session
from tests.toolgateway.upstreams import BIG, ECHO_EXTRA, ECHO_INPUT, ECHO_OUTPUT, REJECTION

Kind = common_pb2.ToolErrorKind


def same_json(a: Any, b: Any) -> bool:
    """Equal as JSON values *and* types: 3 is not 3.0 here, although Python says 3 == 3.0."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_json(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(map(same_json, a, b))
    return type(a) is type(b) and a == b


async def call_json(
    stub: Stub, s: AgentSession, name: str, arguments_json: str, request_id: str = ""
) -> toolgateway_pb2.CallToolResponse:
    req = toolgateway_pb2.CallToolRequest(name=name, arguments_json=arguments_json, request_id=request_id)
    return await stub.CallTool(req, metadata=s.metadata, timeout=20)  # type: ignore[no-any-return]


async def test_schemas_round_trip_exactly(stub: Stub, store: SessionStore, exact_upstream: ExactUpstream) -> None:
    s = await byo_session(store, [exact_upstream.url])
    listed = await stub.ListTools(toolgateway_pb2.ListToolsRequest(), metadata=s.metadata, timeout=20)
    echo = next(t for t in listed.tools if t.name == "echo")
    schema = json.loads(echo.input_schema_json)
    assert same_json(schema, ECHO_INPUT), echo.input_schema_json
    props = schema["properties"]
    assert (props["items"]["minItems"], props["label"]["maxLength"], props["n"]["default"]) == (1, 12, 3)
    assert props["n"]["maximum"] == BIG and '"maximum":1152921504606846976' in echo.input_schema_json
    assert same_json(json.loads(echo.output_schema_json), ECHO_OUTPUT)
    assert json.loads(echo.annotations_json) == {"readOnlyHint": True}
    reject = next(t for t in listed.tools if t.name == "reject")
    assert reject.output_schema_json == "" and reject.annotations_json == ""


async def test_arguments_and_structured_content_round_trip_exactly(
    stub: Stub, store: SessionStore, exact_upstream: ExactUpstream
) -> None:
    s = await byo_session(store, [exact_upstream.url])
    arguments = {"items": [1, 2, BIG], "n": BIG, "ratio": 2.0, "label": "é"}
    resp = await call_json(stub, s, "echo", json.dumps(arguments), request_id="exact-1")
    assert not resp.result.is_error, resp.result.error_message
    structured = json.loads(resp.result.structured_content_json)
    assert same_json(structured, {"arguments": arguments, **ECHO_EXTRA}), resp.result.structured_content_json
    assert '"big":1152921504606846976' in resp.result.structured_content_json
    assert '"whole_float":2.0' in resp.result.structured_content_json  # a float stays a float too

    # A Struct carries whole numbers (within 2^53) to the tool as integers.
    by_struct = await stub.CallTool(
        toolgateway_pb2.CallToolRequest(name="echo", arguments=struct_from_dict({"items": [7], "n": 5})),
        metadata=s.metadata,
        timeout=20,
    )
    assert same_json(json.loads(by_struct.result.structured_content_json)["arguments"], {"items": [7], "n": 5})

    # The tool-call log (what State shows) keeps the exact arguments.
    log = await store.list_tool_calls(s.session.session_id)
    assert log[0].request_id == "exact-1"
    assert same_json(log[0].arguments, arguments) and same_json(log[1].arguments, {"items": [7], "n": 5})
    assert log[0].result_summary == "echo #1"

    # A replay is the recorded result, byte for byte.
    again = await call_json(stub, s, "echo", json.dumps(arguments), request_id="exact-1")
    assert again.replayed and again.result == resp.result
    assert exact_upstream.calls["echo"] == 2


async def test_schema_validation_uses_exact_values(
    stub: Stub, store: SessionStore, exact_upstream: ExactUpstream
) -> None:
    s = await byo_session(store, [exact_upstream.url])
    for arguments, where in [
        ('{"items": []}', "$.items"),
        ('{"items": [1.5]}', "$.items[0]"),
        ('{"items": [1], "label": "far too long a label"}', "$.label"),
        (f'{{"items": [1], "n": {BIG + 1}}}', "$.n"),
    ]:
        resp = await call_json(stub, s, "echo", arguments)
        assert resp.result.error_kind == Kind.TOOL_ERROR_KIND_INVALID_ARGUMENTS, arguments
        assert where in resp.result.error_message, resp.result.error_message
    assert exact_upstream.calls["echo"] == 0


async def test_upstream_json_rpc_error_message_is_passed_on_cut_to_the_limit(
    stub: Stub, store: SessionStore, exact_upstream: ExactUpstream
) -> None:
    s = await byo_session(store, [exact_upstream.url])  # the `gateway` fixture cuts output at 4096 bytes
    resp = await call_json(stub, s, "reject", "{}")
    result = resp.result
    assert result.is_error and result.error_kind == Kind.TOOL_ERROR_KIND_TOOL_FAILED
    assert "JSON-RPC error -32602" in result.error_message and REJECTION[:200] in result.error_message
    assert "output truncated by rlgate" in result.error_message and len(result.error_message.encode()) < 4300
    assert "output truncated by rlgate" in result.content[0].text.text
    assert exact_upstream.calls["reject"] == 1
