"""`SessionStore.commit`: the writes of one Step or CallTool in one atomic step, against both backends."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from rlgate.store import (
    ConflictError,
    RequestExists,
    RequestState,
    Session,
    SessionStatus,
    SessionStore,
    ToolCallEntry,
    Writes,
    add_infra_fault,
)
from tests.store.conftest import StoreFactory


def active(sid: str, **fields: Any) -> Session:
    fields.setdefault("token_hash", f"tok-{sid}")
    return Session(session_id=sid, env_key="mail:v1", status=SessionStatus.ACTIVE, **fields)


async def test_step_commit_updates_and_completes(store: SessionStore) -> None:
    created = await store.create_session(active("s1", last_active_at=100.0))
    await store.claim_request("step:s1", "r1", "me")
    created.turn = 1
    before = time.time()
    updated = await store.commit(session=created, request=("step:s1", "r1", "response-1"))
    assert updated is not None
    assert updated.version == 2 and updated.turn == 1 and updated.updated_at >= before
    assert await store.get_session("s1") == updated
    record = await store.get_request("step:s1", "r1")
    assert record is not None and record.state == RequestState.DONE and record.result == "response-1"
    assert record.owner == "me" and record.finished_at >= before
    assert await store.check_invariants() == []


async def test_lost_compare_and_set_writes_nothing(store: SessionStore) -> None:
    created = await store.create_session(active("s1", last_active_at=100.0))
    await store.update_session(created.copy(turn=5))  # someone else moved the session on
    await store.claim_request("call:s1", "r1", "me")
    entry = ToolCallEntry("s1", 1, "r1", "search", finished_at=9_000.0)
    with pytest.raises(ConflictError):
        await store.commit(session=created.copy(turn=1), request=("call:s1", "r1", "result"), tool_call=entry)
    record = await store.get_request("call:s1", "r1")
    assert record is not None and record.state == RequestState.PENDING and record.result == ""
    assert await store.list_tool_calls("s1") == []
    stored = await store.get_session("s1")
    assert stored is not None and stored.turn == 5 and stored.version == 2
    assert stored.last_active_at == 100.0  # the touch rode with the failed commit: not applied

    with pytest.raises(ConflictError):  # a missing session is a conflict too, as for update_session
        await store.commit(session=active("ghost", version=1), request=("step:ghost", "r", "x"))
    assert await store.get_request("step:ghost", "r") is None


async def test_commit_keeps_the_token_index_rules(store: SessionStore) -> None:
    await store.create_session(active("s1"))
    s2 = await store.create_session(active("s2"))
    with pytest.raises(ConflictError):
        await store.commit(session=s2.copy(token_hash="tok-s1"), request=("step:s2", "r", "x"))
    assert await store.get_request("step:s2", "r") is None
    rotated = await store.commit(session=s2.copy(token_hash="tok-new", episode=2))
    assert rotated is not None and rotated.version == 2
    assert await store.session_by_token("tok-s2") is None
    found = await store.session_by_token("tok-new")
    assert found is not None and found.session_id == "s2" and found.episode == 2
    assert await store.check_invariants() == []


async def test_call_commit_logs_touches_and_completes(store: SessionStore) -> None:
    await store.create_session(active("s1", last_active_at=100.0))
    entry = ToolCallEntry("s1", 1, "r1", "search", arguments={"q": "x"}, finished_at=5_000.0)
    assert await store.commit(request=("call:s1", "r1", "result-1"), tool_call=entry) is None
    logged = await store.list_tool_calls("s1", 1)
    assert logged == [entry]
    record = await store.get_request("call:s1", "r1")
    assert record is not None and record.state == RequestState.DONE and record.result == "result-1"
    stored = await store.get_session("s1")
    assert stored is not None and stored.last_active_at == 5_000.0 and stored.version == 1

    # A repeat of the same request_id is logged once; activity never moves backwards.
    again = ToolCallEntry("s1", 1, "r1", "search", arguments={"q": "x"}, finished_at=4_000.0)
    await store.commit(request=("call:s1", "r1", "result-1"), tool_call=again)
    assert await store.count_tool_calls("s1", 1) == 1
    stored = await store.get_session("s1")
    assert stored is not None and stored.last_active_at == 5_000.0

    # Without a request record (no request_id): the log only.
    await store.commit(tool_call=ToolCallEntry("s1", 1, "", "send", finished_at=6_000.0))
    assert [e.tool for e in await store.list_tool_calls("s1")] == ["search", "send"]
    stored = await store.get_session("s1")
    assert stored is not None and stored.last_active_at == 6_000.0
    assert await store.check_invariants() == []


async def test_commit_of_nothing_is_a_no_op(store: SessionStore) -> None:
    assert await store.commit() is None
    assert await store.check_invariants() == []


async def test_commit_request_without_a_claim_is_recorded(store: SessionStore) -> None:
    """Like complete_request, commit never drops a result whose PENDING record is gone."""
    await store.commit(request=("reset", "lost", "payload"))
    record = await store.get_request("reset", "lost")
    assert record is not None and record.state == RequestState.DONE and record.result == "payload"


# -- new_session: a session registered with its request's record ---------------------------------------
async def test_a_new_session_is_created_with_its_new_record_in_one_write(store: SessionStore) -> None:
    before = time.time()
    created = await store.commit(
        session=active("s1", last_active_at=100.0), request=("reset", "r1", "answer"), new_session=True
    )
    assert created is not None and created.version == 1 and created.last_active_at == 100.0
    assert await store.get_session("s1") == created
    found = await store.session_by_token("tok-s1")
    assert found is not None and found.session_id == "s1"
    record = await store.get_request("reset", "r1")
    assert record is not None and record.state == RequestState.DONE and record.result == "answer"
    assert record.owner == "" and record.created_at >= before
    assert await store.check_invariants() == []


async def test_a_new_session_under_a_held_record_completes_it(store: SessionStore) -> None:
    await store.claim_request("reset", "r1", "me")
    created = await store.commit(
        session=active("s1"), request=("reset", "r1", "answer"), held_by="me", new_session=True
    )
    assert created is not None and created.version == 1
    record = await store.get_request("reset", "r1")
    assert record is not None and record.state == RequestState.DONE and record.result == "answer"

    await store.claim_request("reset", "r2", "someone else")  # not this attempt's record: nothing written
    with pytest.raises(RequestExists):
        await store.commit(session=active("s2"), request=("reset", "r2", "x"), held_by="me", new_session=True)
    assert await store.get_session("s2") is None
    assert await store.check_invariants() == []


async def test_a_new_session_whose_record_or_id_exists_writes_nothing(store: SessionStore) -> None:
    await store.commit(request=("reset", "r1", "first answer"), new_request=True)
    with pytest.raises(RequestExists) as exists:  # the record is checked first: the session is not written
        await store.commit(session=active("s1"), request=("reset", "r1", "x"), new_request=True, new_session=True)
    assert exists.value.record.result == "first answer"
    assert await store.get_session("s1") is None

    await store.create_session(active("s2"))
    with pytest.raises(ConflictError) as conflict:  # the id exists: the record is not written
        await store.commit(session=active("s2"), request=("reset", "r2", "x"), new_request=True, new_session=True)
    assert not isinstance(conflict.value, RequestExists)
    assert await store.get_request("reset", "r2") is None

    with pytest.raises(ConflictError):  # another session's token: nothing written
        await store.commit(
            session=active("s3", token_hash="tok-s2"), request=("reset", "r3", "x"), new_request=True, new_session=True
        )
    assert await store.get_session("s3") is None and await store.get_request("reset", "r3") is None
    assert await store.check_invariants() == []


async def test_new_session_needs_a_session(store: SessionStore) -> None:
    with pytest.raises(ValueError, match="needs a session"):
        await store.commit(request=("reset", "r1", "x"), new_session=True)


async def test_racing_steps_record_exactly_the_winners(store: SessionStore, open_another: StoreFactory) -> None:
    """20 Steps over two store objects, each a CAS retry loop around commit(session, request): the turn
    count is exact and every request is recorded once, by the attempt that won."""
    other = await open_another()
    await store.create_session(active("s1"))
    conflicts = 0

    async def step(s: SessionStore, i: int) -> None:
        nonlocal conflicts
        while True:
            current = await s.get_session("s1")
            assert current is not None
            current.turn += 1
            try:
                await s.commit(session=current, request=("step:s1", f"r{i}", f"turn {current.turn}"))
                return
            except ConflictError:
                conflicts += 1
                await asyncio.sleep(0)

    await asyncio.gather(*(step(store if i % 2 else other, i) for i in range(20)))
    final = await store.get_session("s1")
    assert final is not None and final.turn == 20 and final.version == 21
    results = set()
    for i in range(20):
        record = await store.get_request("step:s1", f"r{i}")
        assert record is not None and record.state == RequestState.DONE
        results.add(record.result)
    assert results == {f"turn {n}" for n in range(1, 21)}  # each turn was recorded by exactly one step
    assert conflicts > 0


# -- change_session: read, change and commit as one step --------------------------------------------------
async def test_change_session_writes_what_change_returns(store: SessionStore) -> None:
    await store.create_session(active("s1"))

    def one_turn(s: Session) -> Writes:
        s.turn += 1
        return Writes(request=("step:-", "r1", "response-1"), new_request=True)

    written, changed = await store.change_session("s1", one_turn)
    assert changed and written is not None and (written.turn, written.version) == (1, 2)
    assert await store.get_session("s1") == written
    record = await store.get_request("step:-", "r1")
    assert record is not None and record.state == RequestState.DONE and record.result == "response-1"

    # The request_id exists: RequestExists carrying it, and the turn is not written.
    with pytest.raises(RequestExists) as exists:
        await store.change_session("s1", one_turn)
    assert exists.value.record.result == "response-1"
    assert (await store.get_session("s1")) == written
    assert await store.check_invariants() == []


async def test_change_session_writes_nothing_when_change_declines_or_raises(store: SessionStore) -> None:
    created = await store.create_session(active("s1"))

    def declines(s: Session) -> None:
        s.turn = 99  # edited, not written
        return None

    seen, changed = await store.change_session("s1", declines)
    assert not changed and seen is not None and seen.turn == 99 and seen.version == 1

    def refuses(s: Session) -> Writes:
        s.turn = 99
        raise ValueError("no")

    with pytest.raises(ValueError, match="no"):
        await store.change_session("s1", refuses)
    assert await store.get_session("s1") == created
    assert await store.change_session("ghost", refuses) == (None, False)  # change never sees a missing one


async def test_concurrent_changes_lose_no_update(store: SessionStore) -> None:
    """Each change sees the other writers' turns: none is lost (one transaction on SQLite; read, change and
    compare-and-set, again from a fresh read when another writer got there first, elsewhere)."""
    await store.create_session(active("s1"))

    def one_turn(s: Session) -> Writes:
        s.turn += 1
        return Writes()

    await asyncio.gather(*(store.change_session("s1", one_turn) for _ in range(20)))
    stored = await store.get_session("s1")
    assert stored is not None and stored.turn == 20 and stored.version == 21


def test_writes_refuses_combinations_that_are_not_one() -> None:
    with pytest.raises(ValueError):
        Writes(new_request=True)
    with pytest.raises(ValueError):
        Writes(request=("s", "r", "x"), new_request=True, held_by="me")


async def test_an_infrastructure_fault_is_counted_with_its_log_entry_in_one_write(store: SessionStore) -> None:
    """The gateway's write of a call that met a fault: the entry (with its kind), the record DONE and the
    session's count, in one `change_session`; every backend keeps the count and the entry's kind."""
    await store.create_session(active("s1"))
    await store.claim_request("call:s1", "r1", "me")
    entry = ToolCallEntry(session_id="s1", episode=1, request_id="r1", tool="peek", infra_fault="tool_reruns")

    def counted(s: Session) -> Writes:
        add_infra_fault(s, "tool_reruns")
        return Writes(("call:s1", "r1", "response-1"), entry, held_by="me")

    written, changed = await store.change_session("s1", counted)
    assert changed and written is not None and written.infra_faults == {"tool_reruns": 1}
    stored = await store.get_session("s1")
    assert stored is not None and stored.infra_faults == {"tool_reruns": 1}
    assert [e.infra_fault for e in await store.list_tool_calls("s1")] == ["tool_reruns"]
    record = await store.get_request("call:s1", "r1")
    assert record is not None and record.result == "response-1"
    with pytest.raises(ValueError, match="unknown infrastructure fault"):
        add_infra_fault(stored, "cosmic_rays")
