"""The crash test: the orchestrator as a real process (`rlgate orchestrator`), SIGKILLed with sessions open
and creates in flight, restarted; then SIGTERM with sessions open. Nothing may leak. It runs on the default
run id, which the store keeps: the restarted process reconciles what the killed one left."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from rlgate.orchestrator.provisioning import default_run_id, store_identity
from rlgate.store.sqlite import SqliteStore
from rlgate.v1 import orchestrator_pb2, orchestrator_pb2_grpc
from tests.orchestrator.conftest import REPO, instances_of
from tests.support.localfleet import LocalfleetProcess
from tests.support.ports import free_port, wait_for_port
from tests.support.wait import wait_until

TASK = "mailbox-count-unread-from-kenji"
RECONCILE_S = 2.0
OWNER_TTL_S = 2.0
CREATE_DELAY_S = 4.0
RECONCILE_PASS = re.compile(r"reconcile: \d+ instance\(s\), kept ")


class OrchestratorProcess:
    def __init__(self, lf: LocalfleetProcess, workdir: Path) -> None:
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.store_path = workdir / "store.db"
        self.log_path = workdir / "orchestrator.log"
        self.args = [
            str(REPO / ".venv" / "bin" / "rlgate"),
            "orchestrator",
            "--listen",
            self.address,
            "--store-url",
            f"sqlite:///{self.store_path}",
            "--fleet-base-url",
            lf.base_url,
            "--fleet-api-key",
            "test",
            "--reconcile-interval-s",
            str(RECONCILE_S),
            "--owner-ttl-s",
            str(OWNER_TTL_S),
            "--provision-timeout-s",
            "30",
            "--reset-timeout-s",
            "3",
            "--drain-s",
            "30",
            "--gateway-address",
            "127.0.0.1:1",
            "--log-level",
            "INFO",
        ]
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RLGATE_", "FLEET_"))}
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.args, stdout=log, stderr=subprocess.STDOUT, cwd=str(REPO), env=env, start_new_session=True
            )
        wait_for_port(self.port, timeout=60)

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)

    def wait(self, timeout: float) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout=timeout)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.signal(signal.SIGKILL)
            self.proc.wait(timeout=10)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:] if self.log_path.exists() else ""

    def reconcile_passes(self) -> int:
        """Reconcile passes the process has logged (each ends with one summary line)."""
        return len(RECONCILE_PASS.findall(self.log_path.read_text(errors="replace"))) if self.log_path.exists() else 0


@pytest.fixture
def crash_lf() -> Iterator[LocalfleetProcess]:
    with LocalfleetProcess() as lf:
        yield lf


async def _orphans(lf: LocalfleetProcess, store: SqliteStore, run_id: str) -> list[str]:
    """Instances localfleet holds for the run that no open session owns."""
    owned = set()
    cursor = ""
    while True:
        page, cursor = await store.list_sessions(
            statuses=frozenset({"active", "done", "provisioning"}), limit=500, cursor=cursor
        )
        owned |= {s.instance_id for s in page}
        if not cursor:
            break
    return [i["instance_id"] for i in instances_of(lf, run_id) if i["instance_id"] not in owned]


@pytest.mark.slow
async def test_sigkill_mid_create_then_restart_then_sigterm(crash_lf: LocalfleetProcess, tmp_path: Path) -> None:
    lf = crash_lf
    orch = OrchestratorProcess(lf, tmp_path)
    orch.start()
    store = await SqliteStore.open(str(orch.store_path))
    run_id = default_run_id(await store_identity(store))  # what the process derived from its store
    try:
        async with grpc.aio.insecure_channel(orch.address) as channel:
            stub = orchestrator_pb2_grpc.OrchestratorServiceStub(channel)
            opened = await asyncio.gather(
                *(
                    stub.Reset(
                        orchestrator_pb2.ResetRequest(task_key=TASK, request_id=f"open-{i}", max_turns=50), timeout=120
                    )
                    for i in range(20)
                )
            )
            assert len({r.session_id for r in opened}) == 20

            lf.set_faults({"environments": {"mailbox": {"create_delay_s": CREATE_DELAY_S}}})
            in_flight = [
                asyncio.ensure_future(
                    stub.Reset(
                        orchestrator_pb2.ResetRequest(task_key=TASK, request_id=f"inflight-{i}", max_turns=50),
                        timeout=120,
                    )
                )
                for i in range(10)
            ]

            async def all_creating() -> bool:
                listed = await asyncio.to_thread(instances_of, lf, run_id)
                return sum(1 for i in listed if i["status"] == "pending") == 10

            # Killed while every create waits inside localfleet (seen pending: for CREATE_DELAY_S, then they land).
            await wait_until(all_creating, 60, "all 10 creates pending in localfleet")
            orch.signal(signal.SIGKILL)
            orch.wait(10)
            results = await asyncio.gather(*in_flight, return_exceptions=True)
            assert all(isinstance(r, grpc.aio.AioRpcError) for r in results)  # none answered before the crash
        lf.set_faults({})

        orch.start()  # same store, so the same default run id
        killed_at = time.monotonic()
        # Within the reconcile interval (after the dead owner's TTL and the slow creates landing), every
        # instance of the run belongs to a live session.
        bound = CREATE_DELAY_S + OWNER_TTL_S + 2 * RECONCILE_S + 10
        orphans: list[str] = []

        async def no_orphan() -> bool:
            orphans[:] = await _orphans(lf, store, run_id)
            return not orphans

        await wait_until(
            no_orphan,
            bound,
            "every instance of the run owned by a live session",
            interval=0.5,
            explain=lambda: f"orphans: {orphans}\n{orch.log()}",
        )
        recovered_s = time.monotonic() - killed_at
        counters = lf.counters()
        print(
            f"localfleet after recovery: created {counters['instances_created']}, "
            f"deleted {counters['instances_deleted']}"
        )
        # Every create that landed after the crash was recognised by its intent and deleted.
        assert counters["instances_deleted"] == counters["instances_created"] - 20

        async with grpc.aio.insecure_channel(orch.address) as channel:
            stub = orchestrator_pb2_grpc.OrchestratorServiceStub(channel)
            steps = await asyncio.gather(
                *(stub.Step(orchestrator_pb2.StepRequest(session_id=r.session_id), timeout=60) for r in opened)
            )
            assert all(s.turn == 1 and not s.done for s in steps)  # the live sessions still work

            retried = await asyncio.gather(
                *(
                    stub.Reset(
                        orchestrator_pb2.ResetRequest(task_key=TASK, request_id=f"inflight-{i}", max_turns=50),
                        timeout=120,
                    )
                    for i in range(10)
                )
            )
            assert len({r.session_id for r in retried}) == 10
            assert not {r.session_id for r in retried} & {r.session_id for r in opened}
            again = await stub.Reset(
                orchestrator_pb2.ResetRequest(task_key=TASK, request_id="inflight-0", max_turns=50), timeout=60
            )
            assert again.session_id == retried[0].session_id  # the retry is now recorded
            steps = await asyncio.gather(
                *(stub.Step(orchestrator_pb2.StepRequest(session_id=r.session_id), timeout=60) for r in retried)
            )
            assert all(s.turn == 1 for s in steps)
        # A whole reconcile pass after the retries (the second summary line from now) deleted nothing.
        passes = orch.reconcile_passes()
        await wait_until(lambda: orch.reconcile_passes() >= passes + 2, 3 * RECONCILE_S + 10, "two reconcile passes")
        assert await _orphans(lf, store, run_id) == []
        assert len(instances_of(lf, run_id)) == 30

        orch.signal(signal.SIGTERM)
        assert orch.wait(60) == 0, orch.log()
        assert instances_of(lf, run_id) == [], orch.log()
        page, _ = await store.list_sessions(statuses=frozenset({"active", "done", "provisioning"}), limit=100)
        assert page == []
        print(f"recovered (no orphan instance) {recovered_s:.1f}s after restart")
    finally:
        orch.stop()
        await store.close()
