"""The request ledger (`rlgate.ledger`) on a real SQLite store, without a server: two ledgers with
different owners stand for two replicas sharing the store."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from rlgate.core.errors import DeadlineExceeded, FailedPrecondition, InvalidArgument
from rlgate.ledger import Claim, RequestLedger, decode_result, fingerprint, scope
from rlgate.runtime.deadline import Deadline
from rlgate.store import RequestState, SessionStore, StoreError, open_store
from rlgate.v1 import orchestrator_pb2
from rlgate.v1.orchestrator_pb2 import StepResponse as Reply
from tests.fakes.store import FaultyMemoryStore

SCOPE = scope("step", "")


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[SessionStore]:
    s = await open_store(f"sqlite:///{tmp_path / 'store.db'}")
    for owner in ("replica-a", "replica-b"):
        await s.heartbeat_owner(owner, 60)
    try:
        yield s
    finally:
        await s.close()


def deadline(seconds: float = 10.0) -> Deadline:
    return Deadline(seconds)


class Work:
    """Counts its runs; each answers with its run number, after `gate` opens (when given)."""

    def __init__(self, gate: asyncio.Event | None = None, fail: Exception | None = None) -> None:
        self.runs = 0
        self.started = asyncio.Event()
        self.gate = gate
        self.fail = fail
        self.claims: list[Claim] = []

    async def __call__(self, claim: Claim) -> Reply:
        self.runs += 1
        self.claims.append(claim)
        self.started.set()
        if self.gate is not None:
            await self.gate.wait()
        if self.fail is not None:
            raise self.fail
        return Reply(turn=self.runs)


def test_fingerprints_compare_json_values_not_their_spelling() -> None:
    assert fingerprint({"a": {"x": 1, "y": [1.0, "z"]}}) == fingerprint({"a": {"y": [1, "z"], "x": 1.0}})
    assert fingerprint({"a": 1}) != fingerprint({"a": 2})
    assert fingerprint({"a": None}) != fingerprint({"a": ""})


async def test_a_repeat_replays_and_other_parameters_name_the_field(store: SessionStore) -> None:
    ledger, work = RequestLedger(store, "replica-a"), Work()
    params = {"session_id": "s1", "text": "hi", "calls": [{"n": 1}]}
    first = await ledger.run(SCOPE, "r1", params, deadline(), Reply, work)
    assert await ledger.run(SCOPE, "r1", dict(params), deadline(), Reply, work) == first
    other_replica = RequestLedger(store, "replica-b")
    assert await other_replica.run(SCOPE, "r1", params, deadline(), Reply, work) == first
    for change, field in (({"text": "bye"}, "text"), ({"calls": [{"n": 2}]}, "calls"), ({"extra": 1}, "extra")):
        with pytest.raises(InvalidArgument) as err:
            await other_replica.run(SCOPE, "r1", {**params, **change}, deadline(), Reply, work)
        assert err.value.field == field and "r1" in err.value.message
    assert work.runs == 1
    # Another scope (another caller) is another request.
    assert (await ledger.run(scope("step", "key-hash"), "r1", {"x": 1}, deadline(), Reply, work)).turn == 2


async def test_repeats_wait_for_the_first_attempt_in_process_and_across_replicas(store: SessionStore) -> None:
    gate = asyncio.Event()
    a, b, work = (
        RequestLedger(store, "replica-a", poll_s=0.01),
        RequestLedger(store, "replica-b", poll_s=0.01),
        Work(gate),
    )
    first = asyncio.create_task(a.run(SCOPE, "r1", {"p": 1}, deadline(), Reply, work))
    await work.started.wait()
    local = asyncio.create_task(a.run(SCOPE, "r1", {"p": 1}, deadline(), Reply, work))
    remote = asyncio.create_task(b.run(SCOPE, "r1", {"p": 1}, deadline(), Reply, work))
    with pytest.raises(InvalidArgument):  # a repeat with other parameters is refused at once, in flight too
        await a.run(SCOPE, "r1", {"p": 2}, deadline(), Reply, work)
    with pytest.raises(DeadlineExceeded):
        await b.run(SCOPE, "r1", {"p": 1}, deadline(0.05), Reply, work)
    gate.set()
    replies = await asyncio.gather(first, local, remote)
    assert [r.turn for r in replies] == [1, 1, 1] and work.runs == 1


async def test_a_failed_attempt_releases_its_record(store: SessionStore) -> None:
    gate = asyncio.Event()
    ledger, failing = RequestLedger(store, "replica-a"), Work(gate, fail=FailedPrecondition("not now"))
    first = asyncio.create_task(ledger.run(SCOPE, "r1", {}, deadline(), Reply, failing))
    await failing.started.wait()
    record = await store.get_request(SCOPE, "r1")
    assert record is not None and record.state == RequestState.PENDING and record.owner == "replica-a"
    gate.set()
    with pytest.raises(FailedPrecondition):
        await first
    assert await store.get_request(SCOPE, "r1") is None  # a retry runs again rather than replaying an error
    assert (await ledger.run(SCOPE, "r1", {}, deadline(), Reply, Work())).turn == 1


async def test_a_dead_owners_record_is_taken_over_or_answered_by_orphan(store: SessionStore) -> None:
    ledger, work = RequestLedger(store, "replica-a"), Work()
    await store.claim_request(SCOPE, "r1", "dead-replica")  # its owner never heartbeated
    assert (await ledger.run(SCOPE, "r1", {}, deadline(), Reply, work)).turn == 1
    (claim,) = work.claims
    assert claim.prior is not None and claim.prior.owner == "dead-replica"

    await store.claim_request(SCOPE, "r2", "dead-replica")
    orphans: list[Claim] = []

    async def unknown(claim: Claim) -> Reply:
        orphans.append(claim)
        return Reply(turn=-1)

    assert (await ledger.run(SCOPE, "r2", {}, deadline(), Reply, work, orphan=unknown)).turn == -1
    assert work.runs == 1  # the orphaned request did not run again
    (orphaned,) = orphans
    assert orphaned.prior is not None and orphaned.prior.owner == "dead-replica"
    record = await store.get_request(SCOPE, "r2")  # its answer is recorded: every repeat gets the same
    assert record is not None and record.state == RequestState.DONE and record.owner == "replica-a"
    assert (await ledger.run(SCOPE, "r2", {}, deadline(), Reply, work, orphan=unknown)).turn == -1
    assert len(orphans) == 1


async def test_repeats_racing_to_take_over_a_dead_owners_record_run_it_once(store: SessionStore) -> None:
    a, b = RequestLedger(store, "replica-a", poll_s=0.01), RequestLedger(store, "replica-b", poll_s=0.01)
    ids = [f"r{i}" for i in range(10)]
    for request_id in ids:
        await store.claim_request(SCOPE, request_id, "dead-replica")
    work = Work()
    replies = await asyncio.gather(
        *(ledger.run(SCOPE, rid, {}, deadline(), Reply, work) for rid in ids for ledger in (a, b))
    )
    assert work.runs == len(ids) and all(claim.prior is not None for claim in work.claims)
    for first, second in zip(replies[::2], replies[1::2], strict=True):
        assert first == second


async def test_lazy_runs_record_with_the_works_own_write(store: SessionStore) -> None:
    ledger = RequestLedger(store, "replica-a")
    calls: list[str] = []

    async def turn(claim: Claim) -> Reply:
        calls.append("work")
        reply = Reply(turn=len(calls))
        await claim.commit(response=reply)  # created DONE with the write: no claim beforehand
        return reply

    first = await ledger.run(SCOPE, "r1", {"a": 1}, deadline(), Reply, turn, lazy=True)
    record = await store.get_request(SCOPE, "r1")
    assert record is not None and record.state == RequestState.DONE and record.owner == ""
    # Another replica's repeat runs its work lazily too; the write finds the record and replays it.
    again = await RequestLedger(store, "replica-b").run(SCOPE, "r1", {"a": 1}, deadline(), Reply, turn, lazy=True)
    assert again == first and calls == ["work", "work"]
    assert (await store.get_request(SCOPE, "r1")).result == record.result  # type: ignore[union-attr]

    # Work that fails before its write (a repeat after the first changed what it checks) is answered from
    # the record instead.
    async def refuses(claim: Claim) -> Reply:
        raise FailedPrecondition("the episode is already done")

    assert await ledger.run(SCOPE, "r1", {"a": 1}, deadline(), Reply, refuses, lazy=True) == first
    with pytest.raises(FailedPrecondition):
        await ledger.run(SCOPE, "new", {"a": 1}, deadline(), Reply, refuses, lazy=True)


async def test_redact_and_replay(store: SessionStore) -> None:
    ledger = RequestLedger(store, "replica-a")
    replays = 0

    async def work(claim: Claim) -> orchestrator_pb2.ResetResponse:
        return orchestrator_pb2.ResetResponse(session_id="s1", agent_token="secret-1")

    def redact(response: orchestrator_pb2.ResetResponse) -> orchestrator_pb2.ResetResponse:
        kept = orchestrator_pb2.ResetResponse()
        kept.CopyFrom(response)
        kept.ClearField("agent_token")
        return kept

    async def replay(recorded: orchestrator_pb2.ResetResponse) -> orchestrator_pb2.ResetResponse:
        nonlocal replays
        replays += 1
        assert recorded.agent_token == ""
        recorded.agent_token = f"fresh-{replays}"
        return recorded

    message = orchestrator_pb2.ResetResponse
    first = await ledger.run(SCOPE, "r1", {}, deadline(), message, work, redact=redact, replay=replay)
    again = await ledger.run(SCOPE, "r1", {}, deadline(), message, work, redact=redact, replay=replay)
    assert (first.agent_token, again.agent_token) == ("secret-1", "fresh-1")
    record = await store.get_request(SCOPE, "r1")
    assert record is not None and "secret-1" not in record.result
    assert b"secret-1" not in decode_result(record.result)[1]


async def test_a_record_from_before_the_ledger_replays_unchecked(store: SessionStore) -> None:
    await store.complete_request(SCOPE, "old", base64.b64encode(Reply(turn=7).SerializeToString()).decode())
    ledger = RequestLedger(store, "replica-a")
    assert (await ledger.run(SCOPE, "old", {"any": "thing"}, deadline(), Reply, Work())).turn == 7


async def test_without_a_request_id_the_work_just_runs(store: SessionStore) -> None:
    ledger, work = RequestLedger(store, "replica-a"), Work()
    replies = [await ledger.run(SCOPE, "", {}, deadline(), Reply, work) for _ in range(2)]
    assert [r.turn for r in replies] == [1, 2]


# -- a DONE write the store refuses (memory store: its failures are injected) -----------------------------------
@pytest.fixture
async def failing() -> AsyncIterator[FaultyMemoryStore]:
    s = FaultyMemoryStore()
    for owner in ("replica-a", "replica-b"):
        await s.heartbeat_owner(owner, 60)
    yield s
    await s.close()


async def done_record(store: SessionStore, request_id: str, timeout_s: float = 10.0) -> Reply:
    """The recorded reply once the record is DONE (polled, bounded)."""
    async with asyncio.timeout(timeout_s):
        while True:
            record = await store.get_request(SCOPE, request_id)
            if record is not None and record.state == RequestState.DONE:
                return Reply.FromString(decode_result(record.result)[1])
            await asyncio.sleep(0.01)


async def test_a_response_the_store_refuses_is_answered_from_memory_and_written_in_the_background(
    failing: FaultyMemoryStore,
) -> None:
    a, b, work = RequestLedger(failing, "replica-a"), RequestLedger(failing, "replica-b", poll_s=0.01), Work()
    failing.fail("commit", times=None)
    with pytest.raises(StoreError):  # the first caller learns that the store is failing ...
        await a.run(SCOPE, "r1", {"p": 1}, deadline(), Reply, work)
    assert (await a.run(SCOPE, "r1", {"p": 1}, deadline(), Reply, work)).turn == 1  # ... its retry gets the answer
    with pytest.raises(InvalidArgument):  # still bound to its parameters
        await a.run(SCOPE, "r1", {"p": 2}, deadline(), Reply, work)
    with pytest.raises(DeadlineExceeded) as err:  # another replica waits on the live owner, bounded
        await b.run(SCOPE, "r1", {"p": 1}, deadline(0.2), Reply, work)
    assert err.value.retry_after_s
    failing.heal()
    assert (await done_record(failing, "r1")).turn == 1
    assert (await b.run(SCOPE, "r1", {"p": 1}, deadline(), Reply, work)).turn == 1 and work.runs == 1
    await a.drain(1)


async def test_a_late_background_write_leaves_a_takeovers_answer_standing(failing: FaultyMemoryStore) -> None:
    a, b, work = RequestLedger(failing, "replica-a"), RequestLedger(failing, "replica-b"), Work()
    failing.fail("commit", times=None)
    with pytest.raises(StoreError):
        await a.run(SCOPE, "r1", {}, deadline(), Reply, work)
    await failing.heartbeat_owner("replica-a", 0)  # replica-a is deemed dead (its heartbeats failed too)
    with pytest.raises(StoreError):
        await b.run(SCOPE, "r1", {}, deadline(), Reply, work)  # taken over: run again, its answer held by b
    failing.heal()  # both write again now: replica-a's write finds the record held by replica-b
    assert (await done_record(failing, "r1")).turn == 2  # the takeover's answer
    await a.drain(5)  # replica-a's background write finds the record taken over and gives up
    assert (await done_record(failing, "r1")).turn == 2
    assert (await a.run(SCOPE, "r1", {}, deadline(), Reply, work)).turn == 2 and work.runs == 2
    await b.drain(1)
