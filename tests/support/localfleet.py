"""localfleet for tests: `LocalfleetProcess` (a real `python -m rlgate.localfleet` on a free loopback port)
and the `localfleet` (function scope) / `localfleet_module` (module scope) fixtures.

    def test_x(localfleet):
        fleet = Fleet(api_key="test", base_url=localfleet.base_url)
        localfleet.set_faults({"environments": {"mailbox": {"tool_latency_s": 0.5}}})
        assert localfleet.counters()["tool_calls"] == 0
        localfleet.kill(); localfleet.restart()   # SIGKILL, then the same port and data dir again

`tiny_environments()` is a small two-era environment pair (`notes` modern, `notes-legacy` legacy) for
platform tests that should not depend on the bundled environments: start with
`LocalfleetProcess(environments="tests.support.localfleet:tiny_environments")`.
"""

from __future__ import annotations

import io
import json
import os
import secrets
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from mcp.server.mcpserver import Context
from mcp.server.mcpserver.exceptions import ToolError

from rlgate.localfleet.environments.base import current_instance, instance_db
from tests.support.ports import free_port

REPO = Path(__file__).resolve().parents[2]


class LocalfleetProcess:
    """A localfleet server process. Always `stop()` it (the fixtures do)."""

    def __init__(
        self,
        *,
        data_dir: str | None = None,
        faults: dict[str, Any] | None = None,
        environments: str = "",
        tasks_dir: str = "",
        extra_args: list[str] | None = None,
        env: dict[str, str] | None = None,
        startup_timeout: float = 60.0,
    ) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix="localfleet-")
        self.data_dir = data_dir or os.path.join(self._tmp.name, "data")
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.faults_file = ""
        if faults is not None:
            self.faults_file = os.path.join(self._tmp.name, "faults.json")
            Path(self.faults_file).write_text(json.dumps(faults))
        self.environments = environments
        self.tasks_dir = tasks_dir
        self.extra_args = list(extra_args or [])
        self.env = env or {}
        self.startup_timeout = startup_timeout
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = os.path.join(self._tmp.name, "localfleet.log")
        self._http = httpx.Client(base_url=self.base_url, timeout=10.0)

    # ---- process control ----

    def start(self) -> LocalfleetProcess:
        args = [
            sys.executable,
            "-m",
            "rlgate.localfleet",
            "--listen",
            f"127.0.0.1:{self.port}",
            "--data-dir",
            self.data_dir,
            "--log-level",
            "WARNING",
        ]
        if self.faults_file:
            args += ["--faults", self.faults_file]
        if self.environments:
            args += ["--environments", self.environments]
        if self.tasks_dir:
            args += ["--tasks-dir", self.tasks_dir]
        args += self.extra_args
        env = {k: v for k, v in os.environ.items() if not k.startswith("RLGATE_LOCALFLEET_")}
        env.update(self.env)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                args, stdout=log, stderr=subprocess.STDOUT, cwd=str(REPO), env=env, start_new_session=True
            )
        self._wait_healthy()
        return self

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"localfleet exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if self._http.get("/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        self.kill()
        raise TimeoutError(f"localfleet not healthy after {self.startup_timeout}s:\n{self.log()}")

    def log(self) -> str:
        try:
            return Path(self.log_path).read_text(errors="replace")[-5000:]
        except OSError:
            return ""

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL (a crash: no cleanup runs)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)

    def terminate(self, timeout: float = 15.0) -> None:
        """SIGTERM and wait (a graceful stop); SIGKILL if it does not stop in time."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill()

    def restart(self) -> LocalfleetProcess:
        """Stop (gracefully if still running) and start again on the same port and data dir."""
        self.terminate()
        return self.start()

    def stop(self) -> None:
        self.terminate()
        self._http.close()
        self._tmp.cleanup()

    # ---- admin helpers ----

    def set_faults(self, faults: dict[str, Any]) -> dict[str, Any]:
        """Replace the whole fault plan (`{}` turns every fault off)."""
        r = self._http.post("/_admin/faults", json=faults)
        r.raise_for_status()
        plan: dict[str, Any] = r.json()
        return plan

    def counters(self) -> dict[str, Any]:
        r = self._http.get("/_admin/counters")
        r.raise_for_status()
        counters: dict[str, Any] = r.json()
        return counters

    def reset_counters(self) -> None:
        self._http.delete("/_admin/counters").raise_for_status()

    def forget_sessions(self) -> int:
        r = self._http.post("/_admin/forget_sessions")
        r.raise_for_status()
        return int(r.json()["forgotten"])

    def __enter__(self) -> LocalfleetProcess:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()


@pytest.fixture
def localfleet() -> Iterator[LocalfleetProcess]:
    """A fresh localfleet (bundled environments and tasks) for one test."""
    with LocalfleetProcess() as lf:
        yield lf


@pytest.fixture(scope="module")
def localfleet_module() -> Iterator[LocalfleetProcess]:
    """One localfleet shared by a module's tests (reset faults/counters yourself if you change them)."""
    with LocalfleetProcess() as lf:
        yield lf


