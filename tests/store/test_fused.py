"""The fused hot-path operations, against every backend: `commit(..., new_request=True)` (a Step's turn and
its DONE record without a prior claim) and `authorize_call` (a CallTool's token lookup and claim)."""

from __future__ import annotations

import asyncio
import contextlib
import pickle
import time
from typing import Any

import pytest
import redis.asyncio

from rlgate.store import (
    ConflictError,
    RequestExists,
    RequestRecord,
    RequestState,
    Session,
    SessionStatus,
    SessionStore,
    ToolCallEntry,
    call_scope,
)
from tests.fakes.store import FaultyMemoryStore
from tests.store import sqlite_files
from tests.store.conftest import Backend, StoreFactory
from tests.store.test_redis_faults import store_losing_replies
from tests.support.redis import RedisServer


def session(sid: str, status: SessionStatus = SessionStatus.ACTIVE, **fields: Any) -> Session:
    fields.setdefault("token_hash", f"tok-{sid}")
    return Session(session_id=sid, env_key="mail:v1", status=status, **fields)


def test_call_scope() -> None:
    assert call_scope("s-1") == "call:s-1"


def test_request_exists_is_a_conflict_that_pickles() -> None:
    record = RequestRecord("step:s1", "r1", RequestState.DONE, "", "payload", 1.0, 2.0)
    exc = RequestExists(record)
    assert isinstance(exc, ConflictError) and "r1" in str(exc)
    again = pickle.loads(pickle.dumps(exc))
    assert isinstance(again, RequestExists) and again.record == record


# -- commit(new_request=True) ------------------------------------------------------------------------------
async def test_new_request_commits_turn_and_done_record(store: SessionStore) -> None:
    created = await store.create_session(session("s1"))
    before = time.time()
    updated = await store.commit(session=created.copy(turn=1), request=("step:s1", "r1", "resp-1"), new_request=True)
    assert updated is not None and updated.version == 2 and updated.turn == 1
    assert await store.get_session("s1") == updated
    record = await store.get_request("step:s1", "r1")
    assert record is not None and record.state == RequestState.DONE and record.result == "resp-1"
    assert record.owner == "" and record.created_at == record.finished_at >= before
    # A DONE record is prunable like any other.
    assert await store.prune(closed_before=0, requests_before=time.time() + 1) == 1
    assert await store.get_request("step:s1", "r1") is None
    assert await store.check_invariants() == []


async def test_new_request_with_a_tool_call_and_no_session(store: SessionStore) -> None:
    await store.create_session(session("s1", last_active_at=100.0))
    entry = ToolCallEntry("s1", 1, "r1", "search", finished_at=5_000.0)
    assert await store.commit(request=("call:s1", "r1", "out"), tool_call=entry, new_request=True) is None
    assert await store.list_tool_calls("s1") == [entry]
    record = await store.get_request("call:s1", "r1")
    assert record is not None and record.state == RequestState.DONE and record.result == "out"
    stored = await store.get_session("s1")
    assert stored is not None and stored.last_active_at == 5_000.0


@pytest.mark.parametrize("existing", ["pending", "done"])
async def test_new_request_over_an_existing_record_writes_nothing(store: SessionStore, existing: str) -> None:
    created = await store.create_session(session("s1", last_active_at=100.0))
    if existing == "pending":
        record, _ = await store.claim_request("step:s1", "r1", "other-owner")
    else:
        await store.complete_request("step:s1", "r1", "first-answer")
        record = await store.get_request("step:s1", "r1")  # type: ignore[assignment]
    entry = ToolCallEntry("s1", 1, "r1", "search", finished_at=9_000.0)
    with pytest.raises(RequestExists) as caught:
        await store.commit(
            session=created.copy(turn=1), request=("step:s1", "r1", "second-answer"), tool_call=entry, new_request=True
        )
    assert caught.value.record == record
    assert caught.value.record.state == existing
    stored = await store.get_session("s1")
    assert stored == created  # version, turn and last_active_at all unchanged
    assert await store.list_tool_calls("s1") == []
    assert await store.get_request("step:s1", "r1") == record

    # Also without a session in the commit.
    with pytest.raises(RequestExists):
        await store.commit(request=("step:s1", "r1", "third"), tool_call=entry, new_request=True)
    assert await store.list_tool_calls("s1") == []
    assert await store.get_request("step:s1", "r1") == record


