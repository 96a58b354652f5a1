"""The one sandbox for task code: a child process with a time limit, resource limits, capped output, a
scrubbed environment, and a result file. Both places that run verifiers use it (the orchestrator's mcp
provider, localfleet's Fleet verifiers); each writes its own input and child program, this runs it.

Isolation, not a security boundary: task files are trusted code. The child cannot hang its parent (killed,
with its whole process group, when its time is up or its caller gives up; and it dies with its parent),
exhaust the machine (`Limits`: address space, CPU time, file size, open files; no core files), flood its
parent's memory (output past MAX_OUTPUT_BYTES is read and dropped) or see the parent's environment. The
child sets the limits on itself (`sandbox.py` runs first, then the target).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import signal
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

MAX_OUTPUT_BYTES = 1 << 20  # of stdout and of stderr each
RESULT_FILE = "result.json"  # what the child writes into its working directory
SANDBOX = Path(__file__).with_name("sandbox.py")
CRASH_SIGNALS = frozenset({signal.SIGSEGV, signal.SIGBUS, signal.SIGILL})
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Limits:
    """What a child may use besides time (CPU time is capped a second past the run's time limit)."""

    memory_mb: int = 1024  # address space
    file_mb: int = 64  # largest file it may write
    open_files: int = 64


@dataclass
class ChildRun:
    """How a child run ended."""

    timed_out: bool
    returncode: int | None
    stdout: str
    stderr: str
    result: dict[str, Any] | None  # RESULT_FILE parsed; None when missing or unreadable

    def crashed(self) -> bool:
        """Ended by a crash signal (not our kill at its time limit) before writing a result."""
        code = self.returncode
        return not self.timed_out and self.result is None and code is not None and -code in CRASH_SIGNALS

    def ending(self) -> str:
        """How the process ended, for a message ("signal 9", "exit code 1")."""
        code = self.returncode
        return f"signal {-code}" if code is not None and code < 0 else f"exit code {code}"


async def run_child(args: Sequence[str], workdir: Path, limit_s: float, *, limits: Limits = Limits()) -> ChildRun:
    """Run `python -I -u <args>` (a script path or `-m module`, then its arguments) in `workdir` (also its HOME
    and TMPDIR) under `limits` for at most `limit_s` seconds, and read the RESULT_FILE it leaves there.

    A child that crashes (CRASH_SIGNALS) without leaving a result runs once more in the time left: such a crash
    has been the process start's, rarely and only under load, in a parent running gRPC's threads, and a
    verifier's ERROR would stand in for its score. A child that crashes again is reported as it ended."""
    loop = asyncio.get_running_loop()
    ends = loop.time() + limit_s
    run = await _run_once(args, workdir, limit_s, limits)
    left = ends - loop.time()
    if run.crashed() and left > 0:
        log.warning("child %s ended with %s and no result; running it once more", Path(args[0]).name, run.ending())
        run = await _run_once(args, workdir, left, limits)
    return run


async def _run_once(args: Sequence[str], workdir: Path, limit_s: float, limits: Limits) -> ChildRun:
    env = {"PATH": "/usr/bin:/bin", "HOME": str(workdir), "LANG": "C.UTF-8", "TMPDIR": str(workdir)}
    sandbox = {**asdict(limits), "cpu_s": math.ceil(limit_s) + 1, "parent_pid": os.getpid()}
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-I",
        "-u",
        str(SANDBOX),
        json.dumps(sandbox),
        *args,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd=workdir,
        env=env,
        start_new_session=True,
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
