"""The child side of a `child_process.run_child` job: read WORKDIR/input.json, run, write WORKDIR/result.json.

Both verifier children use it (localfleet's `verifier_runner` and the orchestrator's `verifier_child`).
Standard library only and importing nothing of rlgate: `verifier_child` (run by path, so that a run costs an
interpreter start and nothing of rlgate) loads this file by its path (`rlgate/runtime/` beside
`rlgate/orchestrator/`, in the source tree as in an installed package).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

INPUT_FILE = "input.json"
RESULT_FILE = "result.json"  # child_process.RESULT_FILE, what the parent reads


def settle(result: Any) -> Any:
    """A verifier's return value, a coroutine's awaited (each run has its own event loop)."""
    if inspect.iscoroutine(result):
        return asyncio.run(result)
    return result


def jsonable(value: Any) -> Any:
    """`value` when JSON can carry it, else its repr."""
    try:
        json.dumps(value)
        return value
    except (TypeError, ValueError):
        return repr(value)


def main(run: Callable[[dict[str, Any], Path], Any], failure: Callable[[BaseException], dict[str, Any]]) -> None:
    """The child's entry point (WORKDIR is `sys.argv[1]`): `run(input, workdir)`'s value as `result`, or
    `failure(exc)`'s fields when it raised (the verifier's failure is the answer, reported as such). Whatever
    the verifier printed is flushed before the result is written."""
    workdir = Path(sys.argv[1])
    inp = json.loads((workdir / INPUT_FILE).read_text(encoding="utf-8"))
    try:
        out = {"success": True, "result": jsonable(run(inp, workdir)), "error": None}
    except BaseException as exc:
        out = {"success": False, "result": None, **failure(exc)}
    sys.stdout.flush()
    (workdir / RESULT_FILE).write_text(json.dumps(out), encoding="utf-8")