async def test_request_is_checked_before_the_session(store: SessionStore) -> None:
    """A stale session and an existing record: the caller learns about the record (its replay)."""
    created = await store.create_session(session("s1"))
    await store.update_session(created.copy(turn=7))
    await store.complete_request("step:s1", "r1", "answer")
    with pytest.raises(RequestExists):
        await store.commit(session=created.copy(turn=1), request=("step:s1", "r1", "x"), new_request=True)


async def test_new_request_losing_the_compare_and_set_writes_no_record(store: SessionStore) -> None:
    created = await store.create_session(session("s1"))
    await store.update_session(created.copy(turn=5))
    entry = ToolCallEntry("s1", 1, "r1", "search")
    with pytest.raises(ConflictError) as caught:
        await store.commit(
            session=created.copy(turn=1), request=("step:s1", "r1", "x"), tool_call=entry, new_request=True
        )
    assert not isinstance(caught.value, RequestExists)
    assert await store.get_request("step:s1", "r1") is None
    assert await store.list_tool_calls("s1") == []
    stored = await store.get_session("s1")
    assert stored is not None and stored.turn == 5 and stored.version == 2
    # The retry, on the fresh version, records it.
    assert await store.commit(session=stored.copy(turn=6), request=("step:s1", "r1", "x"), new_request=True)
    assert await store.get_request("step:s1", "r1") is not None


async def test_new_request_without_a_request_is_a_value_error(store: SessionStore) -> None:
    created = await store.create_session(session("s1"))
    with pytest.raises(ValueError, match="new_request"):
        await store.commit(session=created.copy(turn=1), new_request=True)
    stored = await store.get_session("s1")
    assert stored is not None and stored.version == 1


async def test_racing_new_requests_with_one_request_id_commit_once(
    store: SessionStore, open_another: StoreFactory
) -> None:
    """Ten copies of one Step (same request_id) over two store objects: one turn, one record."""
    other = await open_another()
    await store.create_session(session("s1"))

    async def step(s: SessionStore, i: int) -> str:
        while True:
            current = await s.get_session("s1")
            assert current is not None
            try:
                await s.commit(
                    session=current.copy(turn=current.turn + 1), request=("step:s1", "r", f"by {i}"), new_request=True
                )
                return "committed"
            except RequestExists as exc:
                return exc.record.result
            except ConflictError:
                await asyncio.sleep(0)

    outcomes = await asyncio.gather(*(step(store if i % 2 else other, i) for i in range(10)))
    assert outcomes.count("committed") == 1
    record = await store.get_request("step:s1", "r")
    assert record is not None and all(o in ("committed", record.result) for o in outcomes)
    final = await store.get_session("s1")
    assert final is not None and final.turn == 1 and final.version == 2


# -- authorize_call ----------------------------------------------------------------------------------------
async def test_authorize_unknown_and_revoked_tokens(store: SessionStore) -> None:
    assert await store.authorize_call("no-such-token", "r1", "gw") == (None, None, False)
    assert await store.authorize_call("", "r1", "gw") == (None, None, False)
    created = await store.create_session(session("s1"))
    await store.update_session(created.copy(status=SessionStatus.CLOSED, token_hash=""))  # revoked
    assert await store.authorize_call("tok-s1", "r1", "gw") == (None, None, False)
    assert await store.get_request(call_scope("s1"), "r1") is None


@pytest.mark.parametrize("status", [SessionStatus.PROVISIONING, SessionStatus.DONE])
async def test_authorize_a_session_that_is_not_active_claims_nothing(
    store: SessionStore, status: SessionStatus
) -> None:
    created = await store.create_session(session("s1", status=status))
    found, record, created_flag = await store.authorize_call("tok-s1", "r1", "gw")
    assert found == created and record is None and not created_flag
    assert await store.get_request(call_scope("s1"), "r1") is None


async def test_authorize_active_claims_once(store: SessionStore) -> None:
    created = await store.create_session(session("s1"))
    before = time.time()
    found, record, created_flag = await store.authorize_call("tok-s1", "r1", "gw-1")
    assert found == created and created_flag
    assert record is not None and record.state == RequestState.PENDING and record.owner == "gw-1"
    assert record.scope == call_scope("s1") and record.request_id == "r1" and record.created_at >= before
    assert await store.get_request(call_scope("s1"), "r1") == record  # what it returns is what it stored

    found, again, created_flag = await store.authorize_call("tok-s1", "r1", "gw-2")
    assert found == created and again == record and not created_flag

    # Interoperates with the separate calls: claim_request sees it, complete_request finishes it.
    assert await store.claim_request(call_scope("s1"), "r1", "gw-3") == (record, False)
    await store.complete_request(call_scope("s1"), "r1", "out")
    _, done, created_flag = await store.authorize_call("tok-s1", "r1", "gw-4")
    assert done is not None and done.state == RequestState.DONE and done.result == "out" and not created_flag
    assert await store.check_invariants() == []


