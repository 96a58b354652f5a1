"""`SessionRecords`: CRUD, compare-and-set, the token index, listing, corrupt records.
Runs against every backend (see conftest.py)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import pytest
import redis.asyncio as aioredis

from rlgate.store import (
    OPEN_STATUSES,
    ConflictError,
    MemoryStore,
    Session,
    SessionStatus,
    SessionStore,
    StoreError,
)
from tests.store import sqlite_files
from tests.store.conftest import Backend, StoreFactory


def make_session(sid: str, **fields: object) -> Session:
    return Session(session_id=sid, env_key="mail:v1", **fields)  # type: ignore[arg-type]


async def test_create_get_roundtrip(store: SessionStore) -> None:
    session = make_session(
        "s1",
        task_key="mail/find",
        labels={"team": "rl", "exp": "a"},
        instance={"root_url": "http://127.0.0.1:1/", "nested": {"k": [1, 2]}},
        endpoints=["http://127.0.0.1:1/mcp"],
        reward=0.5,
        token_hash="h1",
        status=SessionStatus.ACTIVE,
    )
    created = await store.create_session(session)
    assert created.version == 1
    got = await store.get_session("s1")
    assert got == created
    assert await store.get_session("nope") is None


async def test_create_duplicate_conflicts(store: SessionStore) -> None:
    await store.create_session(make_session("s1"))
    with pytest.raises(ConflictError):
        await store.create_session(make_session("s1", task_key="other"))
    got = await store.get_session("s1")
    assert got is not None and got.task_key == ""


async def test_update_is_compare_and_set(store: SessionStore) -> None:
    created = await store.create_session(make_session("s1"))
    before = time.time()
    updated = await store.update_session(replace(created, turn=3, status=SessionStatus.ACTIVE, token_hash="t"))
    assert updated.version == 2 and updated.turn == 3 and updated.updated_at >= before
    assert await store.get_session("s1") == updated
    with pytest.raises(ConflictError):  # stale copy
        await store.update_session(replace(created, turn=99))
    with pytest.raises(ConflictError):  # missing session
        await store.update_session(make_session("ghost", version=1))
    stored = await store.get_session("s1")
    assert stored is not None and stored.turn == 3 and stored.version == 2


async def test_concurrent_cas_writers_count_exactly(store: SessionStore, open_another: StoreFactory) -> None:
    """20 writers over two store objects, each incrementing 5 times with retry: the count is exact."""
    other = await open_another()
    await store.create_session(make_session("counter"))
    conflicts = 0

    async def writer(s: SessionStore) -> None:
        nonlocal conflicts
        for _ in range(5):
            while True:
                current = await s.get_session("counter")
                assert current is not None
                try:
                    await s.update_session(replace(current, turn=current.turn + 1))
                    break
                except ConflictError:
                    conflicts += 1
                    await asyncio.sleep(0)

    await asyncio.gather(*(writer(store if i % 2 else other) for i in range(20)))
    final = await store.get_session("counter")
    assert final is not None
    assert final.turn == 100
    assert final.version == 101
    assert conflicts > 0  # the writers really did race


async def test_token_index_rotation_and_revocation(store: SessionStore) -> None:
    s = await store.create_session(make_session("s1", status=SessionStatus.ACTIVE, token_hash="tok-1"))
    await store.create_session(make_session("s2", status=SessionStatus.ACTIVE, token_hash="tok-2"))
    found = await store.session_by_token("tok-1")
    assert found is not None and found.session_id == "s1"
    assert await store.session_by_token("unknown") is None

    s = await store.update_session(replace(s, token_hash="tok-1b", episode=2))  # new episode, new token
    assert await store.session_by_token("tok-1") is None
    found = await store.session_by_token("tok-1b")
    assert found is not None and found.episode == 2

    with pytest.raises(ConflictError):  # a token belongs to one session only
        await store.update_session(replace(s, token_hash="tok-2"))

    s = await store.update_session(replace(s, token_hash="", status=SessionStatus.CLOSED, closed_at=time.time()))
    assert await store.session_by_token("tok-1b") is None
    assert await store.session_by_token("") is None
    other = await store.session_by_token("tok-2")
    assert other is not None and other.session_id == "s2"

    await store.delete_session("s2")
    assert await store.session_by_token("tok-2") is None
    assert await store.get_session("s2") is None


async def test_touch_does_not_bump_version(store: SessionStore) -> None:
    created = await store.create_session(make_session("s1", last_active_at=100.0))
    await store.touch_session("s1", 5000.0)
    await store.touch_session("s1", 4000.0)  # activity never goes backwards
    await store.touch_session("missing", 1.0)  # no-op
    got = await store.get_session("s1")
    assert got is not None and got.version == 1 and got.last_active_at == 5000.0
    updated = await store.update_session(created)  # a stale last_active_at does not undo the touch
    assert updated.last_active_at == 5000.0
    got = await store.get_session("s1")
    assert got is not None and got.last_active_at == 5000.0


async def test_list_pagination_and_filters(store: SessionStore, monkeypatch: pytest.MonkeyPatch) -> None:
    # Small index batches make the Redis walk cross batch boundaries in the middle of created_at ties.
    monkeypatch.setattr("rlgate.store.redis.sessions._WALK_BATCH", 3)
    base = 1_700_000_000.0
    for i in range(25):
        await store.create_session(
            make_session(
                f"s{i:02d}",
                created_at=base + (i // 2),  # pairs share a created_at: ties break on id
                run_id="run-a" if i % 2 else "run-b",
                labels={"exp": "x" if i % 3 == 0 else "y", "team": "rl"},
                status=SessionStatus.CLOSED if i % 5 == 0 else SessionStatus.PROVISIONING,
            )
        )
    expected = sorted((f"s{i:02d}" for i in range(25)), key=lambda s: (base + int(s[1:]) // 2, s), reverse=True)

    seen: list[str] = []
    cursor = ""
    pages = 0
    while True:
        page, cursor = await store.list_sessions(limit=7, cursor=cursor)
        pages += 1
        seen += [s.session_id for s in page]
        if not cursor:
            break
    assert seen == expected
    assert pages == 4

    page, cursor = await store.list_sessions(run_id="run-a", limit=100)
    assert [s.session_id for s in page] == [s for s in expected if int(s[1:]) % 2] and cursor == ""

    page, _ = await store.list_sessions(labels={"exp": "x", "team": "rl"})
    assert [s.session_id for s in page] == [s for s in expected if int(s[1:]) % 3 == 0]
    page, _ = await store.list_sessions(labels={"exp": "nope"})
    assert page == []

    page, _ = await store.list_sessions(statuses=OPEN_STATUSES, run_id="run-b", labels={"exp": "y"})
    assert [s.session_id for s in page] == [
        s for s in expected if int(s[1:]) % 5 and int(s[1:]) % 2 == 0 and int(s[1:]) % 3
    ]
    page, _ = await store.list_sessions(statuses=frozenset({SessionStatus.CLOSED}))
    assert [s.session_id for s in page] == ["s20", "s15", "s10", "s05", "s00"]

    # filtered pages walk the same order
    seen = []
    cursor = ""
    while True:
        page, cursor = await store.list_sessions(statuses=OPEN_STATUSES, limit=3, cursor=cursor)
        seen += [s.session_id for s in page]
        if not cursor:
            break
    assert seen == [s for s in expected if int(s[1:]) % 5]

    with pytest.raises(ValueError):
        await store.list_sessions(cursor="not-a-cursor")


async def test_list_reflects_updates(store: SessionStore) -> None:
    s = await store.create_session(make_session("s1", run_id="r1", labels={"a": "1"}))
    s = await store.update_session(replace(s, run_id="r2", labels={"a": "2"}, status=SessionStatus.CLOSED))
    assert (await store.list_sessions(run_id="r1"))[0] == []
    assert (await store.list_sessions(labels={"a": "1"}))[0] == []
    assert [x.session_id for x in (await store.list_sessions(run_id="r2", labels={"a": "2"}))[0]] == ["s1"]
    assert (await store.list_sessions(statuses=OPEN_STATUSES))[0] == []


async def test_list_by_non_ascii_labels(store: SessionStore) -> None:
    """Label keys and values outside ASCII index and list like any other (Redis keys count bytes)."""
    await store.create_session(make_session("s1", labels={"clé": "värde 🙂"}))
    await store.create_session(make_session("s2", labels={"clé": "other"}))
    assert [x.session_id for x in (await store.list_sessions(labels={"clé": "värde 🙂"}))[0]] == ["s1"]
    assert await store.check_invariants() == []


async def test_count_open_sessions(store: SessionStore) -> None:
    assert await store.count_open_sessions() == 0
    for i, status in enumerate(
        [
            SessionStatus.PROVISIONING,
            SessionStatus.ACTIVE,
            SessionStatus.DONE,
            SessionStatus.CLOSED,
            SessionStatus.EXPIRED,
            SessionStatus.FAILED,
        ]
    ):
        await store.create_session(make_session(f"s{i}", status=status))
    assert await store.count_open_sessions() == 3
    s = await store.get_session("s1")
    assert s is not None
    await store.update_session(replace(s, status=SessionStatus.CLOSED, token_hash=""))
    assert await store.count_open_sessions() == 2
    await store.delete_session("s0")
    assert await store.count_open_sessions() == 1


async def test_corrupt_record_is_store_error(store: SessionStore, backend: Backend) -> None:
    await store.create_session(make_session("s1"))
    if backend.name == "sqlite":
        path = backend.url[len("sqlite:///") :]

        def corrupt() -> None:
            with sqlite_files.connection(path) as conn:
                conn.execute("UPDATE sessions SET data = '{not json' WHERE session_id = 's1'")

        await asyncio.to_thread(corrupt)
    elif isinstance(store, MemoryStore):
        store.data.sessions["s1"] = "{not json"
    else:
        client = aioredis.Redis.from_url(backend.url, socket_timeout=5)
        try:
            await client.hset("rlgate:s:s1", "data", "{not json")
        finally:
            await client.aclose()
    with pytest.raises(StoreError):
        await store.get_session("s1")


async def test_updates_touching_one_indexed_field_keep_every_index_in_step(store: SessionStore) -> None:
    """A write changes only what differs (SQLite skips unchanged index columns and label rows): each
    kind of change on its own must still reach its index."""
    s = await store.create_session(
        make_session("s1", run_id="r1", labels={"a": "1"}, status=SessionStatus.ACTIVE, token_hash="t1")
    )
    s = await store.update_session(replace(s, turn=1))  # nothing indexed changes
    assert [x.session_id for x in (await store.list_sessions(labels={"a": "1"}, run_id="r1"))[0]] == ["s1"]
    s = await store.update_session(replace(s, labels={"a": "2", "b": "3"}))  # labels only
    assert (await store.list_sessions(labels={"a": "1"}))[0] == []
    assert [x.session_id for x in (await store.list_sessions(labels={"a": "2", "b": "3"}))[0]] == ["s1"]
    s = await store.update_session(replace(s, run_id="r2"))  # run only
    assert (await store.list_sessions(run_id="r1"))[0] == [] and len((await store.list_sessions(run_id="r2"))[0]) == 1
    s = await store.update_session(replace(s, token_hash="t2"))  # token only
    assert await store.session_by_token("t1") is None
    assert (found := await store.session_by_token("t2")) is not None and found.version == s.version
    s = await store.update_session(replace(s, labels={}))
    assert (await store.list_sessions(labels={"a": "2"}))[0] == []
    assert await store.check_invariants() == []
    s = await store.update_session(replace(s, status=SessionStatus.CLOSED, token_hash="", closed_at=1_000.0))
    assert await store.count_open_sessions() == 0
    assert await store.check_invariants() == []
    assert await store.prune(closed_before=2_000.0, requests_before=0) == 1
    assert await store.get_session("s1") is None


async def test_concurrent_writes_fail_alone_and_the_rest_are_durable(
    store: SessionStore, open_another: StoreFactory
) -> None:
    # Writes issued together may share a transaction (SQLite's group commit): one that fails must undo only
    # itself, and every write answered must be visible to another connection at once.
    await store.create_session(make_session("taken"))
    results = await asyncio.gather(
        *(store.create_session(make_session(sid)) for sid in ("a1", "a2", "taken", "a3", "a4")),
        return_exceptions=True,
    )
    assert [type(r).__name__ for r in results] == ["Session", "Session", "ConflictError", "Session", "Session"]
    other = await open_another()
    for sid in ("a1", "a2", "a3", "a4"):
        assert await other.get_session(sid) is not None, sid
    got = await other.get_session("taken")
    assert got is not None and got.version == 1
