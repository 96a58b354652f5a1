# ruff: noqa: ASYNC109  -- `timeout=` is the deadline sent with each call, as in grpc.aio itself
"""CallTool and Step over long-lived streams (CallToolStream, StepStream): the client side of `AsyncClient`.

A call on an open stream skips gRPC's per-RPC work (a new HTTP/2 stream, headers, trailers, a server task),
about half of a small call's CPU in grpc.aio; the semantics are the unary RPC's. One `StreamCaller` per
channel and method keeps one stream open: each call writes one request with a fresh call_id and awaits
its answer, which a reader task matches by call_id. A stream is replaced after `max_age_s` (the old one
is half-closed and drains), so it never outlives the server's connection age or pins one replica forever.

Failures look exactly like the unary call's: `StreamCallError` is a `grpc.RpcError` with `code()`,
`details()` and the rich-status trailer, so `rlgate.retry` and `rlgate.errors` treat both alike. A call
whose stream breaks fails UNAVAILABLE, which is what a unary call cut off mid-flight reports too; its
request_id makes the retry safe. A server without the stream methods answers UNIMPLEMENTED:
`StreamsUnsupported` tells the client to use the unary RPC instead.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from rlgate.errors import status_code
from rlgate.v1 import orchestrator_pb2, toolgateway_pb2

Metadata = Sequence[tuple[str, str]]
_DETAILS_KEY = "grpc-status-details-bin"
_CODES = {code.value[0]: code for code in grpc.StatusCode}
# Stream-level statuses that are the caller's to see; any other end of a stream means "try again".
_PASSED_ON = frozenset({grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED,
                        grpc.StatusCode.INVALID_ARGUMENT})


@dataclass(frozen=True)
class StreamedMethod:
    """A unary method and the stream that carries it."""

    method: str  # "CallTool"
    stream: str  # the stub attribute: "CallToolStream"
    envelope: type  # the stream's request message
    payload: str  # the envelope field holding the unary request


STREAMED = {m.method: m for m in (
    StreamedMethod("CallTool", "CallToolStream", toolgateway_pb2.CallToolStreamRequest, "call"),
    StreamedMethod("Step", "StepStream", orchestrator_pb2.StepStreamRequest, "step"),
)}


class StreamCallError(grpc.RpcError):
    """A streamed call's failure, shaped like grpc.aio's unary RpcError."""

    def __init__(self, code: grpc.StatusCode, details: str, rich_status: bytes | None = None) -> None:
        super().__init__(f"{code.name}: {details}")
        self._code, self._details, self._rich = code, details, rich_status

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> tuple[tuple[str, bytes], ...]:
        return ((_DETAILS_KEY, self._rich),) if self._rich else ()

    def initial_metadata(self) -> tuple[tuple[str, bytes], ...]:
        return ()

    @classmethod
    def from_status(cls, status: Any) -> StreamCallError:
        code = _CODES.get(status.code, grpc.StatusCode.UNKNOWN)
        return cls(code, status.message, status.SerializeToString() if status.details else None)


class StreamsUnsupported(Exception):
    """The server has no stream for this method (an older rlgate): use the unary RPC."""


class _Stream:
    """One open stream: a reader task resolves each call's future by call_id."""

    def __init__(self, open_call: Callable[[], Any], where: str) -> None:
        self.call = open_call()
        self.where = where
        self.opened = time.monotonic()
        self.pending: dict[int, asyncio.Future[Any]] = {}
        self.ids = itertools.count(1)
        self.writing = asyncio.Lock()  # grpc.aio allows one write at a time
        self.ended: StreamCallError | StreamsUnsupported | None = None
        self.cancels: set[asyncio.Task[None]] = set()  # cancel messages in flight (owned; see close)
        self.started = False  # the server's headers arrived (see _start)
        self.reader = asyncio.get_running_loop().create_task(self._read())

    async def _read(self) -> None:
        end: StreamCallError | StreamsUnsupported
        try:
            while True:
                answer = await self.call.read()
                if answer is grpc.aio.EOF:
                    end = StreamCallError(grpc.StatusCode.UNAVAILABLE, f"stream to {self.where} ended")
                    break
                future = self.pending.pop(answer.call_id, None)
                if future is not None and not future.done():
                    future.set_result(answer)
        except grpc.RpcError as err:
            end = self._failure(err)
        except asyncio.CancelledError:  # the client is closing: its calls end as a cancelled unary call does
            end = StreamCallError(grpc.StatusCode.CANCELLED, f"stream to {self.where} closed by the client")
            raise
        except Exception as exc:
            end = StreamCallError(grpc.StatusCode.UNAVAILABLE, f"stream to {self.where} broke: {exc!r}")
        finally:
            self.ended = end
            for future in self.pending.values():
                if not future.done():
                    future.set_exception(end)
            self.pending.clear()

    def _failure(self, err: grpc.RpcError) -> StreamCallError | StreamsUnsupported:
        code = status_code(err)
        details = err.details() if callable(getattr(err, "details", None)) else str(err)  # type: ignore[attr-defined]
        if code is grpc.StatusCode.UNIMPLEMENTED:
            return StreamsUnsupported(f"{self.where}: {details}")
        if code in _PASSED_ON:
            return StreamCallError(code, details)
        name = code.name if isinstance(code, grpc.StatusCode) else "error"
        return StreamCallError(grpc.StatusCode.UNAVAILABLE, f"stream to {self.where} broke ({name}: {details})")

    async def request(self, method: StreamedMethod, payload: Any, timeout: float | None,
                      token: str, trace_id: str) -> Any:
        """Send one call and await its answer (the unary reply), or raise StreamCallError."""
        if self.ended is not None:
            raise self.ended
        if not self.started:
            await self._start(timeout)
        call_id = next(self.ids)
        envelope = method.envelope(call_id=call_id, trace_id=trace_id, **{method.payload: payload})
        if token:
            envelope.token = token
        if timeout is not None:
            envelope.timeout.FromNanoseconds(int(max(0.0, timeout) * 1e9))
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.pending[call_id] = future
        try:
            try:
                async with self.writing:
                    await self.call.write(envelope)
            except (grpc.RpcError, asyncio.InvalidStateError) as exc:  # the stream ended under us
                await asyncio.sleep(0)  # let the reader record why
                raise self.ended or StreamCallError(
                    grpc.StatusCode.UNAVAILABLE, f"stream to {self.where} broke: {exc}") from None
            try:
                async with asyncio.timeout(timeout):
                    answer = await future
            except TimeoutError:
                self._cancel(method, call_id)
                raise StreamCallError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded") from None
            except asyncio.CancelledError:
                self._cancel(method, call_id)
                raise
        finally:
            self.pending.pop(call_id, None)
            if not future.done():
                future.cancel()
            elif not future.cancelled():
                future.exception()  # seen: no "exception was never retrieved" when the write failed first
        if answer.HasField("reply"):
            return answer.reply
        raise StreamCallError.from_status(answer.error)

    async def _start(self, timeout: float | None) -> None:
        """Wait for the server's headers before the first write. rlgate servers send them as a stream opens;
        a server without the method ends the stream UNIMPLEMENTED instead, which a write racing that end
        would turn into grpc's INTERNAL and so hide the fallback."""
        try:
            async with asyncio.timeout(timeout):
                await self.call.initial_metadata()
        except TimeoutError:
            raise StreamCallError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded") from None
        if self.call.done():
            await asyncio.wait([self.reader], timeout=1.0)  # let the reader record why it ended
            raise self.ended or StreamCallError(grpc.StatusCode.UNAVAILABLE, f"stream to {self.where} ended")
        self.started = True

    def _cancel(self, method: StreamedMethod, call_id: int) -> None:
        """Tell the server to cancel a call this side gave up on (best effort: the stream may be gone)."""
        if self.ended is None and not self.call.done():
            task = asyncio.get_running_loop().create_task(
                self._send_cancel(method.envelope(call_id=call_id, cancel=True)))
            self.cancels.add(task)
            task.add_done_callback(self.cancels.discard)

    async def _send_cancel(self, envelope: Any) -> None:
        try:
            async with self.writing:
                await self.call.write(envelope)
        except (grpc.RpcError, asyncio.InvalidStateError):
            pass  # the stream ended: its calls are cancelled with it

    async def retire(self) -> None:
        """Half-close: the server answers the calls in flight, then ends the stream (the reader sees EOF)."""
        try:
            async with self.writing:
                await self.call.done_writing()
        except (grpc.RpcError, asyncio.InvalidStateError):
            pass

    async def close(self) -> None:
        tasks = (self.reader, *self.cancels)
        for task in tasks:
            task.cancel()
        self.call.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class StreamCaller:
    """Calls of one method on one channel, over one stream at a time (replaced after `max_age_s`)."""

    def __init__(self, method: StreamedMethod, multicallable: Any, metadata: Metadata, where: str,
                 max_age_s: float) -> None:
        self.method = method
        self._open = lambda: multicallable(metadata=list(metadata))
        self._where = where
        self._max_age_s = max_age_s
        self._stream: _Stream | None = None
        self._retiring: set[asyncio.Task[None]] = set()
        self.unsupported = False

    def _current(self) -> _Stream:
        stream = self._stream
        if stream is not None and stream.ended is None and time.monotonic() - stream.opened < self._max_age_s:
            return stream
        if stream is not None and stream.ended is None:  # aged out: drain it in the background
            task = asyncio.get_running_loop().create_task(self._drain(stream))
            self._retiring.add(task)
            task.add_done_callback(self._retiring.discard)
        self._stream = _Stream(self._open, self._where)
        return self._stream

    @staticmethod
    async def _drain(stream: _Stream) -> None:
        try:
            await stream.retire()
            await stream.reader
        except BaseException:
            await stream.close()
            raise

    async def call(self, payload: Any, timeout: float | None, token: str, trace_id: str) -> Any:
        try:
            return await self._current().request(self.method, payload, timeout, token, trace_id)
        except StreamsUnsupported:
            self.unsupported = True
            raise

    async def close(self) -> None:
        for task in list(self._retiring):
            task.cancel()
        stream, self._stream = self._stream, None
        if stream is not None:
            await stream.close()
        await asyncio.gather(*self._retiring, return_exceptions=True)
