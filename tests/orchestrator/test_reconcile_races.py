"""Reconciliation racing live traffic: many concurrent Resets (warm-pool hand-outs and fresh creates) and
Closes with a reconcile pass every fraction of a second. No instance of a live session may ever be deleted;
real orphans (an intent of this store whose record is gone; an intent of a dead process) are still deleted,
exactly once; an instance of the run id that is not provably this store's is never touched."""

from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
import httpx
import pytest
from fleet import AsyncFleet

from rlgate.orchestrator.providers.base import INTENT_ENV_VAR, InstanceHandle
from rlgate.orchestrator.provisioning import INTENT_SEP, new_intent_id
from rlgate.store import Intent, IntentState, Session, SessionStatus, SessionStore
from rlgate.v1 import orchestrator_pb2
from tests.orchestrator.conftest import Running, fast_config, instances_of
from tests.support.localfleet import AUTH, LocalfleetProcess
from tests.support.wait import wait_until

TASK = "mailbox-count-unread-from-kenji"
WORKERS = 16
EPISODES_PER_WORKER = 4
TURNS = 3
PASS_SUMMARY = re.compile(r"reconcile: \d+ instance\(s\), kept ")


class DeletionLog(logging.Handler):
    """Every 'deleting orphan' decision the reconciler logs: (time, instance id); and how many passes ran."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.deleted: list[tuple[float, str]] = []
        self.passes = 0  # each pass that ran ends with one summary line

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith("reconcile: deleting orphan instance") and record.args:
            self.deleted.append((record.created, str(record.args[0])))  # type: ignore[index]
        elif PASS_SUMMARY.match(message):
            self.passes += 1


@dataclass
class Episode:
    instance_id: str
    opened: float  # Reset answered
    closing: float  # Close about to be sent


@pytest.fixture
def deletions() -> Any:
    handler = DeletionLog()
    logger = logging.getLogger("rlgate.orchestrator.reconcile")
    logger.addHandler(handler)
    old = logger.level
    logger.setLevel(logging.INFO)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old)


async def plant(lf: LocalfleetProcess, run_id: str, env_variables: dict[str, str], *, orphan: bool = False) -> str:
    """A running mailbox instance of `run_id`, created behind the orchestrators' backs; its id. An `orphan`
    may be deleted by a reconcile pass before its create answers (409 naming it): that is its id too."""
    body = {"env_key": "mailbox:v1", "run_id": run_id, "ttl_seconds": 300, "env_variables": env_variables}
    async with httpx.AsyncClient() as http:
        r = await http.post(f"{lf.base_url}/v1/env/instances", json=body, headers=AUTH, timeout=30)
    gone = re.search(r"instance (\w+) was deleted while being created", r.text) if r.status_code == 409 else None
    if orphan and gone is not None:
        return gone.group(1)
    assert r.status_code == 200, r.text
    return str(r.json()["instance_id"])


@pytest.mark.parametrize("replicas", [1, 2])
async def test_reconcile_never_deletes_a_live_sessions_instance(
    lf: LocalfleetProcess,
    orchestrator_factory: Callable[..., Any],
    store: SessionStore,
    deletions: DeletionLog,
    replicas: int,
) -> None:
    """With two replicas on one store, the lease holder judges the other's hand-outs and creates too."""
    config = fast_config(lf, warm_pool="mailbox:v1=4", reconcile_interval_s=0.2, max_concurrent_creates=16)
    orchs: list[Running] = [await orchestrator_factory(config) for _ in range(replicas)]
    run_id = config.run_id
    fleet = AsyncFleet(api_key="t", base_url=lf.base_url)
    # Real orphans, planted after the start-up pass: one naming an intent of this store whose record is gone,
    # one whose intent belongs to a process that is gone (never heartbeated). And a stranger: the same run
    # id but no intent of this store (another deployment's), which must be left alone.
    store_id = orchs[0].handle.orchestrator.provisioner.store_id
    # Planted through the control plane's create, which answers once the instance runs: the SDK's make()
    # would poll it afterwards and fail if a reconcile pass had already deleted it (as it should).
    lost = await plant(lf, run_id, {INTENT_ENV_VAR: new_intent_id("x", store_id)}, orphan=True)
    stranger = await plant(lf, run_id, {})
    dead_intent = Intent(
        intent_id=f"orch-gone{INTENT_SEP}0123456789abcdef",
        run_id=run_id,
        env_key="mailbox:v1",
        state=IntentState.CREATING,
    )
    await store.put_intent(dead_intent)
    dead = await plant(lf, run_id, {INTENT_ENV_VAR: dead_intent.intent_id}, orphan=True)
    orphans = {lost, dead}

    episodes: list[Episode] = []
    failures: list[str] = []

    async def episode(orch: Running, http: httpx.AsyncClient) -> None:
        reset = await orch.stub.Reset(orchestrator_pb2.ResetRequest(task_key=TASK), timeout=120)
        instance_id = reset.instance.instance_id
        opened = time.time()
        try:
            for turn in range(TURNS):
                await asyncio.sleep(0.15)  # let reconcile passes run while the session is live
                r = await http.get(f"{lf.base_url}/instances/{instance_id}/api/v1/env/health", timeout=30)
                if r.status_code != 200:
                    failures.append(
                        f"session {reset.session_id}: instance {instance_id} answered {r.status_code} on turn {turn}"
                    )
                await orch.stub.Step(orchestrator_pb2.StepRequest(session_id=reset.session_id), timeout=60)
        finally:
            episodes.append(Episode(instance_id, opened, time.time()))
            await orch.stub.Close(orchestrator_pb2.CloseRequest(session_id=reset.session_id), timeout=60)

    async def worker(n: int, http: httpx.AsyncClient) -> None:
        for _ in range(EPISODES_PER_WORKER):
            try:
                await episode(orchs[n % replicas], http)
            except grpc.aio.AioRpcError as exc:
                failures.append(f"{exc.code().name}: {exc.details()}")

    async with httpx.AsyncClient() as http:
        await asyncio.gather(*(worker(n, http) for n in range(WORKERS)))

    # The real orphans deleted, then two more passes (the second begun after the traffic and the deletions):
    # what reconciliation deleted is final.
    await wait_until(lambda: orphans <= {iid for _, iid in deletions.deleted}, 30, "both real orphans deleted")
    passes = deletions.passes
    await wait_until(lambda: deletions.passes >= passes + 2, 30, "two more reconcile passes")
    live_deleted = [
        f"{iid} deleted at +{at - ep.opened:.2f}s of its session"
        for at, iid in deletions.deleted
        for ep in episodes
        if iid == ep.instance_id and ep.opened <= at <= ep.closing
    ]
    assert not live_deleted, f"reconcile deleted live sessions' instances: {live_deleted[:5]}"
    assert not failures, failures[:5]
    assert len(episodes) == WORKERS * EPISODES_PER_WORKER
    counts = Counter(iid for _, iid in deletions.deleted)
    assert {iid: counts[iid] for iid in orphans} == dict.fromkeys(orphans, 1)  # each real orphan exactly once
    left = {i["instance_id"] for i in instances_of(lf, run_id)}
    assert not left & orphans
    assert stranger in left and stranger not in counts  # never judged, never deleted
    assert await store.get_intent(dead_intent.intent_id) is None
    await fleet.delete(stranger)


