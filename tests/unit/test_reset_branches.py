"""Every way a Reset can end, on the orchestrator's logic alone: `Episodes` over the in-memory store and a
fake provider (tests/fakes), no gRPC server, no Fleet. Besides the answer, each branch must leave no instance
behind that no session owns (the fake provider records every create and delete), no intent that is not
DELETING or bound, and a request record a retry can use."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc
import pytest

from rlgate.core.errors import FailedPrecondition, ResourceExhausted, Unavailable
from rlgate.ledger import scope
from rlgate.orchestrator.episodes import Episodes
from rlgate.orchestrator.pool import PoolEntry
from rlgate.orchestrator.providers.base import InstanceLimit, ResetFailed, Retryable
from rlgate.orchestrator.resets import ResetParams, session_id_for_request
from rlgate.orchestrator.servicer import error_status
from rlgate.runtime.auth import token_hash
from rlgate.runtime.deadline import Deadline
from rlgate.store import IntentState, RequestState, SessionStatus, StoreError
from rlgate.v1 import orchestrator_pb2
from tests.fakes import FakeProvider, make_episodes
from tests.fakes.store import FaultyMemoryStore, store_calls

OWNER = "orch-1"
RESETS = scope("reset", "")
ENV = "env:v1"


@dataclass
class Orch:
    episodes: Episodes
    store: FaultyMemoryStore
    provider: FakeProvider

    async def reset(
        self, request_id: str = "r1", *, deadline_s: float = 5.0, **fields: object
    ) -> orchestrator_pb2.ResetResponse:
        params = ResetParams(request_id=request_id, **fields)  # type: ignore[arg-type]
        if not (params.task_key or params.env_key or params.session_id):
            params.task_key = "env/t1"
        return await self.episodes.resets.reset(params, Deadline(deadline_s))

    async def owned_instances(self) -> set[str]:
        """Instances an open session uses."""
        return {s.instance_id for s in await self.episodes.sessions.open_sessions()}

    async def assert_nothing_leaked(self) -> None:
        assert set(self.provider.live) == await self.owned_instances(), (self.provider.live, self.provider.deleted)
        for intent in await self.store.list_intents():
            assert intent.state in (IntentState.BOUND, IntentState.DELETING), intent
            if intent.state == IntentState.BOUND:
                assert intent.instance_id in self.provider.live

    async def record_state(self, request_id: str = "r1") -> str | None:
        record = await self.store.get_request(RESETS, request_id)
        return record.state if record is not None else None


async def orch_with(**config: Any) -> Orch:
    store, provider = FaultyMemoryStore(), FakeProvider()
    await store.heartbeat_owner(OWNER, 60)
    return Orch(make_episodes(store, provider, owner=OWNER, **config), store, provider)


@pytest.fixture
async def orch() -> AsyncIterator[Orch]:
    orch = await orch_with()
    yield orch
    await orch.store.close()


# -- provisioned ----------------------------------------------------------------------------------------------
async def test_provision_ok_starts_an_active_session_and_a_repeat_replays_it_with_a_fresh_token(orch: Orch) -> None:
    first = await orch.reset()
    assert first.session_id == session_id_for_request("", "r1") and first.episode == 1
    assert first.agent_token and [t.name for t in first.tools] == ["echo"] and first.prompt == "Do env/t1"
    assert orch.provider.created == ["fake-1"] and orch.provider.resets == ["fake-1"]
    session = await orch.store.get_session(first.session_id)
    assert session is not None and session.status == SessionStatus.ACTIVE and session.instance_id == "fake-1"
    assert session.token_hash == token_hash(first.agent_token)
    (intent,) = await orch.store.list_intents()
    assert intent.state == IntentState.BOUND and intent.session_id == first.session_id
    assert await orch.record_state() == RequestState.DONE

    again = await orch.reset()
    assert again.session_id == first.session_id and again.agent_token != first.agent_token
    session = await orch.store.get_session(first.session_id)
    assert session is not None and session.token_hash == token_hash(again.agent_token)
    assert token_hash(first.agent_token) in session.revoked_tokens  # the gateway can say it was replaced
    assert orch.provider.created == ["fake-1"]  # one instance for both answers
    await orch.assert_nothing_leaked()


async def test_a_fresh_instance_whose_reset_fails_is_used_anyway(orch: Orch) -> None:
    orch.provider.fail_resets("fake-1", ResetFailed("manager 500"))
    response = await orch.reset()
    session = await orch.store.get_session(response.session_id)
    assert session is not None and session.instance_id == "fake-1" and orch.provider.deleted == []


# -- the provider cannot give an instance ---------------------------------------------------------------------
async def test_provider_unavailable_until_the_deadline_is_unavailable_and_a_retry_provisions(orch: Orch) -> None:
    orch.provider.creates.then(*[Retryable("503 placement failed")] * 50)
    with pytest.raises(Unavailable) as err:
        await orch.reset(deadline_s=0.6)
    assert err.value.reason == "PROVIDER_UNAVAILABLE" and err.value.retry_after_s
    assert orch.provider.created == [] and await orch.record_state() is None  # released: a retry runs
    intents = await orch.store.list_intents()  # a create that may have happened is marked for reconciliation
    assert intents and all(i.state == IntentState.DELETING for i in intents)
    assert await orch.store.count_open_sessions() == 0

    orch.provider.creates.entries.clear()
    response = await orch.reset()
    assert response.session_id == session_id_for_request("", "r1") and orch.provider.created == ["fake-1"]
    await orch.assert_nothing_leaked()


async def test_instance_limit_until_the_deadline_is_resource_exhausted_and_leaves_no_intent(orch: Orch) -> None:
    orch.provider.creates.then(*[InstanceLimit("limit reached", running=10, limit=10)] * 50)
    with pytest.raises(ResourceExhausted) as err:
        await orch.reset(deadline_s=0.6)
    assert err.value.reason == "INSTANCE_LIMIT" and err.value.metadata["limit"] == "10"
    assert orch.provider.created == [] and await orch.store.list_intents() == []
    assert await orch.record_state() is None


async def test_max_sessions_is_resource_exhausted_before_provisioning() -> None:
    orch = await orch_with(max_sessions=1)
    await orch.reset("r1")
    with pytest.raises(ResourceExhausted) as err:
        await orch.reset("r2")
    assert err.value.reason == "MAX_SESSIONS"
    assert orch.provider.created == ["fake-1"] and await orch.record_state("r2") is None
    await orch.assert_nothing_leaked()


# -- a reused instance whose reset fails is replaced ----------------------------------------------------------
async def test_a_pooled_instance_whose_reset_fails_is_deleted_and_replaced() -> None:
    orch = await orch_with(warm_pool=f"{ENV}=1")
    handle, intent = await orch.episodes.instances.provisioner.create(ENV, Deadline(5), state=IntentState.POOLED)
    assert await orch.episodes.instances.pool.put_back(PoolEntry(handle, intent))
    orch.provider.fail_resets(handle.instance_id, ResetFailed("dirty state"))

    response = await orch.reset()
    session = await orch.store.get_session(response.session_id)
    assert session is not None and session.instance_id == "fake-2"
    assert orch.provider.deleted == ["fake-1"] and set(orch.provider.live) == {"fake-2"}
    assert orch.provider.resets == ["fake-1", "fake-2"]
    assert await orch.store.get_intent(intent.intent_id) is None
    await orch.assert_nothing_leaked()


async def test_the_next_episode_on_an_instance_whose_reset_fails_gets_a_new_instance(orch: Orch) -> None:
    first = await orch.reset("r1")
    orch.provider.fail_resets("fake-1", ResetFailed("dirty state"))
    second = await orch.reset("r2", session_id=first.session_id)
    assert second.session_id == first.session_id and second.episode == 2
    session = await orch.store.get_session(first.session_id)
    assert session is not None and session.instance_id == "fake-2" and session.status == SessionStatus.ACTIVE
    assert orch.provider.deleted == ["fake-1"]
    await orch.assert_nothing_leaked()


async def test_the_next_episode_fails_the_session_when_no_replacement_comes(orch: Orch) -> None:
    first = await orch.reset("r1")
    orch.provider.fail_resets("fake-1", ResetFailed("dirty state"))
    orch.provider.creates.then(*[Retryable("503")] * 50)
    with pytest.raises(Unavailable):
        await orch.reset("r2", session_id=first.session_id, deadline_s=0.6)
    session = await orch.store.get_session(first.session_id)
    assert session is not None and session.status == SessionStatus.FAILED and not session.token_hash
    # Deleted when its reset failed, and again (already gone, which counts as deleted) when the session failed.
    assert orch.provider.live == {} and set(orch.provider.deleted) == {"fake-1"}
    with pytest.raises(FailedPrecondition):  # a failed session does not come back
        await orch.reset("r3", session_id=first.session_id)
    await orch.assert_nothing_leaked()


# -- the store fails after the instance exists ------------------------------------------------------------------
async def test_store_failing_to_register_the_session_deletes_the_instance(orch: Orch) -> None:
    orch.store.fail("create_session")
    with pytest.raises(StoreError) as err:
        await orch.reset()
    status = error_status(err.value)
    assert status is not None and status.code == grpc.StatusCode.UNAVAILABLE.value[0]
    assert orch.provider.created == ["fake-1"] and orch.provider.deleted == ["fake-1"] and orch.provider.live == {}
    assert await orch.store.list_intents() == [] and await orch.record_state() is None
    assert await orch.store.count_open_sessions() == 0

    response = await orch.reset()  # the retry provisions again and is admitted (no reservation leaked)
    assert response.session_id == session_id_for_request("", "r1")
    await orch.assert_nothing_leaked()


@pytest.mark.parametrize("manages_instances", [True, False], ids=["instances", "static-endpoints"])
async def test_a_retry_whose_record_is_gone_resumes_the_session_registered(manages_instances: bool) -> None:
    # The record of a finished Reset was pruned: its retry finds the session registered under its id and
    # resumes it (fresh token), never a second session. A provider that creates instances looks first (no
    # instance made for nothing); one with static endpoints finds it when registering, with no extra read.
    orch = await orch_with()
    orch.provider.manages_instances = manages_instances
    orch.provider.endpoints_for = lambda env_key, task: ["http://127.0.0.1:1/mcp"]  # type: ignore[method-assign]
    try:
        first = await orch.reset()
        assert await orch.store.prune(0.0, time.time() + 1) >= 1 and await orch.record_state() is None
        again = await orch.reset()
        assert (again.session_id, again.episode) == (first.session_id, 1)
        assert again.agent_token != first.agent_token  # rotated: only the latest reply's holder acts
        session = await orch.store.get_session(first.session_id)
        assert session is not None and session.token_hash == token_hash(again.agent_token)
        assert orch.provider.created == (["fake-1"] if manages_instances else [])
        assert await orch.store.count_open_sessions() == 1
        reads: list[str] = []
        get_session = orch.store.get_session

        async def counted(session_id: str) -> Any:
            reads.append(session_id)
            return await get_session(session_id)

        orch.store.get_session = counted  # type: ignore[method-assign]
        fresh = await orch.reset("r2")  # a new request: read first only where an instance would be made
        assert len(reads) == (1 if manages_instances else 0) and fresh.session_id != first.session_id
        if manages_instances:
            await orch.assert_nothing_leaked()
    finally:
        await orch.store.close()


# -- static endpoints: no instance to create, so no claim before the registering write ----------------------
async def static_orch(store: FaultyMemoryStore | None = None, owner: str = OWNER) -> Orch:
    """An orchestrator whose provider creates no instances (the mcp provider's case): a session's tools are at
    fixed endpoints. `store`: another view of a store already open (another replica on it)."""
    store, provider = store or FaultyMemoryStore(), FakeProvider()
    await store.heartbeat_owner(owner, 60)
    provider.manages_instances = False
    provider.endpoints_for = lambda env_key, task: ["http://127.0.0.1:1/mcp"]  # type: ignore[method-assign]
    return Orch(make_episodes(store, provider, owner=owner), store, provider)


async def test_a_new_session_on_static_endpoints_is_registered_with_its_record_in_one_write() -> None:
    orch = await static_orch()
    try:
        calls = store_calls(orch.store)
        first = await orch.reset()
        assert calls == ["count_open_sessions", "commit"]  # admission's count, then session and record together
        session = await orch.store.get_session(first.session_id)
        assert session is not None and session.version == 1 and session.token_hash == token_hash(first.agent_token)
        record = await orch.store.get_request(RESETS, "r1")
        assert record is not None and record.state == RequestState.DONE and record.owner == ""

        # A repeat: its registering write finds the record first and writes nothing; the recorded answer is
        # given with a fresh token.
        again = await orch.reset()
        assert (again.session_id, again.episode, again.tools) == (first.session_id, 1, first.tools)
        assert again.agent_token != first.agent_token
        session = await orch.store.get_session(first.session_id)
        assert session is not None and session.token_hash == token_hash(again.agent_token)
        assert await orch.store.count_open_sessions() == 1
    finally:
        await orch.store.close()


async def test_one_request_reset_on_two_replicas_at_once_registers_one_session() -> None:
    # Neither claims first: both do the work, one registering write wins, the other finds its record and
    # answers as a repeat (a fresh token, so only the later answer's holder acts).
    one = await static_orch(owner="orch-1")
    two = await static_orch(FaultyMemoryStore(one.store.data), owner="orch-2")
    try:
        calls = [store_calls(one.store), store_calls(two.store)]
        async with one.store.paused():  # both reach the store before either write lands
            racing = [asyncio.ensure_future(orch.reset()) for orch in (one, two)]
            await asyncio.sleep(0.05)
        answers = await asyncio.gather(*racing)
        assert all(c[:2] == ["count_open_sessions", "commit"] and "claim_request" not in c for c in calls), calls
        assert {a.session_id for a in answers} == {session_id_for_request("", "r1")}
        assert {a.episode for a in answers} == {1} and answers[0].agent_token != answers[1].agent_token
        assert await one.store.count_open_sessions() == 1
        session = await one.store.get_session(answers[0].session_id)
        assert session is not None and session.token_hash in {token_hash(a.agent_token) for a in answers}
        record = await one.store.get_request(RESETS, "r1")
        assert record is not None and record.state == RequestState.DONE
    finally:
        await one.store.close()


async def test_a_failed_registering_write_on_static_endpoints_leaves_nothing_and_a_retry_registers() -> None:
    orch = await static_orch()
    try:
        orch.store.fail("commit")
        with pytest.raises(StoreError):
            await orch.reset()
        assert await orch.record_state() is None and await orch.store.count_open_sessions() == 0
        response = await orch.reset()
        assert response.session_id == session_id_for_request("", "r1") and await orch.record_state() == "done"
    finally:
        await orch.store.close()


async def test_store_failing_to_record_the_instance_deletes_it(orch: Orch) -> None:
    orch.store.fail("put_intent", after=1)  # the intent is written, the instance created, its update fails
    with pytest.raises(StoreError):
        await orch.reset()
    assert orch.provider.created == ["fake-1"] and orch.provider.live == {}
    await orch.assert_nothing_leaked()


async def test_store_failing_on_the_done_record_answers_the_retry_then_records_it_in_the_background(
    orch: Orch,
) -> None:
    orch.store.fail("commit", times=None)  # the DONE record cannot be written (the store refuses writes)
    with pytest.raises(StoreError):
        await orch.reset()
    assert await orch.record_state() == RequestState.PENDING  # kept with the session it answers for
    with pytest.raises(StoreError):  # the fresh token a repeat needs cannot be written either
        await orch.reset()

    orch.store.heal()
    retry = await orch.reset()  # the answer this process holds, with a fresh token
    assert retry.session_id == session_id_for_request("", "r1") and retry.episode == 1
    session = await orch.store.get_session(retry.session_id)
    assert session is not None and session.token_hash == token_hash(retry.agent_token)
    async with asyncio.timeout(10):  # written in the background now that the store takes writes (polled)
        while True:
            if await orch.record_state() == RequestState.DONE:
                break
            await asyncio.sleep(0.01)
    again = await orch.reset()
    assert again.session_id == retry.session_id and again.episode == 1
    assert orch.provider.created == ["fake-1"]  # provisioned once for every answer
    await orch.assert_nothing_leaked()
