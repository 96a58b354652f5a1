"""Creating and releasing instances without leaking any: intents, admission control, retry policy.

Every create is preceded by an `Intent` in the store whose id also rides in the instance's env_variables,
so an instance whose create was in flight when the process died is still recognised by reconciliation.
Intent ids name the owning process and the store (`owner~storeid.uuid`): reconciliation keeps an in-flight
create only while its owner is alive, and deletes only instances whose intent is this store's (another
deployment on the same Fleet account, even one configured with the same run id, is never touched). A
create that failed or timed out leaves its intent DELETING, meaning "delete whatever turns up for this
intent".

The store's identity (`store_identity`) is a random id made once per store and kept in it; the default
run id is derived from it, so two deployments with their own stores never share a run id by accident.

Admission: every attempt first takes a slot from the provider account's admission record, shared by every
replica on the store (rlgate.orchestrator.creates): creates in flight and their rate are capped, runs take
turns, Resets go before warm-pool refills. A rate-limit or burst-cap answer from the provider throttles the
shared record (every replica pauses for its Retry-After, the rate is cut and climbs back). Fleet's instance
limit makes a create wait for capacity (woken early when rlgate deletes an instance) until the caller's
deadline, then RESOURCE_EXHAUSTED; retryable placement failures are retried with jittered backoff until the
deadline, then UNAVAILABLE with RetryInfo.

Idempotency: one create (all its attempts) is one intent, and the intent id is the create's idempotency key
at the provider (`fleet` sends it as X-Request-ID). A retry after a lost reply is answered with the instance
the first attempt made (Fleet's 409 duplicate_request_id, which the provider adopts), not a second one. Only
when the provider says that instance failed (`StaleRequest`) does the next attempt start a new intent.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import logging
import time
import uuid
from dataclasses import replace
from typing import Any

from rlgate.core.backoff import Backoff
from rlgate.core.errors import FailedPrecondition, NotFound, ResourceExhausted, RlgateError, Unavailable, clip
from rlgate.orchestrator import creates, metrics
from rlgate.orchestrator.config import OrchestratorConfig
from rlgate.orchestrator.creates import CreateGate
from rlgate.orchestrator.providers.base import (
    INTENT_ENV_VAR,
    EnvNotFound,
    InstanceHandle,
    InstanceLimit,
    Provider,
    ProviderError,
    RateLimited,
    Retryable,
    StaleRequest,
    Unsupported,
)
from rlgate.runtime import tracing
from rlgate.runtime.deadline import Deadline
from rlgate.store import Intent, IntentState, SessionStore, StoreError
from rlgate.store.admission import BACKGROUND, URGENT

log = logging.getLogger(__name__)

# Between create attempts: 0.25 s doubling to 5 s, ±50 % (the capacity wait uses it unjittered).
PROVISION_BACKOFF = Backoff(0.25, 5.0, jitter=0.5)

INTENT_SEP = "~"
STORE_SEP = "."
# The store's identity lives in a request record of a scope no request uses: `claim_request` creates it
# atomically on both backends (the first process wins, every other one reads the winner's id from the
# record's owner field), and a PENDING record is never pruned nor released (retention drops DONE ones).
IDENTITY_SCOPE = "rlgate:store"
IDENTITY_KEY = "identity"


async def store_identity(store: SessionStore) -> str:
    """This store's identity: made on first use, the same for every process on the store ever after."""
    record, _ = await store.claim_request(IDENTITY_SCOPE, IDENTITY_KEY, uuid.uuid4().hex[:12])
    return record.owner


def create_account(config: OrchestratorConfig) -> str:
    """The provider account whose create limits every replica shares: configured, or derived from the
    provider, its URL and its API key (hashed: the key itself never reaches the store)."""
    if config.create_account:
        return config.create_account
    digest = hashlib.sha256(f"{config.fleet_base_url}\0{config.fleet_api_key}".encode()).hexdigest()[:16]
    return f"{config.provider}:{digest}"


def default_run_id(store_id: str) -> str:
    return f"rlgate-{store_id}"


def new_intent_id(owner: str, store_id: str) -> str:
    """`owner~storeid.uuid` (`owner~uuid` without a store identity)."""
    tag = f"{store_id}{STORE_SEP}" if store_id else ""
    return f"{owner}{INTENT_SEP}{tag}{uuid.uuid4().hex}"


def intent_owner(intent_id: str) -> str:
    """The process that wrote an intent ("" for ids from elsewhere)."""
    owner, sep, _ = intent_id.rpartition(INTENT_SEP)
    return owner if sep else ""


def intent_store(intent_id: str) -> str:
    """The identity of the store an intent was written to ("" for untagged or foreign ids)."""
    _, sep, rest = intent_id.rpartition(INTENT_SEP)
    store_id, tagged, _ = rest.partition(STORE_SEP)
    return store_id if sep and tagged else ""


def _retried_under_same_key(exc: BaseException) -> bool:
    """A transient failure whose create may have happened: the retry sends the same idempotency key and adopts
    what this attempt made, so the intent stays CREATING. A throttle created nothing (the intent goes);
    a stale key's instance failed (the intent goes DELETING, the retry takes a new one)."""
    return isinstance(exc, Retryable) and not isinstance(exc, RateLimited | StaleRequest)


