"""Waiting in tests for something to happen: poll the condition itself, with a bound, instead of sleeping a
fixed time and hoping it happened (too short on a loaded machine, too long everywhere else). This is the one
polling loop of the suite: every wait goes through it.

    await wait_until(lambda: pool.size("mailbox:v1") == 2, 60, "the warm pool filled")
    n = await wait_until(lambda: asyncio.to_thread(count_pending), 10, "the creates reached localfleet")
    wait_until_sync(lambda: proc.poll() is not None, 15, "the process exited")
    wait_until_sync(healthy, 60, "localfleet healthy", explain=process.log)

The predicate may return an awaitable (awaited each round): a blocking check goes through
`asyncio.to_thread` so the event loop keeps serving meanwhile. Its first truthy result is returned; if none
comes within `within` seconds the test fails with an AssertionError naming what never happened, the last
result seen and, with `explain`, what that callable says then (a process's log tail). A predicate may raise to
stop waiting at once (a process that exited will never become ready). Give `within` generously: it only costs
time when the test fails anyway.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any

__all__ = ["wait_until", "wait_until_sync"]


def _never(within: float, what: str, last: object, explain: Callable[[], str] | None) -> AssertionError:
    seen = repr(last)
    message = f"not within {within:g}s: {what} (last seen: {seen[:500]})"
    if explain is not None:
        message += f"\n{explain()}"
    return AssertionError(message)


async def wait_until(
    predicate: Callable[[], Any | Awaitable[Any]],
    within: float,
    what: str,
    *,
    interval: float = 0.05,
    explain: Callable[[], str] | None = None,
) -> Any:
    """Poll `predicate` every `interval` seconds until it returns something truthy (returned), at most
    `within` seconds."""
    deadline = time.monotonic() + within
    while True:
        last = predicate()
        if inspect.isawaitable(last):
            last = await last
        if last:
            return last
        if time.monotonic() >= deadline:
            raise _never(within, what, last, explain)
        await asyncio.sleep(interval)


def wait_until_sync(
    predicate: Callable[[], Any],
    within: float,
    what: str,
    *,
    interval: float = 0.05,
    explain: Callable[[], str] | None = None,
) -> Any:
    """`wait_until` for synchronous code (threads, sync tests, process start-up): blocks between polls."""
    deadline = time.monotonic() + within
    while True:
        last = predicate()
        if last:
            return last
        if time.monotonic() >= deadline:
            raise _never(within, what, last, explain)
        time.sleep(interval)
