"""`Admission`: max_sessions held under a burst, with the store's open-session count read once per burst (the
reads shared), not once per Reset in turn. A real in-memory store; sessions registered as a Reset would."""

from __future__ import annotations

import asyncio
import random
import uuid
from typing import Any

import pytest

from rlgate.core.errors import ResourceExhausted
from rlgate.orchestrator.admission import Admission
from rlgate.orchestrator.config import OrchestratorConfig
from rlgate.store import Session, SessionStatus
from rlgate.store.memory import MemoryStore


class CountingStore(MemoryStore):
    """Counts the open-session reads, each answering a little while after it counted (a store round trip)."""

    reads = 0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.counted = asyncio.Event()  # set once a read has counted

    async def count_open_sessions(self) -> int:
        self.reads += 1
        count = await super().count_open_sessions()
        self.counted.set()
        await asyncio.sleep(0.002)  # the answer comes back later: what it says may be out of date by then
        return count


async def register(store: MemoryStore) -> str:
    session_id = f"s-{uuid.uuid4().hex[:12]}"
    await store.create_session(Session(session_id=session_id, env_key="e:v1", status=SessionStatus.ACTIVE))
    return session_id


async def test_a_burst_shares_its_reads_and_is_admitted_up_to_the_limit() -> None:
    store = await CountingStore.open("")
    admission = Admission(OrchestratorConfig(max_sessions=150), store)
    admitted: list[str] = []

    async def reset() -> bool:
        try:
            async with admission.new_session():
                await asyncio.sleep(0.01)  # the create
                admitted.append(await register(store))
            return True
        except ResourceExhausted as exc:
            assert exc.reason == "MAX_SESSIONS"
            return False

    results = await asyncio.gather(*(reset() for _ in range(200)))
    assert results.count(True) == 150 == len(admitted) == await store.count_open_sessions()
    assert store.reads < 20  # one Reset after another would read 200 times, each waiting for the one before
    await store.close()


async def test_the_limit_holds_while_creations_finish_and_sessions_close() -> None:
    """Resets arriving while others finish and close: never more open or being created than the limit, and a
    place freed by a close is given to a later Reset (a refusal is made on a read begun after it came)."""
    limit = 8
    store = await CountingStore.open("")
    admission = Admission(OrchestratorConfig(max_sessions=limit), store)
    rng = random.Random(7)
    live = peak = refused = 0  # admitted and not yet closed: reserved, then open

    async def episode() -> None:
        nonlocal live, peak, refused
        try:
            async with admission.new_session():
                live += 1
                peak = max(peak, live)
                await asyncio.sleep(rng.uniform(0, 0.004))  # the create
                session_id = await register(store)
        except ResourceExhausted:
            refused += 1
            return
        await asyncio.sleep(rng.uniform(0, 0.006))
        live -= 1  # before the close lands, so a place the store shows free is never still counted here
        await store.delete_session(session_id)

    async def arrivals() -> None:
        tasks = []
        for _ in range(300):
            tasks.append(asyncio.ensure_future(episode()))
            await asyncio.sleep(rng.uniform(0, 0.0005))
        await asyncio.gather(*tasks)

    await arrivals()
    assert peak <= limit
    assert refused < 300  # and most got in, as places freed
    # Once every session is closed, the next Reset is admitted: no stale count refuses it.
    async with admission.new_session():
        pass
    assert await store.count_open_sessions() == 0
    await store.close()


async def test_a_refusal_rereads_after_a_close() -> None:
    """A read in flight that still counts a session closed since is not what refuses a Reset."""
    store = await CountingStore.open("")
    admission = Admission(OrchestratorConfig(max_sessions=1), store)
    session_id = await register(store)
    first = asyncio.ensure_future(admission.new_session().__aenter__())
    await store.counted.wait()  # its read counted the open session; the answer is on its way
    await store.delete_session(session_id)
    second = admission.new_session()
    with pytest.raises(ResourceExhausted):
        await first
    await second.__aenter__()  # it joined the read that saw the session, then read again
    await second.__aexit__(None, None, None)
    await store.close()
