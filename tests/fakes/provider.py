"""A fake instance platform: the orchestrator's `Provider` with instances in a dict, for unit tests of Reset,
Step and Close without Fleet or localfleet. Creates, resets and verifier runs follow scripts; every create,
reset, delete and verifier run is recorded, so a test can prove that nothing leaked (`live` is empty once
every session ended) and that a verifier ran once.

Script entries: None (succeed), an exception (raised; `ProviderError`s are what a real provider raises),
`HANG` (wait until cancelled) or an `asyncio.Event` (wait until the test sets it, then succeed); `hung` is set
while one of the last two waits, so a test can wait for it. Verifier scripts may also hold a
`VerifierRun`. An empty script succeeds (verifier: score 1.0)."""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rlgate.core.errors import RlgateError
from rlgate.orchestrator.providers.base import (
    InstanceGone,
    InstanceHandle,
    Provider,
    TaskDef,
    VerifierRun,
)
from rlgate.v1 import common_pb2

HANG = "hang"


@dataclass
class VerifyCall:
    """One verifier run the fake saw."""

    task_key: str
    instance_id: str
    final_answer: str | None
    tool_calls: Sequence[Any] | None


@dataclass
class Script:
    """What the next calls of one provider method do, in order (then success)."""

    entries: deque[Any] = field(default_factory=deque)

    def then(self, *entries: Any) -> None:
        self.entries.extend(entries)

    def next(self) -> Any:
        return self.entries.popleft() if self.entries else None


class FakeProvider(Provider):
    """A `Provider` that manages instances in memory (see the module docstring)."""

    name = "fake"
    manages_instances = True

    def __init__(self, tasks: Sequence[TaskDef] = ()) -> None:
        self.tasks = list(tasks)
        self.live: dict[str, InstanceHandle] = {}
        self.created: list[str] = []
        self.deleted: list[str] = []
        self.resets: list[str] = []
        self.verifications: list[VerifyCall] = []
        self.creates = Script()
        self.verifies = Script()
        self.reset_failures: dict[str, Script] = {}  # instance id -> its reset script
        self.unhealthy: set[str] = set()
        self.hung = asyncio.Event()  # a scripted HANG is waiting
        self._ids = itertools.count(1)

    def fail_resets(self, instance_id: str, *entries: Any) -> None:
        """The next resets of `instance_id` do these (e.g. `ResetFailed("...")`)."""
        self.reset_failures.setdefault(instance_id, Script()).then(*entries)

    async def _play(self, entry: Any) -> Any:
        if isinstance(entry, asyncio.Event):  # a gate: wait until the test opens it, then succeed
            self.hung.set()
            await entry.wait()
            return None
        if entry == HANG:
            self.hung.set()
            await asyncio.Event().wait()
        if isinstance(entry, BaseException):
            raise entry
        return entry

    async def load_tasks(self, *, timeout_s: float) -> list[TaskDef]:
        return list(self.tasks)

    async def create(
        self,
        env_key: str,
        *,
        env_variables: dict[str, Any],
        run_id: str,
        ttl_s: int,
        heartbeat_interval_s: int,
        timeout_s: float,
        modality: str = "tool_use",
    ) -> InstanceHandle:
        await self._play(self.creates.next())
        instance_id = f"fake-{next(self._ids)}"
        root = f"http://{instance_id}.invalid/"
        handle = InstanceHandle(
            instance_id=instance_id,
            env_key=env_key,
            root_url=root,
            manager_url=root + "manager/",
            endpoints=[root + "mcp"],
            run_id=run_id,
            env_variables=dict(env_variables),
        )
        self.live[instance_id] = handle
        self.created.append(instance_id)
        return handle

    async def reset(self, handle: InstanceHandle, *, timeout_s: float) -> None:
        self.resets.append(handle.instance_id)
        script = self.reset_failures.get(handle.instance_id)
        await self._play(script.next() if script is not None else None)

    async def health(self, handle: InstanceHandle, *, timeout_s: float) -> bool:
        return handle.instance_id in self.live and handle.instance_id not in self.unhealthy

    async def delete(self, instance_id: str, *, timeout_s: float) -> None:
        self.deleted.append(instance_id)
        self.live.pop(instance_id, None)  # already gone counts as deleted

    async def heartbeat(self, instance_id: str, *, timeout_s: float) -> None:
        if instance_id not in self.live:
            raise InstanceGone(instance_id)

    async def list_instances(self, run_id: str, *, timeout_s: float) -> list[InstanceHandle]:
        return [h for h in self.live.values() if h.run_id == run_id]

    async def verify(
        self,
        task: TaskDef,
        handle: InstanceHandle,
        final_answer: str | None,
        *,
        timeout_s: float,
        tool_calls: Sequence[Any] | None = None,
    ) -> VerifierRun:
        self.verifications.append(VerifyCall(task.key, handle.instance_id, final_answer, tool_calls))
        outcome = await self._play(self.verifies.next())
        return outcome if isinstance(outcome, VerifierRun) else VerifierRun(success=True, score=1.0)


class FakeToolCache:
    """Stands in for the orchestrator's `ToolCache` (which discovers tools over MCP): every environment lists
    `tools`, each spec naming the session's first endpoint; `error` (an RlgateError) fails the listing."""

    def __init__(self, tools: Sequence[str] = ("echo",)) -> None:
        self.tools = list(tools)
        self.error: RlgateError | None = None
        self.lists = 0

    async def get(
        self, env_key: str, endpoints: Sequence[str], tool_filter: dict[str, Any], *, per_instance: bool = True
    ) -> list[common_pb2.ToolSpec]:
        self.lists += 1
        if self.error is not None:
            raise self.error
        endpoint = endpoints[0] if endpoints else ""
        return [
            common_pb2.ToolSpec(name=n, input_schema_json='{"type":"object"}', endpoint=endpoint) for n in self.tools
        ]
