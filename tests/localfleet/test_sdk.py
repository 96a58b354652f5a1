"""The unmodified fleet-python SDK (sync `Fleet` and `AsyncFleet`) against a real localfleet process."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import httpx
import pytest
from fleet import AsyncFleet, Fleet
from fleet._async.exceptions import FleetInstanceLimitError as AsyncFleetInstanceLimitError
from fleet.exceptions import FleetAPIError, FleetConflictError, FleetInstanceLimitError

from tests.support.localfleet import LocalfleetProcess, write_tiny_tasks
from tests.support.wait import wait_until_sync

AUTH = {"Authorization": "Bearer sdk-key"}


@pytest.fixture(scope="module")
def lf(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalfleetProcess]:
    tasks = write_tiny_tasks(tmp_path_factory.mktemp("tasks"))
    with LocalfleetProcess(
        environments="tests.support.localfleet:tiny_environments",
        tasks_dir=tasks,
        extra_args=["--reaper-interval-s", "0.2"],
    ) as proc:
        yield proc


@pytest.fixture
def fleet(lf: LocalfleetProcess) -> Iterator[Fleet]:
    lf.set_faults({})
    client = Fleet(api_key="sdk-key", base_url=lf.base_url)
    yield client
    for inst in client.instances():
        client.close(inst.instance_id)


def test_sync_lifecycle(fleet: Fleet) -> None:
    run = f"run-{uuid.uuid4().hex[:8]}"
    env = fleet.make("notes:v1", run_id=run, ttl_seconds=600, env_variables={"TAG": "a"})
    assert env.status == "running" and env.urls is not None and env.urls.root.endswith("/")
    assert env.mcp.url == f"{env.urls.root}mcp"
    assert env.run_id == run and env.env_variables == {"LOGGED_IN_USER": "tester@example.com", "TAG": "a"}
    assert {r.name for r in env.resources()} == {"seed", "current"}
    assert env.db("current").query("SELECT COUNT(*) FROM notes").rows == [[50]]
    env.db("current").exec("UPDATE notes SET starred = 1 WHERE id = 2")
    assert env.db("current").query("SELECT starred FROM notes WHERE id = 2").rows == [[1]]
    reset = env.reset()
    assert reset.success
    assert env.db("current").query("SELECT starred FROM notes WHERE id = 2").rows == [[0]]
    assert env.instance.manager_health_check().status == "healthy"
    assert [t.name for t in env.db("seed").describe().tables] == ["notes"]

    other = fleet.make("notes", run_id=run)
    listed = {i.instance_id for i in fleet.instances(run_id=run)}
    assert listed == {env.instance_id, other.instance_id}
    assert all(i.run_id == run for i in fleet.instances(run_id=run))
    assert fleet.account().instance_count == 2
    assert fleet.instance(env.instance_id).env_variables["TAG"] == "a"

    closed = env.close()
    assert closed.status == "stopped"
    assert {i.instance_id for i in fleet.close_all(run_id=run)} == {other.instance_id}
    assert fleet.instances(run_id=run) == []
    assert fleet.account().instance_count == 0
    assert fleet.instance(env.instance_id).status == "stopped"  # a closed instance stays readable


def test_environments_and_tasks(fleet: Fleet) -> None:
    assert {e.env_key for e in fleet.list_envs()} == {"notes", "notes-legacy"}
    assert fleet.environment("notes").default_version == "v1"
    tasks = fleet.load_tasks(env_key="notes")
    assert {t.key for t in tasks} == {"notes-star-7", "notes-count"}
    assert all(t.env_key == "notes:v1" for t in tasks)


def test_instance_limit_raises_the_sdk_error(lf: LocalfleetProcess, fleet: Fleet) -> None:
    lf.set_faults({"instance_limit": 2})
    fleet.make("notes")
    fleet.make("notes")
    with pytest.raises(FleetInstanceLimitError) as info:
        fleet.make("notes")
    assert info.value.running_instances == 2 and info.value.instance_limit == 2
    assert fleet.account().instance_limit == 2


def test_verify_detailed_with_final_answer(fleet: Fleet) -> None:
    env = fleet.make("notes")
    by_key = {t.key: t for t in fleet.load_tasks()}
    right = by_key["notes-count"].verify_detailed(env, final_answer="There are 50 notes.")
    assert right.success and right.result == 1
    wrong = by_key["notes-count"].verify_detailed(env, final_answer="There are 49 notes.")
    assert wrong.success and wrong.result == 0
    star = by_key["notes-star-7"]
    before = star.verify_detailed(env)
    assert before.success and before.result == 0 and "starred = 0" in (before.stdout or "")
    env.instance.load()  # the SDK needs the resource list before env.db()
    env.db("current").exec("UPDATE notes SET starred = 1 WHERE id = 7")
    after = star.verify_detailed(env)
    assert after.success and after.result == 1


def test_verify_raw_through_the_manager(fleet: Fleet) -> None:
    env = fleet.make("notes")
    code = (
        "def check(env, final_answer: str | None = None) -> int:\n"
        "    return 1 if len(env.db('current').table('notes').all()) == 50 else 0\n"
    )
    out = env.verify_raw(code)
    assert out.success and out.result == 1


def test_heartbeat_and_expiry(lf: LocalfleetProcess, fleet: Fleet) -> None:
    beating = fleet.make("notes", heartbeat_interval=1)
    silent = fleet.make("notes", heartbeat_interval=1)
    short = fleet.make("notes", ttl_seconds=1)

    def others_expired() -> bool:
        hb = beating.heartbeat()
        assert hb.success and hb.interval_seconds == 1 and hb.deadline_timestamp
        return {fleet.instance(i.instance_id).status for i in (silent, short)} == {"stopped"}

    # Beat (every 0.3 s, well within the 1 s interval) until both others have expired, however long that takes.
    wait_until_sync(others_expired, 30, "the silent and short-lived instances expired", interval=0.3)
    assert fleet.instance(beating.instance_id).status == "running"
    assert lf.counters()["instances_expired"] >= 2


def test_duplicate_request_id_is_409_and_the_sdk_recovers(lf: LocalfleetProcess, fleet: Fleet) -> None:
    rid = str(uuid.uuid4())
    headers = {**AUTH, "X-Request-ID": rid}
    first = httpx.post(f"{lf.base_url}/v1/env/instances", json={"env_key": "notes"}, headers=headers)
    again = httpx.post(f"{lf.base_url}/v1/env/instances", json={"env_key": "notes"}, headers=headers)
    assert first.status_code == 200 and again.status_code == 409
    detail = again.json()["detail"]
    assert detail["error"] == "duplicate_request_id" and detail["instance_id"] == first.json()["instance_id"]
    # what the SDK does with that answer: FleetConflictError carrying the instance id
    with pytest.raises(FleetConflictError) as info:
        fleet.client.request(
            "POST", "/v1/env/instances", json={"env_key": "notes"}, extra_headers={"X-Request-ID": rid}
        )
    assert info.value.instance_id == first.json()["instance_id"]


def test_unknown_instance_is_a_404_api_error(fleet: Fleet) -> None:
    with pytest.raises(FleetAPIError) as info:
        Fleet(api_key="k", base_url=fleet.client.base_url, max_retries=0).instance("nope")
    assert info.value.status_code == 404


async def test_async_lifecycle(lf: LocalfleetProcess) -> None:
    lf.set_faults({})
    client = AsyncFleet(api_key="sdk-key", base_url=lf.base_url)
    run = f"arun-{uuid.uuid4().hex[:8]}"
    env = await client.make("notes-legacy", run_id=run)
    try:
        assert env.status == "running" and env.urls is not None
        assert {r.name for r in await env.resources()} == {"seed", "current"}
        assert (await env.db("current").query("SELECT COUNT(*) FROM notes")).rows == [[50]]
        assert (await env.reset()).success
        assert [i.instance_id for i in await client.instances(run_id=run)] == [env.instance_id]
        assert (await client.account()).instance_count >= 1
        tasks = {t.key: t for t in await client.load_tasks()}
        res = await tasks["notes-count"].verify_detailed_async(env, final_answer="50")
        assert res.success and res.result == 1
        lf.set_faults({"instance_limit": 1})
        with pytest.raises(AsyncFleetInstanceLimitError):
            await client.make("notes")
    finally:
        lf.set_faults({})
        closed = await client.close_all(run_id=run)
        assert [i.instance_id for i in closed] == [env.instance_id]
    assert await client.instances(run_id=run) == []
