"""Length limits on the ids and keys of every request, checked before any work.

No request value may grow a store key, a log line or an error, so each id field has a documented maximum
(docs/orchestrator.md, "Errors"). A field that names something that must already exist (`session_id`,
`task_key`) and is longer than any such name can be answers NOT_FOUND without a lookup, like any other
unknown name; every other field past its maximum is INVALID_ARGUMENT naming it. Errors echo at most
`errors.MAX_ECHO` characters of a value.
"""

from __future__ import annotations

from collections.abc import Mapping

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from rlgate.runtime.errors import InvalidArgument, NotFound, clip

MAX_ID = 128  # request_id, run_id, session_id (rlgate's own session ids are 26 characters)
MAX_KEY = 256  # task_key, env_key
MAX_PAGE_TOKEN = 2048  # room for a page token positioned at any task key of MAX_KEY characters
MAX_LABEL = 63  # label keys and values

# Fields that name an existing thing: (maximum, what it names, ErrorInfo reason).
_NAMES: dict[str, tuple[int, str, str]] = {
    "session_id": (MAX_ID, "session", "SESSION_NOT_FOUND"),
    "task_key": (MAX_KEY, "task_key", "TASK_NOT_FOUND"),
}
# Fields the caller chooses freely, up to a maximum.
_FREE: dict[str, int] = {"request_id": MAX_ID, "run_id": MAX_ID, "env_key": MAX_KEY, "page_token": MAX_PAGE_TOKEN}


def check_field(name: str, value: str) -> None:
    """Raise if `value` is longer than field `name` allows (fields without a limit always pass)."""
    if name in _NAMES:
        maximum, what, reason = _NAMES[name]
        if len(value) > maximum:
            raise NotFound(f"unknown {what} {clip(value)!r} ({len(value)} characters; names are at most "
                           f"{maximum})", reason=reason, metadata={name: value})
    elif name in _FREE and len(value) > _FREE[name]:
        raise InvalidArgument(name, f"at most {_FREE[name]} characters (got {len(value)})")


def check_labels(labels: Mapping[str, str], field_name: str = "labels") -> None:
    for k, v in labels.items():
        if not k or len(k) > MAX_LABEL:
            raise InvalidArgument(field_name, f"label key {clip(k)!r} must be 1..{MAX_LABEL} characters")
        if len(v) > MAX_LABEL:
            raise InvalidArgument(field_name, f"value of label {k!r} exceeds {MAX_LABEL} characters")


def check_request(request: Message) -> None:
    """Every id field of a request: its top-level strings with a limit (by field name) and its `labels`.
    Checked by name, so a new RPC's fields are covered by the same table."""
    for fd in request.DESCRIPTOR.fields:
        if fd.message_type is not None and fd.message_type.GetOptions().map_entry:
            if fd.name == "labels":
                check_labels(getattr(request, fd.name), fd.name)
        elif fd.type == FieldDescriptor.TYPE_STRING and not fd.is_repeated:
            check_field(fd.name, getattr(request, fd.name))
