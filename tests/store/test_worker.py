"""The SQLite store's worker thread: order, errors, cancellation, batching and stopping."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from rlgate.store._worker import MAX_BATCH, GroupLost, ThreadWorker, WorkerStopped


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


class RecordingGroup:
    """A unit of work that logs what the worker asks of it, and can be told to fail its finish."""

    def __init__(self, fail_finish: BaseException | None = None) -> None:
        self.log: list[str] = []
        self.open = False
        self.fail_finish = fail_finish

    def run(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> Any:
        if not self.open:
            self.open = True
            self.log.append("begin")
        return fn(*args)

    def finish(self) -> BaseException | None:
        if not self.open:
            return None
        self.open = False
        self.log.append("finish")
        return self.fail_finish


async def test_calls_of_a_group_share_one_unit_and_are_answered_after_it_finishes(worker: ThreadWorker) -> None:
    group = RecordingGroup()
    gate = threading.Event()
    first = worker.submit(gate.wait, 10)  # holds the thread while the group's calls queue up behind it

    def step(i: int) -> int:
        group.log.append(f"call {i}")
        return i

    calls = [worker.submit(step, i, group=group) for i in range(5)]
    answered: list[list[str]] = []
    for call in calls:
        call.add_done_callback(lambda _f: answered.append(list(group.log)))
    gate.set()
    assert await first is True
    assert await asyncio.gather(*calls) == list(range(5))
    assert group.log == ["begin", *(f"call {i}" for i in range(5)), "finish"]
    assert all(seen[-1] == "finish" for seen in answered)  # nobody was answered before the unit finished


async def test_a_call_without_the_group_finishes_it_first(worker: ThreadWorker) -> None:
    group = RecordingGroup()
    gate = threading.Event()
    first = worker.submit(gate.wait, 10)
    grouped = worker.submit(group.log.append, "grouped", group=group)
    plain = worker.submit(group.log.append, "plain")
    gate.set()
    await asyncio.gather(first, grouped, plain)
    assert group.log == ["begin", "grouped", "finish", "plain"]


async def test_a_failed_finish_fails_every_call_of_the_group(worker: ThreadWorker) -> None:
    group = RecordingGroup(fail_finish=OSError("disk full"))
    gate = threading.Event()
    first = worker.submit(gate.wait, 10)
    calls = [worker.submit(lambda i=i: i, group=group) for i in range(3)]
    gate.set()
    await first
    for call in calls:
        with pytest.raises(OSError, match="disk full"):
            await call


async def test_a_lost_group_fails_the_calls_run_in_it_before(worker: ThreadWorker) -> None:
    class LosingGroup(RecordingGroup):
        def run(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> Any:
            if args == ("lose",):
                self.open = False
                raise GroupLost(ValueError("rolled back"))
            return super().run(fn, args)

    group = LosingGroup()
    gate = threading.Event()
    first = worker.submit(gate.wait, 10)
    before = worker.submit(lambda _x: "kept?", "before", group=group)
    lost = worker.submit(lambda _x: "never", "lose", group=group)
    after = worker.submit(lambda _x: "after", "after", group=group)
    gate.set()
    await first
    for call in (before, lost):
        with pytest.raises(ValueError, match="rolled back"):
            await call
    assert await after == "after"  # a new unit
