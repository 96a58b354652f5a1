"""`runtime.child_process.run_child`, the one sandbox both verifier runners use: real child processes."""

from __future__ import annotations

import os
import time
from pathlib import Path

import psutil

from rlgate.orchestrator.providers.code_verifier import run_verifier_code
from rlgate.runtime.child_process import MAX_OUTPUT_BYTES, Limits, run_child
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


async def test_a_crash_without_a_result_runs_once_more(tmp_path: Path) -> None:
    """A SIGSEGV before the result (a crashed process start) is retried once; a child that crashes every time
    is reported as it ended, after two runs."""
    crash_once = (
        "import json, os, signal\n"
        "with open('runs', 'a') as f: f.write('x')\n"
        "if open('runs').read() == 'x': os.kill(os.getpid(), signal.SIGSEGV)\n"
        "open('result.json', 'w').write(json.dumps({'success': True}))\n"
    )
    run = await run_child(script(tmp_path, crash_once), tmp_path, 30)
    assert run.result == {"success": True} and run.returncode == 0
    assert (tmp_path / "runs").read_text() == "xx"
    always = tmp_path / "always"
    always.mkdir()
    code = "with open('runs', 'a') as f: f.write('x')\nimport os, signal\nos.kill(os.getpid(), signal.SIGSEGV)\n"
    run = await run_child(script(always, code), always, 30)
    assert run.result is None and run.ending() == "signal 11" and (always / "runs").read_text() == "xx"
    exits = tmp_path / "exits"
    exits.mkdir()
    code = "with open('runs', 'a') as f: f.write('x')\nraise SystemExit(1)\n"
    run = await run_child(script(exits, code), exits, 30)
    assert run.ending() == "exit code 1" and (exits / "runs").read_text() == "x"  # a verifier's failure: once


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


LIMITS_PROBE = """
import json, resource
names = ("AS", "CPU", "FSIZE", "NOFILE", "CORE")
limits = {n: resource.getrlimit(getattr(resource, "RLIMIT_" + n)) for n in names}
files, error = [], None
try:
    while len(files) < 1000:
        files.append(open(__file__))
except OSError as exc:
    error = exc.strerror
for f in files:
    f.close()
open("result.json", "w").write(json.dumps({"limits": limits, "opened": len(files), "error": error}))
"""


async def test_the_child_runs_under_the_sandboxs_limits(tmp_path: Path) -> None:
    limits = Limits(memory_mb=512, file_mb=8, open_files=40)
    run = await run_child(script(tmp_path, LIMITS_PROBE), tmp_path, 2.5, limits=limits)
    assert run.result is not None, run.stderr
    assert run.result["limits"] == {
        "AS": [512 << 20] * 2,
        "CPU": [4, 5],  # a second past the time limit (soft; the hard one a second later)
        "FSIZE": [8 << 20] * 2,
        "NOFILE": [40, 40],
        "CORE": [0, 0],
    }
    assert run.result["error"] == "Too many open files" and run.result["opened"] < 40


async def test_the_mcp_providers_verifier_runs_in_the_sandbox() -> None:
    """The orchestrator's path (localfleet's: tests/localfleet/test_verifier.py) gets the same open-files cap."""
    code = "def verify(env):\n    files = [open('input.json') for _ in range({n})]\n    return 1\n"
    run = await run_verifier_code(code.format(n=Limits().open_files), {"env": {}, "tool_calls": []}, 20)
    assert not run.success and "Too many open files" in run.message
    run = await run_verifier_code(code.format(n=10), {"env": {}, "tool_calls": []}, 20)
    assert run.success and run.score == 1.0
