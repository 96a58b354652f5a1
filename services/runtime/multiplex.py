"""Unary calls carried over one bidi stream (CallToolStream, StepStream): the server side.

Each request on the stream is one call of the unary RPC it stands for. It runs as its own task through
the very handler the unary RPC uses, under its own deadline, and is answered on the stream with the reply
or the status the unary RPC would have ended with. What the interceptors do per unary RPC (trace id, an
INTERNAL status for an unexpected exception, metrics) is done here per call, since interceptors see only
the stream. The point of it all: a call on an open stream skips gRPC's per-RPC work (a new HTTP/2 stream,
headers and trailers, a server task, the interceptor chain), about half of a small call's CPU in grpc.aio.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import time
from collections.abc import AsyncIterable, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import grpc

from rlgate.runtime.logs import session_id_var, trace_id_var
from rlgate.v1 import common_pb2

log = logging.getLogger(__name__)

# Calls of one stream in flight at once; past it the server stops reading the stream (HTTP/2 flow control
# then holds the client back) until one finishes. Stated in the proto, so a change belongs there too.
MAX_IN_FLIGHT = 1024

Reply = TypeVar("Reply")


def call_status(code: grpc.StatusCode, message: str, details: Any = ()) -> common_pb2.CallStatus:
    """A call's status as carried on a stream (`details`: google.protobuf.Any messages)."""
    return common_pb2.CallStatus(code=code.value[0], message=message, details=list(details))


def seconds_left(envelope: Any, context: grpc.aio.ServicerContext) -> float | None:
    """The call's time: its own timeout, bounded by the stream's deadline if the stream has one."""
    own = envelope.timeout.seconds + envelope.timeout.nanos / 1e9 if envelope.HasField("timeout") else None
    stream = context.time_remaining()
    if own is None:
        return stream
    return own if stream is None else min(own, stream)


@dataclass(frozen=True)
class StreamedMethod(Generic[Reply]):
    """What a stream needs to know about the unary method its calls stand for.

    `handle(envelope, seconds_left)` runs one call as the unary handler would (seconds_left: None = no
    deadline); `known_error(exc)` is the status the unary RPC ends with for an expected exception, None for a
    bug (answered INTERNAL and logged). `response` is the stream's response message class."""

    name: str
    response: type
    handle: Callable[[Any, float | None], Awaitable[Reply]]
    known_error: Callable[[Exception], common_pb2.CallStatus | None]
    observe: Callable[[str, float], None] = lambda code, seconds: None  # metrics: status code name, latency


class Multiplexer(Generic[Reply]):
    """Serves one streamed method: `await serve(requests, context)` is the whole stream handler."""

    def __init__(self, method: StreamedMethod[Reply], max_in_flight: int = MAX_IN_FLIGHT) -> None:
        self._method = method
        self._max_in_flight = max_in_flight

    async def serve(self, requests: AsyncIterable[Any], context: grpc.aio.ServicerContext) -> None:
        tasks: dict[int, asyncio.Task[None]] = {}
        cancelled: set[int] = set()  # call_ids the client cancelled: answered CANCELLED
        answering: set[int] = set()  # call_ids whose handler is done: a cancel comes too late
        room = asyncio.Semaphore(self._max_in_flight)
        writing = asyncio.Lock()  # grpc.aio allows one write at a time
        # Headers now, so a client can tell an open stream from a server that lacks the method (which ends it
        # UNIMPLEMENTED) before its first write.
        await context.send_initial_metadata(())

        def finished(call_id: int, _task: asyncio.Task[None]) -> None:
            tasks.pop(call_id, None)
            cancelled.discard(call_id)
            answering.discard(call_id)
            room.release()

        try:
            async for envelope in requests:
                call_id = envelope.call_id
                if envelope.cancel:
                    task = tasks.get(call_id)
                    if task is not None and call_id not in answering:
                        cancelled.add(call_id)
                        task.cancel()
                    continue
                if call_id in tasks:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                        f"call_id {call_id} is already in flight on this stream")
                await room.acquire()
                task = asyncio.create_task(self._call(envelope, context, writing, cancelled, answering))
                tasks[call_id] = task
                task.add_done_callback(functools.partial(finished, call_id))
            # Half-closed by the client: the calls in flight still finish and are answered.
            while tasks:
                await asyncio.wait(list(tasks.values()))
        finally:  # the stream was cancelled or aborted: so are its calls
            for task in tasks.values():
                task.cancel()
            if tasks:
                await asyncio.wait(list(tasks.values()))

    async def _call(self, envelope: Any, context: grpc.aio.ServicerContext, writing: asyncio.Lock,
                    cancelled: set[int], answering: set[int]) -> None:
        method = self._method
        trace = envelope.trace_id[:64] or os.urandom(8).hex()
        trace_id_var.set(trace)  # this task's own context: the call's log lines carry its trace id
        session_id_var.set("-")
        start = time.perf_counter()
        answer = method.response(call_id=envelope.call_id)
        try:
            left = seconds_left(envelope, context)
            deadline = asyncio.timeout(left)
            try:
                async with deadline:
                    answer.reply.CopyFrom(await method.handle(envelope, left))
            except TimeoutError:
                if not deadline.expired():
                    raise  # the handler's own TimeoutError: a bug, as it would be in the unary RPC
                answer.error.CopyFrom(call_status(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded"))
        except asyncio.CancelledError:
            by_client = envelope.call_id in cancelled
            task = asyncio.current_task()
            if not by_client and task is not None and task.cancelling():
                raise  # the stream is going away: nobody to answer
            # the client's cancel, or a CancelledError the handler raised on its own (the stream is fine)
            answer.error.CopyFrom(call_status(grpc.StatusCode.CANCELLED,
                                              "cancelled by the client" if by_client else "cancelled"))
        except Exception as exc:
            try:
                status = method.known_error(exc)
            except Exception:
                status = None
            if status is None:
                log.exception("unhandled error in %s (streamed)", method.name)
                status = call_status(grpc.StatusCode.INTERNAL, f"internal error (trace id {trace})")
            answer.error.CopyFrom(status)
        answering.add(envelope.call_id)  # from here on a cancel from the client would lose the answer
        method.observe("OK" if answer.HasField("reply") else _code_name(answer.error.code), time.perf_counter() - start)
        async with writing:
            try:
                await context.write(answer)
            except Exception as exc:  # the client went away meanwhile; the call's effects are recorded already
                log.debug("%s answer not delivered: %s", method.name, exc)


_NAMES = {code.value[0]: code.name for code in grpc.StatusCode}


def _code_name(value: int) -> str:
    return _NAMES.get(value, "UNKNOWN")
