"""`CreateGate`, a process's admission to creates on a provider account, over real in-process stores (two gates
on one named memory store are two replicas): turns between clients, Resets before refills, the cap held across
replicas, bounded waits, throttles, and callers that give up."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator

import grpc
import pytest

from rlgate.core.errors import ResourceExhausted
from rlgate.orchestrator.creates import ADMISSION_TIMEOUT, QUEUE_FULL, CreateGate
from rlgate.runtime.deadline import Deadline
from rlgate.store import CreateLimits, MemoryStore
from rlgate.store.admission import BACKGROUND, URGENT

ACCOUNT = "fleet:test"


def limits(**overrides: float) -> CreateLimits:
    base: dict[str, float] = {
        "max_in_flight": 1,
        "max_rate": 1000.0,
        "min_rate": 1.0,
        "burst": 1000.0,
        "recover_per_s": 1000.0,
        "slot_ttl_s": 30.0,
        "wait_ttl_s": 1.5,
    }
    base.update(overrides)
    return CreateLimits(**base)  # type: ignore[arg-type]


@pytest.fixture
async def stores() -> AsyncIterator[tuple[MemoryStore, MemoryStore]]:
    name = uuid.uuid4().hex
    a, b = await MemoryStore.open(name), await MemoryStore.open(name)
    yield a, b
    await a.close()
    await b.close()


def gate(store: MemoryStore, lim: CreateLimits, *, max_wait_s: float = 10.0, max_queued: int = 100) -> CreateGate:
    return CreateGate(store, ACCOUNT, lim, max_wait_s=max_wait_s, max_queued=max_queued)


async def test_clients_take_turns(stores: tuple[MemoryStore, MemoryStore]) -> None:
    """Run A queues a burst of 20 creates; run B's 5, queued just after, are not served after all of A's."""
    g = gate(stores[0], limits())
    order: list[str] = []

    async def create(client: str) -> None:
        async with g.slot(client, URGENT, Deadline(30)):
            order.append(client)
            await asyncio.sleep(0.005)

    tasks = [asyncio.create_task(create("A")) for _ in range(20)]
    await asyncio.sleep(0.01)
    tasks += [asyncio.create_task(create("B")) for _ in range(5)]
    await asyncio.gather(*tasks)
    await g.close()
    last_b = max(i for i, c in enumerate(order) if c == "B")
    assert last_b < 14, order  # interleaved: B's five are done while A still has most of its burst to go


async def test_resets_go_before_refills(stores: tuple[MemoryStore, MemoryStore]) -> None:
    g = gate(stores[0], limits())
    order: list[str] = []
    held = asyncio.Event()
    release = asyncio.Event()

    async def hold() -> None:
        async with g.slot("pool", URGENT, Deadline(30)):
            held.set()
            await release.wait()

    async def create(client: str, priority: str) -> None:
        async with g.slot(client, priority, Deadline(30)):
            order.append(priority)

    holder = asyncio.create_task(hold())
    await held.wait()
    refills = [asyncio.create_task(create("pool", BACKGROUND)) for _ in range(5)]
    await asyncio.sleep(0.05)
    resets = [asyncio.create_task(create("run", URGENT)) for _ in range(5)]
    await asyncio.sleep(0.05)
    release.set()
    await asyncio.gather(holder, *refills, *resets)
    await g.close()
    assert order == [URGENT] * 5 + [BACKGROUND] * 5


async def test_replicas_share_the_cap(stores: tuple[MemoryStore, MemoryStore]) -> None:
    gates = [gate(stores[0], limits(max_in_flight=3)), gate(stores[1], limits(max_in_flight=3))]
    in_flight = peak = 0

    async def create(i: int) -> None:
        nonlocal in_flight, peak
        async with gates[i % 2].slot(f"run-{i % 3}", URGENT, Deadline(30)):
            in_flight += 1
            peak = max(peak, in_flight)
            await asyncio.sleep(0.01)
            in_flight -= 1

    await asyncio.gather(*(create(i) for i in range(40)))
    for g in gates:
        await g.close()
    assert peak == 3


async def test_the_wait_is_bounded_then_resource_exhausted_with_retry_info(
    stores: tuple[MemoryStore, MemoryStore],
) -> None:
    g = gate(stores[0], limits(), max_wait_s=0.3, max_queued=2)
    held = asyncio.Event()
    release = asyncio.Event()

    async def hold() -> None:
        async with g.slot("a", URGENT, Deadline(30)):
            held.set()
            await release.wait()

    holder = asyncio.create_task(hold())
    await held.wait()
    start = time.monotonic()
    with pytest.raises(ResourceExhausted) as err:
        async with g.slot("b", URGENT, Deadline(30)):
            pytest.fail("admitted past the cap")
    assert 0.25 <= time.monotonic() - start < 3.0
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and err.value.reason == ADMISSION_TIMEOUT
    assert err.value.retry_after_s is not None and err.value.retry_after_s > 0
    # The caller's own deadline bounds it too.
    start = time.monotonic()
    with pytest.raises(ResourceExhausted):
        async with g.slot("b", URGENT, Deadline(0.1)):
            pytest.fail("admitted past the cap")
    assert time.monotonic() - start < 0.25
    # A full queue refuses at once.
    waiters = [asyncio.create_task(g.slot("c", URGENT, Deadline(30)).__aenter__()) for _ in range(2)]
    await asyncio.sleep(0.05)
    with pytest.raises(ResourceExhausted) as err:
        async with g.slot("d", URGENT, Deadline(30)):
            pytest.fail("queued past the bound")
    assert err.value.reason == QUEUE_FULL
    for waiter in waiters:
        waiter.cancel()
    await asyncio.gather(*waiters, return_exceptions=True)
    release.set()
    await holder
    # Nobody holds a slot now: the cancelled waiters left nothing behind (their runs' places in the turn order
    # lapse on their own, after the waiting TTL).
    await asyncio.sleep(1.6)
    async with g.slot("e", URGENT, Deadline(5)):
        pass
    await g.close()


async def test_a_throttle_pauses_every_replica_and_cuts_the_rate(stores: tuple[MemoryStore, MemoryStore]) -> None:
    lim = limits(max_in_flight=10, max_rate=50.0, recover_per_s=0.0, burst=10.0)
    a, b = gate(stores[0], lim), gate(stores[1], lim)
    async with a.slot("r", URGENT, Deadline(5)):
        pass
    await a.throttled(0.5)  # the provider answered 429 with Retry-After
    assert a.rate == 25.0
    start = time.monotonic()
    async with b.slot("r", URGENT, Deadline(5)):  # the other replica waits the pause out too
        waited = time.monotonic() - start
    assert 0.4 <= waited < 3.0
    assert b.rate == 25.0
    await a.close()
    await b.close()
