"""Claims whose caller is cancelled mid-claim: the store releases what they created.

A store write that has started is not undone when its caller is cancelled (the SQLite worker runs it to the
end; a Redis script already sent runs). A claim that landed after its caller gave up would stay PENDING
under a live owner, and every retry of that request_id would wait on it until its deadline. The SQLite store
learns such a result from its worker (`ThreadWorker.submit(abandoned=...)`, no cost on the normal path);
the Redis store lets the claim finish as its own task (`claim_or_release`). Either way the release is a
store-owned write (`BackgroundWrites`), finished before the store closes.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")

DRAIN_S = 5.0


class BackgroundWrites:
    """Store writes nobody awaits (releases of abandoned claims), owned by their store."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, op: Coroutine[Any, Any, Any], *, quiet: bool = True) -> asyncio.Task[Any]:
        """Run `op` as an owned task; `quiet`: its failure is logged, not raised (nobody awaits it)."""
        task = asyncio.get_running_loop().create_task(self._quietly(op) if quiet else op)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    @staticmethod
    async def _quietly(op: Awaitable[Any]) -> Any:
        try:
            return await op
        except Exception:  # the store is down or closing: a retry waits until this owner's heartbeat lapses
            log.warning("could not release a claim whose caller was cancelled", exc_info=True)
            return None

    async def drain(self, timeout_s: float = DRAIN_S) -> None:
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=timeout_s)


async def claim_or_release(
    claim: Coroutine[Any, Any, T],
    created: Callable[[T], tuple[str, str] | None],
    release: Callable[[str, str], Coroutine[Any, Any, None]],
    background: BackgroundWrites,
) -> T:
    """Await `claim`; if the caller is cancelled meanwhile, the claim still completes as its own task and
    the record it created (`created(result)` -> (scope, request_id), or None) is released."""
    task = background.spawn(claim, quiet=False)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:

        def undo(done: asyncio.Task[Any]) -> None:
            if done.cancelled() or done.exception() is not None:
                return
            target = created(done.result())
            if target is not None:
                background.spawn(release(*target))

        task.add_done_callback(undo)
        raise
