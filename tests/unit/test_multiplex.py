"""runtime.multiplex over a real grpc.aio stream: many unary calls on one CallToolStream.

A test servicer serves CallToolStream through `Multiplexer` with a scripted handler (`Script`): the tool name of
each call says what the handler does (answer at once, sleep, wait for a gate the test opens, raise). The client
side is the raw generated stub, so every test sees exactly what goes over the wire. Every wait is bounded:
a bug fails a test instead of hanging it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import grpc
import pytest
from google.protobuf import any_pb2, duration_pb2
from google.rpc import error_details_pb2
from prometheus_client import REGISTRY

from rlgate.runtime.grpc_server import start_server
from rlgate.runtime.interceptors import ApiKeyInterceptor, ContextInterceptor, RpcMetrics
from rlgate.runtime.logs import trace_id_var
from rlgate.runtime.multiplex import MAX_IN_FLIGHT, Multiplexer, StreamedMethod, call_status
from rlgate.v1 import common_pb2, toolgateway_pb2, toolgateway_pb2_grpc
from rlgate.v1.toolgateway_pb2 import CallToolStreamRequest as Request
from rlgate.v1.toolgateway_pb2 import CallToolStreamResponse as Response

Call = Any  # grpc.aio.StreamStreamCall (its type parameters vary with the stubs' typing)

WAIT = 5.0  # seconds: the bound on every single wait in these tests
STREAM_DEADLINE = 20.0  # seconds: every stream's own gRPC deadline, a backstop
SECRET = "db-password=hunter2"  # the text of an unexpected exception: must never reach the client
BIG = 16 * 1024 * 1024  # a reply this large blocks the server's write until the client reads (flow control)
STREAM_METHOD = "/rlgate.v1.ToolGatewayService/CallToolStream"


class ToolNotFound(Exception):
    """An expected error: `known_error` maps it to NOT_FOUND with an ErrorInfo detail."""


def error_info(tool: str) -> any_pb2.Any:
    packed = any_pb2.Any()
    packed.Pack(error_details_pb2.ErrorInfo(reason="TOOL_NOT_FOUND", domain="rlgate.test", metadata={"tool": tool}))
    return packed


def text_reply(text: str) -> toolgateway_pb2.CallToolResponse:
    block = common_pb2.ContentBlock(text=common_pb2.TextContent(text=text))
    return toolgateway_pb2.CallToolResponse(result=common_pb2.ToolResult(content=[block]))


class Script:
    """The handler, scripted by tool name, and what it saw (everything runs on the test's event loop).

    Tools: "fast" answers at once; "sleep:<seconds>" sleeps; "gate" waits until the test sets `gates[call_id]`;
    "missing" raises ToolNotFound; "bug" raises a RuntimeError carrying SECRET; "self-cancel" awaits an inner
    task that something else cancelled (a CancelledError the client did not ask for); "big" answers BIG bytes."""

    def __init__(self) -> None:
        self.started: list[int] = []
        self.finished: list[int] = []
        self.cancelled: list[int] = []  # calls whose handler saw CancelledError
        self.seconds_left: dict[int, float | None] = {}
        self.trace_ids: dict[int, str] = {}
        self.observed: list[tuple[str, float]] = []
        self.gates: defaultdict[int, asyncio.Event] = defaultdict(asyncio.Event)

    async def handle(self, envelope: Request, seconds_left: float | None) -> toolgateway_pb2.CallToolResponse:
        call_id, tool = envelope.call_id, envelope.call.name
        self.started.append(call_id)
        self.seconds_left[call_id] = seconds_left
        self.trace_ids[call_id] = trace_id_var.get()
        try:
            if tool.startswith("sleep:"):
                await asyncio.sleep(float(tool.removeprefix("sleep:")))
            elif tool == "gate":
                await self.gates[call_id].wait()
            elif tool == "missing":
                raise ToolNotFound(tool)
            elif tool == "bug":
                raise RuntimeError(SECRET)
            elif tool == "self-cancel":
                inner = asyncio.create_task(asyncio.sleep(60))
                inner.cancel()
                await inner
        except asyncio.CancelledError:
            self.cancelled.append(call_id)
            raise
        self.finished.append(call_id)
        return text_reply("x" * BIG if tool == "big" else f"{tool} #{call_id}")

    @staticmethod
    def known_error(exc: Exception) -> common_pb2.CallStatus | None:
        if isinstance(exc, ToolNotFound):
            return call_status(grpc.StatusCode.NOT_FOUND, f"no tool named {exc}", [error_info(str(exc))])
        return None

    def observe(self, code: str, seconds: float) -> None:
        self.observed.append((code, seconds))


class _Servicer(toolgateway_pb2_grpc.ToolGatewayServiceServicer):
    def __init__(self, script: Script, max_in_flight: int, observe: Callable[[str, float], None] | None) -> None:
        self._script = script
        self._max_in_flight = max_in_flight
        self._observe = observe or script.observe

    async def CallToolStream(self, requests, context):  # type: ignore[no-untyped-def]
        method = StreamedMethod(name="CallTool", response=Response, handle=self._script.handle,
                                known_error=self._script.known_error, observe=self._observe)
        await Multiplexer(method, max_in_flight=self._max_in_flight).serve(requests, context)


@contextlib.asynccontextmanager
async def serving(
    script: Script, *, max_in_flight: int = MAX_IN_FLIGHT,
    interceptors: Sequence[grpc.aio.ServerInterceptor] | None = None,
    observe: Callable[[str, float], None] | None = None,
) -> AsyncIterator[tuple[grpc.aio.Channel, toolgateway_pb2_grpc.ToolGatewayServiceStub]]:
    """A server with the scripted servicer (ContextInterceptor unless told otherwise) and a channel to it."""

    def register(server: grpc.aio.Server) -> list[str]:
        toolgateway_pb2_grpc.add_ToolGatewayServiceServicer_to_server(
            _Servicer(script, max_in_flight, observe), server)
        return ["rlgate.v1.ToolGatewayService"]

    chosen = [ContextInterceptor()] if interceptors is None else list(interceptors)
    running = await start_server("127.0.0.1:0", register, interceptors=chosen)
    try:
        options = [("grpc.max_receive_message_length", 64 * 1024 * 1024)]
        async with grpc.aio.insecure_channel(running.address, options=options) as channel:
            yield channel, toolgateway_pb2_grpc.ToolGatewayServiceStub(channel)
    finally:
        await running.shutdown(grace=0)


def call(call_id: int, tool: str, *, timeout: float | None = None, trace_id: str = "") -> Request:
    request = Request(call_id=call_id, call=toolgateway_pb2.CallToolRequest(name=tool), trace_id=trace_id)
    if timeout is not None:
        request.timeout.CopyFrom(duration_pb2.Duration(seconds=int(timeout), nanos=round(timeout % 1 * 1e9)))
    return request


def cancel(call_id: int) -> Request:
    return Request(call_id=call_id, cancel=True)


def open_stream(stub: toolgateway_pb2_grpc.ToolGatewayServiceStub, **kwargs: Any) -> Call:
    return stub.CallToolStream(timeout=STREAM_DEADLINE, **kwargs)


async def read(stream: Call) -> Response:
    """The next answer on the stream (fails on EOF or after WAIT seconds)."""
    message = await asyncio.wait_for(stream.read(), WAIT)
    assert message is not grpc.aio.EOF, "the stream ended while an answer was expected"
    assert isinstance(message, Response)
    return message


async def read_to_end(stream: Call) -> list[Response]:
    """Every answer until the stream ends (fails unless it ends within WAIT seconds)."""
    answers: list[Response] = []
    async with asyncio.timeout(WAIT):
        while (message := await stream.read()) is not grpc.aio.EOF:
            answers.append(message)
    return answers


async def ended_with(stream: Call) -> grpc.StatusCode:
    code = await asyncio.wait_for(stream.code(), WAIT)
    assert isinstance(code, grpc.StatusCode)
    return code


async def wait_until(condition: Callable[[], bool], what: str) -> None:
    """Poll `condition` (server-side effects happen on this event loop) until true, or fail after WAIT seconds."""
    deadline = time.monotonic() + WAIT
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        await asyncio.sleep(0.01)


def code_of(answer: Response) -> grpc.StatusCode:
    if answer.WhichOneof("outcome") == "reply":
        return grpc.StatusCode.OK
    return next(c for c in grpc.StatusCode if c.value[0] == answer.error.code)


async def test_answers_come_as_calls_finish_matched_by_call_id() -> None:
    script = Script()
    async with serving(script) as (_, stub):
        stream = open_stream(stub)
        await stream.write(call(1, "sleep:0.5"))
        await stream.write(call(2, "fast"))
        first, second = await read(stream), await read(stream)
        assert (first.call_id, second.call_id) == (2, 1)
        assert first.reply.result.content[0].text.text == "fast #2"
        assert second.reply.result.content[0].text.text == "sleep:0.5 #1"
        await stream.done_writing()
        assert await read_to_end(stream) == []
        assert await ended_with(stream) == grpc.StatusCode.OK


async def test_cancel_request_cancels_the_call_and_the_stream_stays_usable() -> None:
    script = Script()
    async with serving(script) as (_, stub):
        stream = open_stream(stub)
        await stream.write(call(1, "gate"))
        await wait_until(lambda: 1 in script.started, "call 1 started")
        await stream.write(cancel(1))
        answer = await read(stream)
        assert answer.call_id == 1 and code_of(answer) == grpc.StatusCode.CANCELLED
        assert script.cancelled == [1]
        await stream.write(call(1, "fast"))  # a finished call's id may be used again
        again = await read(stream)
        assert again.call_id == 1 and again.reply.result.content[0].text.text == "fast #1"
        await stream.write(cancel(99))  # cancelling a call that is not in flight is ignored
        await stream.done_writing()
        assert await read_to_end(stream) == []
        assert await ended_with(stream) == grpc.StatusCode.OK


async def test_per_call_timeout_answers_deadline_exceeded_and_cancels_the_handler() -> None:
    script = Script()
    async with serving(script) as (_, stub):
        stream = open_stream(stub)
        started = time.monotonic()
        await stream.write(call(1, "sleep:10", timeout=0.3))
        answer = await read(stream)
        elapsed = time.monotonic() - started
        assert answer.call_id == 1 and code_of(answer) == grpc.StatusCode.DEADLINE_EXCEEDED
        assert 0.25 <= elapsed < 3.0
        assert script.seconds_left[1] == pytest.approx(0.3, abs=0.01)
        assert script.cancelled == [1]
        await stream.done_writing()
        assert await ended_with(stream) == grpc.StatusCode.OK


async def test_stream_deadline_bounds_each_calls_time() -> None:
    script = Script()
    async with serving(script) as (_, stub):
        stream = open_stream(stub)
        await stream.write(call(1, "fast"))  # no timeout of its own: the stream's deadline
        await stream.write(call(2, "fast", timeout=3600))  # longer than the stream's deadline: bounded by it
        await stream.write(call(3, "fast", timeout=2))
        assert sorted(a.call_id for a in [await read(stream) for _ in range(3)]) == [1, 2, 3]
        for call_id in (1, 2):
            left = script.seconds_left[call_id]
            # (the grpc-timeout header is rounded up on the wire, so the server may see a little more)
            assert left is not None and STREAM_DEADLINE - 5 < left <= STREAM_DEADLINE + 1
        assert script.seconds_left[3] == pytest.approx(2.0)
        stream.cancel()


async def test_half_close_lets_calls_in_flight_finish_then_ends_ok() -> None:
    script = Script()
    async with serving(script) as (_, stub):
        stream = open_stream(stub)
        await stream.write(call(1, "sleep:0.3"))
        await stream.write(call(2, "sleep:0.1"))
        await wait_until(lambda: len(script.started) == 2, "both calls started")
        await stream.done_writing()
        answers = await read_to_end(stream)
        assert [a.call_id for a in answers] == [2, 1]
        assert all(code_of(a) == grpc.StatusCode.OK for a in answers)
        assert await ended_with(stream) == grpc.StatusCode.OK
        assert script.cancelled == []


async def test_cancelling_the_stream_cancels_its_calls() -> None:
    script = Script()
    async with serving(script) as (_, stub):
        stream = open_stream(stub)
        await stream.write(call(1, "gate"))
        await stream.write(call(2, "sleep:30"))
        await wait_until(lambda: len(script.started) == 2, "both calls started")
        stream.cancel()
        await wait_until(lambda: sorted(script.cancelled) == [1, 2], "both handlers saw CancelledError")
        assert await ended_with(stream) == grpc.StatusCode.CANCELLED


async def test_reusing_a_call_id_in_flight_ends_the_stream_invalid_argument() -> None:
    script = Script()
    async with serving(script) as (_, stub):
        stream = open_stream(stub)
        await stream.write(call(7, "gate"))
        await wait_until(lambda: 7 in script.started, "call 7 started")
        await stream.write(call(7, "fast"))
        assert await ended_with(stream) == grpc.StatusCode.INVALID_ARGUMENT
        assert "call_id 7" in (await stream.details() or "")
        await wait_until(lambda: script.cancelled == [7], "the call in flight was cancelled with its stream")
        assert script.started == [7]  # the duplicate never ran


async def test_bytes_that_are_not_a_message_end_the_stream_invalid_argument() -> None:
    script = Script()
    async with serving(script) as (channel, _):
        raw = channel.stream_stream(STREAM_METHOD, request_serializer=lambda b: b,
                                    response_deserializer=Response.FromString)
        stream = raw(timeout=STREAM_DEADLINE)
        await stream.write(call(1, "fast").SerializeToString())  # a good message first: answered
        first = await read(stream)
        assert first.call_id == 1 and code_of(first) == grpc.StatusCode.OK
        await stream.write(b"\xff\xff\xff")
        assert await ended_with(stream) == grpc.StatusCode.INVALID_ARGUMENT
        assert "not a valid message" in (await stream.details() or "")
        assert script.started == [1]


async def test_known_error_keeps_code_message_and_details() -> None:
    script = Script()
    async with serving(script) as (_, stub):
        stream = open_stream(stub)
        await stream.write(call(1, "missing"))
        answer = await read(stream)
        assert answer.call_id == 1 and code_of(answer) == grpc.StatusCode.NOT_FOUND
        assert answer.error.message == "no tool named missing"
        assert list(answer.error.details) == [error_info("missing")]
        info = error_details_pb2.ErrorInfo()
        assert answer.error.details[0].Unpack(info) and info.metadata["tool"] == "missing"
        stream.cancel()


async def test_unexpected_error_is_internal_with_trace_id_and_no_secret(caplog: pytest.LogCaptureFixture) -> None:
    script = Script()
    async with serving(script) as (_, stub):
        stream = open_stream(stub)
        with caplog.at_level(logging.ERROR, logger="rlgate.runtime.multiplex"):
            await stream.write(call(1, "bug", trace_id="trace-bug-1"))
            answer = await read(stream)
        assert answer.call_id == 1 and code_of(answer) == grpc.StatusCode.INTERNAL
        assert "trace id trace-bug-1" in answer.error.message
        assert SECRET not in answer.error.message and "RuntimeError" not in answer.error.message
        assert len(answer.error.details) == 0
        logged = [r for r in caplog.records if r.name == "rlgate.runtime.multiplex" and r.levelno == logging.ERROR]
        assert len(logged) == 1 and logged[0].exc_info is not None
        assert SECRET in str(logged[0].exc_info[1])
        # the stream is not affected: the next call works
        await stream.write(call(2, "fast"))
        assert code_of(await read(stream)) == grpc.StatusCode.OK
        stream.cancel()


async def test_max_in_flight_holds_back_further_calls() -> None:
    script = Script()
    async with serving(script, max_in_flight=2) as (_, stub):
        stream = open_stream(stub)
        for call_id in (1, 2, 3):
            await stream.write(call(call_id, "gate"))
        await wait_until(lambda: len(script.started) == 2, "two calls started")
        await asyncio.sleep(0.3)
        assert script.started == [1, 2]  # the third waits for room
        script.gates[2].set()
        assert (await read(stream)).call_id == 2
        await wait_until(lambda: 3 in script.started, "call 3 started once call 2 finished")
        assert script.started == [1, 2, 3]
        script.gates[1].set()
        script.gates[3].set()
        await stream.done_writing()
        assert sorted(a.call_id for a in await read_to_end(stream)) == [1, 3]
        assert await ended_with(stream) == grpc.StatusCode.OK


async def test_observe_is_called_once_per_call_with_its_code() -> None:
    script = Script()
    async with serving(script) as (_, stub):
        stream = open_stream(stub)
        await stream.write(call(1, "fast"))
        await stream.write(call(2, "sleep:10", timeout=0.2))
        await stream.write(call(3, "gate"))
        await stream.write(call(4, "missing"))
        await stream.write(call(5, "bug"))
        await wait_until(lambda: 3 in script.started, "call 3 started")
        await stream.write(cancel(3))
        await stream.done_writing()
        answers = {a.call_id: code_of(a).name for a in await read_to_end(stream)}
    expected = {1: "OK", 2: "DEADLINE_EXCEEDED", 3: "CANCELLED", 4: "NOT_FOUND", 5: "INTERNAL"}
    assert answers == expected
    assert sorted(code for code, _ in script.observed) == sorted(expected.values())
    assert all(seconds >= 0 for _, seconds in script.observed)
    timed_out = next(seconds for code, seconds in script.observed if code == "DEADLINE_EXCEEDED")
    assert timed_out >= 0.15


async def test_rpc_metrics_count_streamed_calls_under_the_unary_method() -> None:
    service = f"multiplex-test-{uuid.uuid4().hex[:8]}"
    script = Script()
    async with serving(script, observe=RpcMetrics(service).method("CallTool")) as (_, stub):
        stream = open_stream(stub)
        await stream.write(call(1, "fast"))
        await stream.write(call(2, "fast"))
        await stream.write(call(3, "missing"))
        await stream.done_writing()
        assert len(await read_to_end(stream)) == 3

    def sample(name: str, **labels: str) -> float | None:
        return REGISTRY.get_sample_value(name, {"service": service, "method": "CallTool", **labels})

    assert sample("rlgate_grpc_requests_total", code="OK") == 2
    assert sample("rlgate_grpc_requests_total", code="NOT_FOUND") == 1
    assert sample("rlgate_grpc_request_seconds_count") == 3


async def test_trace_id_is_the_envelopes_or_a_fresh_one_per_call() -> None:
    script = Script()
    async with serving(script) as (_, stub):
        stream = open_stream(stub, metadata=[("x-rlgate-trace-id", "stream-trace")])
        await stream.write(call(1, "fast", trace_id="trace-abc"))
        await stream.write(call(2, "fast"))
        await stream.write(call(3, "fast"))
        await stream.write(call(4, "fast", trace_id="t" * 100))
        await stream.done_writing()
        assert len(await read_to_end(stream)) == 4
    traces = script.trace_ids
    assert traces[1] == "trace-abc"
    assert traces[4] == "t" * 64  # bounded as the x-rlgate-trace-id header is
    fresh = {traces[2], traces[3]}
    assert len(fresh) == 2 and not fresh & {"", "-", "stream-trace", "trace-abc"}


async def test_api_key_guards_the_stream() -> None:
    script = Script()
    async with serving(script, interceptors=[ContextInterceptor(), ApiKeyInterceptor(["k1"])]) as (_, stub):
        missing = open_stream(stub)
        with contextlib.suppress(grpc.aio.AioRpcError):  # the server may have ended the stream already
            await missing.write(call(1, "fast"))
        assert await ended_with(missing) == grpc.StatusCode.UNAUTHENTICATED
        wrong = open_stream(stub, metadata=[("authorization", "Bearer nope")])
        assert await ended_with(wrong) == grpc.StatusCode.UNAUTHENTICATED
        assert "nope" not in (await wrong.details() or "")
        assert script.started == []

        stream = open_stream(stub, metadata=[("authorization", "Bearer k1")])
        await stream.write(call(1, "fast"))
        answer = await read(stream)
        assert answer.call_id == 1 and code_of(answer) == grpc.StatusCode.OK
        await stream.done_writing()
        assert await ended_with(stream) == grpc.StatusCode.OK


# --- KNOWN BUGS: these two fail against the current runtime/multiplex.py; each docstring names the fix. ---


async def test_bug_call_whose_handler_raises_cancelled_error_is_still_answered() -> None:
    """BUG: `_call` re-raises any CancelledError the client did not ask for, assuming the stream is going away.
    A handler can raise CancelledError on its own (it awaited a task something else cancelled); the stream is
    fine, yet the call is never answered, so a client waits for it until its own deadline.
    Fix: re-raise only when the task itself is being cancelled (`asyncio.current_task().cancelling()`), else
    answer the call (CANCELLED)."""
    script = Script()
    async with serving(script) as (_, stub):
        stream = open_stream(stub)
        await stream.write(call(1, "self-cancel"))
        await stream.write(call(2, "fast"))
        await stream.done_writing()
        answers = {a.call_id: code_of(a) for a in await read_to_end(stream)}
        assert answers.get(2) == grpc.StatusCode.OK
        assert 1 in answers, "call 1 was never answered"
        assert answers[1] != grpc.StatusCode.OK


async def test_bug_cancel_arriving_while_the_answer_waits_for_the_write_is_still_answered() -> None:
    """BUG: the client's cancel cancels the call's task even once the handler has finished and the answer only
    waits for the stream's write lock (another answer's write is held up by flow control). The task dies in
    `async with writing`: the call is never answered, neither with its reply nor with CANCELLED.
    Fix: once the handler is done (answer built), mark the call as answering; `serve` ignores a cancel for it."""
    script = Script()
    async with serving(script) as (_, stub):
        stream = open_stream(stub)
        await stream.write(call(1, "big"))  # its write blocks until the client reads
        await stream.write(call(2, "gate"))
        await wait_until(lambda: 1 in script.finished and 2 in script.started, "call 1 done, call 2 started")
        await asyncio.sleep(0.2)  # call 1's answer is now being written, held up by flow control
        script.gates[2].set()
        await wait_until(lambda: 2 in script.finished, "call 2's handler finished")
        await asyncio.sleep(0.1)  # call 2's answer now waits for the write lock
        await stream.write(cancel(2))
        await asyncio.sleep(0.2)
        await stream.done_writing()
        answers = {a.call_id: code_of(a) for a in await read_to_end(stream)}
        assert answers.get(1) == grpc.StatusCode.OK
        assert 2 in answers, "call 2 was never answered"
