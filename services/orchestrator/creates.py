"""Admission control for instance creation, shared by every replica through the session store.

The provider account's record in the store (rlgate.store.admission: a cap on creates in flight, a token
bucket whose rate a provider's throttling cuts and which climbs back, turns between runs, urgent before
background) is the one authority; this module is a process's door to it. `CreateGate.slot` queues a create
for its client (the caller's API key and run) at a priority: Resets are urgent, warm-pool refills background.
One pump per process asks the store on behalf of its queues, runs taking turns locally as the store makes them
take turns across replicas, so a process sends one admission at a time however many creates wait, and wakes
when a local create finishes or when the store's answer says to ask again.

A create waits at most `create_queue_wait_s` (and never past its deadline) and a process queues at most
`create_queue_max` of them: past either it is refused with RESOURCE_EXHAUSTED and RetryInfo. A slot's
record lapses by itself if this process dies holding it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from rlgate.core.errors import ResourceExhausted
from rlgate.orchestrator import metrics
from rlgate.orchestrator.config import OrchestratorConfig
from rlgate.runtime.deadline import Deadline
from rlgate.store import CreateAdmission, CreateLimits, StoreError
from rlgate.store.admission import BACKGROUND, POLL_S, URGENT

log = logging.getLogger(__name__)

PRIORITIES = (URGENT, BACKGROUND)
# The pump asks again at least this often while creates wait, so a run that still waits renews its place in
# the store's turn order within WAITING_TTL_S; a run whose creates all gave up loses it that long after.
MAX_POLL_S = 1.0
WAITING_TTL_S = 1.5
# After a store error the pump asks again this long later (the waiters' own bounds still hold).
STORE_RETRY_S = 0.5
# Runs whose refusal is account-wide (paused, full, out of tokens): the other queued runs would hear the same.
_ACCOUNT_WIDE = frozenset({"paused", "in_flight", "rate"})
# The ErrorInfo reasons of a create refused admission.
QUEUE_FULL = "CREATE_QUEUE_FULL"
ADMISSION_TIMEOUT = "CREATE_ADMISSION_TIMEOUT"
REFUSED = frozenset({QUEUE_FULL, ADMISSION_TIMEOUT})


def create_client(caller: str, run_id: str) -> str:
    """Who a create is for, when creates take turns for admission: the caller's API key and its run."""
    return f"{caller}/{run_id}"


def create_limits(config: OrchestratorConfig) -> CreateLimits:
    """The account's limits from the typed config."""
    rate = max(0.01, config.create_rate)
    return CreateLimits(
        max_in_flight=max(1, config.max_concurrent_creates),
        max_rate=rate,
        min_rate=min(rate, max(0.01, config.create_rate_min)),
        burst=max(1.0, config.create_burst),
        recover_per_s=max(0.0, config.create_rate_recovery),
        slot_ttl_s=config.provision_timeout_s + 30.0,
        wait_ttl_s=WAITING_TTL_S,
    )


@dataclass
class _Queue:
    """One client's waiting creates at one priority, oldest first."""

    waiters: deque[asyncio.Future[str]] = field(default_factory=deque)

    def live(self) -> asyncio.Future[str] | None:
        while self.waiters and self.waiters[0].done():
            self.waiters.popleft()
        return self.waiters[0] if self.waiters else None


