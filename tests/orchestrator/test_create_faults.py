"""Creates as Fleet really behaves, against localfleet's injected faults: a lost reply is retried under the same
idempotency key and adopted via 409 (one instance, not two); retryable placement failures are retried; a rate
limit's 429 throttles the shared admission and every Reset still gets its instance; a Reset that waits past
the admission bound gets RESOURCE_EXHAUSTED with RetryInfo."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2

from rlgate.v1 import orchestrator_pb2
from tests.orchestrator.conftest import Running, fast_config, instances_of
from tests.support.localfleet import LocalfleetProcess
from tests.support.statuses import detail

TASK = "mailbox-count-unread-from-kenji"


def faults(**env: Any) -> dict[str, Any]:
    return {"environments": {"mailbox": env}}


async def test_a_create_whose_reply_is_lost_is_adopted_leaving_one_instance(
    lf: LocalfleetProcess, orchestrator_factory: Callable[..., Any]
) -> None:
    orch: Running = await orchestrator_factory(fast_config(lf, reconcile_interval_s=600))
    lf.reset_counters()
    lf.set_faults(faults(create_reply_loss_rate=1.0))  # every create's reply is lost; its retry's 409 is not
    reset = await orch.stub.Reset(orchestrator_pb2.ResetRequest(task_key=TASK), timeout=60)
    assert reset.tools
    counters = lf.counters()
    assert counters["create_replies_lost"] == 1
    assert counters["instances_created"] == 1  # the retry adopted it: no second instance
    live = instances_of(lf, orch.config.run_id)
    assert [i["instance_id"] for i in live] == [reset.instance.instance_id]
    intents = await orch.handle.orchestrator.store.list_intents(orch.config.run_id)
    assert [i.instance_id for i in intents] == [reset.instance.instance_id]


async def test_retryable_placement_failures_are_retried(
    lf: LocalfleetProcess, orchestrator_factory: Callable[..., Any]
) -> None:
    orch: Running = await orchestrator_factory(fast_config(lf, reconcile_interval_s=600))
    lf.reset_counters()
    lf.set_faults(faults(placement_failure_rate=0.5))
    created: set[str] = set()
    rounds = 0
    # Half the creates fail, at random: 6 of them all succeed 1 time in 64, so a round without a failure is
    # followed by another (none in 5 rounds: about 1 in 10^9), and the test never passes without a retry.
    while rounds < 5 and not lf.counters().get("creates_placement_failed"):
        resets = await asyncio.gather(
            *(orch.stub.Reset(orchestrator_pb2.ResetRequest(task_key=TASK), timeout=60) for _ in range(6))
        )
        created |= {r.instance.instance_id for r in resets}
        rounds += 1
    counters = lf.counters()
    assert counters.get("creates_placement_failed", 0) >= 1
    assert len(created) == 6 * rounds  # every Reset got an instance of its own
    assert counters["instances_created"] == 6 * rounds
    assert len(instances_of(lf, orch.config.run_id)) == 6 * rounds


async def test_a_rate_limit_throttles_admission_and_every_reset_succeeds(
    lf: LocalfleetProcess, orchestrator_factory: Callable[..., Any]
) -> None:
    # rlgate believes it may create 100/s; the platform allows 4/s and answers 429 with Retry-After past it.
    orch: Running = await orchestrator_factory(
        fast_config(lf, reconcile_interval_s=600, create_rate=100.0, create_burst=100.0, create_rate_recovery=1.0)
    )
    lf.reset_counters()
    lf.set_faults(faults(create_rate=4))
    resets = await asyncio.gather(
        *(orch.stub.Reset(orchestrator_pb2.ResetRequest(task_key=TASK), timeout=60) for _ in range(12))
    )
    assert len({r.instance.instance_id for r in resets}) == 12
    counters = lf.counters()
    assert counters["creates_throttled"] >= 1
    assert counters["instances_created"] == 12
    gate = orch.handle.orchestrator.provisioner.gate
    assert gate.rate < 100.0  # the shared rate was cut (it climbs back at 1/s per second)


async def test_a_reset_past_the_admission_wait_is_resource_exhausted_with_retry_info(
    lf: LocalfleetProcess, orchestrator_factory: Callable[..., Any]
) -> None:
    orch: Running = await orchestrator_factory(
        fast_config(lf, reconcile_interval_s=600, max_concurrent_creates=1, create_queue_wait_s=0.5)
    )
    lf.set_faults(faults(create_delay_s=3.0))  # the one create slot stays taken for 3 s

    async def reset() -> orchestrator_pb2.ResetResponse:
        response: orchestrator_pb2.ResetResponse = await orch.stub.Reset(
            orchestrator_pb2.ResetRequest(task_key=TASK), timeout=60
        )
        return response

    first = asyncio.create_task(reset())
    await asyncio.sleep(0.5)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await orch.stub.Reset(orchestrator_pb2.ResetRequest(task_key=TASK), timeout=60)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert detail(err.value, error_details_pb2.ErrorInfo).reason == "CREATE_ADMISSION_TIMEOUT"
    assert detail(err.value, error_details_pb2.RetryInfo).retry_delay.ToTimedelta().total_seconds() > 0
    assert (await first).tools  # the admitted one goes on
    assert len(instances_of(lf, orch.config.run_id)) == 1  # the refused one made nothing
