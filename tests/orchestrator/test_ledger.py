"""The request ledger (`rlgate.runtime.ledger`) on a real SQLite store, without a server: two ledgers with
different owners stand for two replicas sharing the store."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from rlgate.runtime.deadline import Deadline
from rlgate.runtime.errors import DeadlineExceeded, FailedPrecondition, InvalidArgument
from rlgate.runtime.ledger import Claim, RequestLedger, decode_result, fingerprint, scope
from rlgate.store import RequestState, SessionStore, open_store
from rlgate.v1 import orchestrator_pb2
from rlgate.v1.orchestrator_pb2 import StepResponse as Reply

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

    async def unknown(record: Any) -> Reply:
        return Reply(turn=-1)

    assert (await ledger.run(SCOPE, "r2", {}, deadline(), Reply, work, orphan=unknown)).turn == -1
    assert work.runs == 1  # the orphaned request did not run again


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

    run = {"deadline": deadline(), "redact": redact, "replay": replay}
    first = await ledger.run(SCOPE, "r1", {}, message=orchestrator_pb2.ResetResponse, work=work, **run)
    again = await ledger.run(SCOPE, "r1", {}, message=orchestrator_pb2.ResetResponse, work=work, **run)
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
