"""`Orchestrator`: builds the parts (store, provider, tasks, provisioner, pools, episodes, reconciler, ...),
owns every background loop, and shuts them all down — the one object `server.py` starts and stops.

Shutdown has two halves, each bounded so a stuck store or provider cannot hold the process: `drain` (new
work refused, in-flight RPCs and endings finish, sessions closed or handed back, pools emptied, all within
`drain_s`) and `stop` (background loops cancelled, what is still in flight handed back: this process is
declared dead in the store so another replica takes over its request records at once).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import Protocol

from rlgate.core.backoff import Backoff
from rlgate.orchestrator import metrics
from rlgate.orchestrator.config import OrchestratorConfig
from rlgate.orchestrator.episodes import Episodes
from rlgate.orchestrator.pool import WarmPool
from rlgate.orchestrator.providers.base import Provider
from rlgate.orchestrator.provisioning import Provisioner, default_run_id, store_identity
from rlgate.orchestrator.reaper import Heartbeater, Reaper, prune
from rlgate.orchestrator.reconcile import Reconciler
from rlgate.orchestrator.tasks import TaskCatalog
from rlgate.orchestrator.tools import ToolCache
from rlgate.orchestrator.verifier import Verifier
from rlgate.runtime.identity import process_identity
from rlgate.runtime.settings import default_store_url
from rlgate.store import OPEN_STATUSES, SessionStore, open_store

log = logging.getLogger(__name__)

STOP_STEP_S = 5.0  # bound of each step of `stop` (cancelled loops, the store and provider clients) ...
STOP_TOTAL_S = 10.0  # ... and of all of them, each still getting STOP_FLOOR_S (the hand-back must be tried)
STOP_FLOOR_S = 0.5
CATALOG_BACKOFF = Backoff(0.5, 30.0, jitter=0.25)  # between loads of a task catalog that failed to load
IN_FLIGHT_SHARE = 0.75  # of drain_s, for in-flight RPCs and endings; the rest closes or hands back sessions


class InFlight(Protocol):
    """The server's view of its RPCs in flight (`server.Drain`)."""

    async def idle(self) -> None:
        """Until no RPC is in flight."""

    def cut(self) -> int:
        """Answer every RPC still in flight UNAVAILABLE; returns how many."""


async def bounded(what: str, seconds: float, step: Awaitable[object]) -> bool:
    """Await `step` for at most `seconds`; a timeout or failure is logged, never raised (shutdown goes on).
    Returns whether it finished."""
    try:
        async with asyncio.timeout(max(0.0, seconds)):
            await step
        return True
    except TimeoutError:
        log.warning("shutdown: %s did not finish within %.1fs", what, seconds)
    except Exception as exc:
        log.warning("shutdown: %s failed: %s", what, exc)
    return False


def make_provider(config: OrchestratorConfig) -> Provider:
    if config.provider == "fleet":
        from rlgate.orchestrator.providers.fleet import FleetProvider

        return FleetProvider(
            config.fleet_base_url,
            config.fleet_api_key,
            request_timeout=max(config.provider_timeout_s, config.verify_timeout_s),
        )
    if config.provider == "mcp":
        from rlgate.orchestrator.providers.mcp import McpProvider, parse_mcp_envs

        return McpProvider(parse_mcp_envs(config.mcp_envs))
    raise ValueError(f"unknown provider {config.provider!r} (fleet or mcp)")


