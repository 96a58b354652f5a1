"""The SQLite store's worker thread: order, errors, cancellation, batching and stopping."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import pytest

from rlgate.store._worker import MAX_BATCH, ThreadWorker, WorkerStopped


@pytest.fixture
def worker() -> Iterator[ThreadWorker]:
    w = ThreadWorker("test-worker")
    yield w
    w.stop()
    w.thread.join(10)
    assert not w.thread.is_alive()


async def test_runs_in_order_on_its_own_thread(worker: ThreadWorker) -> None:
    seen: list[int] = []

    def record(i: int) -> str:
        seen.append(i)
        return threading.current_thread().name

    names = await asyncio.gather(*(worker.submit(record, i) for i in range(3 * MAX_BATCH)))
    assert seen == list(range(3 * MAX_BATCH))
    assert set(names) == {"test-worker"}


async def test_exceptions_reach_the_caller(worker: ThreadWorker) -> None:
    def boom() -> None:
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        await worker.submit(boom)
    assert await worker.submit(lambda: 42) == 42  # the thread survives


async def test_a_call_cancelled_before_it_starts_is_skipped(worker: ThreadWorker) -> None:
    gate = threading.Event()
    ran: list[str] = []
    first = worker.submit(gate.wait, 10)
    second = worker.submit(ran.append, "second")
    third = worker.submit(ran.append, "third")
    second.cancel()
    gate.set()
    assert await first is True
    await third
    assert ran == ["third"]


async def test_a_started_call_finishes_after_its_caller_gives_up(worker: ThreadWorker) -> None:
    started, gate = threading.Event(), threading.Event()
    ran: list[str] = []

    def slow() -> None:
        started.set()
        gate.wait(10)
        ran.append("slow")

    future = worker.submit(slow)
    await asyncio.to_thread(started.wait, 10)
    future.cancel()
    gate.set()
    await worker.submit(lambda: None)
    assert ran == ["slow"]


async def test_stop_runs_what_was_queued_then_refuses(worker: ThreadWorker) -> None:
    pending = [worker.submit(lambda i=i: i) for i in range(5)]
    worker.stop()
    assert await asyncio.gather(*pending) == list(range(5))
    with pytest.raises(WorkerStopped):
        worker.submit(lambda: None)
    await asyncio.to_thread(worker.thread.join, 10)
    assert not worker.thread.is_alive()
