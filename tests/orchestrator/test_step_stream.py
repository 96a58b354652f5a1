"""StepStream on the real orchestrator (localfleet through fleet-python, a real SQLite store), driven with the raw
generated stub: every Step on the stream must answer exactly as the unary Step (fields, rich error details,
request_id dedupe), and the stream as a whole must be refused like Step without an API key or before the task
catalog has loaded."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_status import rpc_status
from prometheus_client import REGISTRY

from rlgate.convert import struct_from_dict
from rlgate.v1 import common_pb2, orchestrator_pb2
from rlgate.v1.orchestrator_pb2 import StepStreamRequest as Request
from rlgate.v1.orchestrator_pb2 import StepStreamResponse as Answer
from rlgate.v1.orchestrator_pb2_grpc import OrchestratorServiceStub as Stub
from tests.orchestrator.conftest import Running, fast_config
from tests.support import streams
from tests.support.localfleet import LocalfleetProcess

TASK = "mailbox-count-unread-from-kenji"  # reference answer "3" scores 1.0
Metadata = tuple[tuple[str, str], ...]

STREAM_DEADLINE_S = 90.0  # the whole stream's gRPC deadline: a hung server fails the test, never the run
WAIT_S = 30.0  # one write, one read, one unary call (a final Step runs the verifier)
API_KEY = "secret-key"
WITH_KEY: Metadata = (("authorization", f"Bearer {API_KEY}"),)


@asynccontextmanager
async def open_stream(stub: Stub, metadata: Metadata = ()) -> AsyncIterator[Any]:
    """A StepStream, cancelled on the way out whatever state it is in."""
    stream = stub.StepStream(metadata=metadata, timeout=STREAM_DEADLINE_S)
    try:
        yield stream
    finally:
        stream.cancel()


def step(call_id: int, session_id: str, **fields: Any) -> Request:
    return Request(call_id=call_id, step=orchestrator_pb2.StepRequest(session_id=session_id, **fields))


# Writes and reads on a stream, each bounded by WAIT_S.
send = functools.partial(streams.send, wait_s=WAIT_S)
receive = functools.partial(streams.receive, wait_s=WAIT_S)
ask = functools.partial(streams.ask, wait_s=WAIT_S)


def reply_of(answer: Answer) -> orchestrator_pb2.StepResponse:
    return streams.reply_of(answer)  # type: ignore[no-any-return]


def status_of(answer: Answer) -> status_pb2.Status:
    """A streamed error as the google.rpc.Status unary Step sends (CallStatus is wire-compatible)."""
    assert answer.WhichOneof("outcome") == "error", f"reply instead of an error: {answer.reply}"
    return status_pb2.Status.FromString(answer.error.SerializeToString())


def rich_status(err: grpc.aio.AioRpcError) -> status_pb2.Status:
    """The google.rpc.Status a unary call (or a whole stream) ended with, details included."""
    status = rpc_status.from_call(err)  # type: ignore[arg-type]
    assert status is not None, f"no rich status: {err.code()} {err.details()}"
    return status


def error_info(status: status_pb2.Status) -> error_details_pb2.ErrorInfo:
    info = error_details_pb2.ErrorInfo()
    found = [d for d in status.details if d.Is(info.DESCRIPTOR)]
    assert len(found) == 1, status
    found[0].Unpack(info)
    return info


async def unary_error(stub: Stub, request: orchestrator_pb2.StepRequest,
                      metadata: Metadata = ()) -> grpc.aio.AioRpcError:
    """How unary Step fails for `request`."""
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.Step(request, metadata=metadata, timeout=WAIT_S)
    return err.value


async def unary_status(stub: Stub, request: orchestrator_pb2.StepRequest) -> status_pb2.Status:
    return rich_status(await unary_error(stub, request))


async def stream_refusal(stub: Stub, metadata: Metadata = ()) -> grpc.aio.AioRpcError:
    """How a StepStream the server refuses on opening ends (a Step is written; it must not be answered)."""
    async with open_stream(stub, metadata) as stream:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await send(stream, step(1, "s-any"))
            await receive(stream, 1)
    return err.value


def comparable(response: orchestrator_pb2.StepResponse) -> orchestrator_pb2.StepResponse:
    """A StepResponse without the verifier's wall time (the only field two equal episodes may differ in)."""
    copy = orchestrator_pb2.StepResponse()
    copy.CopyFrom(response)
    copy.verification.ClearField("elapsed_ms")
    return copy


def steps_counted(code: str) -> float:
    labels = {"service": "orchestrator", "method": "Step", "code": code}
    return REGISTRY.get_sample_value("rlgate_grpc_requests_total", labels) or 0.0