async def test_authorize_without_a_request_id_claims_nothing(store: SessionStore) -> None:
    created = await store.create_session(session("s1"))
    assert await store.authorize_call("tok-s1", "", "gw") == (created, None, False)
    assert await store.get_request(call_scope("s1"), "") is None


async def test_authorize_uses_the_current_token(store: SessionStore) -> None:
    created = await store.create_session(session("s1"))
    rotated = await store.update_session(created.copy(token_hash="tok-s1-ep2", episode=2))
    assert await store.authorize_call("tok-s1", "r1", "gw") == (None, None, False)
    found, record, created_flag = await store.authorize_call("tok-s1-ep2", "r1", "gw")
    assert found == rotated and record is not None and created_flag


async def test_authorize_scope_matches_for_non_ascii_session_ids(store: SessionStore) -> None:
    """The claim's scope is keyed like claim_request's (Redis computes the key inside its script)."""
    await store.create_session(session("sé-ß🙂"))
    _, record, created_flag = await store.authorize_call("tok-sé-ß🙂", "r1", "gw")
    assert record is not None and created_flag
    assert await store.get_request(call_scope("sé-ß🙂"), "r1") == record
    assert await store.claim_request(call_scope("sé-ß🙂"), "r1", "other") == (record, False)


async def test_concurrent_authorize_has_one_winner(store: SessionStore, open_another: StoreFactory) -> None:
    stores = [store, await open_another(), await open_another()]
    await store.create_session(session("s1"))
    results = await asyncio.gather(*(stores[i % 3].authorize_call("tok-s1", "r1", f"gw-{i}") for i in range(20)))
    assert sum(created for _, _, created in results) == 1
    records = {r.owner for _, r, _ in results if r is not None}
    assert len(records) == 1 and all(s is not None and s.session_id == "s1" for s, _, _ in results)
    stored = await store.get_request(call_scope("s1"), "r1")
    assert stored is not None and stored.owner in records and stored.state == RequestState.PENDING


# -- Redis: a lost reply ------------------------------------------------------------------------------------
@pytest.mark.redis
async def test_redis_retries_of_fused_writes_apply_once(redis_server: RedisServer) -> None:
    """A retried script whose first run's reply was lost recognises its own work (a per-call nonce)."""
    async with store_losing_replies(redis_server) as (store, proxy):
        with_lost_reply = proxy.dropping_one_reply
        created = await store.create_session(session("s1"))
        updated = await with_lost_reply(
            lambda: store.commit(
                session=created.copy(turn=1),
                request=("step:s1", "r1", "resp"),
                tool_call=ToolCallEntry("s1", 1, "", "t"),
                new_request=True,
            )
        )
        assert updated is not None and updated.version == 2 and updated.turn == 1
        assert await store.count_tool_calls("s1", 1) == 1
        await with_lost_reply(
            lambda: store.commit(
                request=("call:s1", "r2", "out"), tool_call=ToolCallEntry("s1", 1, "", "t2"), new_request=True
            )
        )
        assert await store.count_tool_calls("s1", 1) == 2
        done = await store.get_request("call:s1", "r2")
        assert done is not None and done.state == RequestState.DONE and done.result == "out"

        found, record, created_flag = await with_lost_reply(lambda: store.authorize_call("tok-s1", "r3", "gw"))
        assert found is not None and found.version == 2 and record is not None and created_flag
        # Another call with the same request_id still sees the claim as taken.
        assert (await store.authorize_call("tok-s1", "r3", "gw-2"))[1:] == (record, False)
        assert await store.check_invariants() == []


