"""localfleet platform: instances over HTTP, both MCP endpoints in both eras, the instance-manager API.

Runs a real `python -m rlgate.localfleet` with the tiny test environments (tests/support/localfleet.py).
"""

from __future__ import annotations

import asyncio
import shutil
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from mcp import Client

from tests.support.localfleet import AUTH, LocalfleetProcess, create, delete, text_of, write_tiny_tasks

ERAS = [("notes", "2026-07-28"), ("notes-legacy", "2025-11-25")]


@pytest.fixture(scope="module")
def lf(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalfleetProcess]:
    tasks = write_tiny_tasks(tmp_path_factory.mktemp("tasks"))
    with LocalfleetProcess(environments="tests.support.localfleet:tiny_environments", tasks_dir=tasks) as proc:
        yield proc


def test_instance_urls_are_path_based(lf: LocalfleetProcess) -> None:
    inst = create(lf, run_id="r-urls", env_variables={"X": "1"})
    try:
        root = inst["urls"]["root"]
        assert root == f"{lf.base_url}/instances/{inst['instance_id']}/"
        assert inst["urls"]["manager"]["api"] == f"{root}api/v1/env"
        assert inst["status"] == "running" and inst["run_id"] == "r-urls"
        assert inst["env_variables"] == {"LOGGED_IN_USER": "tester@example.com", "X": "1"}
        again = httpx.get(f"{lf.base_url}/v1/env/instances/{inst['instance_id']}", headers=AUTH).json()
        assert again["run_id"] == "r-urls" and again["env_variables"] == inst["env_variables"]
    finally:
        delete(lf, inst["instance_id"])
    gone = httpx.get(f"{lf.base_url}/v1/env/instances/{inst['instance_id']}", headers=AUTH).json()
    assert gone["status"] == "stopped" and gone["terminated_at"]


def test_control_plane_needs_a_key_and_reports_unknowns(lf: LocalfleetProcess) -> None:
    assert httpx.get(f"{lf.base_url}/v1/account").status_code == 401
    r = httpx.post(f"{lf.base_url}/v1/env/instances", json={"env_key": "nope"}, headers=AUTH)
    assert r.status_code == 400 and "Environment 'nope' not found" in r.json()["detail"]
    r = httpx.post(f"{lf.base_url}/v1/env/instances", json={"env_key": "notes", "env_version": "v9"}, headers=AUTH)
    assert r.status_code == 400 and "Version 'v9' not found" in r.json()["detail"]
    r = httpx.post(f"{lf.base_url}/v1/env/instances", json={"env_key": "notes", "ttl_seconds": -1}, headers=AUTH)
    assert r.status_code == 400
    r = httpx.get(f"{lf.base_url}/v1/env/instances/doesnotexist", headers=AUTH)
    assert r.status_code == 404 and "not found" in r.json()["detail"]


@pytest.mark.parametrize(("env_key", "era"), ERAS)
@pytest.mark.parametrize("endpoint", ["mcp", "api/v1/mcp"])
async def test_both_endpoints_both_eras(lf: LocalfleetProcess, env_key: str, era: str, endpoint: str) -> None:
    inst = create(lf, env_key)
    try:
        url = inst["urls"]["root"] + endpoint
        async with Client(url, read_timeout_seconds=30) as client:
            assert client.protocol_version == era
            names = {t.name for t in (await client.list_tools()).tools}
            assert {"count_notes", "add_note", "star_note", "whoami"} <= names
            assert "computer" not in names  # only the aggregator of image_type="mcp" has it (test_screens.py)
            assert text_of(await client.call_tool("whoami", {})) == inst["instance_id"]
            added = await client.call_tool("add_note", {"title": "t", "body": "b"})
            assert not added.is_error and added.structured_content == {"id": 51}
            assert text_of(await client.call_tool("count_notes", {})) == "51"
            bad = await client.call_tool("star_note", {"note_id": 999})
            assert bad.is_error and "no note 999" in text_of(bad)
    finally:
        delete(lf, inst["instance_id"])


async def test_instances_are_isolated(lf: LocalfleetProcess) -> None:
    a, b = create(lf), create(lf)
    try:
        async with Client(a["urls"]["root"] + "mcp") as ca, Client(b["urls"]["root"] + "mcp") as cb:
            await ca.call_tool("add_note", {"title": "only in a", "body": "x"})
            assert text_of(await ca.call_tool("count_notes", {})) == "51"
            assert text_of(await cb.call_tool("count_notes", {})) == "50"
    finally:
        delete(lf, a["instance_id"])
        delete(lf, b["instance_id"])


