"""Running a task's verifier code for the mcp provider: one subprocess per run (`verifier_child.py`), with a
time limit, resource limits (the child sets them on itself) and a scrubbed environment, as localfleet runs
Fleet verifiers.

Isolation, not a security boundary: task files are trusted code. A verifier cannot hang the orchestrator,
exhaust its memory or touch its state; one that raises, crashes or times out comes back as a failure with its
message and output, never as a score.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any

from rlgate.orchestrator.providers.base import VerifierRun, score_of

CHILD = Path(__file__).with_name("verifier_child.py")
MEMORY_MB = 1024
MAX_OUTPUT_BYTES = 1 << 20


async def run_verifier_code(code: str, payload: dict[str, Any], timeout_s: float) -> VerifierRun:
    """Run `code` on `payload` (env, final_answer, tool_calls). The caller bounds the run with the same
    timeout; the child's own limit is a backstop a little past it, so the caller's TIMEOUT is what shows."""
    workdir = Path(await asyncio.to_thread(tempfile.mkdtemp, prefix="rlgate-verifier-"))
    limits = {"memory_mb": MEMORY_MB, "cpu_s": math.ceil(timeout_s) + 2, "parent_pid": os.getpid()}
    try:
        text = json.dumps({"code": code, "limits": limits, **payload}, default=repr)
        await asyncio.to_thread((workdir / "input.json").write_text, text, "utf-8")
        return await _spawn(workdir, timeout_s + 1.0)
    finally:
        await asyncio.to_thread(shutil.rmtree, workdir, True)


async def _spawn(workdir: Path, limit_s: float) -> VerifierRun:
    env = {"PATH": "/usr/bin:/bin", "HOME": str(workdir), "LANG": "C.UTF-8", "TMPDIR": str(workdir)}
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-I",
        "-u",
        str(CHILD),
        str(workdir),
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd=workdir,
        env=env,
        start_new_session=True,  # no preexec_fn: a fork of a process running gRPC's threads may abort in the child
    )
    assert proc.stdout is not None and proc.stderr is not None
    out_task = asyncio.create_task(_read_capped(proc.stdout))
    err_task = asyncio.create_task(_read_capped(proc.stderr))
    timed_out = False
    try:
        await asyncio.wait_for(proc.wait(), limit_s)
    except TimeoutError:
        timed_out = True
    finally:
        if proc.returncode is None:  # timed out, or the caller gave up: end the whole process group
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
    stdout = (await out_task).decode("utf-8", "replace")
    stderr = (await err_task).decode("utf-8", "replace")
    if timed_out:
        return VerifierRun(success=False, message=f"verifier timed out after {limit_s:g}s", stdout=stdout)
    try:
        result = json.loads(await asyncio.to_thread((workdir / "result.json").read_text, "utf-8"))
    except (OSError, json.JSONDecodeError):
        how = (
            f"signal {-proc.returncode}" if proc.returncode and proc.returncode < 0 else f"exit code {proc.returncode}"
        )
        return VerifierRun(
            success=False, message=f"verifier process ended with {how} and no result: {stderr[-500:]}", stdout=stdout
        )
    if not result.get("success"):
        return VerifierRun(
            success=False,
            message=str(result.get("error") or "verifier failed"),
            stdout=stdout + str(result.get("traceback") or ""),
        )
    return VerifierRun(success=True, score=score_of(result.get("result")), stdout=stdout)


async def _read_capped(stream: asyncio.StreamReader) -> bytes:
    data = bytearray()
    while chunk := await stream.read(65536):
        if len(data) < MAX_OUTPUT_BYTES:
            data += chunk[: MAX_OUTPUT_BYTES - len(data)]
    return bytes(data)