async def reset(stub: Stub, metadata: Metadata = (), **fields: Any) -> orchestrator_pb2.ResetResponse:
    fields = fields or {"task_key": TASK}
    return await stub.Reset(orchestrator_pb2.ResetRequest(**fields), metadata=metadata,  # type: ignore[no-any-return]
                            timeout=60)


async def test_streamed_steps_answer_as_unary_steps(orch: Running) -> None:
    streamed, unary = await asyncio.gather(reset(orch.stub), reset(orch.stub))
    turns: list[dict[str, Any]] = [
        dict(assistant_text="looking", tool_calls=[orchestrator_pb2.ToolCallSummary(
            name="list_folders", arguments=struct_from_dict({}))]),
        dict(assistant_text="counting"),
        dict(final_answer="3"),
    ]
    ok, failed = steps_counted("OK"), steps_counted("FAILED_PRECONDITION")
    async with open_stream(orch.stub) as stream:
        for i, turn in enumerate(turns):
            got = reply_of(await ask(stream, step(i, streamed.session_id, request_id=f"turn-{i}", **turn)))
            want = await orch.stub.Step(orchestrator_pb2.StepRequest(session_id=unary.session_id,
                                                                     request_id=f"turn-{i}", **turn), timeout=WAIT_S)
            assert comparable(got) == comparable(want), i
            assert got.turn == i + 1
        assert (got.done, got.truncated, got.done_reason) == (True, False, orchestrator_pb2.DONE_REASON_FINAL_ANSWER)
        assert got.verification.status == common_pb2.VERIFICATION_STATUS_OK, got.verification.message
        assert got.HasField("reward") and got.reward == 1.0 and got.status == common_pb2.SESSION_STATUS_DONE
        # A Step after the episode ended: the same FAILED_PRECONDITION, details included, on both paths.
        after = orchestrator_pb2.StepRequest(session_id=streamed.session_id, final_answer="3")
        refused = status_of(await ask(stream, Request(call_id=99, step=after)))
        assert refused == await unary_status(orch.stub, after)
        assert refused.code == grpc.StatusCode.FAILED_PRECONDITION.value[0]
    # Streamed Steps are counted under "Step", as the unary ones are: both paths' calls are between the readings.
    assert steps_counted("OK") - ok == 2 * len(turns)
    assert steps_counted("FAILED_PRECONDITION") - failed == 2
    state = await orch.stub.State(orchestrator_pb2.StateRequest(session_id=streamed.session_id), timeout=WAIT_S)
    assert (state.session.turn, state.session.reward) == (len(turns), 1.0)


