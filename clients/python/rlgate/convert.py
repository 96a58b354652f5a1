"""Conversions between Python JSON values and google.protobuf Struct/Value.

Struct carries every number as a double. `py_from_value` returns floats that are whole numbers as floats;
callers that know a schema (the toolgateway) restore integers themselves. Non-finite numbers are rejected
where a JSON value is expected, and so are values nested deeper than `MAX_JSON_DEPTH`: each JSON level is two
protobuf messages (Struct, Value), and receivers refuse messages nested past protobuf's parse depth, so a
deeper value could never be delivered (`ensure_json`)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from google.protobuf import struct_pb2

MAX_JSON_DEPTH = 32  # objects/arrays inside each other; well inside protobuf's parse depth of 100 messages


class InvalidJsonValue(ValueError):
    """A value that cannot travel as a google.protobuf.Struct/Value."""


class NonFiniteNumberError(InvalidJsonValue):
    """NaN or Infinity inside a JSON-shaped value (JSON cannot represent them)."""


class JsonTooDeepError(InvalidJsonValue):
    """Objects/arrays nested deeper than MAX_JSON_DEPTH."""


def value_from_py(obj: Any) -> struct_pb2.Value:
    value = struct_pb2.Value()
    if obj is None:
        value.null_value = struct_pb2.NULL_VALUE
    elif isinstance(obj, bool):
        value.bool_value = obj
    elif isinstance(obj, int | float):
        value.number_value = float(obj)
    elif isinstance(obj, str):
        value.string_value = obj
    elif isinstance(obj, Mapping):
        value.struct_value.CopyFrom(struct_from_dict(obj))
    elif isinstance(obj, list | tuple):
        value.list_value.values.extend(value_from_py(v) for v in obj)
    else:
        value.string_value = str(obj)
    return value


def struct_from_dict(obj: Mapping[str, Any] | None) -> struct_pb2.Struct:
    """A Struct from a JSON object; raises JsonTooDeepError rather than building an undeliverable message."""
    _check_depth(obj or {}, "$", 1)
    struct = struct_pb2.Struct()
    for key, item in (obj or {}).items():
        struct.fields[str(key)].CopyFrom(value_from_py(item))
    return struct


def py_from_value(value: struct_pb2.Value) -> Any:
    kind = value.WhichOneof("kind")
    if kind == "struct_value":
        return dict_from_struct(value.struct_value)
    if kind == "list_value":
        return [py_from_value(v) for v in value.list_value.values]
    if kind == "number_value":
        return value.number_value
    if kind == "string_value":
        return value.string_value
    if kind == "bool_value":
        return value.bool_value
    return None


def dict_from_struct(struct: struct_pb2.Struct) -> dict[str, Any]:
    return {key: py_from_value(v) for key, v in struct.fields.items()}


def ensure_json(obj: Any, path: str = "$") -> None:
    """Raise InvalidJsonValue (NonFiniteNumberError or JsonTooDeepError) naming the first offending place."""
    _check_depth(obj, path, 1)
    ensure_finite(obj, path)


def _check_depth(obj: Any, path: str, depth: int) -> None:
    if isinstance(obj, Mapping | list | tuple):
        if depth > MAX_JSON_DEPTH:
            raise JsonTooDeepError(f"{path} is nested deeper than {MAX_JSON_DEPTH} levels")
        items = obj.items() if isinstance(obj, Mapping) else enumerate(obj)
        for key, item in items:
            _check_depth(item, f"{path}.{key}" if isinstance(obj, Mapping) else f"{path}[{key}]", depth + 1)


def ensure_finite(obj: Any, path: str = "$") -> None:
    """Raise NonFiniteNumberError naming the first NaN/Infinity found in a JSON-shaped value."""
    if isinstance(obj, float) and not math.isfinite(obj):
        raise NonFiniteNumberError(f"{path} is {obj!r}; JSON numbers must be finite")
    if isinstance(obj, Mapping):
        for key, item in obj.items():
            ensure_finite(item, f"{path}.{key}")
    elif isinstance(obj, list | tuple):
        for i, item in enumerate(obj):
            ensure_finite(item, f"{path}[{i}]")
