"""Reconciliation: make the provider's instances of this deployment agree with the store.

Runs on start-up and every `reconcile_interval_s`, under a store lease so several orchestrators of the same
run never double-delete, each pass bounded in time (a stuck store or provider cannot hold it). A pass reads
a snapshot (open sessions, intents, then the provider's instances of the run id), but sessions and intents
keep changing while it runs, so nothing is deleted on the snapshot's word: each instance no snapshot
session owns is judged on its intent and session as they are *now* (`_orphan_reason`), and the candidates
are checked against fresh lists of open sessions and instances right before the delete.

Only instances this deployment can prove are its own are ever judged: the run id AND an intent of this
store (a record in it, or an intent id in the instance's env variables made for this store, see
`provisioning.store_identity`). Anything else listed under the run id — another deployment with its own
store and the same run id, an instance made by hand — is left alone (its own TTL ends it).

What keeps one of ours (see `_orphan_reason`): an open session uses it; its intent is in this process's
warm pool (idle or being handed out / put back); a CREATING or POOLED intent of a live process; a BOUND
intent whose session is open on it, or whose session closed moments ago (the closer releases it); a
DELETING intent a live process is releasing right now; an instance whose intent record is gone but that is
younger than the pass. Everything else is an orphan and deleted (a 404 counts as done). Intents whose
instance never appeared are dropped once their owner is dead; sessions whose instance vanished (TTL,
heartbeat, manual delete) are marked FAILED; sessions stuck PROVISIONING by a dead process are failed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from datetime import UTC, datetime

from rlgate.orchestrator import metrics
from rlgate.orchestrator.config import OrchestratorConfig
from rlgate.orchestrator.episodes import Episodes
from rlgate.orchestrator.pool import WarmPool
from rlgate.orchestrator.providers.base import InstanceHandle, Provider
from rlgate.orchestrator.provisioning import Provisioner, intent_owner
from rlgate.store import Intent, IntentState, SessionStatus, SessionStore

log = logging.getLogger(__name__)

# How long a record a live process just changed is left to that process (a pool entry being appended, a
# session just closed being released or pooled, an instance whose intent cannot be found yet).
SETTLE_GRACE_S = 30.0


@dataclass
class ReconcileReport:
    ran: bool = False
    instances: int = 0
    kept: int = 0
    orphans_deleted: int = 0
    foreign: int = 0  # listed under the run id but not provably this deployment's: left alone
    intents_dropped: int = 0
    sessions_failed: int = 0


def created_at(handle: InstanceHandle) -> float | None:
    """The provider's creation time of an instance (epoch seconds), if it reports one."""
    raw = handle.raw.get("created_at") if handle.raw else None
    if not isinstance(raw, str) or not raw:
        return None
    try:
        parsed = datetime.fromisoformat(raw.replace("Z", "+00:00"))
    except ValueError:
        return None
    return (parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)).timestamp()


