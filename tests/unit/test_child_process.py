"""`runtime.child_process.run_child`, which both verifier runners use: real child processes."""

from __future__ import annotations

import os
import time
from pathlib import Path

import psutil

from rlgate.runtime.child_process import MAX_OUTPUT_BYTES, run_child
from tests.support.wait import wait_until


def script(workdir: Path, code: str) -> list[str]:
    path = workdir / "child.py"
    path.write_text(code)
    return [str(path)]


async def test_the_result_file_and_the_output_come_back(tmp_path: Path) -> None:
    code = (
        "import json, os\nprint('hello')\n"
        "open('result.json', 'w').write(json.dumps({'success': True, 'home': os.environ['HOME']}))\n"
    )
    run = await run_child(script(tmp_path, code), tmp_path, 30)
    assert not run.timed_out and run.returncode == 0 and run.stdout == "hello\n"
    assert run.result == {"success": True, "home": str(tmp_path)}  # a scrubbed environment: HOME is the workdir


async def test_no_result_says_how_the_process_ended(tmp_path: Path) -> None:
    run = await run_child(script(tmp_path, "import sys\nprint('oops', file=sys.stderr)\nsys.exit(3)\n"), tmp_path, 30)
    assert run.result is None and run.ending() == "exit code 3" and "oops" in run.stderr
    (tmp_path / "result.json").write_text("[1, 2]")  # not an object: no result either
    run = await run_child(script(tmp_path, "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n"), tmp_path, 30)
    assert run.result is None and run.ending() == "signal 9"


async def test_a_child_past_its_time_is_killed_with_its_process_group(tmp_path: Path) -> None:
    code = (
        "import subprocess, sys, time\n"
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "time.sleep(60)\n"
    )
    before = {p.pid for p in psutil.Process(os.getpid()).children(recursive=True)}
    started = time.monotonic()
    run = await run_child(script(tmp_path, code), tmp_path, 1.5)
    assert run.timed_out and run.result is None and time.monotonic() - started < 30

    def grandchild_gone() -> bool:  # it went with the group (reaped by init, not by this process)
        return not [
            p for p in psutil.process_iter(["cmdline", "status"])
            if "time.sleep(60)" in " ".join(p.info["cmdline"] or []) and p.info["status"] != psutil.STATUS_ZOMBIE
        ]  # fmt: skip

    await wait_until(grandchild_gone, 10, "the verifier's own child killed with it")
    assert {p.pid for p in psutil.Process(os.getpid()).children(recursive=True)} <= before


async def test_output_past_the_cap_is_read_and_dropped(tmp_path: Path) -> None:
    code = "import sys\nfor _ in range(64):\n    sys.stdout.write('x' * 65536)\n"
    run = await run_child(script(tmp_path, code), tmp_path, 30)
    assert run.returncode == 0 and len(run.stdout) == MAX_OUTPUT_BYTES  # the child was never blocked on a full pipe
