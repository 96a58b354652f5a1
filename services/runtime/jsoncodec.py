"""JSON on the hot paths (session store records, MCP request and response bodies), through orjson.

orjson is ~10x faster than the standard library on the ~3 KB records every Step and CallTool writes or
reads. Where it and the standard library differ, the standard library's behaviour is kept: what orjson
refuses to encode (an int past 64 bits, a non-string key) goes through the standard encoder, and what it
refuses to decode (NaN and Infinity, which the standard encoder writes) through the standard decoder.
"""

from __future__ import annotations

import json
from typing import Any

import orjson

_STD_ENCODE = json.JSONEncoder(separators=(",", ":")).encode


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
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return json.loads(raw)
