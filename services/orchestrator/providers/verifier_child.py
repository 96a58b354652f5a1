"""The verifier subprocess of the mcp provider: runs one task's verifier code and writes what it returned.

Run by path (`verifier_child.py WORKDIR`) in the services' one sandbox (`runtime.child_process.run_child`,
which sets the limits first), standard library only, so a run costs an interpreter start and nothing of
rlgate. WORKDIR holds input.json; the result goes to WORKDIR/result.json, and whatever the verifier prints
to this process's stdout, which the parent keeps (its tail) for the verification record.

The verifier is the function named `verify`, else the first function the code defines (Fleet's rule). It is
called as `verify(env, final_answer=..., tool_calls=...)`, each keyword only if its signature takes it (or
`**kwargs`); `env` carries `env_key`, `endpoints`, `task_key`, `metadata`, `expected_answer` and `tool_calls`.
A coroutine function is awaited.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import re
import sys
import traceback
import types
from pathlib import Path
from typing import Any


def _verifier(code: str) -> Any:
    namespace: dict[str, Any] = {"json": json, "re": re, "__builtins__": __builtins__, "__name__": "verifier"}
    exec(compile(code, "<verifier>", "exec"), namespace)
    functions = [
        obj for obj in namespace.values() if inspect.isfunction(obj) and obj.__code__.co_filename == "<verifier>"
    ]
    named = [f for f in functions if f.__name__ == "verify"]
    if not (named or functions):
        raise ValueError("the verifier code defines no function")
    return (named or functions)[0]


def run(inp: dict[str, Any]) -> Any:
    func = _verifier(inp["code"])
    env = types.SimpleNamespace(**inp["env"], tool_calls=inp["tool_calls"])
    params = inspect.signature(func).parameters
    any_keyword = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    kwargs = {name: inp[name] for name in ("final_answer", "tool_calls") if name in params or any_keyword}
    positional = [p for p in params.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    args = [env] if positional and positional[0].name not in kwargs else []
    result = func(*args, **kwargs)
    if inspect.iscoroutine(result):
        result = asyncio.run(result)
    return result


def _jsonable(value: Any) -> Any:
    try:
        json.dumps(value)
        return value
    except (TypeError, ValueError):
        return repr(value)


def main() -> None:
    workdir = Path(sys.argv[1])
    inp = json.loads((workdir / "input.json").read_text(encoding="utf-8"))
    try:
        out = {"success": True, "result": _jsonable(run(inp)), "error": None}
    except BaseException as exc:  # the verifier's failure is the answer, reported as such
        out = {
            "success": False,
            "result": None,
            "error": f"{type(exc).__name__}: {exc}",
            "traceback": traceback.format_exc()[-4000:],
        }
    sys.stdout.flush()
    (workdir / "result.json").write_text(json.dumps(out), encoding="utf-8")


if __name__ == "__main__":
    main()
