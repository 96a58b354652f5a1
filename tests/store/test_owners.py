"""`Owners` (process heartbeats) and `Leases`, against every backend (see conftest.py). Expiry is waited for by
polling (bounded), never by a fixed sleep."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from rlgate.store import SessionStore
from tests.store.conftest import StoreFactory


async def test_owner_heartbeat_expires(store: SessionStore) -> None:
    assert not await store.owner_alive("orch-1")
    await store.heartbeat_owner("orch-1", 30)
    assert await store.owner_alive("orch-1")
    assert not await store.owner_alive("orch-2")
    await store.heartbeat_owner("orch-1", 0.3)  # the owner stops beating (SIGKILL): it lapses on its own
    assert await until(lambda: not_(store.owner_alive("orch-1")))
    await store.heartbeat_owner("orch-1", 30)
    assert await store.owner_alive("orch-1")


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
