"""Request records, owner heartbeats, provisioning intents and leases, against every backend. Expiry is waited
for by polling (bounded), never by a fixed sleep."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from rlgate.store import Intent, IntentState, RequestState, SessionStore
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


async def test_owner_heartbeat_expires(store: SessionStore) -> None:
    assert not await store.owner_alive("orch-1")
    await store.heartbeat_owner("orch-1", 30)
    assert await store.owner_alive("orch-1")
    assert not await store.owner_alive("orch-2")
    await store.heartbeat_owner("orch-1", 0.3)  # the owner stops beating (SIGKILL): it lapses on its own
    assert await until(lambda: not_(store.owner_alive("orch-1")))
    await store.heartbeat_owner("orch-1", 30)
    assert await store.owner_alive("orch-1")


async def test_intents(store: SessionStore) -> None:
    t = 1_700_000_000.0
    await store.put_intent(Intent("i2", "run-1", "mail:v1", created_at=t + 1))
    await store.put_intent(Intent("i1", "run-1", "mail:v1", created_at=t))
    await store.put_intent(Intent("i3", "run-2", "gh:v2", created_at=t + 2))
    assert [i.intent_id for i in await store.list_intents()] == ["i1", "i2", "i3"]
    assert [i.intent_id for i in await store.list_intents("run-1")] == ["i1", "i2"]
    assert await store.list_intents("run-none") == []

    await store.put_intent(
        Intent(
            "i1",
            "run-1",
            "mail:v1",
            state=IntentState.BOUND,
            instance_id="inst-9",
            session_id="s1",
            created_at=t,
            updated_at=t + 5,
        )
    )
    got = await store.get_intent("i1")
    assert got is not None and got.state == IntentState.BOUND and got.instance_id == "inst-9"
    assert got.updated_at == t + 5
    await store.delete_intent("i1")
    await store.delete_intent("i1")
    assert await store.get_intent("i1") is None
    assert [i.intent_id for i in await store.list_intents("run-1")] == ["i2"]


async def test_lease_is_exclusive_expires_and_releases(store: SessionStore, open_another: StoreFactory) -> None:
    other = await open_another()
    a, b = await asyncio.gather(store.acquire_lease("reaper", "A", 30), other.acquire_lease("reaper", "B", 30))
    assert a != b  # exactly one contender holds it
    holder, loser = ("A", "B") if a else ("B", "A")
    holder_store, loser_store = (store, other) if a else (other, store)

    assert await holder_store.acquire_lease("reaper", holder, 30)  # renewal by the holder
    assert not await loser_store.acquire_lease("reaper", loser, 30)
    await loser_store.release_lease("reaper", loser)  # not the holder: nothing happens
    assert not await loser_store.acquire_lease("reaper", loser, 30)

    assert await holder_store.acquire_lease("reaper", holder, 0.3)  # last renewal, then the holder dies
    assert await until(lambda: loser_store.acquire_lease("reaper", loser, 30))  # expired: the other takes over
    assert not await holder_store.acquire_lease("reaper", holder, 30)

    await loser_store.release_lease("reaper", loser)
    assert await holder_store.acquire_lease("reaper", holder, 30)
    assert await store.acquire_lease("other-lease", "B", 30)  # leases are independent


async def test_lease_renewal_extends_it(store: SessionStore) -> None:
    first_expiry = time.time() + 0.3
    assert await store.acquire_lease("l", "A", 0.3)
    assert await store.acquire_lease("l", "A", 30)
    await until_clock_passes(first_expiry)  # past the first TTL: the renewal keeps it
    assert not await store.acquire_lease("l", "B", 30)
    assert await store.acquire_lease("l", "A", 30)


async def not_(check: Awaitable[bool]) -> bool:
    return not await check


async def until(check: Callable[[], Awaitable[bool]], limit_s: float = 10.0) -> bool:
    """Polls `check` until it is true (True) or `limit_s` passes (False)."""
    give_up = time.monotonic() + limit_s
    while not await check():
        if time.monotonic() > give_up:
            return False
        await asyncio.sleep(0.05)
    return True


async def until_clock_passes(instant: float) -> None:
    """Until the wall clock the stores judge expiry by (time.time()) is past `instant`: the TTL under test is
    itself the time to wait."""
    await asyncio.sleep(max(0.0, instant - time.time()) + 0.01)
    assert time.time() > instant