# -- commit(held_by=...) ---------------------------------------------------------------------------------------
async def test_a_held_commit_completes_only_its_own_claim(store: SessionStore) -> None:
    await store.create_session(session("s1"))
    await store.claim_request("call:s1", "r1", "me")
    await store.commit(request=("call:s1", "r1", "mine"), tool_call=ToolCallEntry("s1", 1, "r1", "t"), held_by="me")
    done = await store.get_request("call:s1", "r1")
    assert done is not None and done.state == RequestState.DONE and done.result == "mine"
    # The same commit again (a retry whose reply was lost): DONE with this very result is its own.
    await store.commit(request=("call:s1", "r1", "mine"), tool_call=ToolCallEntry("s1", 1, "r1", "t"), held_by="me")
    assert await store.count_tool_calls("s1", 1) == 1
    done = await store.get_request("call:s1", "r1")

    # Taken over by another owner, or completed with another answer: nothing at all is written.
    await store.claim_request("call:s1", "r2", "other")
    with pytest.raises(RequestExists) as err:
        await store.commit(request=("call:s1", "r2", "mine"), tool_call=ToolCallEntry("s1", 1, "r2", "t"), held_by="me")
    assert (err.value.record.state, err.value.record.owner) == (RequestState.PENDING, "other")
    with pytest.raises(RequestExists) as err:
        await store.commit(request=("call:s1", "r1", "another"), held_by="me")
    assert err.value.record == done
    assert await store.get_request("call:s1", "r1") == done and await store.count_tool_calls("s1", 1) == 1
    pending = await store.get_request("call:s1", "r2")
    assert pending is not None and pending.owner == "other" and pending.state == RequestState.PENDING

    # A missing record is created DONE, as without held_by (a result is never dropped).
    await store.commit(request=("call:s1", "r3", "late"), held_by="me")
    late = await store.get_request("call:s1", "r3")
    assert late is not None and late.state == RequestState.DONE and late.result == "late"
    with pytest.raises(ValueError):
        await store.commit(held_by="me")
    with pytest.raises(ValueError):
        await store.commit(request=("call:s1", "r4", "x"), new_request=True, held_by="me")
    assert await store.check_invariants() == []


# -- a claim whose caller was cancelled -----------------------------------------------------------------------
class _StoreBusy:
    """Keeps the backend busy from another connection until the block exits, so a claim queued behind it starts
    only after its caller has given up: SQLite's write lock held by another connection, Redis's writes paused
    (CLIENT PAUSE WRITE holds every script until CLIENT UNPAUSE), the in-memory store paused."""

    def __init__(self, backend: Backend, store: SessionStore) -> None:
        self.backend, self.store = backend, store
        self._exit: contextlib.AsyncExitStack = contextlib.AsyncExitStack()

    async def __aenter__(self) -> None:
        if isinstance(self.store, FaultyMemoryStore):
            await self._exit.enter_async_context(self.store.paused())
        elif self.backend.redis is None:
            conn = sqlite_files.hold_write_lock(self.backend.url.removeprefix("sqlite:///"))
            self._exit.callback(conn.close)
            self._exit.callback(conn.execute, "ROLLBACK")
        else:
            client = redis.asyncio.Redis.from_url(self.backend.url)
            self._exit.push_async_callback(client.aclose)
            # Answered once the pause is in force; the cap only bounds a test that dies inside the block.
            assert await client.client_pause(30_000, all=False)
            self._exit.push_async_callback(client.client_unpause)

    async def __aexit__(self, *exc: object) -> None:
        await self._exit.aclose()


@pytest.mark.parametrize("op", ["claim_request", "authorize_call"])
async def test_a_claim_landing_after_its_caller_gave_up_is_released(
    store: SessionStore, backend: Backend, op: str
) -> None:
    await store.create_session(session("s1"))
    scope = "call:s1" if op == "authorize_call" else "step:s1"
    claim = (
        store.authorize_call("tok-s1", "r1", "me") if op == "authorize_call" else store.claim_request(scope, "r1", "me")
    )
    async with _StoreBusy(backend, store):
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(claim, 0.2)
    for _ in range(100):  # the claim lands now, then its release (bounded polling)
        if await store.get_request(scope, "r1") is None:
            break
        await asyncio.sleep(0.05)
    assert await store.get_request(scope, "r1") is None  # released: a retry runs instead of waiting
    record, created = await store.claim_request(scope, "r1", "me")
    assert created and record.state == RequestState.PENDING


async def test_a_takeover_landing_after_its_caller_gave_up_is_handed_back(
    store: SessionStore, backend: Backend
) -> None:
    await store.claim_request("step:s1", "r1", "dead")
    async with _StoreBusy(backend, store):
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(store.take_over_request("step:s1", "r1", "dead", "me"), 0.2)
    for _ in range(100):  # the takeover lands now, then its hand-back (bounded polling)
        record = await store.get_request("step:s1", "r1")
        if record is not None and record.owner == "dead":
            break
        await asyncio.sleep(0.05)
    record = await store.get_request("step:s1", "r1")
    assert record is not None and record.state == RequestState.PENDING and record.owner == "dead"
    _, taken = await store.take_over_request("step:s1", "r1", "dead", "next")  # the next repeat takes it over
    assert taken