class Provisioner:
    """Creates instances under admission control and deletes them, keeping intents in step."""

    def __init__(
        self, config: OrchestratorConfig, store: SessionStore, provider: Provider, owner: str, store_id: str = ""
    ) -> None:
        self._config = config
        self._store = store
        self._provider = provider
        self._owner = owner
        self.store_id = store_id  # tags every intent id (set before the first create; see Orchestrator)
        self.gate = CreateGate.from_config(config, store, create_account(config))
        self._capacity = asyncio.Event()
        self.in_flight = 0
        self.backoff = PROVISION_BACKOFF

    def notify_capacity(self) -> None:
        """An instance was deleted: wake creates waiting at the instance limit."""
        self._capacity.set()
        self._capacity = asyncio.Event()

    async def _wait_capacity(self, seconds: float) -> None:
        event = self._capacity
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), seconds)

    @tracing.traced("rlgate.provision", env_key="env_key")
    async def create(
        self,
        env_key: str,
        deadline: Deadline,
        *,
        env_variables: dict[str, Any] | None = None,
        state: str = IntentState.CREATING,
        modality: str = "tool_use",
        snapshot_id: str = "",
        client: str = "",
        background: bool = False,
    ) -> tuple[InstanceHandle, Intent]:
        """A running instance of the kind `modality` needs and its intent (state `state`), or an RlgateError
        by the deadline. With `snapshot_id` the instance's live state is that snapshot's (Fork). `client`
        (the caller's API key and run) takes its turn for admission with other clients; `background` creates
        (warm-pool refills) wait while any Reset's create waits."""
        last: ProviderError | None = None
        retry = 0
        intent = self._new_intent(env_key)
        priority = BACKGROUND if background else URGENT
        while True:
            if deadline.expired():
                await self._abandon_intent(intent)
                raise self._give_up(env_key, last)
            try:
                async with self.gate.slot(client, priority, deadline):
                    return await self._create_once(intent, deadline, env_variables or {}, state, modality, snapshot_id)
            except InstanceLimit as exc:
                last = exc
                # Not jittered: a deleted instance wakes the waiters early, the delay only bounds the wait.
                wait = min(replace(self.backoff, jitter=0.0).delay(retry), deadline.remaining())
                log.info("instance limit reached creating %s (%s); waiting %.2fs for capacity", env_key, exc, wait)
            except RateLimited as exc:
                last = exc
                # Admission waits for the pause, on every replica (unless the store could not take it).
                wait = min(await self.gate.throttled(exc.retry_after_s), deadline.remaining())
                log.info("create %s: provider throttled (%s); waiting for admission", env_key, exc)
            except Retryable as exc:
                last = exc
                if isinstance(exc, StaleRequest):  # the key's instance failed: retry as a new request
                    intent = self._new_intent(env_key)
                wait = min(self.backoff.delay(retry), deadline.remaining())
                log.warning("create %s: transient failure (%s); retrying in %.2fs", env_key, exc, wait)
            except ResourceExhausted as exc:
                await asyncio.shield(self._abandon_intent(intent))
                if exc.reason in creates.REFUSED and last is not None:  # say why the attempts failed
                    raise self._give_up(env_key, last) from None
                raise
            except BaseException:
                await asyncio.shield(self._abandon_intent(intent))
                raise
            if isinstance(last, InstanceLimit):
                await self._wait_capacity(wait)
            elif wait > 0:
                await asyncio.sleep(wait)
            retry += 1

    def _new_intent(self, env_key: str) -> Intent:
        return Intent(
            intent_id=new_intent_id(self._owner, self.store_id),
            run_id=self._config.run_id,
            env_key=env_key,
            state=IntentState.CREATING,
        )

    async def _abandon_intent(self, intent: Intent) -> None:
        """The create gives up. An intent still CREATING had an attempt whose outcome is unknown (left for a
        retry under its key): DELETING now, so reconciliation deletes whatever it made. An intent never
        written, or settled by its last attempt, is nothing to undo."""
        try:
            stored = await self._store.get_intent(intent.intent_id)
        except StoreError:
            log.exception("could not read intent %s", intent.intent_id)
            return
        if stored is not None and stored.state == IntentState.CREATING:
            await self._after_failed_create(stored, Retryable("gave up"))

    async def close(self) -> None:
        """Stop the admission pump (creates still queued are refused)."""
        await self.gate.close()

    def _give_up(self, env_key: str, last: ProviderError | None) -> RlgateError:
        if isinstance(last, InstanceLimit):
            return ResourceExhausted(
                f"provider instance limit reached creating {env_key}: {last}",
                subject=f"instances:{env_key}",
                reason="INSTANCE_LIMIT",
                metadata={"running": last.running, "limit": last.limit, "env_key": env_key},
                retry_after_s=5.0,
            )
        reason = "RATE_LIMITED" if isinstance(last, RateLimited) else "PROVIDER_UNAVAILABLE"
        detail = f": {last}" if last else " (deadline reached while waiting for a create slot)"
        return Unavailable(
            f"could not create an instance of {env_key} before the deadline{detail}",
            reason=reason,
            retry_after_s=2.0,
            metadata={"env_key": env_key},
        )

    async def _create_once(
        self,
        intent: Intent,
        deadline: Deadline,
        env_variables: dict[str, Any],
        state: str,
        modality: str,
        snapshot_id: str = "",
    ) -> tuple[InstanceHandle, Intent]:
        env_key = intent.env_key
        intent.state = IntentState.CREATING
        intent.updated_at = time.time()
        await self._store.put_intent(intent)
        timeout = deadline.cap(self._config.provision_timeout_s)
        start = time.perf_counter()
        self.in_flight += 1
        metrics.CREATES_IN_FLIGHT.inc()
        try:
            create = (
                functools.partial(self._provider.create_from_snapshot, env_key, snapshot_id)
                if snapshot_id
                else functools.partial(self._provider.create, env_key)
            )
            handle = await create(
                env_variables={**env_variables, INTENT_ENV_VAR: intent.intent_id},
                run_id=self._config.run_id,
                ttl_s=self._config.instance_ttl_s,
                heartbeat_interval_s=self._config.heartbeat_interval_s,
                timeout_s=max(0.1, timeout),
                modality=modality,
            )
        except BaseException as exc:
            metrics.PROVISION_SECONDS.labels("error").observe(time.perf_counter() - start)
            if not _retried_under_same_key(exc):
                await asyncio.shield(self._after_failed_create(intent, exc))
            if isinstance(exc, EnvNotFound):
                raise NotFound(
                    f"unknown environment {clip(env_key)!r}: {exc}",
                    reason="ENV_NOT_FOUND",
                    metadata={"env_key": env_key},
                ) from exc
            if isinstance(exc, Unsupported):
                raise FailedPrecondition(
                    f"the provider cannot create a {modality} instance of {clip(env_key)}: {exc}",
                    reason="PROVIDER_UNSUPPORTED",
                    metadata={"env_key": env_key, "modality": modality},
                ) from exc
            if isinstance(exc, ProviderError) and not isinstance(exc, InstanceLimit | Retryable):
                raise Unavailable(
                    f"provider refused to create {clip(env_key)}: {exc}", reason="PROVIDER_ERROR", retry_after_s=5.0
                ) from exc
            raise
        finally:
            self.in_flight -= 1
            metrics.CREATES_IN_FLIGHT.dec()
        metrics.PROVISION_SECONDS.labels("ok").observe(time.perf_counter() - start)
        intent.instance_id = handle.instance_id
        intent.state = state
        intent.updated_at = time.time()
        try:
            await self._store.put_intent(intent)
        except BaseException:
            await asyncio.shield(self.release(handle.instance_id, intent.intent_id))
            raise
        log.info("created %s instance %s (%.2fs)", env_key, handle.instance_id, time.perf_counter() - start)
        return handle, intent

    async def _after_failed_create(self, intent: Intent, exc: BaseException) -> None:
        """A definite rejection created nothing: drop the intent. Anything else may have created an
        instance we never heard of: mark the intent DELETING so reconciliation removes it."""
        try:
            if isinstance(exc, InstanceLimit | EnvNotFound | RateLimited | Unsupported):
                await self._store.delete_intent(intent.intent_id)
            else:
                intent.state = IntentState.DELETING
                intent.updated_at = time.time()
                await self._store.put_intent(intent)
        except StoreError:
            log.exception("could not record the failed create of intent %s", intent.intent_id)

    def owns(self, intent_id: str) -> bool:
        """Whether an intent id was made for this store (its instance is this deployment's)."""
        return bool(self.store_id) and intent_store(intent_id) == self.store_id

    async def set_intent(self, intent_id: str, state: str, session_id: str = "") -> None:
        intent = await self._store.get_intent(intent_id)
        if intent is None:
            return
        intent.state = state
        intent.session_id = session_id or intent.session_id
        intent.updated_at = time.time()
        await self._store.put_intent(intent)

    @tracing.traced("rlgate.release", instance_id="instance_id")
    async def release(self, instance_id: str, intent_id: str) -> bool:
        """Delete an instance (404 counts as done) and then its intent. On failure the intent stays DELETING
        and reconciliation retries. Returns whether the instance is confirmed gone."""
        if intent_id:
            try:
                await self.set_intent(intent_id, IntentState.DELETING)
            except StoreError:
                log.exception("could not mark intent %s deleting", intent_id)
        if instance_id and self._provider.manages_instances:
            try:
                await self._provider.delete(instance_id, timeout_s=self._config.provider_timeout_s)
            except ProviderError as exc:
                log.warning("delete of %s failed (reconciliation will retry): %s", instance_id, exc)
                return False
            self.notify_capacity()
            log.info("deleted instance %s", instance_id)
        if intent_id:
            try:
                await self._store.delete_intent(intent_id)
            except StoreError:
                log.exception("could not delete intent %s", intent_id)
        return True
