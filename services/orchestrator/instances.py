"""Where an episode's instance comes from and where it goes: a warm-pool instance or a fresh one for a new
session, its seed state restored before an episode starts (a reused instance that cannot be reset is replaced,
so no episode starts on dirty state), and after the session back into its pool or deleted.

A provider that does not manage instances (bring-your-own MCP endpoints) has nothing to create, reset or
delete: its sessions get the environment's endpoints.
"""

from __future__ import annotations

import asyncio
import logging
import time

from rlgate.core.errors import NotFound
from rlgate.orchestrator import metrics
from rlgate.orchestrator.config import OrchestratorConfig
from rlgate.orchestrator.pool import PoolEntry, WarmPool
from rlgate.orchestrator.providers.base import (
    SCREEN_MODALITIES,
    EnvNotFound,
    InstanceHandle,
    Provider,
    ResetFailed,
    TaskDef,
)
from rlgate.orchestrator.provisioning import Provisioner
from rlgate.runtime import tracing
from rlgate.runtime.deadline import Deadline
from rlgate.store import Intent, IntentState, Session

log = logging.getLogger(__name__)


class Instances:
    def __init__(
        self, config: OrchestratorConfig, provider: Provider, provisioner: Provisioner, pool: WarmPool
    ) -> None:
        self._config = config
        self._provider = provider
        self.provisioner = provisioner
        self.pool = pool

    async def acquire(
        self, env_key: str, task: TaskDef | None, deadline: Deadline, *, client: str = ""
    ) -> tuple[InstanceHandle, Intent | None, bool]:
        """An instance for a new session: (handle, intent, reused). A reused one is a warm-pool instance
        whose intent stays claimed until `settled`. A create takes its turn for admission as `client`."""
        if not self._provider.manages_instances:
            try:
                endpoints = self._provider.endpoints_for(env_key, task)
            except EnvNotFound as exc:
                raise NotFound(str(exc), reason="ENV_NOT_FOUND", metadata={"env_key": env_key}) from exc
            return InstanceHandle(instance_id="", env_key=env_key, endpoints=endpoints), None, False
        modality = self._modality(env_key, task)
        if modality not in SCREEN_MODALITIES:  # warm pools hold tool_use instances (no screen)
            entry = await self.pool.take(env_key)
            if entry is not None:
                return entry.handle, entry.intent, True
        env_vars = dict(task.env_variables) if task else {}
        handle, intent = await self.provisioner.create(
            env_key, deadline, env_variables=env_vars, modality=modality, client=client
        )
        return handle, intent, False

    def _modality(self, env_key: str, task: TaskDef | None) -> str:
        """The modality a session on `env_key` runs (it decides the kind of instance created)."""
        return str(self._provider.session_filter(env_key, task)["modality"])

    def settled(self, intent_id: str) -> None:
        """A pooled instance `acquire` handed out is now a session's, or released (reconciliation may judge
        its intent again)."""
        self.pool.settled(intent_id)

    @tracing.traced("rlgate.instance_reset", env_key="env_key")
    async def reset(
        self,
        handle: InstanceHandle,
        intent: Intent | None,
        reused: bool,
        env_key: str,
        task: TaskDef | None,
        deadline: Deadline,
        *,
        client: str = "",
    ) -> tuple[InstanceHandle, Intent | None]:
        """Restore seed state. Fresh instance: a failure is logged and the episode goes on. Reused instance:
        fatal — the instance is deleted and replaced by a fresh one, so no episode starts on dirty state."""
        if not self._provider.manages_instances:
            return handle, intent
        start = time.perf_counter()
        try:
            await self._provider.reset(handle, timeout_s=deadline.cap(self._config.reset_timeout_s) or 0.01)
            metrics.RESET_SECONDS.labels("ok").observe(time.perf_counter() - start)
            return handle, intent
        except ResetFailed as exc:
            metrics.RESET_SECONDS.labels("failed").observe(time.perf_counter() - start)
            if not reused:
                log.warning(
                    "reset failed on fresh instance %s (continuing, seed state is fresh): %s", handle.instance_id, exc
                )
                return handle, intent
            log.warning("reset failed on reused instance %s: replacing it: %s", handle.instance_id, exc)
        await self.discard(handle, intent)
        env_vars = dict(task.env_variables) if task else {}
        fresh, fresh_intent = await self.provisioner.create(
            env_key, deadline, env_variables=env_vars, modality=self._modality(env_key, task), client=client
        )
        return await self.reset(fresh, fresh_intent, False, env_key, task, deadline, client=client)

    async def bind(self, intent: Intent, session_id: str) -> None:
        """The instance is `session_id`'s now. Only once the session records it: a BOUND intent is kept by
        reconciliation only while its session uses the instance."""
        await self.provisioner.set_intent(intent.intent_id, IntentState.BOUND, session_id)

    async def discard(self, handle: InstanceHandle, intent: Intent | None) -> None:
        """Delete an instance no session owns (shielded: a cancelled caller must not leak it)."""
        await asyncio.shield(self.provisioner.release(handle.instance_id, intent.intent_id if intent else ""))

    async def release(self, session: Session, *, pool_ok: bool) -> None:
        """A finished session's instance: reset back into its warm pool when `pool_ok`, pooling on close is on
        and the pool is below target; deleted otherwise."""
        if not session.instance_id:
            return
        handle = InstanceHandle.from_record(session.instance)
        pool_ok = pool_ok and session.modality not in SCREEN_MODALITIES  # a screen instance is not a pool's kind
        if pool_ok and self._config.pool_on_close and session.env_key in self.pool.targets:
            intent = Intent(
                intent_id=session.intent_id,
                run_id=self._config.run_id,
                env_key=session.env_key,
                instance_id=session.instance_id,
            )
            self.pool.claim(intent.intent_id)
            try:
                await self.provisioner.set_intent(intent.intent_id, IntentState.POOLED)
                await self._provider.reset(handle, timeout_s=self._config.reset_timeout_s)
                if await self.pool.put_back(PoolEntry(handle, intent)):
                    log.info("instance %s returned to the %s pool", handle.instance_id, session.env_key)
                    return
            except ResetFailed as exc:
                log.info("instance %s not pooled: %s", handle.instance_id, exc)
            finally:
                self.pool.settled(intent.intent_id)
        await self.provisioner.release(session.instance_id, session.intent_id)