class Orchestrator:
    """Everything the orchestration plane runs, wired together."""

    def __init__(
        self,
        config: OrchestratorConfig,
        store: SessionStore,
        provider: Provider,
        *,
        owns_store: bool,
        store_id: str = "",
    ) -> None:
        # A copy every part shares: an empty run id (built directly, not by `create`) is filled in by `start`.
        self.config = config = replace(config)
        self.store = store
        self.provider = provider
        self._owns_store = owns_store
        self.owner = process_identity("orchestrator")
        self.catalog = TaskCatalog()
        self.provisioner = Provisioner(config, store, provider, self.owner, store_id)
        self.pool = WarmPool(config, provider, self.provisioner)
        self.episodes = Episodes.create(
            config,
            store,
            provider,
            self.catalog,
            ToolCache(config.tools_timeout_s, config.tools_refresh_s),
            Verifier(provider, timeout_s=config.verify_timeout_s, retries=config.verify_retries),
            self.provisioner,
            self.pool,
            self.owner,
        )
        self.reconciler = Reconciler(config, store, provider, self.provisioner, self.pool, self.episodes, self.owner)
        self.reaper = Reaper(config, self.episodes)
        self.heartbeater = Heartbeater(config, store, provider, self.episodes.sessions, self.pool)
        self._tasks: list[asyncio.Task[None]] = []
        self._tasks_loaded = asyncio.Event()
        self.catalog_backoff = CATALOG_BACKOFF

    @classmethod
    async def create(cls, config: OrchestratorConfig, store: SessionStore | None = None) -> Orchestrator:
        """Open the store (unless given) and learn its identity: the default run id is derived from it."""
        owns = store is None
        if store is None:
            store = await open_store(config.store_url or default_store_url(config.data_dir))
        try:
            store_id = await store_identity(store)
            if not config.run_id:
                config = replace(config, run_id=default_run_id(store_id))
            return cls(config, store, make_provider(config), owns_store=owns, store_id=store_id)
        except BaseException:
            if owns:
                await bounded("closing the store", STOP_STEP_S, store.close())
            raise

    # -- lifecycle --------------------------------------------------------------------------------------
    async def start(self) -> None:
        if not self.provisioner.store_id:  # built directly rather than by `create`
            self.provisioner.store_id = await store_identity(self.store)
        if not self.config.run_id:
            self.config.run_id = default_run_id(self.provisioner.store_id)
        await self.store.heartbeat_owner(self.owner, self.config.owner_ttl_s)
        self._spawn(
            "owner-heartbeat",
            max(0.5, self.config.owner_ttl_s / 3),
            lambda: self.store.heartbeat_owner(self.owner, self.config.owner_ttl_s),
        )
        try:
            await self.load_tasks()
        except Exception as exc:
            log.warning("tasks not loaded yet (%s); retrying in the background", exc)
            self._tasks.append(asyncio.create_task(self._load_tasks_until_done(), name="load-tasks"))
        try:
            await self.reconciler.run_once(startup=True)
        except Exception:
            log.exception("start-up reconciliation failed; the periodic one will retry")
        self._spawn("reconcile", self.config.reconcile_interval_s, self.reconciler.run_once, delay=True)
        self._spawn("reaper", self.config.reap_interval_s, self._reap)
        self._spawn("heartbeat", max(1.0, self.config.heartbeat_interval_s / 2), self.heartbeater.run_once, delay=True)
        self._spawn(
            "retention", max(10.0, min(3600.0, self.config.retention_s / 4)), lambda: prune(self.config, self.store)
        )
        if self.pool.targets:
            self._tasks.append(asyncio.create_task(self._guard("warm-pool", self.pool.run), name="warm-pool"))
        log.info(
            "orchestrator %s started (provider %s, run_id %s, %d task(s), pools %s)",
            self.owner,
            self.provider.name,
            self.config.run_id,
            len(self.catalog),
            self.pool.targets or "off",
        )

    async def load_tasks(self) -> None:
        if self.config.tasks_file:
            text = await asyncio.to_thread(Path(self.config.tasks_file).read_text, encoding="utf-8")
            tasks = await self.provider.parse_task_file(text)
        else:
            tasks = await self.provider.load_tasks(timeout_s=self.config.provider_timeout_s)
        self.catalog.replace(tasks)
        self._tasks_loaded.set()

    @property
    def tasks_loaded(self) -> bool:
        """Whether the task catalog has loaded (until then task-dependent RPCs answer UNAVAILABLE)."""
        return self._tasks_loaded.is_set()

    async def wait_tasks_loaded(self) -> None:
        await self._tasks_loaded.wait()

    async def _load_tasks_until_done(self) -> None:
        """Retry the catalog load on `catalog_backoff` until it succeeds."""
        delays = self.catalog_backoff.delays()
        wait = next(delays)
        while not self._tasks_loaded.is_set():
            await asyncio.sleep(wait)
            wait = next(delays)
            try:
                await self.load_tasks()
                log.info("loaded %d task(s); serving", len(self.catalog))
            except Exception as exc:
                log.warning("loading tasks failed (retrying in %.1fs): %s", wait, exc)

    async def _reap(self) -> None:
        await self.reaper.run_once()
        counts = dict.fromkeys(OPEN_STATUSES, 0)
        for s in await self.episodes.sessions.open_sessions(orchestrator_run=self.config.run_id):
            counts[s.status] = counts.get(s.status, 0) + 1
        for status, n in counts.items():
            metrics.SESSIONS.labels(str(status)).set(n)

    def _spawn(self, name: str, interval: float, fn: Callable[[], Awaitable[object]], *, delay: bool = False) -> None:
        async def loop() -> None:
            if delay:
                await asyncio.sleep(interval)
            while True:
                started = time.monotonic()
                try:
                    await fn()
                except asyncio.CancelledError:
                    raise
                except Exception:
                    log.exception("background task %s failed (will retry)", name)
                await asyncio.sleep(max(0.05, interval - (time.monotonic() - started)))

        self._tasks.append(asyncio.create_task(loop(), name=name))

    @staticmethod
    async def _guard(name: str, fn: Callable[[], Awaitable[None]]) -> None:
        while True:
            try:
                await fn()
                return
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("%s crashed; restarting", name)
                await asyncio.sleep(1.0)

    @property
    def draining(self) -> bool:
        """Shutdown has begun: every new RPC is refused (UNAVAILABLE, reason SHUTTING_DOWN)."""
        return not self.episodes.admission.accepting

    async def drain(self, calls: InFlight | None = None) -> None:
        """SIGTERM: refuse new work at once and let what is in flight finish (the RPCs admitted before, and
        endings whose caller left) for up to `IN_FLIGHT_SHARE` of `drain_s`; RPCs still running then are
        answered UNAVAILABLE so their clients retry elsewhere. Then close (or hand back) every open session
        of this run and empty the warm pools, all within `drain_s`. What does not finish in time is handed
        back by `stop`."""
        self.episodes.admission.accepting = False
        loop = asyncio.get_running_loop()
        end = loop.time() + self.config.drain_s
        try:
            async with asyncio.timeout(self.config.drain_s * IN_FLIGHT_SHARE):
                if calls is not None:
                    await calls.idle()
                await self.episodes.endings.wait()
        except TimeoutError:
            cut = calls.cut() if calls is not None else 0
            log.warning(
                "shutdown: %d RPC(s) still running after %.1fs answered UNAVAILABLE (their clients retry on "
                "another replica)",
                cut,
                self.config.drain_s * IN_FLIGHT_SHARE,
            )
        try:
            async with asyncio.timeout_at(end):
                # Admitted Resets finish (or, cut, release what they made).
                await self.episodes.admission.wait_creations()
                if self.config.shutdown_mode == "close":
                    sessions = await self.episodes.sessions.open_sessions(orchestrator_run=self.config.run_id)
                    sem = asyncio.Semaphore(32)

                    async def close(session_id: str) -> None:
                        async with sem:
                            await self.episodes.closing.close(session_id)

                    await asyncio.gather(*(close(s.session_id) for s in sessions), return_exceptions=True)
                    log.info("shutdown: closed %d session(s)", len(sessions))
                else:
                    log.info("shutdown: handing sessions back (shutdown_mode=handoff)")
                await self.pool.drain()
                # Endings of calls just cut go on with the time left (their callers' retries elsewhere wait for
                # the record); `stop` hands back the rest.
                await self.episodes.endings.wait()
        except TimeoutError:
            log.error(
                "shutdown: drain did not finish within %.1fs; what is left is handed back (instance TTLs "
                "clean up what nobody takes over)",
                self.config.drain_s,
            )

    async def stop(self) -> None:
        """Cancel every background loop, hand back what is still in flight and release clients (after
        `drain`, or alone in tests). Every step is bounded, and all of them together (`STOP_TOTAL_S`)."""
        self.episodes.admission.accepting = False
        loop = asyncio.get_running_loop()
        end = loop.time() + STOP_TOTAL_S

        async def step(what: str, work: Awaitable[object]) -> None:
            await bounded(what, max(STOP_FLOOR_S, min(STOP_STEP_S, end - loop.time())), work)

        for task in self._tasks:
            task.cancel()
        await step("background loops", asyncio.gather(*self._tasks, return_exceptions=True))
        self._tasks.clear()
        # Endings not scored by now keep their request records PENDING: declared dead below, this process
        # hands them to the first retry on another replica, which finishes the scoring.
        await step("unfinished endings", self.episodes.abandon())
        await step("handing back request records", self.store.heartbeat_owner(self.owner, 0))
        await step("releasing the reconcile lease", self.reconciler.release_lease())
        await step("create admission", self.provisioner.close())
        await step("closing the provider client", self.provider.close())
        if self._owns_store:
            await step("closing the store", self.store.close())