class Reconciler:
    def __init__(
        self,
        config: OrchestratorConfig,
        store: SessionStore,
        provider: Provider,
        provisioner: Provisioner,
        pool: WarmPool,
        episodes: Episodes,
        owner: str,
    ) -> None:
        self._config = config
        self._store = store
        self._provider = provider
        self._provisioner = provisioner
        self._pool = pool
        self._episodes = episodes
        self._owner = owner
        self._lease_ttl = max(10.0, config.reconcile_interval_s * 3)
        # A pass never outlives a bound: its lease's TTL, or enough for a few provider calls if longer.
        self.pass_s = max(self._lease_ttl, 4 * config.provider_timeout_s)
        self._gone_since: dict[str, float] = {}  # ours, intent record gone, no creation time: first seen

    @property
    def lease(self) -> str:
        """The store lease a pass runs under: one reconciler per run id at a time."""
        return f"reconcile:{self._config.run_id}"

    async def _alive(self, owner: str) -> bool:
        if not owner:
            return False
        return owner == self._owner or await self._store.owner_alive(owner)

    async def run_once(self, *, startup: bool = False) -> ReconcileReport:
        """One pass (when this process gets the lease), cut after `pass_s`: the next pass goes on."""
        report = ReconcileReport()
        if not self._provider.manages_instances:
            return report
        try:
            async with asyncio.timeout(self.pass_s):
                await self._pass(report, startup)
        except TimeoutError:
            log.warning("reconcile: pass cut after %.0fs; the next one goes on", self.pass_s)
        return report

    def _ours(self, intent_id: str, snapshot: dict[str, Intent]) -> bool:
        """Whether an instance's intent proves it is this deployment's: a record of this store, or an id
        made for this store."""
        return bool(intent_id) and (intent_id in snapshot or self._provisioner.owns(intent_id))

    async def _pass(self, report: ReconcileReport, startup: bool) -> None:
        if not await self._store.acquire_lease(self.lease, self._owner, self._lease_ttl):
            return
        report.ran = True
        snapshot_at = time.time()
        sessions = await self._episodes.sessions.open_sessions(orchestrator_run=self._config.run_id)
        intents = {i.intent_id: i for i in await self._store.list_intents(self._config.run_id)}
        instances = await self._provider.list_instances(self._config.run_id, timeout_s=self._config.provider_timeout_s)
        report.instances = len(instances)
        by_instance = {s.instance_id for s in sessions if s.instance_id}
        intent_of_instance = {i.instance_id: i.intent_id for i in intents.values() if i.instance_id}
        live_ids = {inst.instance_id for inst in instances}
        seen_intents = {inst.intent_id for inst in instances if inst.intent_id}
        self._gone_since = {k: v for k, v in self._gone_since.items() if k in live_ids}

        candidates: list[tuple[InstanceHandle, str, str]] = []  # (instance, intent id, why it is an orphan)
        for inst in instances:
            if inst.instance_id in by_instance:
                report.kept += 1
                if startup:
                    metrics.RECONCILED.labels("session_resumed").inc()
                continue
            intent_id = inst.intent_id or intent_of_instance.get(inst.instance_id, "")
            if not self._ours(intent_id, intents):
                report.foreign += 1
                continue
            why = await self._orphan_reason(inst, intent_id, snapshot_at)
            if why is None:
                report.kept += 1
            else:
                candidates.append((inst, intent_id, why))
        if candidates:
            # Sessions registered since the snapshot (a hand-out whose intent a dead owner never marked
            # BOUND is found only this way): every verdict above was reached before this read. And the
            # instances still there: one released meanwhile (its intent gone with it) is no orphan.
            fresh = {
                s.instance_id
                for s in await self._episodes.sessions.open_sessions(orchestrator_run=self._config.run_id)
                if s.instance_id
            }
            listed = {
                h.instance_id
                for h in await self._provider.list_instances(
                    self._config.run_id, timeout_s=self._config.provider_timeout_s
                )
            }
            for inst, intent_id, why in candidates:
                if inst.instance_id in fresh:
                    report.kept += 1
                    continue
                if inst.instance_id not in listed:
                    continue
                if not await self._store.acquire_lease(self.lease, self._owner, self._lease_ttl):
                    log.warning("reconcile: lease lost mid-pass; leaving the rest to its holder")
                    break
                log.warning("reconcile: deleting orphan instance %s (%s, %s)", inst.instance_id, inst.env_key, why)
                if await self._provisioner.release(inst.instance_id, intent_id):
                    report.orphans_deleted += 1
                    metrics.RECONCILED.labels("orphan_deleted").inc()

        stale_after = self._config.provision_timeout_s + 30
        for snap in intents.values():
            if snap.instance_id in live_ids or snap.intent_id in seen_intents:
                continue
            intent = await self._store.get_intent(snap.intent_id)
            if intent is None or (intent.state, intent.updated_at) != (snap.state, snap.updated_at):
                continue  # changed since the snapshot: the next pass judges it
            owner_alive = await self._alive(intent_owner(intent.intent_id))
            age = time.time() - intent.updated_at
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
                if s.updated_at < snapshot_at - stuck_after and await self._episodes.closing.fail(
                    s.session_id, "reset did not finish (its owner is gone)"
                ):
                    report.sessions_failed += 1
            elif (
                s.instance_id
                and s.instance_id not in live_ids
                and await self._episodes.closing.fail(
                    s.session_id, f"instance {s.instance_id} no longer exists", instance_id=s.instance_id
                )
            ):
                metrics.RECONCILED.labels("session_lost").inc()
                report.sessions_failed += 1
        log.info(
            "reconcile: %d instance(s), kept %d, deleted %d orphan(s), left %d not ours, dropped %d "
            "intent(s), failed %d session(s)",
            report.instances,
            report.kept,
            report.orphans_deleted,
            report.foreign,
            report.intents_dropped,
            report.sessions_failed,
        )

    async def _orphan_reason(self, inst: InstanceHandle, intent_id: str, snapshot_at: float) -> str | None:
        """Why `inst` (owned by no snapshot session) is an orphan, judged on the current records; None keeps
        it. The pool is asked before the intent is read: a hand-out settles (session registered, intent
        BOUND) before it leaves the pool, so an entry not in the pool now shows its settled intent below."""
        if intent_id and intent_id in self._pool.intent_ids():
            return None  # idle here, or being handed out / put back by this process
        intent = await self._store.get_intent(intent_id) if intent_id else None
        now = time.time()
        if intent is None:
            if not self._provisioner.owns(intent_id):
                return None  # its record went away since the snapshot and its id names no store: not ours
            return None if self._young(inst, snapshot_at, now) else "intent gone"
        if intent.intent_id in self._pool.intent_ids():
            return None
        owner = intent_owner(intent.intent_id)
        alive = await self._alive(owner)
        settling = alive and now - intent.updated_at < SETTLE_GRACE_S  # its live owner is mid-transition
        if intent.state == IntentState.CREATING:
            return None if alive else "intent creating, owner gone"
        if intent.state == IntentState.POOLED:
            if owner == self._owner:  # not in this pool: an entry about to be appended, or a lost one
                return None if settling else "intent pooled, not in this process's pool"
            return None if alive else "intent pooled, owner gone"
        if intent.state == IntentState.BOUND:
            session = await self._store.get_session(intent.session_id) if intent.session_id else None
            if session is not None and session.is_open and session.instance_id == inst.instance_id:
                return None
            if session is not None and not session.is_open and now - session.closed_at < SETTLE_GRACE_S:
                return None  # just closed: its closer releases (or pools) the instance
            if session is None and settling:
                return None  # bound moments ago by a live process; its session is being registered
            return "intent bound, session " + (
                "gone" if session is None else "closed" if not session.is_open else "moved on"
            )
        if intent.instance_id and settling:
            return None  # a release in progress (a failed create's intent has no instance id: delete it)
        return "intent deleting"  # a failed create, or a release that did not finish: delete (404 = done)

    def _young(self, inst: InstanceHandle, snapshot_at: float, now: float) -> bool:
        """An instance of ours whose intent record is gone is an orphan only once it is old enough that the
        record cannot be settling: created before this pass's snapshot, or first seen longer ago than the
        grace period."""
        created = created_at(inst)
        if created is not None:
            return created >= snapshot_at and now - created < SETTLE_GRACE_S
        first = self._gone_since.setdefault(inst.instance_id, now)
        return now - first < SETTLE_GRACE_S

    async def release_lease(self) -> None:
        try:
            async with asyncio.timeout(5.0):
                await self._store.release_lease(self.lease, self._owner)
        except Exception:
            log.debug("could not release the reconcile lease (it expires on its own)", exc_info=True)


__all__ = ["ReconcileReport", "Reconciler", "created_at"]
