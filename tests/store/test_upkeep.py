"""`Upkeep`: retention, invariants, reachability and closing, against every backend (see conftest.py)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import pytest
import redis.asyncio as aioredis

from rlgate.store import MemoryStore, RequestState, SessionStatus, SessionStore, StoreError, ToolCallEntry
from tests.store import sqlite_files
from tests.store.conftest import Backend, StoreFactory
from tests.store.test_sessions import make_session


async def test_prune_retention(store: SessionStore) -> None:
    old, now = 1_000.0, time.time()
    await store.create_session(make_session("closed-old", status=SessionStatus.CLOSED, closed_at=old))
    await store.create_session(make_session("failed-old", status=SessionStatus.FAILED, closed_at=old))
    await store.create_session(make_session("closed-new", status=SessionStatus.CLOSED, closed_at=now))
    await store.create_session(make_session("open-old", status=SessionStatus.DONE, created_at=old))
    await store.append_tool_call(ToolCallEntry("closed-old", 1, "r", "t"))
    await store.claim_request("reset", "done-old", "o")
    await store.complete_request("reset", "done-old", "result")
    await store.claim_request("reset", "pending", "o")

    removed = await store.prune(closed_before=now - 60, requests_before=time.time() + 1)
    assert removed == 3  # two sessions + one DONE request
    assert await store.get_session("closed-old") is None
    assert await store.get_session("failed-old") is None
    assert await store.list_tool_calls("closed-old") == []
    assert await store.get_session("closed-new") is not None
    assert await store.get_session("open-old") is not None
    assert await store.get_request("reset", "done-old") is None
    pending = await store.get_request("reset", "pending")
    assert pending is not None and pending.state == RequestState.PENDING
    assert await store.prune(closed_before=now - 60, requests_before=time.time() + 1) == 0
    assert await store.check_invariants() == []


async def test_invariants_healthy_and_broken(store: SessionStore) -> None:
    assert await store.check_invariants() == []
    s = await store.create_session(make_session("s1", status=SessionStatus.ACTIVE, token_hash="t1", labels={"a": "b"}))
    await store.create_session(make_session("s2", status=SessionStatus.CLOSED, closed_at=5.0))
    await store.update_session(replace(s, turn=1))
    await store.append_tool_call(ToolCallEntry("s1", 1, "r", "t"))
    assert await store.check_invariants() == []
    # A session ACTIVE without a token breaks an invariant the reliability suite relies on.
    await store.create_session(make_session("bad", status=SessionStatus.ACTIVE))
    problems = await store.check_invariants()
    assert any("bad" in p and "token" in p for p in problems), problems


async def test_ping_and_closed_store(store: SessionStore, open_another: StoreFactory) -> None:
    await store.ping()
    extra = await open_another()
    await extra.close()
    await extra.close()  # idempotent
    with pytest.raises(StoreError):
        await extra.get_session("x")


async def test_invariants_catch_a_broken_index(store: SessionStore, backend: Backend) -> None:
    """Corrupt the backend's own token index behind the store's back: check_invariants must notice."""
    await store.create_session(make_session("s1", status=SessionStatus.ACTIVE, token_hash="t1"))
    assert await store.check_invariants() == []
    if backend.name == "sqlite":
        path = backend.url[len("sqlite:///") :]

        def corrupt() -> None:
            with sqlite_files.connection(path) as conn:
                conn.execute("UPDATE sessions SET token_hash = 'other' WHERE session_id = 's1'")

        await asyncio.to_thread(corrupt)
    elif isinstance(store, MemoryStore):
        del store.data.tokens["t1"]
    else:
        client = aioredis.Redis.from_url(backend.url, socket_timeout=5)
        try:
            assert await client.delete("rlgate:tok:t1") == 1
        finally:
            await client.aclose()
    problems = await store.check_invariants()
    assert any("s1" in p for p in problems), problems