def test_mcp_urls_answer_without_redirect(lf: LocalfleetProcess) -> None:
    inst = create(lf)
    try:
        for suffix in ("mcp", "mcp/", "api/v1/mcp", "api/v1/mcp/"):
            r = httpx.post(
                inst["urls"]["root"] + suffix,
                follow_redirects=False,
                json={
                    "jsonrpc": "2.0",
                    "id": 1,
                    "method": "initialize",
                    "params": {
                        "protocolVersion": "2025-11-25",
                        "capabilities": {},
                        "clientInfo": {"name": "t", "version": "1"},
                    },
                },
                headers={"Accept": "application/json, text/event-stream"},
            )
            assert r.status_code == 200, (suffix, r.status_code, r.text)
    finally:
        delete(lf, inst["instance_id"])


def test_legacy_era_refuses_the_modern_probe(lf: LocalfleetProcess) -> None:
    inst = create(lf, "notes-legacy")
    try:
        r = httpx.post(
            inst["urls"]["root"] + "mcp",
            json={"jsonrpc": "2.0", "id": 1, "method": "server/discover"},
            headers={"MCP-Protocol-Version": "2026-07-28", "Accept": "application/json"},
        )
        assert r.status_code == 400 and "Unsupported protocol version" in r.text
    finally:
        delete(lf, inst["instance_id"])


def test_mcp_on_unknown_or_deleted_instance_is_404(lf: LocalfleetProcess) -> None:
    inst = create(lf)
    delete(lf, inst["instance_id"])
    r = httpx.post(inst["urls"]["root"] + "mcp", json={"jsonrpc": "2.0", "id": 1, "method": "tools/list"})
    assert r.status_code == 404
    r = httpx.post(f"{lf.base_url}/instances/nope/api/v1/env/reset", json={})
    assert r.status_code == 404


def test_manager_reset_describe_query(lf: LocalfleetProcess) -> None:
    inst = create(lf)
    api = inst["urls"]["manager"]["api"]

    async def star() -> None:
        async with Client(inst["urls"]["root"] + "mcp") as client:
            await client.call_tool("star_note", {"note_id": 3})

    try:
        asyncio.run(star())
        q = {"query": "SELECT starred FROM notes WHERE id = ?", "args": [3], "read_only": True}
        assert httpx.post(f"{api}/resources/sqlite/current/query", json=q).json()["rows"] == [[1]]
        assert httpx.post(f"{api}/resources/sqlite/seed/query", json=q).json()["rows"] == [[0]]
        diff = httpx.post(f"{api}/diff/structured", json={}).json()
        assert diff["success"] and diff["diff"]["notes"]["total_changes"] == 1
        r = httpx.post(f"{api}/reset", json={"seed": None, "timestamp": None})
        assert r.status_code == 200 and r.json()["success"] is True
        assert httpx.post(f"{api}/resources/sqlite/current/query", json=q).json()["rows"] == [[0]]
        described = httpx.get(f"{api}/resources/sqlite/current/describe").json()
        assert described["success"] and [t["name"] for t in described["tables"]] == ["notes"]
        assert httpx.get(f"{api}/health").json()["status"] == "healthy"
        names = {r["name"] for r in httpx.get(f"{api}/resources").json()}
        assert names == {"seed", "current"}
        # the seed database cannot be written through the query route
        w = httpx.post(
            f"{api}/resources/sqlite/seed/query", json={"query": "DELETE FROM notes", "read_only": False}
        ).json()
        assert w["success"] is False
        bad = httpx.post(f"{api}/resources/sqlite/current/query", json={"query": "SELEC nonsense"}).json()
        assert bad["success"] is False and bad["error"]
        assert httpx.get(f"{api}/resources/sqlite/other/describe").status_code == 404
    finally:
        delete(lf, inst["instance_id"])


def test_tasks_and_environments_are_served(lf: LocalfleetProcess) -> None:
    tasks = httpx.get(f"{lf.base_url}/v1/tasks", headers=AUTH).json()
    assert tasks["total"] == 2 and {t["key"] for t in tasks["tasks"]} == {"notes-star-7", "notes-count"}
    only = httpx.get(f"{lf.base_url}/v1/tasks", params={"task_keys": ["notes-count"]}, headers=AUTH).json()
    assert [t["key"] for t in only["tasks"]] == ["notes-count"]
    envs = httpx.get(f"{lf.base_url}/v1/env/", headers=AUTH).json()
    assert {e["env_key"] for e in envs} == {"notes", "notes-legacy"}
    assert httpx.get(f"{lf.base_url}/v1/env/notes", headers=AUTH).json()["default_version"] == "v1"