# ---------------------------------------------------------------------------------------------------------
# A tiny environment pair for platform tests (independent of the bundled environments).

_NOTES_SCHEMA = """
CREATE TABLE notes (id INTEGER PRIMARY KEY, title TEXT NOT NULL, body TEXT NOT NULL, starred INTEGER NOT NULL);
"""


def _seed_notes(conn: sqlite3.Connection) -> None:
    conn.executemany(
        "INSERT INTO notes (id, title, body, starred) VALUES (?, ?, ?, 0)",
        [(i, f"note {i}", f"body of note {i}") for i in range(1, 51)],
    )


def _register_notes(server: Any) -> None:
    @server.tool()
    def count_notes(ctx: Context) -> int:
        """How many notes there are."""
        return int(instance_db(ctx).execute("SELECT COUNT(*) FROM notes").fetchone()[0])

    @server.tool()
    def add_note(title: str, body: str, ctx: Context) -> dict[str, Any]:
        """Add a note; returns its id."""
        conn = instance_db(ctx)
        cur = conn.execute("INSERT INTO notes (title, body, starred) VALUES (?, ?, 0)", (title, body))
        conn.commit()
        return {"id": cur.lastrowid}

    @server.tool()
    async def star_note(note_id: int, ctx: Context) -> str:
        """Star a note by id."""
        conn = instance_db(ctx)
        if conn.execute("UPDATE notes SET starred = 1 WHERE id = ?", (note_id,)).rowcount == 0:
            raise ToolError(f"no note {note_id}")
        conn.commit()
        return "starred"

    @server.tool()
    def draw_ticket(ctx: Context) -> str:
        """Draw a raffle ticket (a fresh random number each call: a tool no replay can reproduce)."""
        return f"ticket {secrets.randbelow(10**9)}"

    @server.tool()
    def whoami(ctx: Context) -> str:
        """The instance serving this call."""
        return current_instance(ctx).instance_id


def _render_notes(conn: sqlite3.Connection) -> bytes:
    from PIL import Image, ImageDraw

    count = conn.execute("SELECT COUNT(*) FROM notes").fetchone()[0]
    img = Image.new("RGB", (200, 60), "white")
    ImageDraw.Draw(img).text((10, 20), f"{count} notes", fill="black")
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def tiny_environments() -> list[Any]:
    from rlgate.localfleet.environments.base import EnvironmentSpec

    common: dict[str, Any] = dict(
        version="v1",
        description="A tiny notes app",
        schema_sql=_NOTES_SCHEMA,
        seed=_seed_notes,
        register_tools=_register_notes,
        render_screen=_render_notes,
        env_variables={"LOGGED_IN_USER": "tester@example.com"},
    )
    return [
        EnvironmentSpec(env_id="notes", name="Notes", mcp_era="modern", **common),
        EnvironmentSpec(env_id="notes-legacy", name="Notes (legacy MCP)", mcp_era="legacy", **common),
    ]


TINY_TASKS = [
    {
        "key": "notes-star-7",
        "prompt": "Star note 7.",
        "env_id": "notes",
        "version": "v1",
        "task_modality": "tool_use",
        "verifier_code": (
            "def verify(env, final_answer=None):\n"
            "    cur = env.db('current').table('notes').eq('id', 7).first()\n"
            "    print('starred =', cur['starred'])\n"
            "    return TASK_SUCCESSFUL_SCORE if cur['starred'] == 1 else TASK_FAILED_SCORE\n"
        ),
        "metadata": {
            "reference_solution": {
                "tool_calls": [{"name": "star_note", "arguments": {"note_id": 7}}],
                "final_answer": None,
            }
        },
    },
    {
        "key": "notes-count",
        "prompt": "How many notes are there?",
        "env_id": "notes",
        "version": "v1",
        "task_modality": "tool_use",
        "verifier_code": (
            "def verify(env, final_answer=None):\n"
            "    n = len(env.db('current').table('notes').all())\n"
            "    return 1 if final_answer is not None and contains_number(final_answer, n) else 0\n"
        ),
        "metadata": {
            "reference_solution": {"tool_calls": [{"name": "count_notes", "arguments": {}}], "final_answer": "50"}
        },
    },
]


def write_tiny_tasks(directory: str | Path) -> str:
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    (path / "tiny.json").write_text(json.dumps({"tasks": TINY_TASKS}))
    return str(path)
