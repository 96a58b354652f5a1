"""The verifier subprocess of the mcp provider: runs one task's verifier code and writes what it returned.

Run by path (`verifier_child.py WORKDIR`) in the services' one sandbox (`runtime.child_process.run_child`,
which sets the limits first), standard library only (with `runtime/child_job.py`, the job's reading and
writing, shared with localfleet's verifier runner), so a run costs an interpreter start and nothing of
rlgate. WORKDIR holds input.json; the result goes to WORKDIR/result.json, and whatever the verifier prints
to this process's stdout, which the parent keeps (its tail) for the verification record.

The verifier is the function named `verify`, else the first function the code defines (Fleet's rule). It is
called as `verify(env, final_answer=..., tool_calls=...)`, each keyword only if its signature takes it (or
`**kwargs`); `env` carries `env_key`, `endpoints`, `task_key`, `metadata`, `expected_answer` and `tool_calls`.
A coroutine function is awaited.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import re
import traceback
import types
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the same file, as mypy sees it
    from rlgate.runtime import child_job
else:  # loaded by path: `import rlgate.runtime...` would import rlgate (grpc, protobuf) on every run
    _spec = importlib.util.spec_from_file_location("child_job", Path(__file__).parents[2] / "runtime" / "child_job.py")
    child_job = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(child_job)


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


def run(inp: dict[str, Any], workdir: Path) -> Any:
    func = _verifier(inp["code"])
    env = types.SimpleNamespace(**inp["env"], tool_calls=inp["tool_calls"])
    params = inspect.signature(func).parameters
    any_keyword = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    kwargs = {name: inp[name] for name in ("final_answer", "tool_calls") if name in params or any_keyword}
    positional = [p for p in params.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    args = [env] if positional and positional[0].name not in kwargs else []
    return child_job.settle(func(*args, **kwargs))


def _failure(exc: BaseException) -> dict[str, Any]:
    return {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-4000:]}


def main() -> None:
    child_job.main(run, _failure)


if __name__ == "__main__":
    main()
