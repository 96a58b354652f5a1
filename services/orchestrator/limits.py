"""Limits on every request's strings and labels, checked before any work.

No request value may grow a store key, a log line or an error, so each string field has a documented
maximum (docs/orchestrator.md, "Errors") or is listed in `MESSAGE_BOUNDED` (free text that is only digested
or handed to a verifier, never stored, echoed or logged: the 16 MiB message limit bounds it). Nested
messages (a Step's `tool_calls`) are checked field by field the same way. A field that names something
that must already exist (`session_id`, `task_key`) and is longer than any such name can be answers
NOT_FOUND without a lookup, like any other unknown name; every other field past its maximum is
INVALID_ARGUMENT naming it. Errors echo at most `errors.MAX_ECHO` characters of a value.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message

from rlgate.core.errors import InvalidArgument, NotFound, clip

MAX_ID = 128  # request_id, run_id, session_id (rlgate's own session ids are 26 characters)
MAX_KEY = 256  # task_key, env_key
MAX_PAGE_TOKEN = 2048  # room for a page token positioned at any task key of MAX_KEY characters
MAX_LABEL = 63  # label keys and values
MAX_LABELS = 64  # labels on a session, and label filters on CloseSessions / ListSessions (each one a store join)

# Fields that name an existing thing: (maximum, what it names, ErrorInfo reason).
_NAMES: dict[str, tuple[int, str, str]] = {
    "session_id": (MAX_ID, "session", "SESSION_NOT_FOUND"),
    "task_key": (MAX_KEY, "task_key", "TASK_NOT_FOUND"),
}
# Fields the caller chooses freely, up to a maximum.
_FREE: dict[str, int] = {
    "request_id": MAX_ID,
    "run_id": MAX_ID,
    "env_key": MAX_KEY,
    "page_token": MAX_PAGE_TOKEN,
    "tool_calls_page_token": MAX_PAGE_TOKEN,
}
# What the model wrote (a Step's text, final answer, and its tool calls' names and arguments as reported):
# refusing it would end a rollout over model output, and it is only digested by the request ledger or
# passed to the verifier, never stored, echoed or logged.
MESSAGE_BOUNDED = frozenset({
    "rlgate.v1.StepRequest.assistant_text",
    "rlgate.v1.StepRequest.final_answer",
    "rlgate.v1.ToolCallSummary.name",
    "rlgate.v1.ToolCallSummary.arguments_json",
})  # fmt: skip
_WELL_KNOWN = "google.protobuf."  # Struct arguments: bounded by the message, checked as JSON by the handler


def check_field(name: str, value: str, path: str = "") -> None:
    """Raise if `value` is longer than field `name` allows (`path`: where it sits, for the error)."""
    where = path or name
    if name in _NAMES:
        maximum, what, reason = _NAMES[name]
        if len(value) > maximum:
            raise NotFound(
                f"unknown {what} {clip(value)!r} ({len(value)} characters; names are at most {maximum})",
                reason=reason,
                metadata={name: value},
            )
    elif name in _FREE and len(value) > _FREE[name]:
        raise InvalidArgument(where, f"at most {_FREE[name]} characters (got {len(value)})")


def check_labels(labels: Mapping[str, str], field_name: str = "labels") -> None:
    if len(labels) > MAX_LABELS:
        raise InvalidArgument(field_name, f"at most {MAX_LABELS} labels (got {len(labels)})")
    for k, v in labels.items():
        if not k or len(k) > MAX_LABEL:
            raise InvalidArgument(field_name, f"label key {clip(k)!r} must be 1..{MAX_LABEL} characters")
        if len(v) > MAX_LABEL:
            raise InvalidArgument(field_name, f"value of label {k!r} exceeds {MAX_LABEL} characters ({len(v)})")


def check_request(request: Message, path: str = "") -> None:
    """Every string field of a request (nested messages included) with a limit, by field name, and its
    `labels`. Checked by name, so a new RPC's fields are covered by the same tables (`unlimited_fields`
    lists any string field that is in none of them, for the tests)."""
    for name, kind in _checked_fields(request.DESCRIPTOR):
        if kind == "labels":
            check_labels(getattr(request, name), path + name)
        elif kind == "string":
            check_field(name, getattr(request, name), path + name)
        elif kind == "messages":
            for i, item in enumerate(getattr(request, name)):
                check_request(item, f"{path}{name}[{i}].")
        elif request.HasField(name):
            check_request(getattr(request, name), f"{path}{name}.")


@functools.cache
def _checked_fields(descriptor: Descriptor) -> tuple[tuple[str, str], ...]:
    """(field name, how it is checked) for the fields `check_request` looks at: "labels", "string",
    "messages" (repeated) or "message"; worked out once per message type."""
    out: list[tuple[str, str]] = []
    for fd in descriptor.fields:
        if fd.message_type is not None and fd.message_type.GetOptions().map_entry:
            if fd.name == "labels":
                out.append((fd.name, "labels"))
        elif fd.type == FieldDescriptor.TYPE_STRING and not fd.is_repeated:
            out.append((fd.name, "string"))
        elif fd.message_type is not None and not fd.message_type.full_name.startswith(_WELL_KNOWN):
            out.append((fd.name, "messages" if fd.is_repeated else "message"))
    return tuple(out)


def unlimited_fields(descriptor: Descriptor, path: str = "") -> list[str]:
    """String and map fields of a request type (nested ones included) that no table above bounds."""
    out: list[str] = []
    for fd in descriptor.fields:
        where = f"{path}{fd.name}"
        if fd.message_type is not None and fd.message_type.GetOptions().map_entry:
            if fd.name != "labels":
                out.append(where)
        elif fd.type == FieldDescriptor.TYPE_STRING:
            if fd.is_repeated or (fd.name not in (*_NAMES, *_FREE) and fd.full_name not in MESSAGE_BOUNDED):
                out.append(where)
        elif fd.message_type is not None and not fd.message_type.full_name.startswith(_WELL_KNOWN):
            out.extend(unlimited_fields(fd.message_type, f"{where}."))
    return out
