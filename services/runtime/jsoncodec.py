"""JSON of the session store's records, through orjson.

orjson is several times faster than the standard library on the few-KB records every Step and CallTool
writes and reads. Where the two differ, the standard library's behaviour is kept:
- what orjson refuses to encode (an int past 64 bits, a non-string key) goes through the standard encoder;
  such text starts with a space (valid JSON), which tells `loads` to decode it with the standard decoder
  too, since orjson would silently read an integer past 64 bits as a float;
- what orjson refuses to decode (NaN and Infinity, which the standard encoder writes) goes through the
  standard decoder.
The marker costs nothing on the common path (one byte compared), where scanning every record for long
digit runs cost several times the parse itself.
"""

from __future__ import annotations

import json
from typing import Any

import orjson

_STD_ENCODE = json.JSONEncoder(separators=(",", ":")).encode
_STD_MARK = " "  # leading whitespace: valid JSON, and a sign that only the standard decoder reads it exactly


def dumps_bytes(value: Any) -> bytes:
    """Compact JSON of `value`, as UTF-8 bytes."""
    try:
        return orjson.dumps(value)
    except TypeError:
        return (_STD_MARK + _STD_ENCODE(value)).encode()


def dumps(value: Any) -> str:
    """Compact JSON of `value`."""
    try:
        return orjson.dumps(value).decode()
    except TypeError:
        return _STD_MARK + _STD_ENCODE(value)


def loads(raw: str | bytes) -> Any:
    """Parse JSON text; raises ValueError (json.JSONDecodeError) when it is not JSON."""
    if raw[:1] in (" ", b" "):
        return json.loads(raw)
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return json.loads(raw)
