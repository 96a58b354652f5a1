"""One worker thread that runs blocking calls in order and hands their results back to the event loop.

Cheaper per call than `loop.run_in_executor` (the SQLite store makes several calls per RPC): a call is
a tuple on a `queue.SimpleQueue` and an asyncio future, with no concurrent.futures future, work item or
future chaining. Results go back in batches: the thread keeps running whatever is queued and wakes the
loop once (`call_soon_threadsafe`) when the queue runs dry, or after `MAX_BATCH` calls or `MAX_HOLD_S`,
so under load many calls share one wakeup while a lone call is answered at once.

A call may name a `Group` (a unit of work several calls can share, e.g. one database transaction): calls of
a group run through it, and at every hand-back the group is finished first (`Group.finish`, e.g. COMMIT),
so none of its calls is answered before what they did is done; if finishing fails, every call of the group
gets that error instead of its result. A call without a group first finishes the open one.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

T = TypeVar("T")

MAX_BATCH = 64  # results held back for one wakeup at most
MAX_HOLD_S = 0.002  # nor longer than this, so a long queue cannot delay the first answer much

# A call's result whose caller was cancelled after the call had started (the result is otherwise dropped).
Abandoned = Callable[[Any], None]


class Group(Protocol):
    """Calls that share one unit of work, finished before any of them is answered (see the module doc)."""

    def run(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> Any:
        """Run one call within the unit (opening it if needed). Raises the call's exception; `GroupLost`
        when the call's failure also undid what the unit's earlier calls did."""
        ...

    def finish(self) -> BaseException | None:
        """End the open unit, if any: None when it is done, else the error every call of it gets."""
        ...


class GroupLost(Exception):
    """A call's failure ended the whole unit: the calls run in it before are undone too."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


# (loop, future, fn, args, abandoned, group); None stops the thread.
_Job = tuple[
    asyncio.AbstractEventLoop, asyncio.Future[Any], Callable[..., Any], tuple[Any, ...], Abandoned | None, Group | None
]
# (future, result, exception, abandoned)
_Outcome = tuple[asyncio.Future[Any], Any, BaseException | None, Abandoned | None]


class WorkerStopped(RuntimeError):
    """The worker was stopped before this call could run."""


class ThreadWorker:
    """Runs `fn(*args)` calls one at a time, in submission order, on one dedicated thread."""

    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._stopped = False
        # The thread holds the queue, not this object, so an abandoned worker is collected and its
        # thread told to end (daemon: an unclosed store never blocks interpreter exit).
        self._thread = threading.Thread(target=_serve, args=(self._queue,), name=name, daemon=True)
        self._thread.start()
        weakref.finalize(self, self._queue.put, None)

    def submit(
        self, fn: Callable[..., T], *args: Any, abandoned: Abandoned | None = None, group: Group | None = None
    ) -> asyncio.Future[T]:
        """Queue `fn(*args)`; the future resolves on the calling loop. If the future is cancelled before
        the call starts, the call is skipped; once started it runs to the end, and its result is dropped,
        or handed to `abandoned(result)` on the loop (a write that must be undone, e.g. a claim). With
        `group`, the call runs through it and is answered once the group is finished."""
        if self._stopped:
            raise WorkerStopped("worker stopped")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        self._queue.put((loop, future, fn, args, abandoned, group))
        return future

    def stop(self) -> None:
        """End the thread after the calls already queued; later submits raise WorkerStopped."""
        if not self._stopped:
            self._stopped = True
            self._queue.put(None)

    @property
    def thread(self) -> threading.Thread:
        return self._thread


def _serve(jobs: queue.SimpleQueue[_Job | None]) -> None:
    """The worker thread's loop."""
    done: dict[asyncio.AbstractEventLoop, list[_Outcome]] = {}
    open_group: Group | None = None
    grouped: list[tuple[asyncio.AbstractEventLoop, _Outcome]] = []  # answered once open_group is finished

    def finish_group() -> None:
        nonlocal open_group
        if open_group is None:
            return
        error = open_group.finish()
        open_group = None
        for loop, (future, result, exc, abandoned) in grouped:
            outcome = (future, result, exc, abandoned) if error is None else (future, None, error, abandoned)
            done.setdefault(loop, []).append(outcome)
        grouped.clear()

    def hand_back() -> None:
        finish_group()
        _hand_back(done)

    held = 0
    first_at = 0.0
    while True:
        try:
            job = jobs.get_nowait()
        except queue.Empty:
            hand_back()  # nothing more to do now: answer what is finished with one wakeup
            held = 0
            job = jobs.get()
        if job is None:
            hand_back()
            _fail_rest(jobs)
            return
        loop, future, fn, args, abandoned, group = job
        # Read without the loop's lock: a plain state check under the GIL. A cancel racing with it only
        # means the call runs and its result is dropped, as for a call already started.
        if future.cancelled():
            continue
        if group is not open_group:
            finish_group()
        outcome: _Outcome
        if group is None:
            try:
                outcome = (future, fn(*args), None, abandoned)
            except BaseException as exc:  # handed to the awaiting task, which re-raises it
                outcome = (future, None, exc, abandoned)
            done.setdefault(loop, []).append(outcome)
        else:
            open_group = group
            try:
                outcome = (future, group.run(fn, args), None, abandoned)
            except GroupLost as lost:
                outcome = (future, None, lost.error, abandoned)
                for i, (earlier_loop, (f, _r, e, a)) in enumerate(grouped):
                    grouped[i] = (earlier_loop, (f, None, e or lost.error, a))
            except BaseException as exc:
                outcome = (future, None, exc, abandoned)
            grouped.append((loop, outcome))
        held += 1
        if held == 1:
            first_at = time.monotonic()
        elif held >= MAX_BATCH or time.monotonic() - first_at >= MAX_HOLD_S:
            hand_back()
            held = 0


def _hand_back(done: dict[asyncio.AbstractEventLoop, list[_Outcome]]) -> None:
    for loop, outcomes in done.items():
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is waiting any more
            loop.call_soon_threadsafe(_settle, outcomes)
    done.clear()


def _fail_rest(jobs: queue.SimpleQueue[_Job | None]) -> None:
    """Jobs queued behind the stop marker (submitted from another thread mid-stop) fail, never hang."""
    stopped = WorkerStopped("worker stopped")
    rest: dict[asyncio.AbstractEventLoop, list[_Outcome]] = {}
    while True:
        try:
            job = jobs.get_nowait()
        except queue.Empty:
            break
        if job is not None:
            rest.setdefault(job[0], []).append((job[1], None, stopped, None))
    _hand_back(rest)


def _settle(outcomes: list[_Outcome]) -> None:
    """On the loop: resolve the futures of one batch (skipping callers that gave up)."""
    for future, result, exc, abandoned in outcomes:
        if future.cancelled():
            if abandoned is not None and exc is None:
                abandoned(result)
            continue
        if exc is not None:
            future.set_exception(exc)
        else:
            future.set_result(result)
