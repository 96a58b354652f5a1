"""Every way a Step can end, on the orchestrator's logic alone: `Episodes` over the in-memory store and a
fake provider (tests/fakes), no gRPC server, no Fleet. A turn is counted once whatever is retried; an ending
turn is scored once; a verifier that fails or hangs is never a reward; an ending whose process died is
finished by the retry."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pytest

from rlgate.core.errors import DeadlineExceeded, FailedPrecondition
from rlgate.ledger import scope
from rlgate.orchestrator.episodes import Episodes
from rlgate.orchestrator.providers.base import Retryable, VerifierRun
from rlgate.orchestrator.resets import ResetParams
from rlgate.runtime.deadline import Deadline
from rlgate.store import RequestState, StoreError
from rlgate.v1 import common_pb2, orchestrator_pb2
from tests.fakes import HANG, FakeProvider, make_episodes
from tests.fakes.episodes import task
from tests.fakes.store import FaultyMemoryStore, store_calls

OWNER = "orch-1"
STEPS = scope("step", "")
Done = orchestrator_pb2.DoneReason
Verified = common_pb2.VerificationStatus


@dataclass
class Episode:
    episodes: Episodes
    store: FaultyMemoryStore
    provider: FakeProvider
    session_id: str

    async def step(
        self, request_id: str = "", *, deadline_s: float = 10.0, **fields: Any
    ) -> orchestrator_pb2.StepResponse:
        request = orchestrator_pb2.StepRequest(
            session_id=self.session_id, request_id=request_id or uuid.uuid4().hex, assistant_text="thinking", **fields
        )
        return await self.episodes.steps.step(request, Deadline(deadline_s))

    async def turn(self) -> int:
        session = await self.store.get_session(self.session_id)
        assert session is not None
        return session.turn

    async def record_state(self, request_id: str) -> str | None:
        record = await self.store.get_request(STEPS, request_id)
        return record.state if record is not None else None

    async def until_recorded(self, request_id: str, timeout_s: float = 10.0) -> None:
        """Until the request's record is DONE (polled, bounded)."""
        async with asyncio.timeout(timeout_s):
            while True:
                if await self.record_state(request_id) == RequestState.DONE:
                    return
                await asyncio.sleep(0.01)


async def episode_on(store: FaultyMemoryStore, provider: FakeProvider, **config: Any) -> Episode:
    await store.heartbeat_owner(OWNER, 60)
    episodes = make_episodes(store, provider, owner=OWNER, **config)
    reset = await episodes.resets.reset(ResetParams(request_id="reset-1", task_key="env/t1"), Deadline(5))
    return Episode(episodes, store, provider, reset.session_id)


@pytest.fixture
async def ep() -> AsyncIterator[Episode]:
    store = FaultyMemoryStore()
    episode = await episode_on(store, FakeProvider())
    yield episode
    await episode.episodes.endings.wait()
    await store.close()


async def died_mid_scoring(store: FaultyMemoryStore, provider: FakeProvider, **fields: Any) -> Episode:
    """An episode of owner orch-1 whose ending Step ("end", final answer "42", `fields`) was being scored when
    its process went away (its record left PENDING) and whose lease has lapsed."""
    dying = await episode_on(store, provider)
    provider.verifies.then(HANG)  # the first scoring never finishes: the process dies during it
    first = asyncio.create_task(dying.step("end", final_answer="42", **fields))
    await asyncio.wait_for(provider.hung.wait(), 5)
    await dying.episodes.abandon()  # the process goes away mid-scoring: DONE written, no outcome
    with pytest.raises(asyncio.CancelledError):
        await first
    assert await dying.record_state("end") == RequestState.PENDING
    await store.heartbeat_owner(OWNER, 0)  # and its lease lapses
    return dying


