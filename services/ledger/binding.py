"""What a request_id is bound to: its caller's scope, the digests of its parameters, and the DONE record's
payload (see the package docstring)."""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Mapping
from typing import Any

from google.protobuf.message import Message

from rlgate.core.convert import InvalidJsonValue, json_text, parse_json_text
from rlgate.core.errors import InvalidArgument, clip
from rlgate.runtime import jsoncodec

ANONYMOUS = "-"  # the caller when no credentials identify one (no API keys configured)
DIGEST_CHARS = 16  # hex characters per field digest (64 bits: a collision is no practical concern)


def scope(kind: str, caller: str) -> str:
    """The records of one kind of request ("reset", "step") of one caller (an API key's hash, or "")."""
    return f"{kind}:{caller or ANONYMOUS}"


def fingerprint(params: Mapping[str, Any]) -> dict[str, str]:
    """{field: digest of its canonical JSON value}. Object keys are sorted and whole floats are integers
    (JSON does not tell 1 from 1.0), so equal values digest equally whichever form they arrived in."""
    return {
        name: hashlib.sha256(_digested(_canonical(value))).hexdigest()[:DIGEST_CHARS] for name, value in params.items()
    }


def _digested(value: Any) -> bytes:
    """`json_text(value)` as bytes. The parameters were parsed and checked where they arrived, so the text is
    made directly; `json_text` runs (and names the place) only for one that JSON cannot carry."""
    try:
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode("utf-8")
    except (TypeError, ValueError, RecursionError):
        return json_text(value).encode("utf-8")


def check_binding(request_id: str, first: Mapping[str, str] | None, now: Mapping[str, str]) -> None:
    """InvalidArgument naming the first field whose digest differs (`now`'s order first); `first` None: the
    first attempt's parameters are unknown (a record from before the ledger), nothing to compare."""
    if first is None:
        return
    for name in [*now, *(k for k in first if k not in now)]:
        if first.get(name) != now.get(name):
            raise InvalidArgument(
                name,
                f"differs from the first request with request_id {clip(request_id)!r}; "
                "a request_id names one request: use a new one for another request",
            )


def _canonical(value: Any) -> Any:
    if isinstance(value, str | int | bool) or value is None:
        return value
    if isinstance(value, Mapping):
        return {str(k): _canonical(value[k]) for k in sorted(value, key=str)}
    if isinstance(value, list | tuple):
        return [_canonical(v) for v in value]
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def encode_result(params: Mapping[str, str], response: Message) -> str:
    """A DONE record's payload: the parameters' digests and the serialised response. Only strings (hex
    digests, base64), so the store's encoder writes it without `json_text`'s checks (every Step pays them)."""
    encoded = base64.b64encode(response.SerializeToString()).decode()
    return jsoncodec.dumps({"params": dict(params), "response": encoded})


def decode_result(raw: str) -> tuple[dict[str, str] | None, bytes]:
    """(digests or None when the record predates them, serialised response) of a DONE record's payload."""
    if not raw.startswith("{"):
        return None, base64.b64decode(raw)
    try:
        data = parse_json_text(raw, "request record")
        return dict(data["params"]), base64.b64decode(data["response"])
    except (InvalidJsonValue, KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"corrupt request record payload: {exc}") from exc
