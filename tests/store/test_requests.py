"""`RequestRecords`: claims, DONE records, releases and takeovers, against every backend (see conftest.py).
`commit` and `authorize_call`, the records' fused writes, have suites of their own (test_commit.py,
test_fused.py)."""

from __future__ import annotations

import asyncio
import time

from rlgate.store import RequestState, Session, SessionStatus, SessionStore, call_scope
from tests.store.conftest import StoreFactory


async def test_claim_request_race_has_one_winner(store: SessionStore, open_another: StoreFactory) -> None:
    others = [store, await open_another(), await open_another()]
    results = await asyncio.gather(*(others[i % 3].claim_request("call:s1", "req-1", f"owner-{i}") for i in range(30)))
    winners = [record for record, created in results if created]
    assert len(winners) == 1
    winner = winners[0].owner
    # every loser sees the winner's PENDING record
    assert all(r.owner == winner and r.state == RequestState.PENDING for r, _ in results)
    got = await store.get_request("call:s1", "req-1")
    assert got is not None and got.owner == winner and got.result == "" and got.finished_at == 0


async def test_request_lifecycle(store: SessionStore) -> None:
    assert await store.get_request("reset", "r1") is None
    record, created = await store.claim_request("reset", "r1", "me")
    assert created and record.state == RequestState.PENDING and record.owner == "me"
    assert record.created_at > 0
    assert await store.get_request("reset", "r1") == record  # what the claim returns is what it stored

    await store.complete_request("reset", "r1", "payload-1")
    done = await store.get_request("reset", "r1")
    assert done is not None and done.state == RequestState.DONE and done.result == "payload-1"
    assert done.finished_at >= done.created_at
    again, created = await store.claim_request("reset", "r1", "someone-else")
    assert not created and again.state == RequestState.DONE and again.result == "payload-1"

    await store.release_request("reset", "r1")  # DONE records are never released
    assert await store.get_request("reset", "r1") is not None

    # a PENDING record whose work never started is released; the next claim wins again
    await store.claim_request("reset", "r2", "me")
    await store.release_request("reset", "r2")
    assert await store.get_request("reset", "r2") is None
    _, created = await store.claim_request("reset", "r2", "other")
    assert created

    # scopes are independent, including ones that look alike once joined
    _, created = await store.claim_request("step:a", "b:c", "x")
    assert created
    _, created = await store.claim_request("step:a:b", "c", "x")
    assert created


async def test_pending_requests_lists_a_scopes_unsettled_records(store: SessionStore) -> None:
    """PENDING records of one scope, claimed directly or by `authorize_call`, until completed or released;
    a takeover keeps its record PENDING. Other scopes, including look-alikes, are apart."""
    scope = call_scope("s1")

    async def pending() -> set[str]:
        return {r.request_id for r in await store.pending_requests(scope, 100)}

    assert await pending() == set()
    for rid in ("a", "b", "c"):
        await store.claim_request(scope, rid, "gw")
    await store.claim_request(call_scope("s1x"), "d", "gw")
    await store.claim_request("call:s", "1:e", "gw")
    listed = await store.pending_requests(scope, 100)
    assert {r.request_id for r in listed} == {"a", "b", "c"}
    assert all(r.scope == scope and r.state == RequestState.PENDING and r.owner == "gw" for r in listed)
    assert len(await store.pending_requests(scope, 2)) == 2  # bounded by the limit
    await store.complete_request(scope, "a", "done")
    await store.release_request(scope, "b")
    assert await pending() == {"c"}
    _, taken = await store.take_over_request(scope, "c", "gw", "gw-2")
    assert taken
    assert [r.owner for r in await store.pending_requests(scope, 100)] == ["gw-2"]
    await store.commit(request=(scope, "c", "{}"), held_by="gw-2")
    assert await pending() == set()
    # a CallTool's claim, made with its token lookup
    await store.create_session(Session(session_id="s1", env_key="e:v1", status=SessionStatus.ACTIVE, token_hash="h1"))
    session, _, created = await store.authorize_call("h1", "f", "gw")
    assert session is not None and created
    assert await pending() == {"f"}
    # a record created DONE by a commit was never pending
    await store.commit(request=(scope, "g", "{}"), new_request=True)
    assert await pending() == {"f"}


async def test_take_over_hands_a_dead_owners_record_to_exactly_one_repeat(
    store: SessionStore, open_another: StoreFactory
) -> None:
    await store.claim_request("call:s1", "r1", "dead")
    before = time.time()
    others = [store, await open_another(), await open_another()]
    results = await asyncio.gather(
        *(others[i % 3].take_over_request("call:s1", "r1", "dead", f"owner-{i}") for i in range(30))
    )
    (winner,) = [record for record, taken in results if taken]
    assert winner is not None and winner.state == RequestState.PENDING and winner.owner.startswith("owner-")
    assert winner.created_at >= before and winner.result == "" and winner.finished_at == 0
    # The record never went missing: every loser saw the winner's claim, as a claim would.
    assert all(record == winner for record, _ in results)
    assert await store.get_request("call:s1", "r1") == winner
    assert (await store.claim_request("call:s1", "r1", "late"))[1] is False

    assert await store.take_over_request("call:s1", "r1", "dead", "late") == (winner, False)  # not dead's now
    await store.complete_request("call:s1", "r1", "out")
    done = await store.get_request("call:s1", "r1")
    assert await store.take_over_request("call:s1", "r1", winner.owner, "late") == (done, False)  # DONE stays
    assert await store.take_over_request("call:s1", "none", "dead", "late") == (None, False)