async def replica_of(store: FaultyMemoryStore, provider: FakeProvider, session_id: str) -> Episode:
    """The same session seen from another replica (owner orch-2) on the same store."""
    other = FaultyMemoryStore(store.data)
    await other.heartbeat_owner("orch-2", 60)
    return Episode(make_episodes(other, provider, owner="orch-2"), other, provider, session_id)


# -- ordinary turns ------------------------------------------------------------------------------------------
async def test_a_turn_is_counted_once_and_replayed(ep: Episode) -> None:
    first = await ep.step("s1")
    assert (first.turn, first.done, first.status) == (1, False, common_pb2.SESSION_STATUS_ACTIVE)
    assert not first.HasField("reward")
    assert await ep.record_state("s1") == RequestState.DONE
    again = await ep.step("s1")
    assert again == first and await ep.turn() == 1
    second = await ep.step("s2")
    assert second.turn == 2 and await ep.turn() == 2


async def test_a_step_after_the_episode_ended_is_failed_precondition(ep: Episode) -> None:
    await ep.step("s1", done=True)
    with pytest.raises(FailedPrecondition) as err:
        await ep.step("s2")
    assert err.value.reason == "EPISODE_DONE"
    assert await ep.record_state("s2") is None


# -- the turn that ends the episode --------------------------------------------------------------------------
async def test_a_final_answer_ends_the_episode_scored_once(ep: Episode) -> None:
    ep.provider.verifies.then(VerifierRun(success=True, score=0.75))
    ending = await ep.step("end", final_answer="42")
    assert ending.done and not ending.truncated and ending.done_reason == Done.DONE_REASON_FINAL_ANSWER
    assert ending.reward == 0.75 and ending.verification.status == Verified.VERIFICATION_STATUS_OK
    assert ending.status == common_pb2.SESSION_STATUS_DONE
    (run,) = ep.provider.verifications
    assert run.final_answer == "42" and run.task_key == "env/t1"
    assert await ep.record_state("end") == RequestState.DONE
    assert await ep.step("end", final_answer="42") == ending  # replayed, not scored again
    assert len(ep.provider.verifications) == 1


async def test_done_without_an_answer_is_agent_done(ep: Episode) -> None:
    ending = await ep.step("end", done=True)
    assert ending.done and ending.done_reason == Done.DONE_REASON_AGENT_DONE and ending.reward == 1.0
    assert ep.provider.verifications[0].final_answer is None


async def test_the_last_allowed_turn_is_truncated(ep: Episode) -> None:
    await ep.step("t1")
    await ep.step("t2")
    last = await ep.step("t3")  # the task allows 3 turns
    assert last.done and last.truncated and last.done_reason == Done.DONE_REASON_MAX_TURNS and last.turn == 3
    assert last.reward == 1.0 and len(ep.provider.verifications) == 1


async def test_a_verifier_error_is_no_reward(ep: Episode) -> None:
    ep.provider.verifies.then(VerifierRun(success=False, message="AssertionError: wrong file"))
    ending = await ep.step("end", final_answer="x")
    assert ending.done and not ending.HasField("reward")
    assert ending.verification.status == Verified.VERIFICATION_STATUS_ERROR
    assert "wrong file" in ending.verification.message
    session = await ep.store.get_session(ep.session_id)
    assert session is not None and session.reward is None


async def test_verifier_infrastructure_failures_are_retried_then_no_reward(ep: Episode) -> None:
    ep.provider.verifies.then(*[Retryable("502")] * 10)
    ending = await ep.step("end", final_answer="x")
    assert not ending.HasField("reward") and ending.verification.status == Verified.VERIFICATION_STATUS_ERROR
    assert ending.verification.attempts == len(ep.provider.verifications) == 3  # 1 + verify_retries (2)


