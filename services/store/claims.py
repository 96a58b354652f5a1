"""Claiming a request record from a caller that may be cancelled mid-claim.

A store write that has started is not undone when its caller is cancelled (the SQLite worker runs it to the
end; a Redis script already sent runs). A claim that lands after its caller gave up would stay PENDING under
a live owner, and every retry of that request_id would wait on it until its deadline. `claim_or_release`
lets the claim finish on its own and releases it if it created the record.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")

Spawn = Callable[[Coroutine[Any, Any, Any]], "asyncio.Task[Any]"]


async def claim_or_release(claim: Coroutine[Any, Any, T], created: Callable[[T], tuple[str, str] | None],
                           release: Callable[[str, str], Awaitable[None]], spawn: Spawn) -> T:
    """Await `claim` (a store call that may create a PENDING record). If the caller is cancelled meanwhile,
    the claim still completes, and the record it created (`created(result)` -> (scope, request_id), or
    None) is released. `spawn` runs both as tasks its caller owns (and cancels or drains on shutdown)."""
    task = spawn(claim)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        task.add_done_callback(lambda done: _release_created(done, created, release, spawn))
        raise


def _release_created(done: asyncio.Task[Any], created: Callable[[Any], tuple[str, str] | None],
                     release: Callable[[str, str], Awaitable[None]], spawn: Spawn) -> None:
    if done.cancelled() or done.exception() is not None:
        return
    target = created(done.result())
    if target is not None:
        spawn(_quietly(release(*target)))


async def _quietly(op: Awaitable[None]) -> None:
    try:
        await op
    except Exception:  # the store is down or closing: a retry waits until this process's owner lapses
        log.warning("could not release a claim whose caller was cancelled", exc_info=True)
