"""Tool arguments: JSON Schema validation at the gateway, with a message the model can act on.

The arguments arrive exact (`arguments_json` as written; a Struct's whole numbers as integers), so they are
validated as they are and sent upstream unchanged. Upstream servers often do not validate, or answer with
a message a model cannot use; the gateway names the JSON path and the expected shape instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jsonschema
from jsonschema import exceptions as js_exceptions

MAX_ERRORS = 5
_validators: dict[int, tuple[Mapping[str, Any], Any]] = {}  # id(schema) -> (schema, validator)


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


def arguments_problem(tool: str, arguments: Mapping[str, Any], schema: Mapping[str, Any]) -> str:
    """A message for the model naming what is wrong with `arguments` and the expected shape, or "" when they
    satisfy the tool's input schema."""
    problems = validation_errors(arguments, schema)
    if not problems:
        return ""
    props: Mapping[str, Any] = schema["properties"] if isinstance(schema.get("properties"), Mapping) else {}
    required = schema.get("required") or []
    expected = (
        ", ".join(f"{name}{'' if name in required else '?'}: {_describe(props[name])}" for name in props)
        or "no arguments"
    )
    return (
        f"Invalid arguments for tool '{tool}': "
        + "; ".join(problems)
        + f". Expected {{{expected}}}. Fix the arguments and call the tool again."
    )


def _describe(schema: Any) -> str:
    if not isinstance(schema, Mapping):
        return "any"
    if "enum" in schema:
        return "one of " + "|".join(map(repr, schema["enum"]))
    t = schema.get("type")
    types = {t} if isinstance(t, str) else {x for x in t if isinstance(x, str)} if isinstance(t, list) else set()
    return "|".join(sorted(types)) if types else "any"
