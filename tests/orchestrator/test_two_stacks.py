"""Two deployments with their own stores on one Fleet account (one localfleet) never touch each other.

Each store makes its own identity once and keeps it: the default run id is derived from it, so two stacks
do not share a run id by accident, and one restarted keeps its own. And even when both are configured with
the same run id, reconciliation only deletes instances it can prove are its own (an intent of its store):
each stack reconciles (one of them restarted) while the other's sessions live on and its episodes still
score."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from fleet import AsyncFleet

from rlgate.orchestrator.config import OrchestratorConfig
from rlgate.orchestrator.providers.base import INTENT_ENV_VAR
from rlgate.orchestrator.provisioning import default_run_id, new_intent_id, store_identity
from rlgate.orchestrator.server import OrchestratorHandle, start_orchestrator
from rlgate.store import SessionStore, open_store
from rlgate.store.sqlite import SqliteStore
from rlgate.v1 import common_pb2, orchestrator_pb2, orchestrator_pb2_grpc
from tests.orchestrator.conftest import fast_config, instances_of
from tests.support.localfleet import LocalfleetProcess
from tests.support.redis import RedisServer

TASK = "mailbox-count-unread-from-kenji"
ANSWER = "3"
SESSIONS = 3


@dataclass
class Stack:
    """One deployment: its own store and an orchestrator on it (restartable)."""

    name: str
    store: SessionStore
    config: OrchestratorConfig
    handle: OrchestratorHandle | None = None
    channel: grpc.aio.Channel | None = None

    async def start(self) -> None:
        self.handle = await start_orchestrator(self.config, self.store)
        self.channel = grpc.aio.insecure_channel(self.handle.address)

    async def stop(self) -> None:
        if self.channel is not None:
            await self.channel.close()
        if self.handle is not None:
            await self.handle.stop()
        self.handle = self.channel = None

    @property
    def stub(self) -> orchestrator_pb2_grpc.OrchestratorServiceStub:
        assert self.channel is not None
        return orchestrator_pb2_grpc.OrchestratorServiceStub(self.channel)

    @property
    def run_id(self) -> str:
        assert self.handle is not None
        return self.handle.config.run_id

    @property
    def store_id(self) -> str:
        assert self.handle is not None
        return self.handle.orchestrator.provisioner.store_id


@pytest.fixture
async def stacks(tmp_path: Path) -> AsyncIterator[Callable[..., Any]]:
    made: list[Stack] = []

    async def make(name: str, config: OrchestratorConfig) -> Stack:
        stack = Stack(name, await SqliteStore.open(str(tmp_path / f"{name}.db")), config)
        made.append(stack)
        await stack.start()
        return stack

    yield make
    for stack in made:
        with contextlib.suppress(Exception):
            await stack.stop()
        await stack.store.close()


async def test_a_stores_identity_is_made_once_and_kept(tmp_path: Path) -> None:
    first = await open_store(f"sqlite:///{tmp_path / 'a.db'}")
    again = await open_store(f"sqlite:///{tmp_path / 'a.db'}")
    other = await open_store(f"sqlite:///{tmp_path / 'b.db'}")
    try:
        ids = await asyncio.gather(*(store_identity(s) for s in (first, again, first, again)))
        assert len(set(ids)) == 1  # concurrent first uses agree
        await first.prune(closed_before=float("inf"), requests_before=float("inf"))  # retention keeps it
        assert await store_identity(again) == ids[0]
        assert await store_identity(other) != ids[0]
    finally:
        for store in (first, again, other):
            await store.close()


@pytest.mark.redis
async def test_a_redis_stores_identity_is_one_for_every_process(redis_server: RedisServer) -> None:
    stores = [await open_store(redis_server.url) for _ in range(3)]
    try:
        ids = await asyncio.gather(*(store_identity(s) for s in stores))  # concurrent first uses
        assert len(set(ids)) == 1
        await stores[0].prune(closed_before=float("inf"), requests_before=float("inf"))
        assert await store_identity(stores[1]) == ids[0]
    finally:
        for store in stores:
            await store.close()


async def test_the_default_run_id_is_per_store_and_survives_a_restart(
    lf: LocalfleetProcess, stacks: Callable[..., Any]
) -> None:
    a: Stack = await stacks("a", fast_config(lf, run_id=""))
    b: Stack = await stacks("b", fast_config(lf, run_id=""))
    assert a.run_id == default_run_id(a.store_id) and b.run_id == default_run_id(b.store_id)
    assert a.run_id != b.run_id
    before = a.run_id
    await a.stop()
    await a.start()
    assert a.run_id == before
    explicit: Stack = await stacks("c", fast_config(lf, run_id="configured"))
    assert explicit.run_id == "configured"  # an explicitly configured run id wins


async def _open(stack: Stack) -> list[orchestrator_pb2.ResetResponse]:
    return list(
        await asyncio.gather(
            *(
                stack.stub.Reset(
                    orchestrator_pb2.ResetRequest(task_key=TASK, request_id=f"{stack.name}-{i}"), timeout=60
                )
                for i in range(SESSIONS)
            )
        )
    )


async def _score(stack: Stack, resets: list[orchestrator_pb2.ResetResponse]) -> None:
    for reset in resets:
        step = await stack.stub.Step(
            orchestrator_pb2.StepRequest(
                session_id=reset.session_id, final_answer=ANSWER, request_id=f"end-{reset.session_id}"
            ),
            timeout=60,
        )
        assert step.done and step.reward == 1.0, (stack.name, step)
        assert step.verification.status == common_pb2.VERIFICATION_STATUS_OK
        await stack.stub.Close(orchestrator_pb2.CloseRequest(session_id=reset.session_id), timeout=30)


@pytest.mark.parametrize("run_ids", ["per store", "shared"])
async def test_each_stack_reconciles_and_the_other_lives_on(
    lf: LocalfleetProcess, stacks: Callable[..., Any], run_ids: str
) -> None:
    run_id = "" if run_ids == "per store" else f"shared-{lf.port}"
    config = fast_config(lf, run_id=run_id, shutdown_mode="handoff", reconcile_interval_s=3600)
    a: Stack = await stacks("a", config)
    b: Stack = await stacks("b", config)
    opened = {"a": await _open(a), "b": await _open(b)}
    live = {r.instance.instance_id for rs in opened.values() for r in rs}

    # An orphan of each stack: an intent id of its store whose record is gone (a crash after the create).
    fleet = AsyncFleet(api_key="t", base_url=lf.base_url)
    orphans = {}
    for stack in (a, b):
        made = await fleet.make(
            "mailbox:v1",
            run_id=stack.run_id,
            ttl_seconds=300,
            env_variables={INTENT_ENV_VAR: new_intent_id("orch-gone", stack.store_id)},
        )
        orphans[stack.name] = made.instance_id

    # Restart a (its start-up pass reconciles), then reconcile b too.
    await a.stop()
    await a.start()
    assert a.handle is not None and b.handle is not None
    report_b = await b.handle.orchestrator.reconciler.run_once()
    report_a = await a.handle.orchestrator.reconciler.run_once()
    assert report_a.ran and report_b.ran
    if run_ids == "shared":  # each lists the other's instances under the run id, and leaves them alone
        assert report_a.foreign >= SESSIONS and report_b.foreign >= SESSIONS
    left = {i["instance_id"] for i in instances_of(lf, a.run_id)} | {
        i["instance_id"] for i in instances_of(lf, b.run_id)
    }
    assert live <= left, f"a live session's instance was deleted: {live - left}"
    assert not left & set(orphans.values()), "each stack deletes its own orphan"

    # Every episode of both stacks still scores (b never restarted; a's sessions resumed after its restart).
    await _score(b, opened["b"])
    await _score(a, opened["a"])
    for stack in (a, b):
        assert instances_of(lf, stack.run_id) == []
