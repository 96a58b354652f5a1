"""Each of the orchestrator's retry loops draws its delays from `rlgate.core.backoff.Backoff`, one retry index
after another, with the schedule it documents: the loop's backoff is swapped for a recorder that notes the
nominal (unjittered) delay and jitter the loop asked for and sleeps a hundredth of it."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import pytest

from rlgate.core.backoff import Backoff
from rlgate.core.errors import RlgateError
from rlgate.orchestrator.config import OrchestratorConfig
from rlgate.orchestrator.providers.base import InstanceHandle, InstanceLimit, Retryable, TaskDef
from rlgate.orchestrator.providers.fleet import FleetProvider
from rlgate.orchestrator.providers.mcp import McpProvider
from rlgate.orchestrator.provisioning import Provisioner
from rlgate.orchestrator.service import Orchestrator
from rlgate.orchestrator.verifier import Verifier
from rlgate.runtime.deadline import Deadline
from rlgate.store.sqlite import SqliteStore
from tests.orchestrator.test_units import _RejectingProvider, _ScriptedProvider

SCALE = 0.01  # of each nominal delay actually slept


@dataclass(frozen=True)
class RecordingBackoff(Backoff):
    """The schedule of the backoff it copies; notes (retry index, nominal delay, jitter) per delay asked."""

    asked: list[tuple[int, float, float]] = field(default_factory=list)

    @classmethod
    def of(cls, backoff: Backoff) -> RecordingBackoff:
        return cls(**asdict(backoff))

    def delay(self, retry_index: int, rng: Callable[[], float] = random.random) -> float:
        nominal = Backoff(self.initial, self.maximum, self.multiplier, jitter=0.0).delay(retry_index)
        self.asked.append((retry_index, nominal, self.jitter))
        return nominal * SCALE


def _doubling(initial: float, maximum: float, n: int) -> list[float]:
    return [min(maximum, initial * 2**i) for i in range(n)]


@pytest.mark.parametrize(("error", "jitter"), [(Retryable("503 placement"), 0.5), (InstanceLimit("full", 9, 9), 0.0)])
async def test_provisioning_waits_025s_doubling_to_5s(error: Exception, jitter: float, tmp_path: Path) -> None:
    store = await SqliteStore.open(str(tmp_path / "s.db"))
    try:
        provider = _RejectingProvider(error)
        provisioner = Provisioner(OrchestratorConfig(run_id="unit"), store, provider, "owner-1")
        provisioner.backoff = recorder = RecordingBackoff.of(provisioner.backoff)
        with pytest.raises(RlgateError):
            await provisioner.create("mailbox:v1", Deadline(0.6))
    finally:
        await store.close()
    n = len(recorder.asked)
    assert n == provider.creates >= 7  # one delay after each failed attempt, reaching the ceiling
    # Transient failures are jittered ±50 %; the capacity wait is not (a deletion wakes it early).
    assert recorder.asked == [(i, d, jitter) for i, d in enumerate(_doubling(0.25, 5.0, n))]


async def test_verifier_waits_backoff_s_doubling() -> None:
    provider = _ScriptedProvider([Retryable("502")])
    verifier = Verifier(provider, timeout_s=5.0, retries=4, backoff_s=0.5)
    verifier.backoff = recorder = RecordingBackoff.of(verifier.backoff)
    task = TaskDef(key="k", env_id="e", version="v1", prompt="p", verifier_code="def verify(env): return 1")
    outcome = await verifier.run(task, InstanceHandle(instance_id="i", env_key="e:v1"), "answer")
    assert (outcome.status, outcome.attempts, provider.calls) == ("error", 5, 5)
    # Unjittered, uncapped doubling; no wait after the last attempt.
    assert recorder.asked == [(i, d, 0.0) for i, d in enumerate(_doubling(0.5, 1e9, 4))]


class _FlakyCatalog(McpProvider):
    def __init__(self, failures: int) -> None:
        super().__init__({})
        self.failures = failures
        self.loads = 0

    async def load_tasks(self, *, timeout_s: float) -> list[TaskDef]:
        self.loads += 1
        if self.loads <= self.failures:
            raise Retryable("catalog unavailable")
        return [TaskDef(key="k", env_id="e", version="v1", prompt="p")]


async def test_catalog_load_waits_05s_doubling_to_30s(tmp_path: Path) -> None:
    store = await SqliteStore.open(str(tmp_path / "s.db"))
    try:
        provider = _FlakyCatalog(failures=8)
        orchestrator = Orchestrator(OrchestratorConfig(run_id="unit"), store, provider, owns_store=False)
        orchestrator.catalog_backoff = recorder = RecordingBackoff.of(orchestrator.catalog_backoff)
        await asyncio.wait_for(orchestrator._load_tasks_until_done(), 30)
        assert orchestrator.tasks_loaded and provider.loads == 9
    finally:
        await store.close()
    # One wait before each of the 9 loads (the first one failed in start()), and the next one drawn for the log.
    assert recorder.asked == [(i, d, 0.25) for i, d in enumerate(_doubling(0.5, 30.0, 10))]


async def test_fleet_calls_wait_02s_doubling_to_2s() -> None:
    provider = FleetProvider("http://127.0.0.1:9", "key")
    provider.backoff = recorder = RecordingBackoff.of(provider.backoff)
    tries = 0

    async def flaky() -> str:
        nonlocal tries
        tries += 1
        if tries <= 6:
            raise httpx.ConnectError("refused")
        return "ok"

    try:
        assert await provider._call("probe", flaky, 10.0, attempts=7) == "ok"
    finally:
        await provider.close()
    assert recorder.asked == [(i, d, 0.5) for i, d in enumerate(_doubling(0.2, 2.0, 6))]
