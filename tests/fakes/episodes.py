"""The orchestrator's episode logic wired as `Orchestrator` wires it, on a fake provider and any store: an
`Episodes` to call Reset / Step / Close on directly, without a gRPC server."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rlgate.orchestrator.config import OrchestratorConfig
from rlgate.orchestrator.episodes import Episodes
from rlgate.orchestrator.pool import WarmPool
from rlgate.orchestrator.providers.base import TaskDef
from rlgate.orchestrator.provisioning import Provisioner
from rlgate.orchestrator.tasks import TaskCatalog
from rlgate.orchestrator.verifier import Verifier
from rlgate.store import SessionStore
from tests.fakes.provider import FakeProvider, FakeToolCache

RUN_ID = "rlgate-unit"
STORE_ID = "unitstore"


def task(key: str = "env/t1", *, max_turns: int = 3, verifier: bool = True) -> TaskDef:
    """A task of environment `env:v1` (scored by the fake provider's verifier unless `verifier=False`)."""
    return TaskDef(
        key=key,
        env_id="env",
        version="v1",
        prompt=f"Do {key}",
        max_turns=max_turns,
        verifier_code="def verify(env, final_answer=None):\n    return 1\n" if verifier else "",
    )


def make_episodes(
    store: SessionStore,
    provider: FakeProvider,
    *,
    owner: str = "orch-1",
    tasks: Sequence[TaskDef] = (),
    tools: FakeToolCache | None = None,
    verify_timeout_s: float = 10.0,
    **config: Any,
) -> Episodes:
    """The `Episodes` of `owner` (heartbeat it in the store for it to count as alive). `config`:
    `OrchestratorConfig` fields (run_id defaults to RUN_ID)."""
    settings = OrchestratorConfig(**{"run_id": RUN_ID, "provider": "fleet", **config})
    provisioner = Provisioner(settings, store, provider, owner, STORE_ID)
    return Episodes.create(
        settings,
        store,
        provider,
        TaskCatalog(tasks or [task()]),
        tools or FakeToolCache(),  # type: ignore[arg-type]  # stands in for ToolCache (no MCP discovery)
        Verifier(provider, timeout_s=verify_timeout_s, retries=settings.verify_retries, backoff_s=0.01),
        provisioner,
        WarmPool(settings, provider, provisioner),
        owner,
    )
