"""A burst of Resets from two runs on two orchestrator replicas sharing one Redis, against a localfleet that
caps creates as Fleet does (16 in flight, 20 per second, 429 past either). The shared admission keeps the
platform under both caps, so no episode fails; the runs take turns, so the small run is not stuck behind the
big one's burst; and every instance made is deleted again."""

from __future__ import annotations

import asyncio
import os
import time
from datetime import datetime
from typing import Any

import grpc
import httpx
import pytest

from rlgate.orchestrator.server import start_orchestrator
from rlgate.store import open_store
from rlgate.v1 import orchestrator_pb2, orchestrator_pb2_grpc
from tests.orchestrator.conftest import fast_config, instances_of
from tests.support.localfleet import LocalfleetProcess
from tests.support.wait import wait_until

pytestmark = pytest.mark.redis

TASK = "mailbox-count-unread-from-kenji"
IN_FLIGHT_CAP = 16
RATE_CAP = 20
# 512 Resets as the issue states; RLGATE_BURST_RESETS scales it down on a machine too loaded to finish it in
# a few minutes (the shape stays: two runs, three quarters of them from the big one).
RESETS = int(os.environ.get("RLGATE_BURST_RESETS", "512"))


def stopped_instances(lf: LocalfleetProcess, run_id: str) -> dict[str, datetime]:
    """When localfleet made each stopped instance of a run."""
    r = httpx.get(
        f"{lf.base_url}/v1/env/instances",
        params={"run_id": run_id, "status": "stopped"},
        headers={"Authorization": "Bearer test"},
        timeout=30,
    )
    r.raise_for_status()
    return {i["instance_id"]: datetime.fromisoformat(i["created_at"]) for i in r.json()}


async def test_two_runs_burst_through_two_replicas_within_the_platform_caps(
    lf: LocalfleetProcess, redis_server: Any
) -> None:
    lf.reset_counters()
    lf.set_faults(
        {"environments": {"*": {"max_inflight_creates": IN_FLIGHT_CAP, "create_rate": RATE_CAP, "create_delay_s": 0.2}}}
    )
    config = fast_config(
        lf,
        max_concurrent_creates=IN_FLIGHT_CAP,
        create_rate=RATE_CAP,
        create_burst=IN_FLIGHT_CAP,
        provision_timeout_s=60.0,
        create_queue_wait_s=600.0,
        max_sessions=4 * RESETS,
        reconcile_interval_s=600.0,
    )
    stores = [await open_store(redis_server.url) for _ in range(2)]
    replicas = [await start_orchestrator(config, store) for store in stores]
    channels = [grpc.aio.insecure_channel(r.address) for r in replicas]
    stubs = [orchestrator_pb2_grpc.OrchestratorServiceStub(c) for c in channels]
    big, small = RESETS * 3 // 4, RESETS - RESETS * 3 // 4
    instances: dict[str, list[str]] = {"big": [], "small": []}
    failures: list[str] = []

    async def episode(run: str, i: int) -> None:
        stub = stubs[i % 2]  # each run spread over both replicas
        try:
            reset = await stub.Reset(orchestrator_pb2.ResetRequest(task_key=TASK, run_id=run), timeout=600)
            instances[run].append(reset.instance.instance_id)
            await stub.Close(orchestrator_pb2.CloseRequest(session_id=reset.session_id), timeout=60)
        except grpc.aio.AioRpcError as exc:
            failures.append(f"{run}#{i}: {exc.code().name}: {exc.details()}")

    try:
        start = time.monotonic()
        await asyncio.gather(*(episode("big", i) for i in range(big)), *(episode("small", i) for i in range(small)))
        elapsed = time.monotonic() - start
        counters = lf.counters()
        # The order the platform made them in (every one is stopped now, and still listed).
        made = stopped_instances(lf, config.run_id)
        order = sorted(instances["big"] + instances["small"], key=lambda i: made[i])
        small_ids = set(instances["small"])
        last_small = max(n for n, i in enumerate(order) if i in small_ids)
        print(
            f"{RESETS} Resets in {elapsed:.1f}s; platform peak in flight {counters['creates_in_flight_peak']}, "
            f"over the in-flight cap {counters.get('creates_over_inflight_cap', 0)}, over the rate "
            f"{counters.get('creates_over_rate', 0)}; the small run's last create was #{last_small + 1}"
        )
        assert failures == []
        # The platform's own count of create requests it served at once, refused ones included.
        assert counters["creates_in_flight_peak"] <= IN_FLIGHT_CAP
        assert counters.get("creates_over_inflight_cap", 0) == 0
        assert counters["instances_created"] == RESETS and len(made) == RESETS
        # Turns: with runs alternating, the small run's last create comes about 2 x small creates after the
        # first burst; run after the big one, it would come last. Halfway between is the bar.
        assert last_small < (IN_FLIGHT_CAP + 2 * small + RESETS) / 2, last_small
        # And both progress from the start: the first half of the creates holds a good share of each run's.
        first_half = order[: RESETS // 2]
        assert sum(i in small_ids for i in first_half) >= small // 4
        assert sum(i not in small_ids for i in first_half) >= big // 4
        # No instance leaked: every one was deleted with its session.
        await wait_until(lambda: instances_of(lf, config.run_id) == [], 60, "every instance deleted")
    finally:
        for channel in channels:
            await channel.close()
        for replica in replicas:
            await replica.stop()
        for store in stores:
            await store.close()
