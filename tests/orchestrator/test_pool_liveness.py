"""Warm pools hand out only live instances: a pooled instance killed while it waits, or one idle past
`pool_max_age_s`, is deleted and replaced, never given to a Reset (against localfleet)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx

from rlgate.v1 import orchestrator_pb2
from tests.orchestrator.conftest import Running, fast_config, instances_of
from tests.support.localfleet import LocalfleetProcess
from tests.support.wait import wait_until

TASK = "mailbox-count-unread-from-kenji"
ENV = "mailbox:v1"


def kill(lf: LocalfleetProcess, instance_id: str) -> None:
    """Stop an instance at the platform, behind rlgate's back (its TTL ran out, the node died, ...)."""
    r = httpx.delete(
        f"{lf.base_url}/v1/env/instances/{instance_id}", headers={"Authorization": "Bearer test"}, timeout=10
    )
    r.raise_for_status()


async def test_a_pooled_instance_killed_while_it_waits_is_never_handed_out(
    lf: LocalfleetProcess, orchestrator_factory: Callable[..., Any]
) -> None:
    orch: Running = await orchestrator_factory(fast_config(lf, warm_pool=f"{ENV}=2", reconcile_interval_s=600))
    pool = orch.handle.orchestrator.pool
    await wait_until(lambda: pool.size(ENV) == 2, 60, "pool filled")
    killed = set(pool.instance_ids())
    for instance_id in killed:
        kill(lf, instance_id)

    reset = await orch.stub.Reset(orchestrator_pb2.ResetRequest(task_key=TASK), timeout=60)
    assert reset.instance.instance_id not in killed  # a fresh one, not a dead pooled one
    assert reset.tools
    # The dead ones are gone from the pool and replaced by live ones.
    await wait_until(lambda: pool.size(ENV) == 2 and not killed & set(pool.instance_ids()), 60, "pool replaced")
    live = {i["instance_id"] for i in instances_of(lf, orch.config.run_id)}
    assert set(pool.instance_ids()) | {reset.instance.instance_id} == live

    second = await orch.stub.Reset(orchestrator_pb2.ResetRequest(task_key=TASK), timeout=60)
    assert second.instance.instance_id not in killed


async def test_a_pooled_instance_idle_past_its_age_bound_is_replaced(
    lf: LocalfleetProcess, orchestrator_factory: Callable[..., Any]
) -> None:
    orch: Running = await orchestrator_factory(
        fast_config(lf, warm_pool=f"{ENV}=1", pool_max_age_s=1.5, reconcile_interval_s=600)
    )
    pool = orch.handle.orchestrator.pool
    await wait_until(lambda: pool.size(ENV) == 1, 60, "pool filled")
    first = set(pool.instance_ids())
    # Past the bound the refill loop sweeps it out and makes another; the old one is deleted at the platform.
    await wait_until(lambda: pool.size(ENV) == 1 and not first & set(pool.instance_ids()), 60, "aged one replaced")
    await wait_until(
        lambda: not first & {i["instance_id"] for i in instances_of(lf, orch.config.run_id)}, 30, "aged one deleted"
    )
