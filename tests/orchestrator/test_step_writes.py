"""How a Step reaches the store, without a server: the common turn is one read (or none, from the session
this process last wrote) and one write that records the turn and its request together; anything unusual
takes the general path. Real SQLite; the orchestrator's parts wired as in production (`Orchestrator`)."""

from __future__ import annotations

import asyncio
import base64
import sqlite3
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from rlgate.orchestrator.config import OrchestratorConfig
from rlgate.orchestrator.episodes import EpisodeManager
from rlgate.orchestrator.service import Orchestrator, make_provider
from rlgate.runtime.deadline import Deadline
from rlgate.runtime.errors import FailedPrecondition
from rlgate.store import RequestState, Session, SessionStatus, SessionStore, open_store
from rlgate.v1 import orchestrator_pb2

SID = "s-step-writes"


class CountingStore:
    """Counts the store calls a Step makes (delegates everything)."""

    def __init__(self, inner: SessionStore) -> None:
        self.inner = inner
        self.calls: list[str] = []

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.inner, name)
        if not callable(attr):
            return attr

        async def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls.append(name)
            return await attr(*args, **kwargs)

        return counted


@pytest.fixture
async def parts(tmp_path: Path) -> AsyncIterator[tuple[EpisodeManager, CountingStore, SessionStore]]:
    store = await open_store(f"sqlite:///{tmp_path / 'store.db'}")
    counting = CountingStore(store)
    config = OrchestratorConfig(provider="mcp", mcp_envs="")
    orch = Orchestrator(config, counting, make_provider(config), owns_store=False)  # type: ignore[arg-type]
    await store.create_session(Session(session_id=SID, env_key="mailbox:v1", status=SessionStatus.ACTIVE,
                                       max_turns=5, endpoints=["http://127.0.0.1:1/mcp"], token_hash="ab" * 32))
    try:
        yield orch.episodes, counting, store
    finally:
        await store.close()


def step(request_id: str = "", **fields: Any) -> orchestrator_pb2.StepRequest:
    return orchestrator_pb2.StepRequest(session_id=SID, request_id=request_id or uuid.uuid4().hex,
                                        assistant_text="thinking", **fields)


def deadline() -> Deadline:
    return Deadline.from_grpc(None, 30.0)


async def test_a_turn_is_one_read_and_one_write_then_one_write(parts: Any) -> None:
    episodes, counting, store = parts
    first = await episodes.step(step("r1"), deadline())
    assert counting.calls == ["get_session", "commit"]
    counting.calls.clear()
    second = await episodes.step(step("r2"), deadline())
    assert counting.calls == ["commit"]  # from the session this process wrote last
    assert (first.turn, second.turn) == (1, 2)
    record = await store.get_request(f"step:{SID}", "r2")
    assert record is not None and record.state == RequestState.DONE
    assert orchestrator_pb2.StepResponse.FromString(base64.b64decode(record.result)) == second


async def test_a_repeat_replays_the_recorded_response(parts: Any) -> None:
    episodes, _, store = parts
    first = await episodes.step(step("same"), deadline())
    again = await episodes.step(step("same"), deadline())
    assert again == first and again.turn == 1
    assert (await store.get_session(SID)).turn == 1  # counted once


async def test_a_write_by_someone_else_is_seen_not_overwritten(parts: Any) -> None:
    episodes, counting, store = parts
    await episodes.step(step(), deadline())
    other = await store.get_session(SID)  # another replica takes a turn meanwhile
    other.turn += 1
    await store.update_session(other)
    counting.calls.clear()
    reply = await episodes.step(step(), deadline())
    assert reply.turn == 3
    assert counting.calls == ["commit", "get_session", "commit"]  # the stale copy lost; read, write again
    assert (await store.get_session(SID)).turn == 3


async def test_the_ending_turn_and_a_done_episode_take_the_general_path(parts: Any) -> None:
    episodes, counting, store = parts
    for _ in range(4):
        await episodes.step(step(), deadline())
    counting.calls.clear()
    last = await episodes.step(step("end"), deadline())  # turn 5 of max 5: the episode ends, then is scored
    assert last.done and last.truncated and "claim_request" in counting.calls
    with pytest.raises(FailedPrecondition):
        await episodes.step(step(), deadline())
    assert (await episodes.step(step("end"), deadline())) == last  # a repeat of the ending turn replays it
    assert (await store.get_session(SID)).turn == 5


async def test_a_claim_whose_caller_was_cancelled_is_released(parts: Any, tmp_path: Path) -> None:
    # A store write that has started is not undone by cancelling its caller: a claim that lands after the
    # caller gave up must not stay PENDING under this live process (every retry would wait on it).
    episodes, _, store = parts
    other = sqlite3.connect(tmp_path / "store.db", isolation_level=None)
    other.execute("BEGIN IMMEDIATE")  # another process holds the write lock for a moment
    try:
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(episodes.idempotency.run(
                f"step:{SID}", "held", deadline(), orchestrator_pb2.StepResponse,
                lambda prior: episodes._step(step("held"), prior)), 0.3)
    finally:
        other.execute("ROLLBACK")
        other.close()
    for _ in range(100):  # the claim commits once the lock is gone, then is released
        await asyncio.sleep(0.05)
        if await store.get_request(f"step:{SID}", "held") is None:
            break
    assert await store.get_request(f"step:{SID}", "held") is None
    reply = await episodes.step(step("held", done=True), deadline())  # a retry runs at once
    assert reply.turn == 1
