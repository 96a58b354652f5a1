"""localfleet's snapshots: the manager's `snapshot` URL copies an instance's live database consistently, and a
create with `snapshot_id` starts an instance whose live database is the copy and whose seed is the
environment's, read back through the unmodified fleet SDK."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import httpx
import pytest
from fleet import Fleet

from tests.support.localfleet import LocalfleetProcess, write_tiny_tasks

AUTH = {"Authorization": "Bearer sdk-key"}
COUNT = "SELECT COUNT(*) FROM notes"


@pytest.fixture(scope="module")
def lf(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalfleetProcess]:
    tasks = write_tiny_tasks(tmp_path_factory.mktemp("tasks"))
    with LocalfleetProcess(environments="tests.support.localfleet:tiny_environments", tasks_dir=tasks) as proc:
        yield proc


@pytest.fixture
def fleet(lf: LocalfleetProcess) -> Iterator[Fleet]:
    client = Fleet(api_key="sdk-key", base_url=lf.base_url)
    yield client
    for inst in client.instances():
        client.close(inst.instance_id)


def snapshot(url: str) -> httpx.Response:
    return httpx.post(url, timeout=30)


def create(lf: LocalfleetProcess, **body: object) -> httpx.Response:
    return httpx.post(f"{lf.base_url}/v1/env/instances", json=body, headers=AUTH, timeout=30)


def test_a_snapshot_becomes_a_new_instance_whose_seed_stays_the_environments(
    lf: LocalfleetProcess, fleet: Fleet
) -> None:
    source = fleet.make("notes:v1")
    source.instance.load()
    source.db("current").exec("UPDATE notes SET starred = 1 WHERE id = 7")
    source.db("current").exec("INSERT INTO notes (title, body, starred) VALUES ('n', 'b', 0)")
    assert source.urls is not None and source.urls.manager is not None
    taken = snapshot(source.urls.manager.snapshot)
    assert taken.status_code == 200, taken.text
    snap = taken.json()
    assert snap["success"] and snap["snapshot_id"].startswith("snap-") and snap["env_key"] == "notes"

    made = create(lf, env_key="notes", env_version="v1", snapshot_id=snap["snapshot_id"], run_id="snap-run")
    assert made.status_code == 200, made.text
    branch = fleet.instance(made.json()["instance_id"])
    branch.instance.load()
    assert branch.db("current").query(COUNT).rows == [[51]]
    assert branch.db("current").query("SELECT starred FROM notes WHERE id = 7").rows == [[1]]
    assert branch.db("seed").query(COUNT).rows == [[50]]  # the verifier's baseline: the task's seed state
    # The copy is the branch's own: a change there is not in the source.
    branch.db("current").exec("DELETE FROM notes WHERE id = 1")
    assert branch.db("current").query(COUNT).rows == [[50]] and source.db("current").query(COUNT).rows == [[51]]
    # A snapshot outlives its instance.
    fleet.close(source.instance_id)
    again = create(lf, env_key="notes:v1", snapshot_id=snap["snapshot_id"])
    assert again.status_code == 200, again.text


def test_snapshots_while_tools_write_are_consistent(lf: LocalfleetProcess, fleet: Fleet) -> None:
    source = fleet.make("notes:v1")
    source.instance.load()
    stop = threading.Event()

    def write() -> None:
        n = 0
        while not stop.is_set() and n < 400:
            source.db("current").exec(f"INSERT INTO notes (title, body, starred) VALUES ('w{n}', 'b', 0)")
            n += 1

    writer = threading.Thread(target=write)
    writer.start()
    try:
        ids = [snapshot(source.urls.manager.snapshot).json()["snapshot_id"] for _ in range(5)]
    finally:
        stop.set()
        writer.join(30)
    for snapshot_id in ids:
        made = create(lf, env_key="notes:v1", snapshot_id=snapshot_id)
        inst = fleet.instance(made.json()["instance_id"])
        inst.instance.load()
        # Each snapshot is one committed state: ids 1..n with no gap (every write is a committed insert).
        ((count, top),) = inst.db("current").query("SELECT COUNT(*), MAX(id) FROM notes").rows
        assert count == top >= 50


def test_bad_snapshot_requests(lf: LocalfleetProcess, fleet: Fleet) -> None:
    unknown = create(lf, env_key="notes:v1", snapshot_id="snap-nope")
    assert unknown.status_code == 400 and "not found" in unknown.text
    source = fleet.make("notes:v1")
    snap = snapshot(source.urls.manager.snapshot).json()["snapshot_id"]
    other = create(lf, env_key="notes-legacy:v1", snapshot_id=snap)
    assert other.status_code == 400 and "is of notes:v1" in other.text
    root = f"{lf.base_url}/instances/does-not-exist/api/v1/env/snapshot"
    assert snapshot(root).status_code == 404
    fleet.close(source.instance_id)
    assert snapshot(source.urls.manager.snapshot).status_code == 404
