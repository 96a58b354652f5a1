"""Reconciliation: make the provider's instances (tagged with this run_id) agree with the store.

Runs on start-up and every `reconcile_interval_s`, under a store lease so several orchestrators of the same
run never double-delete. For each live instance: an open session owns it -> keep (resumed); its intent is
a create in flight or a warm-pool entry of a live process -> keep; anything else is an orphan -> deleted
(a 404 counts as done, so a delete never happens twice in effect). Intents whose instance never appeared
are dropped once their owner is dead; sessions whose instance vanished (TTL, heartbeat, manual delete) are
marked FAILED; sessions stuck PROVISIONING by a dead process are failed and their instance released.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from rlgate.orchestrator import metrics
from rlgate.orchestrator.config import OrchestratorConfig
from rlgate.orchestrator.episodes import EpisodeManager
from rlgate.orchestrator.pool import WarmPool
from rlgate.orchestrator.providers.base import Provider
from rlgate.orchestrator.provisioning import Provisioner, intent_owner
from rlgate.store import Intent, IntentState, Session, SessionStatus, SessionStore

log = logging.getLogger(__name__)


@dataclass
class ReconcileReport:
    ran: bool = False
    instances: int = 0
    kept: int = 0
    orphans_deleted: int = 0
    intents_dropped: int = 0
    sessions_failed: int = 0


class Reconciler:
    def __init__(self, config: OrchestratorConfig, store: SessionStore, provider: Provider,
                 provisioner: Provisioner, pool: WarmPool, episodes: EpisodeManager, owner: str) -> None:
        self._config = config
        self._store = store
        self._provider = provider
        self._provisioner = provisioner
        self._pool = pool
        self._episodes = episodes
        self._owner = owner
        self.lease = f"reconcile:{config.run_id}"

    async def _alive(self, owner: str) -> bool:
        if not owner:
            return False
        return owner == self._owner or await self._store.owner_alive(owner)

    async def run_once(self, *, startup: bool = False) -> ReconcileReport:
        report = ReconcileReport()
        if not self._provider.manages_instances:
            return report
        ttl = max(10.0, self._config.reconcile_interval_s * 3)
        if not await self._store.acquire_lease(self.lease, self._owner, ttl):
            return report
        report.ran = True
        listed_at = time.time()
        sessions = await self._episodes.open_sessions(orchestrator_run=self._config.run_id)
        intents = {i.intent_id: i for i in await self._store.list_intents(self._config.run_id)}
        instances = await self._provider.list_instances(self._config.run_id,
                                                        timeout_s=self._config.provider_timeout_s)
        report.instances = len(instances)
        by_instance = {s.instance_id: s for s in sessions if s.instance_id}
        by_intent_instance = {i.instance_id: i for i in intents.values() if i.instance_id}
        live_ids = {inst.instance_id for inst in instances}
        seen_intents = {inst.intent_id for inst in instances if inst.intent_id}

        for inst in instances:
            if inst.instance_id in by_instance:
                report.kept += 1
                if startup:
                    metrics.RECONCILED.labels("session_resumed").inc()
                continue
            intent = intents.get(inst.intent_id) or by_intent_instance.get(inst.instance_id)
            if intent is not None and await self._keep(intent, by_instance):
                report.kept += 1
                continue
            log.warning("reconcile: deleting orphan instance %s (%s, intent %s)", inst.instance_id, inst.env_key,
                        intent.state if intent else "none")
            if await self._provisioner.release(inst.instance_id, intent.intent_id if intent else ""):
                report.orphans_deleted += 1
                metrics.RECONCILED.labels("orphan_deleted").inc()

        stale_after = self._config.provision_timeout_s + 30
        for intent in intents.values():
            if intent.instance_id in live_ids or intent.intent_id in seen_intents:
                continue
            owner_alive = await self._alive(intent_owner(intent.intent_id))
            age = listed_at - intent.updated_at
            drop = (
                (intent.state == IntentState.CREATING and not owner_alive)
                or (intent.state == IntentState.DELETING and (not owner_alive or age > stale_after))
                or (intent.state in (IntentState.BOUND, IntentState.POOLED) and age > 5)
            )
            if drop:
                await self._store.delete_intent(intent.intent_id)
                report.intents_dropped += 1

        stuck_after = self._config.provision_timeout_s + self._config.reset_timeout_s + 30
        for s in sessions:
            if s.status == SessionStatus.PROVISIONING:
                if s.updated_at < listed_at - stuck_after and await self._episodes.fail(
                        s.session_id, "reset did not finish (its owner is gone)"):
                    report.sessions_failed += 1
            elif s.instance_id and s.instance_id not in live_ids and await self._episodes.fail(
                    s.session_id, f"instance {s.instance_id} no longer exists", instance_id=s.instance_id):
                metrics.RECONCILED.labels("session_lost").inc()
                report.sessions_failed += 1
        log.info("reconcile: %d instance(s), kept %d, deleted %d orphan(s), dropped %d intent(s), failed %d "
                 "session(s)", report.instances, report.kept, report.orphans_deleted, report.intents_dropped,
                 report.sessions_failed)
        return report

    async def _keep(self, intent: Intent, by_instance: dict[str, Session]) -> bool:
        if intent.state == IntentState.CREATING:
            return await self._alive(intent_owner(intent.intent_id))  # a create still in flight
        if intent.state == IntentState.POOLED:
            if intent_owner(intent.intent_id) == self._owner:
                return intent.intent_id in self._pool.intent_ids()
            return await self._alive(intent_owner(intent.intent_id))
        if intent.state == IntentState.BOUND:
            # Bound but no open session uses it: the session closed and the delete never finished,
            # or the session record is gone.
            session = await self._store.get_session(intent.session_id) if intent.session_id else None
            return bool(session and session.is_open and session.instance_id == intent.instance_id)
        return False  # DELETING

    async def release_lease(self) -> None:
        try:
            await self._store.release_lease(self.lease, self._owner)
        except Exception:
            log.debug("could not release the reconcile lease", exc_info=True)


__all__ = ["ReconcileReport", "Reconciler"]
