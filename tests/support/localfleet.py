"""localfleet for tests: `LocalfleetProcess` (a real `python -m rlgate.localfleet` on a free loopback port)
and its fixtures: `localfleet` (a fresh one per test), `localfleet_module` (one per module, serving the
environments named by the overridable `localfleet_environments`) and `lf` (the module's one, faults off around
each test: what most tests take).

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

import json
import os
import secrets
import signal
import sqlite3
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from mcp.server.mcpserver import Context
from mcp.server.mcpserver.exceptions import ToolError

from rlgate.localfleet.environments.base import current_instance, instance_db
from tests.support.ports import free_port
from tests.support.wait import wait_until_sync

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
        proc = self.proc
        assert proc is not None

        def healthy() -> bool:
            if proc.poll() is not None:
                raise RuntimeError(f"localfleet exited with {proc.returncode}:\n{self.log()}")
            try:
                return self._http.get("/health", timeout=1.0).status_code == 200
            except httpx.HTTPError:
                return False

        try:
            wait_until_sync(healthy, self.startup_timeout, "localfleet healthy", explain=self.log)
        except AssertionError:
            self.kill()
            raise

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
def localfleet_environments() -> str:
    """The environments `localfleet_module` serves: "" for the bundled ones. A directory's conftest overrides
    this fixture to serve its own (e.g. tests/toolgateway: its gateway test environments)."""
    return ""


@pytest.fixture(scope="module")
def localfleet_module(localfleet_environments: str) -> Iterator[LocalfleetProcess]:
    """One localfleet shared by a module's tests (reset faults/counters yourself if you change them, or take
    `lf`, which does)."""
    with LocalfleetProcess(environments=localfleet_environments) as lf:
        yield lf


@pytest.fixture
def lf(localfleet_module: LocalfleetProcess) -> Iterator[LocalfleetProcess]:
    """The module's shared localfleet with every fault off at the start and at the end of the test."""
    localfleet_module.set_faults({})
    yield localfleet_module
    localfleet_module.set_faults({})


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


def _notes_app(current_db: Any) -> list[Any]:
    """A small web app over the notes (the stub the screen tests drive): elements at fixed places."""
    import asyncio
    import html

    from starlette.requests import Request
    from starlette.responses import HTMLResponse, RedirectResponse
    from starlette.routing import Route

    style = (
        "<style>body{margin:0;font-family:sans-serif}#count{position:absolute;left:20px;top:10px;font-size:32px}"
        "#title{position:absolute;left:20px;top:80px;width:300px;height:30px;font-size:18px}"
        "#add{position:absolute;left:340px;top:80px;width:100px;height:34px}"
        "#list{position:absolute;left:20px;top:140px}#list a{display:block;height:40px;font-size:20px}"
        "#out{position:absolute;left:500px;top:10px;font-size:24px}</style>"
    )

    def page(title: str, body: str) -> HTMLResponse:
        return HTMLResponse(
            f"<!doctype html><html><head><title>{title}</title>{style}</head><body>{body}</body></html>"
        )

    def read(sql: str, *args: Any) -> list[tuple[Any, ...]]:
        conn = current_db()
        return list(conn.execute(sql, args).fetchall())

    async def index(request: Request) -> HTMLResponse:
        rows = await asyncio.to_thread(read, "SELECT id, title FROM notes ORDER BY id DESC")
        links = "".join(f'<a href="{request.url_for("note", note_id=i)}">{html.escape(t)}</a>' for i, t in rows)
        form = (
            f'<form method="post" action="{request.url_for("add")}">'
            '<input id="title" name="title" autocomplete="off"><button id="add" type="submit">Add</button></form>'
        )
        out = '<a id="out" href="/v1/regions">leave the app</a>'  # a link outside the app (the browser blocks it)
        return page("Notes", f'<div id="count">{len(rows)} notes</div>{out}{form}<div id="list">{links}</div>')

    async def note(request: Request) -> HTMLResponse:
        rows = await asyncio.to_thread(
            read, "SELECT title, body FROM notes WHERE id = ?", request.path_params["note_id"]
        )
        if not rows:
            return HTMLResponse("no such note", status_code=404)
        return page(
            rows[0][0],
            f'<h1 id="count">{html.escape(rows[0][0])}</h1><p style="margin-top:80px">{html.escape(rows[0][1])}</p>',
        )

    async def add(request: Request) -> RedirectResponse:
        title = str((await request.form()).get("title") or "")

        def insert() -> None:
            conn = current_db()
            conn.execute("INSERT INTO notes (title, body, starred) VALUES (?, '', 0)", (title,))
            conn.commit()

        await asyncio.to_thread(insert)
        return RedirectResponse(str(request.url_for("index")), status_code=303)

    return [
        Route("/", index, methods=["GET"], name="index"),
        Route("/notes/{note_id:int}", note, methods=["GET"], name="note"),
        Route("/add", add, methods=["POST"], name="add"),
    ]


def tiny_environments() -> list[Any]:
    from rlgate.localfleet.environments.base import EnvironmentSpec

    common: dict[str, Any] = dict(
        version="v1",
        description="A tiny notes app",
        schema_sql=_NOTES_SCHEMA,
        seed=_seed_notes,
        register_tools=_register_notes,
        app=_notes_app,
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


# ---- the control plane over HTTP, as the localfleet tests drive it

AUTH = {"Authorization": "Bearer test-key"}  # localfleet wants a key, and accepts any


def create(lf: LocalfleetProcess, env_key: str = "notes", **body: Any) -> dict[str, Any]:
    """Create an instance through the control plane; asserts it was created.

    Args:
        lf: the running localfleet.
        env_key: the environment.
        **body: more fields of the create request (`image_type`, `ttl_seconds`, ...).

    Returns:
        The instance's JSON.
    """
    r = httpx.post(f"{lf.base_url}/v1/env/instances", json={"env_key": env_key, **body}, headers=AUTH, timeout=30)
    assert r.status_code == 200, r.text
    instance: dict[str, Any] = r.json()
    return instance


def delete(lf: LocalfleetProcess, instance_id: str) -> None:
    """Delete an instance through the control plane.

    Args:
        lf: the running localfleet.
        instance_id: the instance.
    """
    httpx.delete(f"{lf.base_url}/v1/env/instances/{instance_id}", headers=AUTH, timeout=30)


def text_of(result: Any) -> str:
    """The text blocks of an MCP tool result, joined.

    Args:
        result: a `CallToolResult`.
    """
    return "".join(getattr(c, "text", "") for c in result.content)
