"""Periodic upkeep: TTL/idle reaping of abandoned sessions, instance heartbeats, retention pruning.

Trainers do not always call Close; a session past its TTL (`expires_at`) or idle longer than
`idle_timeout_s` (no Step, no tool call: the gateway touches `last_active_at`) is EXPIRED: token revoked,
instance released. The compare-and-set in `closing` makes exactly one replica win each expiry.
"""

from __future__ import annotations

import asyncio
import logging
import time

from rlgate.orchestrator import metrics
from rlgate.orchestrator.config import OrchestratorConfig
from rlgate.orchestrator.episodes import Episodes
from rlgate.orchestrator.pool import WarmPool
from rlgate.orchestrator.providers.base import InstanceGone, Provider, ProviderError
from rlgate.orchestrator.sessions import Sessions
from rlgate.store import Session, SessionStatus, SessionStore, Upkeep

log = logging.getLogger(__name__)


class Reaper:
    def __init__(self, config: OrchestratorConfig, episodes: Episodes) -> None:
        self._config = config
        self._episodes = episodes

    async def run_once(self, now: float | None = None) -> list[str]:
        """Expire due sessions of this run; returns the ids this call expired."""
        at = time.time() if now is None else now
        reaped: list[str] = []
        for s in await self._episodes.sessions.open_sessions(orchestrator_run=self._config.run_id):
            reason = self.due(s, at)
            # Re-checked on the fresh record inside the compare-and-set: activity since the listing wins.
            if reason and await self._episodes.closing.expire(
                s.session_id, f"reaped: {reason}", only_if=lambda fresh: bool(self.due(fresh, at))
            ):
                metrics.REAPED.labels(reason).inc()
                reaped.append(s.session_id)
        return reaped

    def due(self, s: Session, now: float) -> str:
        """Why `s` should be reaped now ("ttl", "idle") or ""."""
        if s.status == SessionStatus.PROVISIONING:
            return ""  # a reset in flight; reconciliation handles one that never finishes
        if s.expires_at and s.expires_at <= now:
            return "ttl"
        if self._config.idle_timeout_s > 0 and s.last_active_at + self._config.idle_timeout_s <= now:
            return "idle"
        return ""


class Heartbeater:
    """Heartbeats every instance this run holds (sessions and warm pools), so Fleet keeps them alive while
    rlgate does, and lets them die on their own (heartbeat_interval) when rlgate and its store are gone."""

    def __init__(
        self, config: OrchestratorConfig, store: SessionStore, provider: Provider, sessions: Sessions, pool: WarmPool
    ) -> None:
        self._config = config
        self._store = store
        self._provider = provider
        self._sessions = sessions
        self._pool = pool

    async def run_once(self) -> int:
        if not self._provider.manages_instances:
            return 0
        sessions = await self._sessions.open_sessions(orchestrator_run=self._config.run_id)
        ids = {s.instance_id for s in sessions if s.instance_id} | set(self._pool.instance_ids())
        sem = asyncio.Semaphore(16)

        async def beat(instance_id: str) -> bool:
            async with sem:
                try:
                    await self._provider.heartbeat(instance_id, timeout_s=self._config.provider_timeout_s)
                    return True
                except InstanceGone:
                    log.warning("heartbeat: instance %s is gone", instance_id)
                except ProviderError as exc:
                    log.warning("heartbeat of %s failed: %s", instance_id, exc)
                return False

        results = await asyncio.gather(*(beat(i) for i in ids))
        return sum(results)


async def prune(config: OrchestratorConfig, store: Upkeep) -> int:
    """Retention: drop closed sessions and finished request records older than `retention_s`."""
    cutoff = time.time() - config.retention_s
    removed = await store.prune(cutoff, cutoff)
    if removed:
        log.info("retention: pruned %d record(s)", removed)
    return removed