async def test_orphan_verdicts_use_the_current_records(
    lf: LocalfleetProcess,
    orchestrator_factory: Callable[..., Any],
    store: SessionStore,
) -> None:
    """Each window between create, intent update, session registration and close, judged directly."""
    orch: Running = await orchestrator_factory(fast_config(lf, reconcile_interval_s=3600))
    o = orch.handle.orchestrator
    run_id = orch.config.run_id
    fleet = AsyncFleet(api_key="t", base_url=lf.base_url)
    other = f"orch-other-{uuid.uuid4().hex[:6]}"
    await store.heartbeat_owner(other, 60)

    async def instance(intent: Intent | None, *, record_id: bool = True, intent_id: str = "") -> InstanceHandle:
        if intent is not None:
            await store.put_intent(intent)
        intent_id = intent.intent_id if intent else intent_id
        env = {INTENT_ENV_VAR: intent_id} if intent_id else {}
        made = await fleet.make("mailbox:v1", run_id=run_id, ttl_seconds=300, env_variables=env)
        [handle] = [
            h for h in await o.provider.list_instances(run_id, timeout_s=10) if h.instance_id == made.instance_id
        ]
        if intent is not None and record_id:
            intent.instance_id = handle.instance_id
            await store.put_intent(intent)
        return handle

    def intent(owner: str, state: str, *, age: float = 0.0, session_id: str = "") -> Intent:
        at = time.time() - age
        return Intent(
            intent_id=new_intent_id(owner, o.provisioner.store_id),
            run_id=run_id,
            env_key="mailbox:v1",
            state=state,
            session_id=session_id,
            created_at=at,
            updated_at=at,
        )

    async def session(handle: InstanceHandle, status: SessionStatus, *, closed_ago: float = 0.0) -> str:
        sid = f"s-{uuid.uuid4().hex[:24]}"
        await store.create_session(
            Session(
                session_id=sid,
                env_key="mailbox:v1",
                status=status,
                orchestrator_run=run_id,
                instance_id=handle.instance_id,
                closed_at=time.time() - closed_ago if closed_ago else 0.0,
            )
        )
        return sid

    async def verdict(handle: InstanceHandle, snapshot_at: float) -> str | None:
        return await o.reconciler._orphan_reason(handle, handle.intent_id, snapshot_at)

    before = time.time() - 1.0  # a snapshot taken before everything below was written
    # No intent, or another store's: not provably ours, never an orphan however old.
    assert await verdict(await instance(None), time.time()) is None
    assert await verdict(await instance(None, intent_id=new_intent_id(o.owner, "0123456789ab")), time.time()) is None
    # An intent id of this store whose record is gone: younger than the snapshot -> the record may be
    # settling; older -> orphan.
    lost = await instance(None, intent_id=new_intent_id("orch-gone", o.provisioner.store_id))
    assert await verdict(lost, before) is None
    assert await verdict(lost, time.time()) == "intent gone"
    # An intent written after the snapshot: a create in flight of a live process, of a dead one.
    assert await verdict(await instance(intent(o.owner, IntentState.CREATING)), before) is None
    assert await verdict(await instance(intent(other, IntentState.CREATING)), before) is None
    assert (
        await verdict(await instance(intent("orch-gone", IntentState.CREATING)), before)
        == "intent creating, owner gone"
    )
    # POOLED: another live process's pool; this process's pool entry about to be appended; a lost one.
    assert await verdict(await instance(intent(other, IntentState.POOLED, age=300)), before) is None
    assert await verdict(await instance(intent(o.owner, IntentState.POOLED)), before) is None
    assert (
        await verdict(await instance(intent(o.owner, IntentState.POOLED, age=300)), before)
        == "intent pooled, not in this process's pool"
    )
    # BOUND: to a session registered after the snapshot; to one closed just now (its closer releases it);
    # to one closed long ago; to one not registered yet (a hand-out of a live process, moments ago).
    bound = await instance(intent(o.owner, IntentState.BOUND, age=300))
    b = await store.get_intent(bound.intent_id)
    assert b is not None
    b.session_id = await session(bound, SessionStatus.ACTIVE)
    await store.put_intent(b)
    assert await verdict(bound, before) is None
    closed = await instance(intent(other, IntentState.BOUND, age=300))
    c = await store.get_intent(closed.intent_id)
    assert c is not None
    c.session_id = await session(closed, SessionStatus.CLOSED, closed_ago=1.0)
    await store.put_intent(c)
    assert await verdict(closed, before) is None
    long_closed = await instance(intent(other, IntentState.BOUND, age=300))
    lc = await store.get_intent(long_closed.intent_id)
    assert lc is not None
    lc.session_id = await session(long_closed, SessionStatus.CLOSED, closed_ago=300.0)
    await store.put_intent(lc)
    assert await verdict(long_closed, before) == "intent bound, session closed"
    assert await verdict(await instance(intent(other, IntentState.BOUND, session_id="s-not-yet")), before) is None
    # DELETING: a release in progress is left to the releaser; a stalled one and a failed create (its
    # intent never learnt the instance id) are orphans.
    assert await verdict(await instance(intent(o.owner, IntentState.DELETING)), before) is None
    assert await verdict(await instance(intent(o.owner, IntentState.DELETING, age=300)), before) == "intent deleting"
    assert (
        await verdict(await instance(intent(o.owner, IntentState.DELETING), record_id=False), before)
        == "intent deleting"
    )

    for h in await o.provider.list_instances(run_id, timeout_s=10):
        await fleet.delete(h.instance_id)