async def test_errors_carry_the_unary_details(orch: Running) -> None:
    live = await reset(orch.stub, env_key="mailbox:v1")
    cases: list[tuple[orchestrator_pb2.StepRequest, grpc.StatusCode, str]] = [
        (orchestrator_pb2.StepRequest(session_id="s-missing"), grpc.StatusCode.NOT_FOUND, "SESSION_NOT_FOUND"),
        (orchestrator_pb2.StepRequest(), grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ARGUMENT"),
        (orchestrator_pb2.StepRequest(session_id="s-" + "x" * 20_000, request_id="huge"),
         grpc.StatusCode.NOT_FOUND, ""),  # checked before any work (limits.check_request), echoed clipped
        (orchestrator_pb2.StepRequest(session_id=live.session_id, request_id="r" * 200),
         grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ARGUMENT"),
        (orchestrator_pb2.StepRequest(session_id=live.session_id, tool_calls=[orchestrator_pb2.ToolCallSummary()]),
         grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ARGUMENT"),
    ]
    async with open_stream(orch.stub) as stream:
        await send(stream, *(Request(call_id=i, step=req) for i, (req, _, _) in enumerate(cases)))
        answers = await receive(stream, len(cases))
        for i, (req, code, reason) in enumerate(cases):
            streamed = status_of(answers[i])
            assert streamed == await unary_status(orch.stub, req), i  # code, message and every detail
            assert streamed.code == code.value[0] and len(streamed.message) < 256, i
            info = error_info(streamed)
            assert info.domain == "rlgate.dev" and (not reason or info.reason == reason), info
        missing = error_info(status_of(answers[0]))
        assert missing.metadata["session_id"] == "s-missing"
        bad = error_details_pb2.BadRequest()
        assert any(d.Unpack(bad) for d in status_of(answers[1]).details)
        assert [v.field for v in bad.field_violations] == ["session_id"]
        # None of it ended the stream or touched the live session.
        assert reply_of(await ask(stream, step(50, live.session_id))).turn == 1


async def test_request_id_dedupe(orch: Running) -> None:
    a, b = await asyncio.gather(reset(orch.stub, env_key="mailbox:v1"), reset(orch.stub, env_key="mailbox:v1"))
    async with open_stream(orch.stub) as stream:
        first = reply_of(await ask(stream, step(1, a.session_id, request_id="t-1", assistant_text="x")))
        again = reply_of(await ask(stream, step(2, a.session_id, request_id="t-1", assistant_text="x")))
        assert first.turn == 1 and again == first
        # Concurrent repeats on the stream, beside another session's turns: each request_id counts once.
        await send(stream, step(3, a.session_id, request_id="t-2"), step(4, a.session_id, request_id="t-2"),
                   step(5, b.session_id, request_id="t-2"), step(6, b.session_id, request_id="u-1"))
        answers = await receive(stream, 4)
        assert [reply_of(answers[i]).turn for i in (3, 4)] == [2, 2]
        assert sorted(reply_of(answers[i]).turn for i in (5, 6)) == [1, 2]
        # The record is shared with unary Step: a unary retry of a streamed request_id replays it.
        replay = await orch.stub.Step(orchestrator_pb2.StepRequest(session_id=a.session_id, request_id="t-1",
                                                                   assistant_text="x"), timeout=WAIT_S)
        assert replay == first
        assert reply_of(await ask(stream, step(7, a.session_id, request_id="t-3"))).turn == 3
    for session_id, turns in ((a.session_id, 3), (b.session_id, 2)):
        state = await orch.stub.State(orchestrator_pb2.StateRequest(session_id=session_id), timeout=WAIT_S)
        assert state.session.turn == turns


async def test_api_key_checked_when_the_stream_opens(lf: LocalfleetProcess,
                                                    orchestrator_factory: Callable[..., Any]) -> None:
    orch: Running = await orchestrator_factory(fast_config(lf, api_keys=[API_KEY]))
    for metadata in ((), (("authorization", "Bearer wrong-key"),), (("authorization", API_KEY),)):
        unary = await unary_error(orch.stub, orchestrator_pb2.StepRequest(session_id="s-any"), metadata)
        refused = await stream_refusal(orch.stub, metadata)
        assert (refused.code(), refused.details()) == (unary.code(), unary.details()), metadata
        assert refused.code() == grpc.StatusCode.UNAUTHENTICATED, metadata
    started = await reset(orch.stub, WITH_KEY, env_key="mailbox:v1")
    async with open_stream(orch.stub, WITH_KEY) as stream:
        # Steps carry no key of their own: the stream's is enough.
        for turn in (1, 2):
            assert reply_of(await ask(stream, step(turn, started.session_id))).turn == turn
        done = reply_of(await ask(stream, step(3, started.session_id, done=True)))
        assert (done.turn, done.done_reason) == (3, orchestrator_pb2.DONE_REASON_AGENT_DONE)


async def test_refused_until_tasks_load(orchestrator_factory: Callable[..., Any]) -> None:
    lf = LocalfleetProcess()  # its port is reserved; the process starts later
    try:
        orch: Running = await orchestrator_factory(fast_config(lf, provider_timeout_s=2.0))
        unary = await unary_status(orch.stub, orchestrator_pb2.StepRequest(session_id="s-any"))
        refused = await stream_refusal(orch.stub)
        assert refused.code() == grpc.StatusCode.UNAVAILABLE
        streamed = rich_status(refused)
        assert streamed == unary  # message, ErrorInfo and RetryInfo, as unary Step
        assert error_info(streamed).reason == "TASKS_NOT_LOADED"
        retry = error_details_pb2.RetryInfo()
        assert any(d.Unpack(retry) for d in streamed.details) and retry.retry_delay.seconds > 0

        await asyncio.to_thread(lf.start)
        health = health_pb2_grpc.HealthStub(orch.channel)
        deadline = time.monotonic() + 90
        while (await health.Check(health_pb2.HealthCheckRequest(), timeout=10)).status \
                != health_pb2.HealthCheckResponse.SERVING:
            assert time.monotonic() < deadline, "not SERVING within 90 s of the provider starting"
            await asyncio.sleep(0.2)
        started = await reset(orch.stub, env_key="mailbox:v1")
        async with open_stream(orch.stub) as stream:
            assert reply_of(await ask(stream, step(1, started.session_id))).turn == 1
        await orch.handle.stop()
    finally:
        lf.stop()
