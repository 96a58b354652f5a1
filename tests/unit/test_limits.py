"""The orchestrator's request limits cover every field of every request: label counts and sizes, ids in
nested messages, and a table decision for each string field (a new field without one fails here)."""

from __future__ import annotations

import grpc
import pytest

from rlgate.core.errors import InvalidArgument, NotFound, RlgateError
from rlgate.orchestrator.limits import (
    MAX_ID,
    MAX_LABEL,
    MAX_LABELS,
    MESSAGE_BOUNDED,
    check_request,
    unlimited_fields,
)
from rlgate.v1 import orchestrator_pb2

SERVICE = orchestrator_pb2.DESCRIPTOR.services_by_name["OrchestratorService"]


def many(n: int) -> dict[str, str]:
    return {f"k{i}": "v" for i in range(n)}


def test_every_string_field_of_every_request_has_a_limit_or_a_reason() -> None:
    assert {m.name: unlimited_fields(m.input_type) for m in SERVICE.methods} == {m.name: [] for m in SERVICE.methods}
    for name in MESSAGE_BOUNDED:  # the free-text list names real fields
        message, _, field = name.rpartition(".")
        assert field in orchestrator_pb2.DESCRIPTOR.message_types_by_name[message.split(".")[-1]].fields_by_name


@pytest.mark.parametrize(
    "request_type",
    [orchestrator_pb2.ResetRequest, orchestrator_pb2.CloseSessionsRequest, orchestrator_pb2.ListSessionsRequest],
)
def test_label_count_is_bounded(request_type: type) -> None:
    check_request(request_type(labels=many(MAX_LABELS)))
    for n in (MAX_LABELS + 1, 1_001, 100_000):
        with pytest.raises(InvalidArgument) as err:
            check_request(request_type(labels=many(n)))
        assert err.value.field == "labels" and f"at most {MAX_LABELS} labels (got {n})" in err.value.message
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_label_keys_and_values_are_bounded_and_never_echoed_whole() -> None:
    check_request(orchestrator_pb2.ResetRequest(labels={"k" * MAX_LABEL: "v" * MAX_LABEL}))
    for bad in ({"k" * (MAX_LABEL + 1): "v"}, {"": "v"}, {"k": "v" * (MAX_LABEL + 1)}, {"k" * 10**6: "v" * 10**6}):
        with pytest.raises(InvalidArgument) as err:
            check_request(orchestrator_pb2.ListSessionsRequest(labels=bad))
        assert err.value.field == "labels" and err.value.to_status().ByteSize() < 1024


def test_tool_call_summaries_are_checked_field_by_field() -> None:
    """A Step's tool_calls[i].request_id is bounded (it names a CallTool request_id, itself <= 128), with the
    index in the field; the model's name and arguments as written are not (refusing them would end a rollout
    over model output; they are only digested)."""
    ok = orchestrator_pb2.ToolCallSummary(
        name="n" * 100_000, arguments_json="{}" + " " * 100_000, request_id="r" * MAX_ID
    )
    check_request(orchestrator_pb2.StepRequest(session_id="s-1", tool_calls=[ok, ok]))
    long = orchestrator_pb2.ToolCallSummary(name="echo", request_id="r" * 10**6)
    with pytest.raises(InvalidArgument) as err:
        check_request(orchestrator_pb2.StepRequest(session_id="s-1", tool_calls=[ok, long]))
    assert err.value.field == "tool_calls[1].request_id" and err.value.to_status().ByteSize() < 1024


@pytest.mark.parametrize("method", [m.name for m in SERVICE.methods])
def test_every_id_field_at_a_megabyte_answers_a_short_status(method: str) -> None:
    """Each string field with a limit, set to 1 MiB characters on its own: INVALID_ARGUMENT or NOT_FOUND with
    a status far below the trailers' limit."""
    request_type = getattr(orchestrator_pb2, SERVICE.methods_by_name[method].input_type.name)
    bounded = [
        fd.name
        for fd in request_type.DESCRIPTOR.fields
        if fd.type == fd.TYPE_STRING and fd.full_name not in MESSAGE_BOUNDED and not fd.is_repeated
    ]
    for name in bounded:
        with pytest.raises(RlgateError) as err:
            check_request(request_type(**{name: "x" * (1 << 20)}))
        assert isinstance(err.value, InvalidArgument | NotFound), (method, name)
        assert err.value.to_status().ByteSize() < 1024, (method, name)