async def test_a_verifier_timeout_is_no_reward() -> None:
    store, provider = FaultyMemoryStore(), FakeProvider()
    ep = await episode_on(store, provider, verify_timeout_s=0.3)
    provider.verifies.then(HANG)
    ending = await ep.step("end", final_answer="x")
    assert ending.done and not ending.HasField("reward")
    assert ending.verification.status == Verified.VERIFICATION_STATUS_TIMEOUT
    assert await ep.step("end", final_answer="x") == ending and len(provider.verifications) == 1


async def test_a_repeat_while_the_ending_is_scored_gets_the_same_ending(ep: Episode) -> None:
    gate = asyncio.Event()
    ep.provider.verifies.then(gate)
    first = asyncio.create_task(ep.step("end", final_answer="x"))
    await asyncio.wait_for(ep.provider.hung.wait(), 5)  # the ending is being scored
    repeat = asyncio.create_task(ep.step("end", final_answer="x"))
    for _ in range(10):  # let the repeat get as far as it can: it must wait for the scoring
        await asyncio.sleep(0)
    assert not repeat.done()
    gate.set()
    ending, again = await asyncio.wait_for(asyncio.gather(first, repeat), 5)
    assert again == ending and ending.reward == 1.0 and len(ep.provider.verifications) == 1


# -- close_when_done: the ending closes the session too ---------------------------------------------------------
async def test_close_when_done_closes_after_the_verifier_ran_and_releases_the_instance_once(ep: Episode) -> None:
    gate = asyncio.Event()
    ep.provider.verifies.then(gate)
    session = await ep.store.get_session(ep.session_id)
    assert session is not None and session.instance_id
    going = await ep.step("s1", close_when_done=True)
    assert going.status == common_pb2.SESSION_STATUS_ACTIVE and not ep.provider.deleted  # nothing ended
    ending = asyncio.create_task(ep.step("end", final_answer="42", close_when_done=True))
    await asyncio.wait_for(ep.provider.hung.wait(), 5)  # being scored: the instance is the verifier's still
    assert not ep.provider.deleted
    live = await ep.store.get_session(ep.session_id)
    assert live is not None and live.status == "done" and live.token_hash  # not closed before its score
    gate.set()
    response = await asyncio.wait_for(ending, 5)
    assert (response.done, response.status, response.reward) == (True, common_pb2.SESSION_STATUS_CLOSED, 1.0)
    assert ep.provider.deleted == [session.instance_id]
    closed = await ep.store.get_session(ep.session_id)
    assert closed is not None and closed.status == "closed" and not closed.token_hash and closed.closed_at
    assert await ep.step("end", final_answer="42", close_when_done=True) == response  # replayed
    assert len(ep.provider.verifications) == 1 and ep.provider.deleted == [session.instance_id]
    again = await ep.episodes.closing.close(ep.session_id)
    assert again.already_closed and ep.provider.deleted == [session.instance_id]


async def test_a_close_while_the_ending_is_scored_releases_the_instance_once(ep: Episode) -> None:
    gate = asyncio.Event()
    ep.provider.verifies.then(gate)
    ending = asyncio.create_task(ep.step("end", final_answer="42", close_when_done=True))
    await asyncio.wait_for(ep.provider.hung.wait(), 5)
    closed = await ep.episodes.closing.close(ep.session_id)  # the caller gave up on the Step and closed
    assert not closed.already_closed and len(ep.provider.deleted) == 1
    gate.set()
    response = await asyncio.wait_for(ending, 5)
    assert response.done and response.status == common_pb2.SESSION_STATUS_CLOSED and response.reward == 1.0
    assert len(ep.provider.deleted) == 1  # the outcome's write found it closed: no second release


