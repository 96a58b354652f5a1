"""JSON on the hot paths (session store records, MCP request and response bodies), through orjson.

orjson is ~10x faster than the standard library on the ~3 KB records every Step and CallTool writes or
reads. Where it and the standard library differ, the standard library's behaviour is kept: what orjson
refuses to encode (an int past 64 bits, a non-string key) goes through the standard encoder, and what it
refuses to decode (NaN and Infinity, which the standard encoder writes) through the standard decoder. orjson
reads an integer past 64 bits as a float, silently; a run of 20 digits, or 19 after a minus (the only ways to write one)
sends the text to the standard decoder, so such an integer comes back exactly.
"""

from __future__ import annotations

import json
import re
from typing import Any

import orjson

_STD_ENCODE = json.JSONEncoder(separators=(",", ":")).encode
_LONG_DIGITS = re.compile(rb"-[0-9]{19}|[0-9]{20}")
_LONG_DIGITS_TEXT = re.compile(r"-[0-9]{19}|[0-9]{20}")


def dumps_bytes(value: Any) -> bytes:
    """Compact JSON of `value`, as UTF-8 bytes."""
    try:
        return orjson.dumps(value)
    except TypeError:
        return _STD_ENCODE(value).encode()


def dumps(value: Any) -> str:
    """Compact JSON of `value`."""
    try:
        return orjson.dumps(value).decode()
    except TypeError:
        return _STD_ENCODE(value)


def loads(raw: str | bytes) -> Any:
    """Parse JSON text; raises ValueError (json.JSONDecodeError) when it is not JSON."""
    if (_LONG_DIGITS_TEXT if isinstance(raw, str) else _LONG_DIGITS).search(raw):  # type: ignore[arg-type]
        return json.loads(raw)
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return json.loads(raw)
