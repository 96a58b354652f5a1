"""The verifier subprocess: runs one verifier the way Fleet does, on copies of an instance's databases.

Run as `python -I -u -m rlgate.localfleet.verifier_runner WORKDIR` (WORKDIR holds input.json, seed.db,
current.db); writes WORKDIR/result.json. The verifier's prints go to this process's stdout, which the
parent captures. Like `fleet.verifiers.local_executor`: decorators and fleet imports are stripped, the code
runs with Fleet's helper namespace, and the *first function defined in the code* is the verifier; `env`
offers `env.db("seed")` / `env.db("current")` as the SDK's `DatabaseSnapshot` and `env.instance.load()`.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import os
import re
import string
import sys
import traceback
import types
import typing
from pathlib import Path
from typing import Any

from rlgate.runtime import child_job

_STRIP = (
    (r"@verifier\([^)]*\)\s*\n", 0),
    (r"^from fleet\.verifiers.*import.*$\n?", re.MULTILINE),
    (r"^from fleet import verifier.*$\n?", re.MULTILINE),
    (r"^import fleet\.verifiers.*$\n?", re.MULTILINE),
    (r"^import fleet$\n?", re.MULTILINE),
)


def _light_fleet() -> None:
    """Make `fleet.verifiers.*` importable without running `fleet/__init__.py`.

    The package's __init__ imports the whole SDK (httpx, pydantic models), paid on every run; the verifier
    helpers (`db`, `code`, `local_executor`, `sql_differ`) need only the standard library.
    """
    if "fleet" in sys.modules:
        return
    spec = importlib.util.find_spec("fleet")
    if spec is None or not spec.submodule_search_locations:
        return
    root = next(iter(spec.submodule_search_locations))
    for name, path in (("fleet", root), ("fleet.verifiers", os.path.join(root, "verifiers"))):
        module = types.ModuleType(name)
        module.__path__ = [path]
        module.__package__ = name
        sys.modules[name] = module


def _namespace(env: Any) -> dict[str, Any]:
    from fleet.verifiers.code import TASK_FAILED_SCORE, TASK_SUCCESSFUL_SCORE
    from fleet.verifiers.db import DatabaseSnapshot, IgnoreConfig, SnapshotDiff
    from fleet.verifiers.local_executor import (
        contains_number,
        extract_numbers,
        normalized_contains,
        normalized_string_comparison,
    )

    return {
        "TASK_SUCCESSFUL_SCORE": TASK_SUCCESSFUL_SCORE,
        "TASK_FAILED_SCORE": TASK_FAILED_SCORE,
        "normalized_contains": normalized_contains,
        "normalized_string_comparison": normalized_string_comparison,
        "extract_numbers": extract_numbers,
        "contains_number": contains_number,
        "DatabaseSnapshot": DatabaseSnapshot,
        "IgnoreConfig": IgnoreConfig,
        "SnapshotDiff": SnapshotDiff,
        "Environment": type(env),
        "json": json,
        "re": re,
        "string": string,
        # the SDK's converted (before, after, transcript) form annotates with these
        "Optional": typing.Optional,
        "Any": typing.Any,
        "List": list,
        "Dict": dict,
        "__builtins__": __builtins__,
    }


def _first_function(code: str, env: Any) -> Any:
    for pattern, flags in _STRIP:
        code = re.sub(pattern, "", code, flags=flags)
    exec_globals = _namespace(env)
    local_ns: dict[str, Any] = {}
    exec(compile(code, "<string>", "exec"), exec_globals, local_ns)
    exec_globals.update(local_ns)
    for obj in local_ns.values():
        if inspect.isfunction(obj) and obj.__code__.co_filename == "<string>":
            return obj
    raise ValueError("No function found in verifier code")


def _call(func: Any, *args: Any, **kwargs: Any) -> Any:
    return child_job.settle(func(*args, **kwargs))


def run(inp: dict[str, Any], workdir: Path) -> Any:
    _light_fleet()
    from fleet.verifiers.local_executor import LocalEnvironment

    env = LocalEnvironment(str(workdir / "seed.db"), str(workdir / "current.db"))
    func = _first_function(inp["code"], env)
    params = list(inspect.signature(func).parameters)
    if inp["mode"] == "manager":
        # `env.verify_raw` sends the SDK's converted form `(before, after, transcript)` when it could convert
        # the code, else the code as written (`(env, final_answer)`).
        if params[:2] == ["before", "after"]:
            return _call(func, env.db("seed"), env.db("current"), inp.get("text_solution"))
        if len(params) >= 2:
            return _call(func, env, inp.get("text_solution"))
        return _call(func, env) if params else _call(func)
    return _call(func, env, *inp.get("args", []), **inp.get("kwargs", {}))


def _failure(exc: BaseException) -> dict[str, Any]:
    return {"error": {"type": type(exc).__name__, "message": str(exc), "traceback": traceback.format_exc()}}


def main() -> None:
    child_job.main(run, _failure)


if __name__ == "__main__":
    main()
