"""CallToolStream on the real toolgateway (localfleet in both MCP eras, a real SQLite store), driven with the raw
generated stub: every call on the stream must behave exactly as the unary CallTool it stands for (result,
per-call token, idempotency, is_error results, statuses, metrics), plus the stream's own machinery (call_id
matching, per-call timeout, cancel, half-close, a call_id reused while in flight, a request that does not
parse, and every call answered even when its cancel races its answer)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any

import grpc
import pytest
from google.protobuf import duration_pb2
from prometheus_client import REGISTRY

from rlgate.convert import struct_from_dict
from rlgate.store import SessionStatus, SessionStore
from rlgate.toolgateway.server import GatewayHandle
from rlgate.v1 import common_pb2, toolgateway_pb2
from rlgate.v1.toolgateway_pb2 import CallToolStreamRequest as Request
from rlgate.v1.toolgateway_pb2 import CallToolStreamResponse as Answer
from rlgate.v1.toolgateway_pb2_grpc import ToolGatewayServiceStub as Stub
from tests.support import streams
from tests.support.localfleet import LocalfleetProcess
from tests.toolgateway.conftest import AgentSession, make_session
from tests.toolgateway.test_gateway import call, text, wait_for

Kind = common_pb2.ToolErrorKind

STREAM_DEADLINE_S = 60.0  # the whole stream's gRPC deadline: a hung server fails the test, never the run
WAIT_S = 20.0  # one write or one read


@asynccontextmanager
async def open_stream(stub: Stub) -> AsyncIterator[Any]:
    """A CallToolStream, cancelled on the way out whatever state it is in."""
    stream = stub.CallToolStream(timeout=STREAM_DEADLINE_S)
    try:
        yield stream
    finally:
        stream.cancel()


def request(call_id: int, token: str, name: str, args: dict[str, Any] | None = None, *, request_id: str = "",
            deadline_s: float | None = None) -> Request:
    req = Request(call_id=call_id, token=token,
                  call=toolgateway_pb2.CallToolRequest(name=name, request_id=request_id,
                                                       arguments=struct_from_dict(args or {})))
    if deadline_s is not None:
        req.timeout.CopyFrom(duration_pb2.Duration(seconds=int(deadline_s), nanos=int(deadline_s % 1 * 1e9)))
    return req


# Writes and reads on a stream, each bounded by WAIT_S.
send = functools.partial(streams.send, wait_s=WAIT_S)
receive = functools.partial(streams.receive, wait_s=WAIT_S)
ask = functools.partial(streams.ask, wait_s=WAIT_S)


def reply_of(answer: Answer) -> toolgateway_pb2.CallToolResponse:
    return streams.reply_of(answer)  # type: ignore[no-any-return]


CODES = {code.value[0]: code for code in grpc.StatusCode}


def error_of(answer: Answer) -> tuple[grpc.StatusCode, str]:
    """The status a streamed call was answered with, as (code, message)."""
    assert answer.WhichOneof("outcome") == "error", f"reply instead of an error: {answer.reply}"
    return CODES[answer.error.code], answer.error.message


async def unary_error(stub: Stub, token: str, name: str,
                      args: dict[str, Any] | None = None) -> tuple[grpc.StatusCode, str]:
    """The status unary CallTool ends with for the same call ("" token: no authorization header)."""
    metadata = (("authorization", f"Bearer {token}"),) if token else ()
    req = toolgateway_pb2.CallToolRequest(name=name, arguments=struct_from_dict(args or {}))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.CallTool(req, metadata=metadata, timeout=WAIT_S)
    return err.value.code(), err.value.details() or ""


async def test_streamed_result_equals_unary(stub: Stub, store: SessionStore, fleet: LocalfleetProcess,
                                            era: str) -> None:
    s = await make_session(store, fleet, era)
    cases: list[tuple[str, dict[str, Any]]] = [
        ("add", {"n": 5, "m": 2}), ("where", {}), ("picture", {}), ("big", {"size": 100}),
        ("fail", {"message": "disk full"}),
    ]
    unary = [await call(stub, s, name, args) for name, args in cases]
    async with open_stream(stub) as stream:
        await send(stream, *(request(i, s.token, name, args) for i, (name, args) in enumerate(cases)))
        answers = await receive(stream, len(cases))
    assert sorted(answers) == list(range(len(cases)))
    for i, (name, _) in enumerate(cases):
        streamed = reply_of(answers[i])
        assert streamed.result == unary[i].result, name  # content, structured_content, is_error, error_kind
        assert not streamed.replayed
    assert text(reply_of(answers[0])) == "7 (int)"  # integers restored from the schema, as unary
    assert reply_of(answers[2]).result.content[0].image.mime_type == "image/png"
    assert reply_of(answers[4]).result.error_kind == Kind.TOOL_ERROR_KIND_TOOL_FAILED
    names = [name for name, _ in cases]
    log = [e.tool for e in await store.list_tool_calls(s.session.session_id)]
    assert log[:len(cases)] == names and sorted(log[len(cases):]) == sorted(names)  # streamed calls logged too


async def test_each_call_carries_its_own_token(stub: Stub, store: SessionStore, fleet: LocalfleetProcess) -> None:
    a = await make_session(store, fleet, "gw")
    b = await make_session(store, fleet, "gw")
    async with open_stream(stub) as stream:
        await send(stream, request(1, a.token, "where"), request(2, b.token, "where"),
                   request(3, "not-a-token", "where"), request(4, "", "where"), request(5, a.token, "add", {"n": 1}))
        answers = await receive(stream, 5)
        assert text(reply_of(answers[1])) == f"/instances/{a.instance['instance_id']}/mcp"
        assert text(reply_of(answers[2])) == f"/instances/{b.instance['instance_id']}/mcp"
        assert error_of(answers[3])[0] == grpc.StatusCode.UNAUTHENTICATED
        assert error_of(answers[4])[0] == grpc.StatusCode.UNAUTHENTICATED
        assert text(reply_of(answers[5])) == "2 (int)"
        # The same answers as unary CallTool with the same (missing) tokens.
        assert error_of(answers[3]) == await unary_error(stub, "not-a-token", "where")
        assert error_of(answers[4]) == await unary_error(stub, "", "where")
        # After the refused calls the stream is still open and serves the next good call.
        assert text(reply_of(await ask(stream, request(6, b.token, "add", {"n": 41})))) == "42 (int)"
    for session in (a, b):  # each session logged its own two calls (concurrent: in either order)
        assert sorted(e.tool for e in await store.list_tool_calls(session.session.session_id)) == ["add", "where"]


async def test_same_request_id_runs_once(stub: Stub, store: SessionStore, fleet: LocalfleetProcess,
                                         era: str) -> None:
    s = await make_session(store, fleet, era)
    await call(stub, s, "where")  # connected and listed: only the calls below count
    before = fleet.counters()["by_env"][era]["tool_calls"]
    async with open_stream(stub) as stream:
        first = reply_of(await ask(stream, request(1, s.token, "add", {"n": 40}, request_id="req-1")))
        again = reply_of(await ask(stream, request(2, s.token, "add", {"n": 40}, request_id="req-1")))
        assert (first.replayed, again.replayed) == (False, True)
        assert again.result == first.result and text(again) == "41 (int)"
        # Two concurrent attempts on the stream: one runs, the other gets its recorded result.
        await send(stream, request(3, s.token, "sleep", {"seconds": 0.5}, request_id="req-2"),
                   request(4, s.token, "sleep", {"seconds": 0.5}, request_id="req-2"))
        answers = await receive(stream, 2)
        x, y = reply_of(answers[3]), reply_of(answers[4])
        assert sorted([x.replayed, y.replayed]) == [False, True] and x.result == y.result
    # Idempotency is shared with the unary path: a unary retry of a streamed request_id is a replay.
    retry = await call(stub, s, "add", {"n": 40}, request_id="req-1")
    assert retry.replayed and retry.result == first.result
    assert fleet.counters()["by_env"][era]["tool_calls"] - before == 2  # the tool ran once per request_id
    log = await store.list_tool_calls(s.session.session_id)
    assert [e.request_id for e in log] == ["", "req-1", "req-2"]


async def test_model_mistakes_are_results_and_caller_mistakes_are_statuses(
        stub: Stub, store: SessionStore, fleet: LocalfleetProcess, era: str) -> None:
    s = await make_session(store, fleet, era)
    mistakes: list[tuple[str, dict[str, Any], int]] = [
        ("computer", {}, Kind.TOOL_ERROR_KIND_UNKNOWN_TOOL),  # exists upstream, hidden by the tool_use filter
        ("no_such_tool", {}, Kind.TOOL_ERROR_KIND_UNKNOWN_TOOL),
        ("add", {"n": "five"}, Kind.TOOL_ERROR_KIND_INVALID_ARGUMENTS),
        ("add", {"n": 5.5}, Kind.TOOL_ERROR_KIND_INVALID_ARGUMENTS),
    ]
    async with open_stream(stub) as stream:
        for i, (name, args, kind) in enumerate(mistakes):
            streamed = reply_of(await ask(stream, request(i, s.token, name, args)))
            unary = await call(stub, s, name, args)
            assert streamed.result.is_error and streamed.result.error_kind == kind, (name, args)
            assert streamed.result == unary.result, (name, args)
        # The caller's mistakes are INVALID_ARGUMENT statuses, as unary, answered in `error`: the stream lives on.
        for i, (name, args) in enumerate([("add", {"n": math.nan}), ("", {})], start=100):
            code, message = error_of(await ask(stream, request(i, s.token, name, args)))
            assert (code, message) == await unary_error(stub, s.token, name, args)
            assert code == grpc.StatusCode.INVALID_ARGUMENT
        assert text(reply_of(await ask(stream, request(200, s.token, "add", {"n": 1})))) == "2 (int)"


async def test_unusable_session_statuses_equal_unary(stub: Stub, store: SessionStore,
                                                     fleet: LocalfleetProcess) -> None:
    base = await make_session(store, fleet, "gw")
    cases = [
        ("closed", dict(status=SessionStatus.CLOSED, expires_at=0.0)),
        ("closed, token revoked", dict(status=SessionStatus.CLOSED, token_hash="")),
        ("done", dict(status=SessionStatus.DONE, done_reason="max_turns")),
        ("expired", dict(status=SessionStatus.EXPIRED, expires_at=0.0)),
        ("past expires_at", dict(expires_at=time.time() - 1)),
        ("next episode's token", dict(token_hash="0" * 64, episode=2)),
    ]
    seen: set[grpc.StatusCode] = set()
    async with open_stream(stub) as stream:
        for i, (what, change) in enumerate(cases):
            s = await make_session(store, fleet, "gw", instance=base.instance)
            current = await store.get_session(s.session.session_id)
            assert current is not None
            await store.update_session(replace(current, **change))  # type: ignore[arg-type]
            streamed = error_of(await ask(stream, request(i, s.token, "add", {"n": 1})))
            assert streamed == await unary_error(stub, s.token, "add", {"n": 1}), what
            assert streamed[0] in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNAUTHENTICATED), what
            seen.add(streamed[0])
    assert seen == {grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNAUTHENTICATED}


def calls_counted(code: str) -> float:
    labels = {"service": "toolgateway", "method": "CallTool", "code": code}
    return REGISTRY.get_sample_value("rlgate_grpc_requests_total", labels) or 0.0


async def test_streamed_calls_are_counted_as_calltool(stub: Stub, store: SessionStore,
                                                      fleet: LocalfleetProcess) -> None:
    s = await make_session(store, fleet, "gw")
    await call(stub, s, "where")
    ok, refused = calls_counted("OK"), calls_counted("UNAUTHENTICATED")
    latency = REGISTRY.get_sample_value("rlgate_grpc_request_seconds_count",
                                        {"service": "toolgateway", "method": "CallTool"}) or 0.0
    async with open_stream(stub) as stream:
        await send(stream, *(request(i, s.token, "add", {"n": i}) for i in range(5)),
                   request(9, "not-a-token", "add", {"n": 1}))
        answers = await receive(stream, 6)
    assert [a.WhichOneof("outcome") for _, a in sorted(answers.items())] == ["reply"] * 5 + ["error"]
    assert calls_counted("OK") - ok == 5
    assert calls_counted("UNAUTHENTICATED") - refused == 1
    after = REGISTRY.get_sample_value("rlgate_grpc_request_seconds_count",
                                      {"service": "toolgateway", "method": "CallTool"}) or 0.0
    assert after - latency == 6


async def test_per_call_timeout_cancel_and_half_close(stub: Stub, store: SessionStore, fleet: LocalfleetProcess,
                                                      era: str) -> None:
    fleet.set_faults({"environments": {era: {"hang_tools": ["hang"]}}})
    s = await make_session(store, fleet, era)
    await call(stub, s, "where")
    async with open_stream(stub) as stream:
        # A call's own timeout: DEADLINE_EXCEEDED for it alone, in about that time.
        start = time.monotonic()
        code, _ = error_of(await ask(stream, request(1, s.token, "hang", request_id="hang-1", deadline_s=1.0)))
        assert code == grpc.StatusCode.DEADLINE_EXCEEDED and time.monotonic() - start < 5.0
        # Cancelling one call answers it CANCELLED; a call beside it is unaffected.
        tool_calls = fleet.counters()["by_env"][era]["tool_calls"]
        await send(stream, request(2, s.token, "hang", request_id="hang-2"))
        assert await wait_for(lambda: fleet.counters()["by_env"][era]["tool_calls"] > tool_calls)
        assert text(reply_of(await ask(stream, request(3, s.token, "add", {"n": 2})))) == "3 (int)"
        await send(stream, Request(call_id=2, cancel=True))
        assert error_of((await receive(stream, 1))[2])[0] == grpc.StatusCode.CANCELLED
        # Half-closing lets the calls in flight finish and be answered, then the stream ends OK.
        await send(stream, request(4, s.token, "sleep", {"seconds": 0.5}), request(5, s.token, "add", {"n": 4}))
        await asyncio.wait_for(stream.done_writing(), WAIT_S)
        answers = await receive(stream, 2)
        assert (text(reply_of(answers[4])), text(reply_of(answers[5]))) == ("slept 0.5", "5 (int)")
        assert await asyncio.wait_for(stream.read(), WAIT_S) is grpc.aio.EOF
        assert await asyncio.wait_for(stream.code(), WAIT_S) == grpc.StatusCode.OK
    # Neither interrupted call runs again on a retry (same as unary).
    for request_id in ("hang-1", "hang-2"):
        retry = await call(stub, s, "hang", request_id=request_id)
        assert retry.result.error_kind == Kind.TOOL_ERROR_KIND_OUTCOME_UNKNOWN, request_id


async def test_call_id_reused_in_flight_ends_the_stream(stub: Stub, store: SessionStore,
                                                        fleet: LocalfleetProcess) -> None:
    s = await make_session(store, fleet, "gw")
    async with open_stream(stub) as stream:
        await send(stream, request(7, s.token, "sleep", {"seconds": 5}), request(7, s.token, "add", {"n": 1}))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await receive(stream, 1)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "call_id 7" in (err.value.details() or "")
    # A call_id may be used again once its call has been answered.
    async with open_stream(stub) as stream:
        for _ in range(2):
            assert text(reply_of(await ask(stream, request(7, s.token, "add", {"n": 1})))) == "2 (int)"


async def test_a_request_that_does_not_parse_ends_the_stream(gateway: GatewayHandle) -> None:
    async with grpc.aio.insecure_channel(gateway.address) as channel:
        raw = channel.stream_stream("/rlgate.v1.ToolGatewayService/CallToolStream",
                                    request_serializer=None, response_deserializer=Answer.FromString)
        stream = raw(timeout=STREAM_DEADLINE_S)
        try:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await asyncio.wait_for(stream.write(b"\xff\xff\xff"), WAIT_S)
                await asyncio.wait_for(stream.read(), WAIT_S)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        finally:
            stream.cancel()


# The client's receive window kept tiny: the server's answers queue behind one another (flow control).
SLOW_READER = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024)]


async def cancel_every_finished_call(stub: Stub, store: SessionStore, s: AgentSession, count: int) -> dict[int, str]:
    """Run `count` calls on one stream, wait until all have run (results logged, answers pending behind the slow
    reader), cancel every one, then read what comes back: call_id -> "reply" or the status code's name."""
    async with open_stream(stub) as stream:
        await ask(stream, request(count, s.token, "where"))  # connected and listed
        await send(stream, *(request(i, s.token, "big", {"size": 4000}) for i in range(count)))
        for _ in range(200):
            if len(await store.list_tool_calls(s.session.session_id)) == count + 1:
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.2)  # the handlers return: their answers wait for the writer
        await send(stream, *(Request(call_id=i, cancel=True) for i in range(count)))
        answered: dict[int, str] = {}
        with contextlib.suppress(TimeoutError):
            while len(answered) < count:
                answer = await asyncio.wait_for(stream.read(), 3.0)
                assert answer is not grpc.aio.EOF and answer.call_id not in answered
                outcome = answer.WhichOneof("outcome")
                answered[answer.call_id] = "reply" if outcome == "reply" else CODES[answer.error.code].name
        return answered


async def test_every_call_is_answered_when_cancels_race_the_answers(gateway: GatewayHandle, store: SessionStore,
                                                                     fleet: LocalfleetProcess) -> None:
    """The proto: a cancelled call "is then answered CANCELLED"; a call that already finished may keep its
    reply. Either way every call_id gets exactly one answer. (Regression: a cancel arriving while a finished
    call's answer waited for the writer used to drop the answer altogether, fixed in ff63545.)"""
    s = await make_session(store, fleet, "gw")
    count = 100
    async with grpc.aio.insecure_channel(gateway.address, options=SLOW_READER) as channel:
        answered = await cancel_every_finished_call(Stub(channel), store, s, count)
    assert set(answered.values()) <= {"reply", "CANCELLED"}
    assert len(answered) == count, f"{count - len(answered)} of {count} calls never answered"
