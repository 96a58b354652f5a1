"""Running a task's verifier code for the mcp provider: one subprocess per run (`verifier_child.py`) in the
services' one sandbox (`runtime.child_process`: a time limit, resource limits, a scrubbed environment), the
one localfleet runs Fleet verifiers in.

Isolation, not a security boundary: task files are trusted code. A verifier cannot hang the orchestrator,
exhaust its memory or touch its state; one that raises, crashes or times out comes back as a failure with its
message and output, never as a score.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

from rlgate.orchestrator.providers.base import VerifierRun, score_of
from rlgate.runtime.child_process import Limits, run_child

CHILD = Path(__file__).with_name("verifier_child.py")
MEMORY_MB = 1024


async def run_verifier_code(code: str, payload: dict[str, Any], timeout_s: float) -> VerifierRun:
    """Run `code` on `payload` (env, final_answer, tool_calls). The caller bounds the run with the same
    timeout; the child's own limit is a backstop a little past it, so the caller's TIMEOUT is what shows."""
    workdir = Path(await asyncio.to_thread(tempfile.mkdtemp, prefix="rlgate-verifier-"))
    try:
        text = json.dumps({"code": code, **payload}, default=repr)
        await asyncio.to_thread((workdir / "input.json").write_text, text, "utf-8")
        return await _spawn(workdir, timeout_s + 1.0)
    finally:
        await asyncio.to_thread(shutil.rmtree, workdir, True)


async def _spawn(workdir: Path, limit_s: float) -> VerifierRun:
    run = await run_child([str(CHILD), str(workdir)], workdir, limit_s, limits=Limits(memory_mb=MEMORY_MB))
    if run.timed_out:
        return VerifierRun(success=False, message=f"verifier timed out after {limit_s:g}s", stdout=run.stdout)
    result = run.result
    if result is None:
        return VerifierRun(
            success=False,
            message=f"verifier process ended with {run.ending()} and no result: {run.stderr[-500:]}",
            stdout=run.stdout,
        )
    if not result.get("success"):
        return VerifierRun(
            success=False,
            message=str(result.get("error") or "verifier failed"),
            stdout=run.stdout + str(result.get("traceback") or ""),
        )
    return VerifierRun(success=True, score=score_of(result.get("result")), stdout=run.stdout)