def test_instances_survive_a_restart(tmp_path: Any) -> None:
    with LocalfleetProcess(environments="tests.support.localfleet:tiny_environments") as proc:
        inst = create(proc, run_id="survivor")
        api = inst["urls"]["manager"]["api"]
        httpx.post(
            f"{api}/resources/sqlite/current/query",
            json={"query": "UPDATE notes SET starred = 1 WHERE id = 1", "read_only": False},
        )
        proc.kill()
        proc.start()
        listed = httpx.get(f"{proc.base_url}/v1/env/instances", params={"run_id": "survivor"}, headers=AUTH).json()
        assert [i["instance_id"] for i in listed] == [inst["instance_id"]]
        rows = httpx.post(
            f"{api}/resources/sqlite/current/query", json={"query": "SELECT starred FROM notes WHERE id = 1"}
        ).json()["rows"]
        assert rows == [[1]]


async def test_app_factory_in_process(tmp_path: Any) -> None:
    """`create_app` runs without a socket (httpx ASGITransport); the platform's lifespan owns its tasks."""
    from rlgate.localfleet.config import LocalfleetConfig
    from rlgate.localfleet.server import create_app
    from tests.support.localfleet import TINY_TASKS, tiny_environments

    config = LocalfleetConfig(listen="127.0.0.1:9", data_dir=str(tmp_path))
    app = create_app(config, specs=tiny_environments(), tasks=TINY_TASKS)
    async with app.platform.running():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:9", headers=AUTH) as http:
            inst = (await http.post("/v1/env/instances", json={"env_key": "notes"})).json()
            assert inst["urls"]["root"] == f"http://127.0.0.1:9/instances/{inst['instance_id']}/"
            q = {"query": "SELECT COUNT(*) FROM notes"}
            r = await http.post(f"/instances/{inst['instance_id']}/api/v1/env/resources/sqlite/seed/query", json=q)
            assert r.json()["rows"] == [[50]]
            assert (await http.get("/v1/tasks")).json()["total"] == 2
        reaper = app.platform.registry._reaper
        assert reaper is not None and not reaper.done()
    assert reaper.done()  # cancelled on shutdown


async def test_a_delete_during_the_copy_answers_the_create_409(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """An instance deleted while its files are written (a reconciler judging it an orphan) fails its create
    with 409 naming it, never a 500 from the copy that lost its directory."""
    from rlgate.localfleet.config import LocalfleetConfig
    from rlgate.localfleet.server import create_app
    from tests.support.localfleet import TINY_TASKS, tiny_environments

    copying, go_on = threading.Event(), threading.Event()
    copyfile = shutil.copyfile

    def held(src: Any, dst: Any) -> Any:
        """The create's first file copy waits, its directory made, until the test has deleted the instance."""
        if not copying.is_set():
            copying.set()
            assert go_on.wait(30)
        return copyfile(src, dst)

    monkeypatch.setattr(shutil, "copyfile", held)
    config = LocalfleetConfig(listen="127.0.0.1:9", data_dir=str(tmp_path))
    app = create_app(config, specs=tiny_environments(), tasks=TINY_TASKS)
    async with app.platform.running():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:9", headers=AUTH) as http:
            create = asyncio.ensure_future(http.post("/v1/env/instances", json={"env_key": "notes"}))
            assert await asyncio.to_thread(copying.wait, 30)
            (pending,) = app.platform.registry.live
            assert (await http.delete(f"/v1/env/instances/{pending}")).status_code == 200
            go_on.set()
            r = await create
            assert r.status_code == 409, r.text
            assert f"instance {pending} was deleted while being created" in r.text
            assert (await http.get("/v1/env/instances")).json() == []


def test_cli_help_documents_the_flags() -> None:
    import subprocess
    import sys

    for cmd in (
        [sys.executable, "-m", "rlgate.localfleet", "--help"],
        [sys.executable, "-c", "from rlgate.cli import main; main()", "localfleet", "--help"],
    ):
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=True).stdout
        for flag in ("--listen", "--data-dir", "--faults", "RLGATE_LOCALFLEET_FAULTS", "--verifier-timeout-s"):
            assert flag in out, (cmd, flag)
