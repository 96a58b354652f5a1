"""Running task code in a child process: a time limit, capped output, a scrubbed environment, and a result
file. Both places that run verifiers use it (the orchestrator's mcp provider, localfleet's Fleet verifiers);
each writes its own input and child program, this runs it.

Isolation, not a security boundary: task files are trusted code. The child cannot hang its parent (killed,
with its whole process group, when its time is up or its caller gives up), flood its memory (output past
MAX_OUTPUT_BYTES is read and dropped) or see the parent's environment.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MAX_OUTPUT_BYTES = 1 << 20  # of stdout and of stderr each
RESULT_FILE = "result.json"  # what the child writes into its working directory


@dataclass
class ChildRun:
    """How a child run ended."""

    timed_out: bool
    returncode: int | None
    stdout: str
    stderr: str
    result: dict[str, Any] | None  # RESULT_FILE parsed; None when missing or unreadable

    def ending(self) -> str:
        """How the process ended, for a message ("signal 9", "exit code 1")."""
        code = self.returncode
        return f"signal {-code}" if code is not None and code < 0 else f"exit code {code}"


async def run_child(
    args: Sequence[str], workdir: Path, limit_s: float, *, preexec_fn: Callable[[], None] | None = None
) -> ChildRun:
    """Run `python -I -u <args>` in `workdir` (also its HOME and TMPDIR) for at most `limit_s` seconds, and read
    the RESULT_FILE it leaves there. `preexec_fn` runs in the child before exec (only in a process without
    gRPC's threads: a fork of one may abort in the child)."""
    env = {"PATH": "/usr/bin:/bin", "HOME": str(workdir), "LANG": "C.UTF-8", "TMPDIR": str(workdir)}
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-I",
        "-u",
        *args,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd=workdir,
        env=env,
        start_new_session=True,
        preexec_fn=preexec_fn,
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
    result = None if timed_out else await asyncio.to_thread(_read_result, workdir / RESULT_FILE)
    return ChildRun(timed_out, proc.returncode, stdout, stderr, result)


def _read_result(path: Path) -> dict[str, Any] | None:
    try:
        result = json.loads(path.read_text("utf-8"))
    except (OSError, ValueError):
        return None
    return result if isinstance(result, dict) else None


async def _read_capped(stream: asyncio.StreamReader) -> bytes:
    data = bytearray()
    while chunk := await stream.read(65536):
        if len(data) < MAX_OUTPUT_BYTES:
            data += chunk[: MAX_OUTPUT_BYTES - len(data)]
    return bytes(data)
