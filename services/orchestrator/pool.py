"""Warm pools: idle instances per env key, created ahead of demand so Reset skips provisioning.

Pool instances are real instances with POOLED intents (reaped like any other if this process dies). Only a
live instance is handed out: one idle longer than `pool_max_age_s` (its TTL runs from its create, so an old
one may die mid-episode) or failing its health check (the provider says it is not running, or its manager
does not answer /health) is deleted instead and the next one tried; the refill replaces it. The refill loop
also sweeps out instances that aged past the bound while waiting. A refill task per env key tops the pool up
to its target in the background (through the provisioner, so it obeys admission control, at background
priority: Resets' creates go first). Instances handed out count as *reused*: a failing reset is fatal for
them and they are replaced.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from dataclasses import dataclass, field

from rlgate.core.errors import RlgateError
from rlgate.orchestrator import metrics
from rlgate.orchestrator.config import OrchestratorConfig
from rlgate.orchestrator.providers.base import InstanceHandle, Provider
from rlgate.orchestrator.provisioning import Provisioner
from rlgate.runtime.deadline import Deadline
from rlgate.store import Intent, IntentState

log = logging.getLogger(__name__)


def parse_pool_targets(spec: str) -> dict[str, int]:
    """'mailbox:v1=4,tracker:v1=2' -> {'mailbox:v1': 4, 'tracker:v1': 2}."""
    out: dict[str, int] = {}
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        key, sep, count = part.rpartition("=")
        if not sep or not key or not count.strip().isdigit():
            raise ValueError(f"bad warm pool entry {part!r} (want env_key=count)")
        out[key.strip()] = int(count)
    return out


@dataclass
class PoolEntry:
    handle: InstanceHandle
    intent: Intent
    pooled_at: float = field(default_factory=time.monotonic)  # when it (re)entered the pool

    def age(self) -> float:
        return time.monotonic() - self.pooled_at


class WarmPool:
    def __init__(self, config: OrchestratorConfig, provider: Provider, provisioner: Provisioner) -> None:
        self._config = config
        self._provider = provider
        self._provisioner = provisioner
        self.targets = parse_pool_targets(config.warm_pool) if provider.manages_instances else {}
        self._idle: dict[str, deque[PoolEntry]] = {k: deque() for k in self.targets}
        self._filling: dict[str, int] = dict.fromkeys(self.targets, 0)
        self._wake = asyncio.Event()
        self._closed = False
        self._claimed: set[str] = set()  # intents handed out, not yet bound to a session or released

    def size(self, env_key: str) -> int:
        return len(self._idle.get(env_key, ()))

    def instance_ids(self) -> list[str]:
        return [e.handle.instance_id for q in self._idle.values() for e in q]

    def intent_ids(self) -> set[str]:
        """Intents this pool still answers for: idle entries and hand-outs not yet settled (reconciliation
        keeps their instances)."""
        return {e.intent.intent_id for q in self._idle.values() for e in q} | self._claimed

    def claim(self, intent_id: str) -> None:
        """An instance on its way into this pool (being reset after Close): keep it through reconciliation."""
        self._claimed.add(intent_id)

    def settled(self, intent_id: str) -> None:
        """A handed-out instance is now bound to a session (or released)."""
        self._claimed.discard(intent_id)

    def _gauge(self, env_key: str) -> None:
        metrics.POOL_SIZE.labels(env_key).set(self.size(env_key))

    async def take(self, env_key: str) -> PoolEntry | None:
        """A healthy idle instance, or None (a miss: the caller provisions)."""
        queue = self._idle.get(env_key)
        while queue:
            entry = queue.popleft()
            self._gauge(env_key)
            self._wake.set()
            self._claimed.add(entry.intent.intent_id)
            why = await self._unfit(entry)
            if not why:
                metrics.POOL_HITS.labels("hit").inc()
                return entry
            self._claimed.discard(entry.intent.intent_id)
            metrics.POOL_DISCARDED.labels(why).inc()
            log.warning("pool instance %s %s; deleting it", entry.handle.instance_id, why)
            await asyncio.shield(self._provisioner.release(entry.handle.instance_id, entry.intent.intent_id))
        if env_key in self.targets:
            metrics.POOL_HITS.labels("miss").inc()
        return None

    async def _unfit(self, entry: PoolEntry) -> str:
        """Why an idle instance must not be handed out ("" when it is fit): too old, or not alive."""
        if self._too_old(entry):
            return "aged out"
        if not await self._provider.health(entry.handle, timeout_s=self._config.health_timeout_s):
            return "failed its health check"
        return ""

    def _too_old(self, entry: PoolEntry) -> bool:
        return self._config.pool_max_age_s > 0 and entry.age() > self._config.pool_max_age_s

    def _sweep(self, env_key: str, tasks: set[asyncio.Task[None]]) -> None:
        """Delete the idle instances that aged out while waiting (the refill replaces them)."""
        queue = self._idle[env_key]
        stale = [e for e in queue if self._too_old(e)]
        for entry in stale:
            queue.remove(entry)
            metrics.POOL_DISCARDED.labels("aged out").inc()
            log.info("pool instance %s aged out; deleting it", entry.handle.instance_id)
            task = asyncio.create_task(self._delete(entry))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if stale:
            self._gauge(env_key)

    async def _delete(self, entry: PoolEntry) -> None:
        await self._provisioner.release(entry.handle.instance_id, entry.intent.intent_id)

    async def put_back(self, entry: PoolEntry) -> bool:
        """Return a clean instance to its pool if below target (Close with pool_on_close)."""
        queue = self._idle.get(entry.handle.env_key)
        if self._closed or queue is None or len(queue) >= self.targets[entry.handle.env_key]:
            return False
        await self._provisioner.set_intent(entry.intent.intent_id, IntentState.POOLED)
        self._claimed.discard(entry.intent.intent_id)
        entry.pooled_at = time.monotonic()
        queue.append(entry)
        self._gauge(entry.handle.env_key)
        return True

    async def run(self) -> None:
        """Background refill: keep every pool at its target (owned by the Supervisor)."""
        tasks: set[asyncio.Task[None]] = set()
        try:
            while True:
                self._wake.clear()
                for env_key, target in ({} if self._closed else self.targets).items():
                    self._sweep(env_key, tasks)
                    missing = target - len(self._idle[env_key]) - self._filling[env_key]
                    for _ in range(max(0, missing)):
                        self._filling[env_key] += 1
                        task = asyncio.create_task(self._fill_one(env_key))
                        tasks.add(task)
                        task.add_done_callback(tasks.discard)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), 2.0)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _fill_one(self, env_key: str) -> None:
        try:
            handle, intent = await self._provisioner.create(
                env_key, Deadline(self._config.provision_timeout_s), state=IntentState.POOLED, background=True
            )
        except RlgateError as exc:
            log.warning("warm pool %s: create failed: %s", env_key, exc.message)
            await asyncio.sleep(1.0)
            return
        finally:
            self._filling[env_key] -= 1
            self._wake.set()
        if self._closed:
            await asyncio.shield(self._provisioner.release(handle.instance_id, intent.intent_id))
            return
        self._idle[env_key].append(PoolEntry(handle, intent))
        self._gauge(env_key)

    async def drain(self) -> None:
        """Shutdown: delete every idle instance."""
        self._closed = True
        entries = [e for q in self._idle.values() for e in q]
        for q in self._idle.values():
            q.clear()
        await asyncio.gather(
            *(self._provisioner.release(e.handle.instance_id, e.intent.intent_id) for e in entries),
            return_exceptions=True,
        )
        for env_key in self.targets:
            self._gauge(env_key)
