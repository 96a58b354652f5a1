"""Tool arguments: integers restored from the input schema, then JSON Schema validation.

`google.protobuf.Struct` carries every number as a double, so `{"n": 5}` arrives as `{"n": 5.0}`. Upstream
servers often do not validate (or reject 5.0 for an int), so the gateway restores whole doubles where the
schema says `integer` and validates against the tool's schema itself, giving the model a message it can
act on.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jsonschema
from jsonschema import exceptions as js_exceptions

MAX_ERRORS = 5
_validators: dict[int, tuple[Mapping[str, Any], Any]] = {}  # id(schema) -> (schema, validator)


def _resolve(schema: Any, root: Mapping[str, Any], depth: int = 0) -> Mapping[str, Any]:
    """Follow local `$ref`s ("#/$defs/X", "#/definitions/X"); anything else resolves to {}."""
    while isinstance(schema, Mapping) and "$ref" in schema and depth < 32:
        ref = schema["$ref"]
        if not isinstance(ref, str) or not ref.startswith("#"):
            return {}
        target: Any = root
        for part in [p for p in ref[1:].split("/") if p]:
            part = part.replace("~1", "/").replace("~0", "~")
            target = target.get(part) if isinstance(target, Mapping) else None
        schema, depth = target, depth + 1
    return schema if isinstance(schema, Mapping) else {}


def _types(schema: Mapping[str, Any]) -> set[str]:
    t = schema.get("type")
    if isinstance(t, str):
        return {t}
    if isinstance(t, list):
        return {x for x in t if isinstance(x, str)}
    return set()


def _branches(schema: Mapping[str, Any], root: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    out = [schema]
    for key in ("anyOf", "oneOf", "allOf"):
        for sub in schema.get(key) or ():
            out.extend(_branches(_resolve(sub, root), root))
    return out


def restore_integers(value: Any, schema: Any, root: Mapping[str, Any] | None = None) -> Any:
    """A copy of `value` with whole floats turned into ints wherever `schema` allows an integer there."""
    root = root if root is not None else (schema if isinstance(schema, Mapping) else {})
    branches = _branches(_resolve(schema, root), root)
    if isinstance(value, float):
        if value.is_integer() and any("integer" in _types(b) for b in branches):
            return int(value)
        return value
    if isinstance(value, dict):
        out = dict(value)
        for b in branches:
            props: Mapping[str, Any] = b["properties"] if isinstance(b.get("properties"), Mapping) else {}
            extra = b.get("additionalProperties")
            for key, item in out.items():
                if key in props:
                    out[key] = restore_integers(item, props[key], root)
                elif isinstance(extra, Mapping):
                    out[key] = restore_integers(item, extra, root)
        return out
    if isinstance(value, list):
        out_list = list(value)
        for b in branches:
            prefix: list[Any] = b["prefixItems"] if isinstance(b.get("prefixItems"), list) else []
            items = b.get("items")
            for i, item in enumerate(out_list):
                if i < len(prefix):
                    out_list[i] = restore_integers(item, prefix[i], root)
                elif isinstance(items, Mapping):
                    out_list[i] = restore_integers(item, items, root)
                elif isinstance(items, list) and i < len(items):  # draft-04..2019 tuple form
                    out_list[i] = restore_integers(item, items[i], root)
        return out_list
    return value


def _validator(schema: Mapping[str, Any]) -> Any:
    hit = _validators.get(id(schema))
    if hit is not None and hit[0] is schema:
        return hit[1]
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        cls.check_schema(dict(schema))
        validator = cls(schema)
    except js_exceptions.SchemaError:
        validator = None  # an upstream's broken schema: let the upstream judge the arguments
    if len(_validators) > 4096:
        _validators.clear()
    _validators[id(schema)] = (schema, validator)
    return validator


def _path(error: js_exceptions.ValidationError) -> str:
    out = "$"
    for part in error.absolute_path:
        out += f"[{part}]" if isinstance(part, int) else f".{part}"
    return out


def validation_errors(arguments: Mapping[str, Any], schema: Mapping[str, Any]) -> list[str]:
    """Readable schema violations (at most MAX_ERRORS), empty when the arguments are valid."""
    validator = _validator(schema)
    if validator is None:
        return []
    errors = sorted(validator.iter_errors(arguments), key=lambda e: (list(map(str, e.absolute_path)), e.message))
    return [f"{_path(e)}: {e.message}" for e in errors[:MAX_ERRORS]]


def prepare_arguments(tool: str, arguments: dict[str, Any], schema: Mapping[str, Any]) -> tuple[dict[str, Any], str]:
    """(arguments with integers restored, "" or a message for the model naming what is wrong)."""
    restored = restore_integers(arguments, schema)
    problems = validation_errors(restored, schema)
    if not problems:
        return restored, ""
    props: Mapping[str, Any] = schema["properties"] if isinstance(schema.get("properties"), Mapping) else {}
    required = schema.get("required") or []
    expected = ", ".join(
        f"{name}{'' if name in required else '?'}: {_describe(props[name])}" for name in props
    ) or "no arguments"
    message = (
        f"Invalid arguments for tool '{tool}': " + "; ".join(problems)
        + f". Expected {{{expected}}}. Fix the arguments and call the tool again."
    )
    return restored, message


def _describe(schema: Any) -> str:
    if not isinstance(schema, Mapping):
        return "any"
    types = _types(schema)
    if "enum" in schema:
        return "one of " + "|".join(map(repr, schema["enum"]))
    return "|".join(sorted(types)) if types else "any"
