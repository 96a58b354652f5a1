"""The child side of `child_process.run_child`: set the sandbox's limits on this process, then run the target.

Started by path (`python -I -u sandbox.py LIMITS_JSON TARGET...`, TARGET being `-m module args...` or
`script.py args...`), standard library only, so the limits hold before the target imports anything.
LIMITS_JSON of `{"parent_pid": N}` alone sets no limits, only death with the parent: how `rlgate up` starts
its services, so a `kill -9` of it leaves none running. The
child limits itself rather than the parent setting them in a pre-exec hook: a fork of a process running
gRPC's threads may abort in the child, so the orchestrator could not use one.
"""

from __future__ import annotations

import json
import os
import resource
import runpy
import signal
import sys
from typing import Any

_PR_SET_PDEATHSIG = 1


def apply(limits: dict[str, Any]) -> None:
    """Address space, CPU time, file size and open files capped, no core files, and death with the parent."""
    memory = int(limits["memory_mb"]) << 20
    file_size = int(limits["file_mb"]) << 20
    cpu = int(limits["cpu_s"])
    files = int(limits["open_files"])
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_FSIZE, (file_size, file_size))
    resource.setrlimit(resource.RLIMIT_NOFILE, (files, files))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    die_with_parent(int(limits["parent_pid"]))


def die_with_parent(parent_pid: int) -> None:
    """SIGKILLed when the parent dies (Linux: a sleeping child uses no CPU time, so only this ends it with
    its parent), and gone at once if the parent died before this took effect."""
    if sys.platform.startswith("linux"):
        import ctypes
        import ctypes.util

        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        except OSError:
            pass
    if os.getppid() != parent_pid:
        os._exit(1)


def main() -> None:
    limits = json.loads(sys.argv[1])
    if set(limits) == {"parent_pid"}:  # `rlgate up`'s services: death with the parent, no resource limits
        die_with_parent(int(limits["parent_pid"]))
    else:
        apply(limits)
    target = sys.argv[2:]
    if target[0] == "-m":
        sys.argv = target[1:]
        runpy.run_module(target[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = target
        runpy.run_path(target[0], run_name="__main__")


if __name__ == "__main__":
    main()
