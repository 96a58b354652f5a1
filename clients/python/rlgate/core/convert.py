"""JSON values and how rlgate carries them (see common.proto).

JSON that rlgate passes on travels as JSON text: `json_text` writes it, `parse_json_text` /
`parse_json_object` read it, exactly (integers stay integers, NaN/Infinity refused, nesting bounded by
MAX_JSON_TEXT_DEPTH).

google.protobuf.Struct carries every number as a double, so it remains only as the hand-written form of a
request's arguments (CallToolRequest / ToolCallSummary `arguments`, what a grpcurl user types):
`arguments_of` reads either form, `json_from_struct` reads a Struct with whole numbers as integers, and
`struct_from_dict` builds one. A Struct value nests two protobuf messages per JSON level and receivers refuse
messages nested past protobuf's parse depth, so `ensure_json` bounds it at MAX_JSON_DEPTH (and refuses
non-finite numbers)."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from typing import Any

from google.protobuf import struct_pb2

MAX_JSON_DEPTH = 32  # objects/arrays inside each other; well inside protobuf's parse depth of 100 messages


class InvalidJsonValue(ValueError):
    """A value that is not JSON rlgate can carry (as JSON text or as a google.protobuf.Struct)."""


class NonFiniteNumberError(InvalidJsonValue):
    """NaN or Infinity inside a JSON-shaped value (JSON cannot represent them)."""


class JsonTooDeepError(InvalidJsonValue):
    """Objects/arrays nested deeper than MAX_JSON_DEPTH."""


def fill_value(target: struct_pb2.Value, obj: Any, depth: int = 1, what: str = "$") -> None:
    """Write a JSON value into `target` in place (one pass, no nested message copies).

    Args:
        target: the Struct value to fill.
        obj: a JSON-shaped value; anything else is written as its `str()`.
        depth: the nesting level of `obj` (1 at the top).
        what: the value's name for the error.

    Raises:
        JsonTooDeepError: past MAX_JSON_DEPTH, instead of building a message no receiver could parse.
    """
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


def struct_from_dict(obj: Mapping[str, Any] | None) -> struct_pb2.Struct:
    """A Struct from a JSON object.

    Args:
        obj: the object; None gives an empty Struct.

    Raises:
        JsonTooDeepError: rather than building an undeliverable message.
    """
    struct = struct_pb2.Struct()
    for key, item in (obj or {}).items():
        fill_value(struct.fields[str(key)], item, 2)
    return struct


def ensure_json(obj: Any, path: str = "$") -> None:
    """Check that a value can travel as a Struct.

    Args:
        obj: a JSON-shaped value.
        path: the value's name in the error (its places are spelled below it, as `$.a[0].b`).

    Raises:
        InvalidJsonValue: NonFiniteNumberError or JsonTooDeepError, naming the first offending place.
    """
    _check_depth(obj, path, 1)
    ensure_finite(obj, path)


# Where a value sits, built as a walk goes down and spelled out ($.a[0].b) only for an error: a root name,
# or (the parent's place, key or index).
_Place = str | tuple[Any, str | int]


def _spelled(place: _Place) -> str:
    parts: list[str] = []
    while isinstance(place, tuple):
        place, key = place
        parts.append(f"[{key}]" if isinstance(key, int) else f".{key}")
    return place + "".join(reversed(parts))


_SCALARS = (str, int, float, type(None))


def _children(obj: Any, place: _Place) -> list[tuple[Any, _Place]]:
    """The items of a JSON object or array with their places, last first (a walk's stack pops the first
    first); nothing for a scalar."""
    if isinstance(obj, _SCALARS):  # most values: spare them the Mapping check (an ABC, slow)
        return []
    if isinstance(obj, Mapping):
        return [(item, (place, str(key))) for key, item in list(obj.items())[::-1]]
    if isinstance(obj, list | tuple):
        return [(obj[i], (place, i)) for i in range(len(obj) - 1, -1, -1)]
    return []


def _check_depth(obj: Any, path: str, depth: int, limit: int = MAX_JSON_DEPTH) -> None:
    stack: list[tuple[Any, _Place, int]] = [(obj, path, depth)]
    while stack:
        item, place, level = stack.pop()
        if not isinstance(item, _SCALARS) and isinstance(item, Mapping | list | tuple):
            if level > limit:
                raise JsonTooDeepError(f"{_spelled(place)} is nested deeper than {limit} levels")
            stack.extend((child, where, level + 1) for child, where in _children(item, place))


def ensure_finite(obj: Any, path: str = "$") -> None:
    """Check that a JSON-shaped value holds no NaN or Infinity.

    Args:
        obj: a JSON-shaped value.
        path: the value's name in the error.

    Raises:
        NonFiniteNumberError: naming the first NaN/Infinity found.
    """
    stack: list[tuple[Any, _Place]] = [(obj, path)]
    while stack:
        item, place = stack.pop()
        if isinstance(item, float) and not math.isfinite(item):
            raise NonFiniteNumberError(f"{_spelled(place)} is {item!r}; JSON numbers must be finite")
        stack.extend(_children(item, place))


# ---- JSON text: how rlgate carries JSON it passes on (see common.proto) ----------------------------------

MAX_JSON_TEXT_DEPTH = 64  # objects/arrays inside each other in a JSON text rlgate parses
# `json.dumps` with any non-default option builds a new encoder per call; this one is made once (it keeps no
# state between calls).
_ENCODER = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def json_text(value: Any) -> str:
    """`value` as compact JSON text, exactly: integers stay integers, no NaN/Infinity, non-ASCII kept.

    Args:
        value: a JSON-shaped value.

    Raises:
        InvalidJsonValue: naming the place, for what JSON cannot carry or what nests past MAX_JSON_TEXT_DEPTH.
    """
    _check_depth(value, "$", 1, MAX_JSON_TEXT_DEPTH)
    try:
        text = _ENCODER.encode(value)
    except ValueError as exc:  # NaN / Infinity
        ensure_finite(value)
        raise InvalidJsonValue(str(exc)) from exc
    except (TypeError, RecursionError) as exc:
        raise InvalidJsonValue(f"not a JSON value: {exc}") from exc
    # A lone UTF-16 surrogate (what JSON's "\ud800" decodes to) has no UTF-8 form: the text could never be
    # sent, so it is refused here rather than as a UnicodeEncodeError deep inside gRPC.
    if _SURROGATE.search(text):
        raise InvalidJsonValue("a string contains a lone UTF-16 surrogate (e.g. \\ud800), which JSON text cannot carry")
    return text


def parse_json_text(text: str | bytes, what: str = "$") -> Any:
    """Parse JSON text rlgate received (exact: integers stay ints).

    Args:
        text: the JSON text.
        what: the text's name in the error (a field name, say).

    Raises:
        InvalidJsonValue: for text that is not JSON, uses NaN/Infinity, nests deeper than MAX_JSON_TEXT_DEPTH
            or escapes a lone surrogate.
    """
    try:
        value = json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_float)
    except (ValueError, RecursionError) as exc:
        raise InvalidJsonValue(f"{what} is not valid JSON: {str(exc)[:200]}") from exc
    _check_depth(value, what, 1, MAX_JSON_TEXT_DEPTH)
    # Valid syntax that no JSON text can carry back (an escaped lone surrogate) is refused here, where it
    # arrives, rather than failing later when rlgate writes it (a fingerprint, the store, a reply).
    _check_surrogates(value, what)
    return value


def parse_json_object(text: str | bytes, what: str = "$") -> dict[str, Any]:
    """`parse_json_text` for a JSON object; "" means {}.

    Args:
        text: the JSON text.
        what: the text's name in the error.

    Raises:
        InvalidJsonValue: as `parse_json_text`, or for a value that is not an object.
    """
    if not text:
        return {}
    value = parse_json_text(text, what)
    if not isinstance(value, dict):
        raise InvalidJsonValue(f"{what} must be a JSON object, not {type(value).__name__}")
    return value


def json_from_struct_value(value: struct_pb2.Value) -> Any:
    """A Struct value as JSON: whole numbers (within 2^53) become integers, since JSON does not tell 3 from
    3.0 and Struct stores every number as a double.

    Args:
        value: the Struct value.

    Raises:
        NonFiniteNumberError: for a NaN or infinite number.
    """
    kind = value.WhichOneof("kind")
    if kind == "struct_value":
        return json_from_struct(value.struct_value)
    if kind == "list_value":
        return [json_from_struct_value(v) for v in value.list_value.values]
    if kind == "number_value":
        number = value.number_value
        if not math.isfinite(number):
            raise NonFiniteNumberError(f"{number!r} is not a JSON number")
        return int(number) if number.is_integer() and abs(number) <= _EXACT_INT else number
    if kind == "string_value":
        return value.string_value
    if kind == "bool_value":
        return value.bool_value
    return None


def json_from_struct(struct: struct_pb2.Struct) -> dict[str, Any]:
    """A Struct as a JSON object (see `json_from_struct_value`).

    Args:
        struct: the Struct.
    """
    return {key: json_from_struct_value(v) for key, v in struct.fields.items()}


def arguments_of(message: Any) -> dict[str, Any]:
    """The arguments object of a message with the `args` oneof: `arguments_json` exactly, or `arguments`
    (a Struct) with whole numbers as integers; unset means {}.

    Args:
        message: a CallToolRequest or ToolCallSummary (any message with the `args` oneof).

    Raises:
        InvalidJsonValue: for `arguments_json` that is not a JSON object.
    """
    form = message.WhichOneof("args")
    if form == "arguments_json":
        return parse_json_object(message.arguments_json, "arguments_json")
    if form == "arguments":
        return json_from_struct(message.arguments)
    return {}


_EXACT_INT = 2**53
_SURROGATE = re.compile("[\ud800-\udfff]")


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    number = float(text)
    if not math.isfinite(number):  # 1e999 parses as inf, which JSON cannot write back
        raise ValueError(f"the number {text[:40]} is too large for a double")
    return number


def _check_surrogates(value: Any, what: str) -> None:
    stack: list[tuple[Any, _Place]] = [(value, what)]
    while stack:
        item, place = stack.pop()
        if isinstance(item, str):
            if _SURROGATE.search(item):
                raise InvalidJsonValue(
                    f"the string at {_spelled(place)} contains a lone UTF-16 surrogate, which JSON text cannot carry"
                )
        elif isinstance(item, dict):
            for key in item:
                if _SURROGATE.search(key):
                    raise InvalidJsonValue(
                        f"a key in {_spelled(place)} contains a lone UTF-16 surrogate, which JSON text cannot carry"
                    )
        stack.extend(_children(item, place))
