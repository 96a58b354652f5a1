"""Decode the SDK's cloudpickled verifier arguments without letting the payload run code.

`verify_detailed` sends `b64(cloudpickle({"args": (None, *args, {"env": instance_id}), "kwargs": kwargs}))`.
Arguments are plain data (strings, numbers, lists, dicts), which pickle encodes with opcodes alone; any
*global* (a class, a function, `os.system`, a pickled lambda's `cloudpickle` helpers) is refused, so a
payload cannot construct objects or call anything while it is decoded.
"""

from __future__ import annotations

import base64
import binascii
import io
import pickle
from typing import Any

MAX_PICKLE_BYTES = 1 << 20


class UnsafePayload(ValueError):
    """The arguments are not plain data (or not the SDK's shape)."""


class _DataOnlyUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise UnsafePayload(f"verifier arguments may only hold plain data; refused global {module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafePayload("verifier arguments may not use persistent ids")


def loads_data(blob: bytes) -> Any:
    if len(blob) > MAX_PICKLE_BYTES:
        raise UnsafePayload(f"pickled arguments exceed {MAX_PICKLE_BYTES} bytes")
    try:
        return _DataOnlyUnpickler(io.BytesIO(blob)).load()
    except UnsafePayload:
        raise
    except Exception as exc:  # truncated or corrupt pickles raise many different types
        raise UnsafePayload(f"cannot decode pickled arguments: {type(exc).__name__}: {exc}") from exc


def decode_verifier_args(b64: str) -> tuple[list[Any], dict[str, Any]]:
    """`args` field of /v1/verifiers/execute -> (positional args incl. the env marker, kwargs)."""
    try:
        blob = base64.b64decode(b64, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise UnsafePayload(f"args is not base64: {exc}") from exc
    doc = loads_data(blob)
    if (
        not isinstance(doc, dict)
        or not isinstance(doc.get("args", ()), tuple | list)
        or not isinstance(doc.get("kwargs", {}), dict)
    ):
        raise UnsafePayload("args must decode to {'args': tuple, 'kwargs': dict}")
    args = list(doc.get("args", ()))
    if args and args[0] is None:  # the SDK's placeholder for `env`
        args = args[1:]
    kwargs = doc.get("kwargs", {})
    if not all(isinstance(k, str) for k in kwargs):
        raise UnsafePayload("kwargs keys must be strings")
    return args, kwargs


def split_env_marker(args: list[Any]) -> tuple[str | None, list[Any]]:
    """The SDK appends `{"env": instance_id}`; return (instance_id, the other positional args)."""
    if args and isinstance(args[-1], dict) and set(args[-1]) == {"env"} and isinstance(args[-1]["env"], str):
        return args[-1]["env"], args[:-1]
    return None, args
