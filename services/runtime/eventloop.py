"""The event loop every rlgate service runs on: uvloop's (libuv), not asyncio's own.

uvloop is the loop uvicorn and most production asyncio servers use. It implements the same asyncio
interface, so grpc.aio, aiohttp, anyio and the mcp SDK run on it unchanged; its loop iteration, timers and
the wakeup that hands a store thread's result back cost less CPU, which every RPC pays several times
(docs/benchmarks-log.md, "Event loop"). The client library leaves the loop to the trainer.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

import uvloop

T = TypeVar("T")


def run(main: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run(main)` on a new uvloop loop: runs it to completion, then cancels what is left, shuts
    down async generators and the default executor, and closes the loop."""
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main)