async def test_close_when_done_on_an_episode_no_verifier_scores_is_one_write() -> None:
    store = FaultyMemoryStore()
    ep = await episode_on(store, FakeProvider(), tasks=[task(verifier=False)])
    session = await store.get_session(ep.session_id)
    assert session is not None
    calls = store_calls(store)
    ending = await ep.step("end", done=True, close_when_done=True)
    assert ending.status == common_pb2.SESSION_STATUS_CLOSED
    assert ending.verification.status == Verified.VERIFICATION_STATUS_SKIPPED
    # The turn, its SKIPPED outcome, the close and the request's record: one write (the in-memory store's
    # change_session is a read and a commit), as for an ending without close_when_done; then the release.
    assert calls == ["get_session", "commit", "get_intent", "put_intent", "delete_intent"], calls
    assert ep.provider.deleted == [session.instance_id]
    await store.close()


# -- the process scoring the ending died ------------------------------------------------------------------------
async def test_an_ending_whose_owner_died_is_scored_by_the_retry() -> None:
    store, provider = FaultyMemoryStore(), FakeProvider()
    dying = await died_mid_scoring(store, provider)
    replica = await replica_of(store, provider, dying.session_id)
    ending = await replica.step("end", final_answer="42")
    assert ending.done and ending.done_reason == Done.DONE_REASON_FINAL_ANSWER and ending.reward == 1.0
    assert ending.turn == 1 and await replica.turn() == 1  # the dead attempt's turn, not a second one
    assert len(provider.verifications) == 2  # the dead attempt's run (never finished) and this one
    assert await replica.record_state("end") == RequestState.DONE
    assert await replica.step("end", final_answer="42") == ending
    assert len(provider.verifications) == 2


async def test_a_closing_ending_whose_owner_died_is_scored_and_closed_by_the_retry() -> None:
    store, provider = FaultyMemoryStore(), FakeProvider()
    dying = await died_mid_scoring(store, provider, close_when_done=True)
    assert not provider.deleted
    replica = await replica_of(store, provider, dying.session_id)
    ending = await replica.step("end", final_answer="42", close_when_done=True)
    assert (ending.done, ending.status, ending.reward, ending.turn) == (True, common_pb2.SESSION_STATUS_CLOSED, 1.0, 1)
    assert len(provider.deleted) == 1
    assert await replica.step("end", final_answer="42", close_when_done=True) == ending


async def test_a_takeover_after_an_outside_close_does_not_score_a_released_instance() -> None:
    store, provider = FaultyMemoryStore(), FakeProvider()
    dying = await died_mid_scoring(store, provider, close_when_done=True)
    await dying.episodes.closing.close(dying.session_id)  # the trainer closed it meanwhile
    assert len(provider.deleted) == 1
    replica = await replica_of(store, provider, dying.session_id)
    with pytest.raises(FailedPrecondition):
        await replica.step("end", final_answer="42", close_when_done=True)
    assert len(provider.verifications) == 1 and len(provider.deleted) == 1  # not scored, not released again


# -- the store refuses the ending's DONE record ------------------------------------------------------------------
async def test_an_ending_whose_done_write_fails_is_answered_from_memory_and_recorded_once_the_store_heals(
    ep: Episode,
) -> None:
    ep.store.fail("commit", times=None)  # the ending's DONE record cannot be written (a full disk)
    with pytest.raises(StoreError):
        await ep.step("end", final_answer="42")
    assert await ep.record_state("end") == RequestState.PENDING  # kept: releasing it would lose the scored ending
    ending = await ep.step("end", final_answer="42")  # a retry here gets the ending this process holds
    assert ending.done and ending.reward == 1.0 and len(ep.provider.verifications) == 1

    # another replica cannot have it: bounded by its deadline, with RetryInfo
    replica = await replica_of(ep.store, ep.provider, ep.session_id)
    with pytest.raises(DeadlineExceeded) as err:
        await replica.step("end", final_answer="42", deadline_s=0.3)
    assert err.value.retry_after_s

    ep.store.heal()  # the write succeeds in the background
    await ep.until_recorded("end")
    assert await replica.step("end", final_answer="42") == ending
    assert await ep.step("end", final_answer="42") == ending and len(ep.provider.verifications) == 1
    assert await ep.turn() == 1
