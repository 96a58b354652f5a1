"""How a Step reaches the store, without a server: one path for every turn. An ordinary turn is one store
call that reads the session, counts the turn and records its request together; a turn that ends the episode
claims its request_id first (it is scored after its write). Real SQLite; the orchestrator's parts wired as in production
(`Orchestrator`)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from rlgate.core.errors import FailedPrecondition, InvalidArgument
from rlgate.ledger import decode_result, scope
from rlgate.orchestrator.config import OrchestratorConfig
from rlgate.orchestrator.episodes import Episodes
from rlgate.orchestrator.providers.base import TaskDef
from rlgate.orchestrator.service import Orchestrator, make_provider
from rlgate.runtime.deadline import Deadline
from rlgate.store import RequestState, Session, SessionStatus, SessionStore, open_store
from rlgate.v1 import common_pb2, orchestrator_pb2

SID = "s-step-writes"  # its task has an answer key: a verifier scores its episodes after the ending turn
UNSCORED = "s-step-writes-unscored"  # no task: its episodes end SKIPPED, with no verifier
STEPS = scope("step", "")  # the anonymous caller's Step records


class CountingStore:
    """Counts the store calls a Step makes (delegates everything); `before[name]` runs once before the next
    call of that name (another writer stepping in)."""

    def __init__(self, inner: SessionStore) -> None:
        self.inner = inner
        self.calls: list[str] = []
        self.before: dict[str, Any] = {}

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.inner, name)
        if not callable(attr):
            return attr

        async def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls.append(name)
            if (hook := self.before.pop(name, None)) is not None:
                await hook()
            return await attr(*args, **kwargs)

        return counted


@pytest.fixture
async def parts(tmp_path: Path) -> AsyncIterator[tuple[Episodes, CountingStore, SessionStore]]:
    store = await open_store(f"sqlite:///{tmp_path / 'store.db'}")
    counting = CountingStore(store)
    config = OrchestratorConfig(provider="mcp", mcp_envs="")
    orch = Orchestrator(config, counting, make_provider(config), owns_store=False)  # type: ignore[arg-type]
    orch.catalog.replace([TaskDef(key="answered", env_id="mailbox", version="v1", prompt="p", expected_answer="42")])
    for session_id, task_key, token in ((SID, "answered", "ab"), (UNSCORED, "", "cd")):
        await store.create_session(
            Session(
                session_id=session_id,
                env_key="mailbox:v1",
                task_key=task_key,
                status=SessionStatus.ACTIVE,
                max_turns=5,
                endpoints=["http://127.0.0.1:1/mcp"],
                token_hash=token * 32,
            )
        )
    try:
        yield orch.episodes, counting, store
    finally:
        await store.close()


def step(request_id: str = "", session_id: str = SID, **fields: Any) -> orchestrator_pb2.StepRequest:
    return orchestrator_pb2.StepRequest(
        session_id=session_id, request_id=request_id or uuid.uuid4().hex, assistant_text="thinking", **fields
    )


def deadline() -> Deadline:
    return Deadline.from_grpc(None, 30.0)


async def test_a_turn_is_one_store_call(parts: Any) -> None:
    episodes, counting, store = parts
    first = await episodes.steps.step(step("r1"), deadline())
    assert counting.calls == ["change_session"]
    counting.calls.clear()
    second = await episodes.steps.step(step("r2"), deadline())
    assert counting.calls == ["change_session"]
    assert (first.turn, second.turn) == (1, 2)
    record = await store.get_request(STEPS, "r2")
    assert record is not None and record.state == RequestState.DONE
    params, response = decode_result(record.result)
    assert orchestrator_pb2.StepResponse.FromString(response) == second
    assert params is not None and set(params) == {
        "session_id",
        "assistant_text",
        "tool_calls",
        "final_answer",
        "done",
    }


async def test_a_repeat_replays_the_recorded_response(parts: Any) -> None:
    episodes, _, store = parts
    first = await episodes.steps.step(step("same"), deadline())
    again = await episodes.steps.step(step("same"), deadline())
    assert again == first and again.turn == 1
    assert (await store.get_session(SID)).turn == 1  # counted once


async def test_a_repeat_with_other_contents_is_invalid_argument(parts: Any) -> None:
    episodes, _, store = parts
    await episodes.steps.step(step("bound"), deadline())
    for changed, field in (
        (step("bound", final_answer="3"), "final_answer"),
        (orchestrator_pb2.StepRequest(session_id=SID, request_id="bound", assistant_text="other"), "assistant_text"),
        (step("bound", done=True), "done"),
    ):
        with pytest.raises(InvalidArgument) as err:
            await episodes.steps.step(changed, deadline())
        assert err.value.field == field
    assert (await store.get_session(SID)).turn == 1


async def test_concurrent_repeats_count_once(parts: Any) -> None:
    episodes, _, store = parts
    replies = await asyncio.gather(*(episodes.steps.step(step("together"), deadline()) for _ in range(5)))
    assert {r.turn for r in replies} == {1}
    assert (await store.get_session(SID)).turn == 1


async def test_a_write_by_someone_else_is_seen_not_overwritten(parts: Any) -> None:
    episodes, counting, store = parts
    await episodes.steps.step(step(), deadline())

    async def another_replica_takes_a_turn() -> None:
        other = await store.get_session(SID)
        other.turn += 1
        await store.update_session(other)

    counting.before["change_session"] = another_replica_takes_a_turn  # just before this Step's store call
    reply = await episodes.steps.step(step(), deadline())
    assert reply.turn == 3
    assert (await store.get_session(SID)).turn == 3


async def test_the_ending_turn_claims_first_and_a_repeat_replays_its_score(parts: Any) -> None:
    episodes, counting, store = parts
    for _ in range(4):
        await episodes.steps.step(step(), deadline())
    counting.calls.clear()
    last = await episodes.steps.step(step("end"), deadline())  # turn 5 of max 5: the episode ends, then is scored
    assert last.done and last.truncated
    # One read (the first call's), then the claim before the write: the write starts from what was read.
    assert counting.calls[:3] == ["change_session", "claim_request", "update_session"]
    assert "get_session" not in counting.calls
    with pytest.raises(FailedPrecondition):
        await episodes.steps.step(step(), deadline())
    assert (await episodes.steps.step(step("end"), deadline())) == last  # a repeat of the ending turn replays it
    assert (await store.get_session(SID)).turn == 5


async def test_an_ending_turn_counts_again_when_another_write_lands_before_its_own(parts: Any) -> None:
    # The ending turn's write starts from the session its first call read; another replica's write in
    # between loses it the compare-and-set, and the turn is counted again on a fresh read: the other write
    # is kept, not overwritten.
    episodes, counting, store = parts
    for _ in range(4):
        await episodes.steps.step(step(), deadline())

    async def another_replica_takes_a_turn() -> None:
        other = await store.get_session(SID)
        other.turn += 1
        await store.update_session(other)

    counting.calls.clear()
    counting.before["claim_request"] = another_replica_takes_a_turn  # after this turn's read, before its write
    last = await episodes.steps.step(step("late"), deadline())  # read turn 4: this would be turn 5 of 5
    assert (last.turn, last.done, last.truncated) == (6, True, True)  # counted after the other replica's 5th
    assert (await store.get_session(SID)).turn == 6
    assert counting.calls[:4] == ["change_session", "claim_request", "update_session", "get_session"]


async def test_an_ending_turn_is_scored_and_recorded_even_if_its_caller_goes_away(parts: Any) -> None:
    # The turn is written before the verifier runs: a caller that gives up then must neither leave the
    # episode unscored nor its request_id unanswerable (a retry would get FAILED_PRECONDITION, or wait).
    episodes, _, store = parts
    scoring, release = asyncio.Event(), asyncio.Event()
    run = episodes.endings.verifier.run

    async def held(*args: Any) -> Any:
        scoring.set()
        await release.wait()
        return await run(*args)

    episodes.endings.verifier.run = held
    caller = asyncio.create_task(episodes.steps.step(step("held", done=True), deadline()))
    await asyncio.wait_for(scoring.wait(), 10)
    record = await store.get_request(STEPS, "held")
    assert record is not None and record.state == RequestState.PENDING
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    release.set()
    retry = await asyncio.wait_for(episodes.steps.step(step("held", done=True), deadline()), 10)  # waits, then replays
    assert (retry.turn, retry.done, retry.done_reason) == (1, True, orchestrator_pb2.DONE_REASON_AGENT_DONE)
    assert retry.verification.status == common_pb2.VERIFICATION_STATUS_OK  # scored: the answer key, no final answer
    assert retry.HasField("reward") and retry.reward == 0.0
    record = await store.get_request(STEPS, "held")
    assert record is not None and record.state == RequestState.DONE


async def test_an_ending_turn_without_a_verifier_is_one_store_call(parts: Any) -> None:
    # Nothing scores the episode: its SKIPPED outcome is known at once, so the turn, the ending, the outcome
    # and the request's record are one write, like an ordinary turn.
    episodes, counting, store = parts
    await episodes.steps.step(step(session_id=UNSCORED), deadline())
    counting.calls.clear()
    last = await episodes.steps.step(step("unscored-end", session_id=UNSCORED, final_answer="42"), deadline())
    assert counting.calls == ["change_session"]
    assert (last.turn, last.done, last.done_reason) == (2, True, orchestrator_pb2.DONE_REASON_FINAL_ANSWER)
    assert last.verification.status == common_pb2.VERIFICATION_STATUS_SKIPPED and not last.HasField("reward")
    session = await store.get_session(UNSCORED)
    assert session.status == SessionStatus.DONE and session.verification is not None and session.reward is None
    record = await store.get_request(STEPS, "unscored-end")
    assert record is not None and record.state == RequestState.DONE
    assert orchestrator_pb2.StepResponse.FromString(decode_result(record.result)[1]) == last
    again = await episodes.steps.step(step("unscored-end", session_id=UNSCORED, final_answer="42"), deadline())
    assert again == last and (await store.get_session(UNSCORED)).turn == 2  # the repeat replays the record
    with pytest.raises(FailedPrecondition):
        await episodes.steps.step(step(session_id=UNSCORED), deadline())


async def test_closing_a_session_changes_it_in_one_store_call(parts: Any) -> None:
    # Sessions.mutate without a custom write is the store's change_session: read, change and write in one
    # round trip (one transaction on SQLite), where it used to be a read and then a compare-and-set.
    episodes, counting, store = parts
    closed = await episodes.closing.close(SID)
    assert counting.calls[0] == "change_session"
    assert "get_session" not in counting.calls and "update_session" not in counting.calls
    assert not closed.already_closed and closed.status == common_pb2.SESSION_STATUS_CLOSED
    session = await store.get_session(SID)
    assert session.status == SessionStatus.CLOSED and session.token_hash == ""  # the token is revoked
    counting.calls.clear()
    again = await episodes.closing.close(SID)
    assert again.already_closed and counting.calls == ["change_session"]  # nothing to write: nothing written
