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


def fill_value(target: struct_pb2.Value, obj: Any, depth: int = 1, what: str = "$") -> None:
    """Write a JSON value into `target` in place: one pass, no nested message copies (hot paths convert a
    structured result per call). Raises JsonTooDeepError past MAX_JSON_DEPTH instead of building a message
    no receiver could parse."""
    if obj is None:
        target.null_value = struct_pb2.NULL_VALUE
    elif isinstance(obj, bool):
        target.bool_value = obj
    elif isinstance(obj, int | float):
        target.number_value = float(obj)
    elif isinstance(obj, str):
        target.string_value = obj
    elif isinstance(obj, Mapping | list | tuple):
        if depth > MAX_JSON_DEPTH:
            raise JsonTooDeepError(f"{what} is nested deeper than {MAX_JSON_DEPTH} levels")
        if isinstance(obj, Mapping):
            struct = target.struct_value
            struct.SetInParent()  # an empty object is still an object
            for key, item in obj.items():
                fill_value(struct.fields[str(key)], item, depth + 1, what)
        else:
            values = target.list_value
            values.SetInParent()
            for item in obj:
                fill_value(values.values.add(), item, depth + 1, what)
    else:
        target.string_value = str(obj)


def value_from_py(obj: Any) -> struct_pb2.Value:
    value = struct_pb2.Value()
    fill_value(value, obj)
    return value


def struct_from_dict(obj: Mapping[str, Any] | None) -> struct_pb2.Struct:
    """A Struct from a JSON object; raises JsonTooDeepError rather than building an undeliverable message."""
    struct = struct_pb2.Struct()
    for key, item in (obj or {}).items():
        fill_value(struct.fields[str(key)], item, 2)
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
