"""SIGTERM one of two orchestrators mid-rollout (processes over one Redis store, as in compose's `scale`
profile): no episode is lost.

Many reference episodes run through one `rlgate.AsyncClient` holding both orchestrator addresses (and both
gateways). Once some have finished, orchestrator-1 gets SIGTERM: it refuses new calls at once (UNAVAILABLE
with RetryInfo, so the client retries on orchestrator-2), finishes or hands back what it has in flight, and
exits within its drain time plus a small bound. Every episode ends scored with reward 1.0, each scored
exactly once (localfleet ran one verifier per episode), and nothing is left open.

And the hard case: an ending whose scoring outlasts the drain. The drain cuts the Step (UNAVAILABLE), the
client retries it on the other replica, which takes the ending over once the drained process is gone and
answers with the episode's ending — never FAILED_PRECONDITION.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from rlgate import AsyncClient, RetryPolicy
from rlgate.store import SessionStatus, open_store
from rlgate.v1 import common_pb2
from tests.deploy.replicas import Outcome, Replicas, run_episode, solutions
from tests.support.redis import RedisServer
from tests.support.wait import wait_until

pytestmark = [pytest.mark.redis, pytest.mark.slow]

RUN_ID = "drain-test"
EPISODES = 60
CONCURRENCY = 12
TERM_AFTER = EPISODES // 4  # finished episodes before the SIGTERM: the rest are in flight or still to come
DRAIN_S = 8.0
EXIT_BOUND_S = 5.0  # beyond the drain, for stopping the server, cancelling loops and the interpreter's exit
SETTINGS: dict[str, Any] = {
    "RLGATE_DRAIN_S": DRAIN_S,
    "RLGATE_SHUTDOWN_MODE": "handoff",  # the scale profile's: the run goes on on the other replica
    "RLGATE_RECONCILE_INTERVAL_S": 2,
    "RLGATE_OWNER_TTL_S": 5,
    "RLGATE_PROVISION_TIMEOUT_S": 30,
    "RLGATE_LOG_LEVEL": "INFO",
}
OPEN = {common_pb2.SESSION_STATUS_PROVISIONING, common_pb2.SESSION_STATUS_ACTIVE, common_pb2.SESSION_STATUS_DONE}


async def test_sigterm_mid_rollout_loses_no_episode(tmp_path: Path, redis_server: RedisServer) -> None:
    replicas = Replicas(
        directory=tmp_path / "replicas",
        store_url=redis_server.url,
        run_id=RUN_ID,
        orchestrators=2,
        gateways=2,
        orchestrator_settings=SETTINGS,
    )
    await asyncio.to_thread(replicas.start)
    try:
        drained, survivor = replicas.named("orchestrator")
        client = AsyncClient(
            [s.address for s in replicas.named("orchestrator")],
            gateway_addresses=[s.address for s in replicas.named("toolgateway")],
            retry=RetryPolicy(max_attempts=100, max_backoff=1.0),
        )
        try:
            plan = await solutions(client)
            before = await asyncio.to_thread(replicas.counters)
            outcomes = [Outcome() for _ in range(EPISODES)]
            finished = 0
            enough = asyncio.Event()
            limit = asyncio.Semaphore(CONCURRENCY)

            async def one(index: int) -> Outcome:
                nonlocal finished
                async with limit:
                    try:
                        return await run_episode(
                            client, plan[index % len(plan)], index, outcomes[index], RUN_ID, "drain"
                        )
                    finally:  # failed ones too: the signal comes, and the failures are reported below
                        finished += 1
                        if finished >= TERM_AFTER:
                            enough.set()

            async def terminate() -> tuple[int | None, float]:
                await enough.wait()
                return await asyncio.to_thread(drained.terminate, DRAIN_S + 60)

            stopper = asyncio.create_task(terminate())
            try:
                results = await asyncio.wait_for(
                    asyncio.gather(*(one(i) for i in range(EPISODES)), return_exceptions=True), timeout=180
                )
                code, took = await asyncio.wait_for(stopper, DRAIN_S + 90)
            finally:
                stopper.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await stopper
            print(
                f"{EPISODES} episodes, SIGTERM after {TERM_AFTER}; the drained orchestrator exited {code} "
                f"{took:.2f}s after the signal (drain_s {DRAIN_S})"
            )
            assert code == 0, drained.tail()
            assert took <= DRAIN_S + EXIT_BOUND_S, f"exit took {took:.1f}s:\n{drained.tail()}"

            # 0 episodes lost: each ended, scored 1.0, exactly once.
            failures = Counter(f"{type(r).__name__}: {str(r)[:300]}" for r in results if isinstance(r, BaseException))
            assert not failures, f"{sum(failures.values())} of {EPISODES} episodes lost: {dict(failures)}"
            wrong = [
                (o.session_id, o.verification, o.reward) for o in outcomes if o.verification != "OK" or o.reward != 1.0
            ]
            assert not wrong, f"episodes not scored 1.0: {wrong}"
            after = await asyncio.to_thread(replicas.counters)
            runs = after["verifier_runs"] - before["verifier_runs"]
            assert runs == EPISODES, f"{runs} verifier runs for {EPISODES} episodes"
            check = AsyncClient(survivor.address)
            try:
                for o in outcomes:
                    state = await check.state(o.session_id)
                    assert state.session.status not in OPEN, f"{o.session_id} still open"
                    assert state.session.reward == 1.0
            finally:
                await check.close()
            await wait_until(
                lambda: asyncio.to_thread(lambda: not replicas.instances(RUN_ID)),
                60,
                "no instance left",
                interval=0.5,
            )
        finally:
            await client.close()
    except BaseException:
        print(replicas.logs())
        raise
    finally:
        await asyncio.to_thread(replicas.stop)


SLOW_VERIFY_S = 6.0  # longer than the drain's share for in-flight work (3/4 of CUT_DRAIN_S)
CUT_DRAIN_S = 4.0
SLOW_TASK = {
    "key": "mailbox-slow-verifier",
    "prompt": "Say done.",
    "env_id": "mailbox",
    "version": "v1",
    "task_modality": "tool_use",
    "verifier_code": (
        f"def verify(env, final_answer=None):\n    import time\n    time.sleep({SLOW_VERIFY_S})\n    return 1\n"
    ),
}


async def test_an_ending_cut_by_sigterm_is_answered_by_the_other_replica(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    tasks = tmp_path / "tasks.json"
    tasks.write_text(json.dumps({"tasks": [SLOW_TASK]}))
    replicas = Replicas(
        directory=tmp_path / "replicas",
        store_url=redis_server.url,
        run_id=RUN_ID,
        orchestrators=2,
        gateways=1,
        orchestrator_settings={**SETTINGS, "RLGATE_DRAIN_S": CUT_DRAIN_S, "RLGATE_TASKS_FILE": tasks},
    )
    await asyncio.to_thread(replicas.start)
    store = await open_store(redis_server.url)
    try:
        drained, survivor = replicas.named("orchestrator")
        first = AsyncClient(drained.address)
        client = AsyncClient([drained.address, survivor.address], retry=RetryPolicy(max_attempts=100))
        try:
            reset = await first.reset(task_key=SLOW_TASK["key"], run_id=RUN_ID)
            # The client's first call goes to its first address (the replica about to drain); its retry
            # goes round to the other.
            step = asyncio.create_task(client.step(reset.session_id, final_answer="done", timeout=120))

            async def ending_written() -> bool:
                assert not step.done(), f"the Step ended before its ending turn was written: {step}"
                session = await store.get_session(reset.session_id)
                return session is not None and session.status == SessionStatus.DONE

            await wait_until(ending_written, 30, "the ending turn written")
            # Written: now it is being scored on the drained replica.
            code, took = await asyncio.to_thread(drained.terminate, CUT_DRAIN_S + 60)
            assert code == 0 and took <= CUT_DRAIN_S + EXIT_BOUND_S, (code, took, drained.tail())
            answer = await asyncio.wait_for(step, 120)
            print(f"drained in {took:.2f}s; the cut ending was answered by the other replica")
            assert answer.done and answer.reward == 1.0, answer
            assert answer.verification.status == common_pb2.VERIFICATION_STATUS_OK
            assert "1 RPC(s) still running" in drained.tail(200), drained.tail()  # the call was cut, not finished
            await client.close_session(reset.session_id)
        finally:
            await first.close()
            await client.close()
    except BaseException:
        print(replicas.logs())
        raise
    finally:
        await store.close()
        await asyncio.to_thread(replicas.stop)
