"""`CreateAdmission` (admission control for instance creation), against every backend (see conftest.py): the cap
on creates in flight, the token bucket, turns between runs, urgent before background, AIMD on a throttle, and
slots that lapse when their holder dies. Expiry and refills are waited for by polling (bounded)."""

from __future__ import annotations

import asyncio
import time

from rlgate.store import CreateLimits, SessionStore
from rlgate.store.admission import BACKGROUND, URGENT
from tests.store.conftest import StoreFactory

ACCOUNT = "fleet:team-a"


def limits(**overrides: float) -> CreateLimits:
    base: dict[str, float] = {
        "max_in_flight": 3,
        "max_rate": 1000.0,
        "min_rate": 0.5,
        "burst": 1000.0,
        "recover_per_s": 1.0,
        "slot_ttl_s": 30.0,
        "wait_ttl_s": 5.0,
    }
    base.update(overrides)
    return CreateLimits(**base)  # type: ignore[arg-type]


async def test_cap_on_creates_in_flight_and_release(store: SessionStore) -> None:
    lim = limits()
    grants = [await store.admit_create(ACCOUNT, f"s{i}", "run-a", URGENT, lim) for i in range(4)]
    assert [g.admitted for g in grants] == [True, True, True, False]
    assert grants[2].in_flight == 3
    assert grants[3].reason == "in_flight" and 0 < grants[3].wait_s <= 0.1
    await store.release_create(ACCOUNT, "s0")
    await store.release_create(ACCOUNT, "s0")  # twice: a no-op
    assert (await store.admit_create(ACCOUNT, "s3", "run-a", URGENT, lim)).admitted
    # Another account is independent.
    assert (await store.admit_create("fleet:team-b", "s9", "run-a", URGENT, lim)).admitted


async def test_asking_again_for_a_granted_slot_takes_nothing_more(store: SessionStore) -> None:
    lim = limits(max_in_flight=2, burst=2, max_rate=0.5)
    assert (await store.admit_create(ACCOUNT, "s0", "r", URGENT, lim)).admitted
    again = await store.admit_create(ACCOUNT, "s0", "r", URGENT, lim)  # a retried call whose reply was lost
    assert again.admitted and again.in_flight == 1
    assert (await store.admit_create(ACCOUNT, "s1", "r", URGENT, lim)).admitted  # the second token is still there


async def test_token_bucket_limits_the_rate(store: SessionStore) -> None:
    lim = limits(max_in_flight=100, max_rate=5.0, burst=2.0, min_rate=0.1)
    assert (await store.admit_create(ACCOUNT, "a", "r", URGENT, lim)).admitted
    assert (await store.admit_create(ACCOUNT, "b", "r", URGENT, lim)).admitted
    refused = await store.admit_create(ACCOUNT, "c", "r", URGENT, lim)
    assert not refused.admitted and refused.reason == "rate"
    assert 0 < refused.wait_s <= 1 / 5.0 + 0.01 and refused.rate == 5.0
    await asyncio.sleep(refused.wait_s + 0.02)
    assert (await store.admit_create(ACCOUNT, "c", "r", URGENT, lim)).admitted


async def test_runs_take_turns(store: SessionStore, open_another: StoreFactory) -> None:
    """Run A has waited longest: a newcomer B waits its turn, then A goes to the back and B goes next, even
    through another store object (another replica)."""
    other = await open_another()
    lim = limits(max_in_flight=1)
    assert (await store.admit_create(ACCOUNT, "a0", "A", URGENT, lim)).admitted
    assert (await store.admit_create(ACCOUNT, "a1", "A", URGENT, lim)).reason == "in_flight"  # A waits since now
    assert (await other.admit_create(ACCOUNT, "b0", "B", URGENT, lim)).reason == "in_flight"  # B waits after A
    await store.release_create(ACCOUNT, "a0")
    assert (await other.admit_create(ACCOUNT, "b0", "B", URGENT, lim)).reason == "turn"  # A's turn first
    assert (await store.admit_create(ACCOUNT, "a1", "A", URGENT, lim)).admitted
    await store.release_create(ACCOUNT, "a1")
    assert (await store.admit_create(ACCOUNT, "a2", "A", URGENT, lim)).reason == "turn"  # now B's
    assert (await other.admit_create(ACCOUNT, "b0", "B", URGENT, lim)).admitted


async def test_background_waits_while_urgent_requests_wait(store: SessionStore) -> None:
    lim = limits(max_in_flight=1, wait_ttl_s=0.5)
    assert (await store.admit_create(ACCOUNT, "u0", "A", URGENT, lim)).admitted
    assert (await store.admit_create(ACCOUNT, "u1", "A", URGENT, lim)).reason == "in_flight"
    await store.release_create(ACCOUNT, "u0")
    refill = await store.admit_create(ACCOUNT, "p0", "pool", BACKGROUND, lim)
    assert not refill.admitted and refill.reason == "priority"
    assert (await store.admit_create(ACCOUNT, "u1", "A", URGENT, lim)).admitted
    await store.release_create(ACCOUNT, "u1")
    await asyncio.sleep(0.6)  # no urgent request refused for wait_ttl_s: background goes
    assert (await store.admit_create(ACCOUNT, "p0", "pool", BACKGROUND, lim)).admitted


async def test_throttle_pauses_cuts_the_rate_once_and_it_climbs_back(store: SessionStore) -> None:
    lim = limits(max_rate=10.0, min_rate=1.0, recover_per_s=20.0, cut_window_s=5.0)
    assert (await store.admit_create(ACCOUNT, "s0", "r", URGENT, lim)).admitted
    started = time.time()
    assert await store.throttle_creates(ACCOUNT, 0.3, lim) == 5.0
    assert await store.throttle_creates(ACCOUNT, 0.3, lim) == 5.0  # the same burst seen twice: one cut
    paused = await store.admit_create(ACCOUNT, "s1", "r", URGENT, lim)
    assert not paused.admitted and paused.reason == "paused"
    assert 0 < paused.wait_s <= 0.31 and paused.rate == 5.0
    await asyncio.sleep(max(0.0, started + 0.35 - time.time()))
    waited = await store.admit_create(ACCOUNT, "s1", "r", URGENT, lim)  # no tokens saved up across the pause
    assert waited.admitted or waited.reason == "rate"
    await asyncio.sleep(0.4)  # recovers at 20/s per second: back to the max
    grant = await store.admit_create(ACCOUNT, "s2", "r", URGENT, lim)
    assert grant.admitted and grant.rate == 10.0
    assert await store.throttle_creates(ACCOUNT, 0.0, limits(min_rate=4.0, max_rate=10.0)) >= 4.0


async def test_slot_of_a_dead_holder_lapses(store: SessionStore) -> None:
    lim = limits(max_in_flight=1, slot_ttl_s=0.3)
    assert (await store.admit_create(ACCOUNT, "s0", "r", URGENT, lim)).admitted  # its holder is SIGKILLed
    assert (await store.admit_create(ACCOUNT, "s1", "r", URGENT, lim)).reason == "in_flight"
    await asyncio.sleep(0.35)
    assert (await store.admit_create(ACCOUNT, "s1", "r", URGENT, lim)).admitted


async def test_racing_admissions_never_exceed_the_cap(store: SessionStore, open_another: StoreFactory) -> None:
    other = await open_another()
    lim = limits(max_in_flight=5)
    grants = await asyncio.gather(
        *((store if i % 2 else other).admit_create(ACCOUNT, f"s{i}", f"run-{i % 3}", URGENT, lim) for i in range(40))
    )
    assert sum(g.admitted for g in grants) == 5