class CreateGate:
    """This process's admission to creates on one provider account (see the module docstring)."""

    def __init__(
        self, store: CreateAdmission, account: str, limits: CreateLimits, *, max_wait_s: float, max_queued: int
    ) -> None:
        self._store = store
        self.account = account
        self.limits = limits
        self._max_wait_s = max_wait_s
        self._max_queued = max(1, max_queued)
        self._queues: dict[str, dict[str, _Queue]] = {p: {} for p in PRIORITIES}  # priority -> client -> queue
        self._queued = 0
        self._wake = asyncio.Event()
        self._pump: asyncio.Task[None] | None = None
        self._closed = False
        self.rate = limits.max_rate  # the account's rate as the store last said
        self.hint_s = POLL_S  # the store's last "ask again in"

    @classmethod
    def from_config(cls, config: OrchestratorConfig, store: CreateAdmission, account: str) -> CreateGate:
        return cls(
            store,
            account,
            create_limits(config),
            max_wait_s=config.create_queue_wait_s,
            max_queued=config.create_queue_max,
        )

    @contextlib.asynccontextmanager
    async def slot(self, client: str, priority: str, deadline: Deadline) -> AsyncIterator[None]:
        """Hold one admitted create for `client` (its API key and run) while the body runs."""
        slot_id = await self._admitted(client, priority, deadline)
        try:
            yield
        finally:
            await asyncio.shield(self._release(slot_id))

    async def throttled(self, retry_after_s: float | None) -> float:
        """The provider refused a create for its rate or burst cap: every replica pauses for its Retry-After
        (or the store's last hint) and the shared rate is cut. Returns how long the caller must wait itself
        before asking again: 0 once the store took the pause, else the pause (the store could not)."""
        wait = retry_after_s if retry_after_s is not None else max(self.hint_s, 1.0 / self.rate)
        try:
            self.rate = await self._store.throttle_creates(self.account, wait, self.limits)
        except StoreError:
            log.exception("could not record a throttle of %s", self.account)
            return wait
        metrics.CREATE_RATE.set(self.rate)
        metrics.CREATE_THROTTLES.inc()
        log.info("provider throttled creates on %s: pausing %.2fs, rate now %.2f/s", self.account, wait, self.rate)
        return 0.0

    async def close(self) -> None:
        """Cancel the pump; waiters still queued get RESOURCE_EXHAUSTED."""
        self._closed = True
        if self._pump is not None:
            self._pump.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._pump
        for queues in self._queues.values():
            for queue in queues.values():
                for waiter in queue.waiters:
                    if not waiter.done():
                        waiter.cancel()

    async def _admitted(self, client: str, priority: str, deadline: Deadline) -> str:
        if self._queued >= self._max_queued or self._closed:
            raise self._refused(client, QUEUE_FULL, f"{self._queued} creates already queued")
        waiter: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._queues[priority].setdefault(client, _Queue()).waiters.append(waiter)
        self._queued += 1
        metrics.CREATES_QUEUED.labels(priority).inc()
        self._wake.set()
        if self._pump is None or self._pump.done():
            self._pump = asyncio.create_task(self._run(), name=f"create-admission:{self.account}")
        try:
            async with asyncio.timeout(min(deadline.remaining(), self._max_wait_s)):
                return await asyncio.shield(waiter)
        except TimeoutError:
            await self._abandon(waiter)
            raise self._refused(client, ADMISSION_TIMEOUT, "no create slot in time") from None
        except BaseException:
            await self._abandon(waiter)
            raise
        finally:
            self._queued -= 1
            metrics.CREATES_QUEUED.labels(priority).dec()

    async def _abandon(self, waiter: asyncio.Future[str]) -> None:
        """The caller gave up: a slot granted just then is handed back, an ungranted waiter leaves the queue."""
        if waiter.done() and not waiter.cancelled():
            await asyncio.shield(self._release(waiter.result()))
        else:
            waiter.cancel()

    def _refused(self, client: str, reason: str, why: str) -> ResourceExhausted:
        return ResourceExhausted(
            f"instance creation is at its limit on this provider account ({why}); retry later",
            subject=f"creates:{self.account}",
            reason=reason,
            metadata={"rate": f"{self.rate:.2f}", "client": client},
            retry_after_s=max(1.0, self.hint_s),
        )

    async def _release(self, slot_id: str) -> None:
        try:
            await self._store.release_create(self.account, slot_id)
        except StoreError:
            log.exception("could not release create slot %s (it lapses on its own)", slot_id)
        metrics.CREATE_SLOTS_HELD.dec()
        self._wake.set()

    def _candidates(self) -> list[tuple[str, str, _Queue]]:
        """(priority, client, queue) with a live waiter: urgent first, clients in turn order."""
        out = []
        for priority in PRIORITIES:
            for client, queue in list(self._queues[priority].items()):
                if queue.live() is None:
                    del self._queues[priority][client]
                else:
                    out.append((priority, client, queue))
        return out

    async def _run(self) -> None:
        """The pump: while creates wait, ask the store for the client whose turn it is."""
        while not self._closed:
            candidates = self._candidates()
            if not candidates:
                return
            self._wake.clear()
            try:
                wait = await self._offer(candidates)
            except Exception:  # a bug must not strand the queue: the waiters' own bounds still hold
                log.exception("create admission pump on %s failed", self.account)
                wait = STORE_RETRY_S
            if wait > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), wait)

    async def _offer(self, candidates: list[tuple[str, str, _Queue]]) -> float:
        """Ask for each candidate in order until one is admitted (0: ask again at once) or all were refused
        (the least wait the store named)."""
        wait = float("inf")
        for priority, client, queue in candidates:
            slot_id = uuid.uuid4().hex
            try:
                grant = await self._store.admit_create(self.account, slot_id, client, priority, self.limits)
            except StoreError:
                log.exception("create admission on %s failed", self.account)
                return STORE_RETRY_S
            self.rate = grant.rate
            metrics.CREATE_RATE.set(grant.rate)
            if grant.admitted:
                metrics.CREATE_SLOTS_HELD.inc()
                waiter = queue.live()
                if waiter is None:  # gave up while we asked
                    await self._release(slot_id)
                else:
                    waiter.set_result(slot_id)
                    queue.waiters.popleft()
                # This client goes to the back of its priority's turn order.
                queues = self._queues[priority]
                queues[client] = queues.pop(client)
                return 0.0
            self.hint_s = grant.wait_s
            wait = min(wait, grant.wait_s)
            if grant.reason in _ACCOUNT_WIDE:
                break
        return max(0.001, min(wait, MAX_POLL_S))


__all__ = ["ADMISSION_TIMEOUT", "QUEUE_FULL", "REFUSED", "CreateGate", "create_client", "create_limits"]
