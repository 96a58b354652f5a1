"""The event loop every rlgate service runs on: uvloop's (libuv), not asyncio's own.

uvloop is the loop uvicorn and most production asyncio servers use. It implements the same asyncio
interface, so grpc.aio, aiohttp, anyio and the mcp SDK run on it unchanged; its loop iteration, timers and
the wakeup that hands a store thread's result back cost less CPU, which every RPC pays several times
(docs/benchmarks-log.md, "Event loop"). The client library leaves the loop to the trainer.

Before the loop starts, what the service holds by then (its modules, classes, the SDKs' pydantic models and
schemas: the bulk of its objects) is moved out of the cyclic garbage collector's reach (`gc.freeze`). A
service allocates many short-lived containers per RPC, so the collector runs often, and its full passes
would otherwise walk every one of those startup objects each time: CPU paid per RPC for objects that live as
long as the process (docs/benchmarks.md, "CPU per session").
"""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Coroutine
from typing import Any, TypeVar

import uvloop

T = TypeVar("T")


def run(main: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run(main)` on a new uvloop loop: runs it to completion, then cancels what is left, shuts
    down async generators and the default executor, and closes the loop."""
    freeze_startup_objects()
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main)


def freeze_startup_objects() -> None:
    """Collect what startup left as garbage, then exempt every object alive now from later collections
    (they are never freed; cycles made from here on are collected as before)."""
    gc.collect()
    gc.freeze()
