"""Every way a CallTool can end, on the gateway's logic alone: `ToolGateway` over the in-memory store and a
fake upstream (tests/fakes), no gRPC server, no MCP server. What each branch must leave behind: the answer, the
request record (released, so a retry runs; or DONE, so a retry replays), the tool-call log, and how many
times the tool ran (never twice)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import mcp_types as mt
import pytest

from rlgate.core.errors import DeadlineExceeded, Unavailable
from rlgate.ledger import decode_result
from rlgate.runtime.auth import mint_agent_token, token_hash
from rlgate.runtime.deadline import Deadline
from rlgate.store import RequestState, Session, SessionStatus, call_scope
from rlgate.toolgateway.recording import ORPHAN_NOTE
from rlgate.toolgateway.service import ToolGateway
from rlgate.v1 import common_pb2, toolgateway_pb2
from tests.fakes import FakeUpstreamPool, Outcome, hang, lost, not_sent, rejected, timed_out, too_large
from tests.fakes.store import FaultyMemoryStore
from tests.fakes.upstream import ENDPOINT, echo_tool

Kind = common_pb2.ToolErrorKind
SID = "s-calls"
OWNER = "gw-1"


@dataclass
class Gateway:
    gateway: ToolGateway
    store: FaultyMemoryStore
    upstream: FakeUpstreamPool
    token: str

    async def call(
        self, request_id: str = "r1", *, name: str = "echo", arguments: str = '{"x": 1}', deadline_s: float = 5.0
    ) -> toolgateway_pb2.CallToolResponse:
        request = toolgateway_pb2.CallToolRequest(request_id=request_id, name=name, arguments_json=arguments)
        return await self.gateway.call_tool(self.token, request, Deadline(deadline_s))

    async def record(self, request_id: str = "r1") -> tuple[str, toolgateway_pb2.CallToolResponse | None] | None:
        """(state, recorded response when DONE) of the call's request record, or None."""
        record = await self.store.get_request(call_scope(SID), request_id)
        if record is None:
            return None
        if record.state != RequestState.DONE:
            return record.state, None
        return record.state, toolgateway_pb2.CallToolResponse.FromString(decode_result(record.result)[1])

    async def logged(self) -> list[tuple[str, str]]:
        """(request_id, error kind) of every entry of the session's tool-call log."""
        return [(e.request_id, e.error_kind) for e in await self.store.list_tool_calls(SID)]

    async def replica(self, owner: str = "gw-2") -> Gateway:
        """Another gateway process on the same store (alive)."""
        store = FaultyMemoryStore(self.store.data)
        await store.heartbeat_owner(owner, 60)
        gateway = ToolGateway(store, self.upstream, owner)  # type: ignore[arg-type]
        return Gateway(gateway, store, self.upstream, self.token)

    async def recorded_done(self, request_id: str = "r1", timeout_s: float = 10.0) -> toolgateway_pb2.CallToolResponse:
        """The recorded response once the record is DONE (polled, bounded)."""
        async with asyncio.timeout(timeout_s):
            while True:
                record = await self.record(request_id)
                if record is not None and record[1] is not None:
                    return record[1]
                await asyncio.sleep(0.01)


@pytest.fixture
async def gw() -> AsyncIterator[Gateway]:
    store = FaultyMemoryStore()
    token = mint_agent_token(SID)
    await store.create_session(
        Session(
            session_id=SID,
            env_key="env:v1",
            status=SessionStatus.ACTIVE,
            token_hash=token_hash(token),
            endpoints=[ENDPOINT],
            tool_filter={"modality": "tool_use"},
        )
    )
    await store.heartbeat_owner(OWNER, 60)
    upstream = FakeUpstreamPool()
    gateway = ToolGateway(store, upstream, OWNER)  # type: ignore[arg-type]  # the fake stands in for the pool
    yield Gateway(gateway, store, upstream, token)
    await gateway.drain()
    await store.close()


def kind(response: toolgateway_pb2.CallToolResponse) -> str:
    return Kind.Name(response.result.error_kind)


# -- the tool answered ---------------------------------------------------------------------------------------
async def test_sent_and_answered_is_recorded_logged_and_replayed(gw: Gateway) -> None:
    first = await gw.call()
    assert not first.result.is_error and first.result.content[0].text.text == "ok" and not first.replayed
    assert gw.upstream.calls[0].arguments == {"x": 1}
    assert await gw.record() == ("done", first)
    assert await gw.logged() == [("r1", "")]
    again = await gw.call()
    assert again.replayed and again.result == first.result
    assert gw.upstream.runs("echo") == 1 and await gw.logged() == [("r1", "")]


@pytest.mark.parametrize(
    ("outcome", "why"),
    [(rejected(-32602, "bad x"), "JSON-RPC error -32602"), (too_large(), "reply larger")],
    ids=["rejected", "reply-too-large"],
)
async def test_an_answer_that_is_an_error_is_a_tool_failure_result(gw: Gateway, outcome: Outcome, why: str) -> None:
    gw.upstream.will("echo", outcome)
    response = await gw.call()
    assert response.result.is_error and kind(response) == "TOOL_ERROR_KIND_TOOL_FAILED"
    assert why in response.result.error_message
    assert await gw.record() == ("done", response)
    assert await gw.logged() == [("r1", "TOOL_FAILED")]
    assert (await gw.call()).replayed and len(gw.upstream.calls) == 1


# -- the call never reached the upstream: the request_id is free again ----------------------------------------
async def test_not_sent_is_unavailable_and_a_retry_runs_it(gw: Gateway) -> None:
    gw.upstream.will("echo", not_sent())
    with pytest.raises(Unavailable) as err:
        await gw.call()
    assert err.value.reason == "UPSTREAM_UNAVAILABLE" and "did not run" in err.value.message
    assert await gw.record() is None and await gw.logged() == []
    retry = await gw.call()
    assert not retry.result.is_error and not retry.replayed
    assert gw.upstream.runs("echo") == 1 and await gw.logged() == [("r1", "")]


async def test_timed_out_before_sending_is_deadline_exceeded_and_a_retry_runs_it(gw: Gateway) -> None:
    gw.upstream.will("echo", timed_out(sent=False))
    with pytest.raises(DeadlineExceeded):
        await gw.call()
    assert await gw.record() is None and await gw.logged() == []
    assert not (await gw.call()).result.is_error
    assert gw.upstream.runs("echo") == 1


# -- the tool may have run: OUTCOME_UNKNOWN, recorded, and never run again -------------------------------------
async def assert_outcome_unknown_kept(gw: Gateway) -> None:
    state, recorded = await gw.record() or ("", None)
    assert state == "done" and recorded is not None and kind(recorded) == "TOOL_ERROR_KIND_OUTCOME_UNKNOWN"
    assert await gw.logged() == [("r1", "OUTCOME_UNKNOWN")]
    retry = await gw.call()
    assert retry.replayed and kind(retry) == "TOOL_ERROR_KIND_OUTCOME_UNKNOWN"
    assert len(gw.upstream.calls) == 1  # the retry did not reach the upstream


async def test_lost_is_unavailable_then_outcome_unknown(gw: Gateway) -> None:
    gw.upstream.will("echo", lost())
    with pytest.raises(Unavailable) as err:
        await gw.call()
    assert "may have run" in err.value.message and "OUTCOME_UNKNOWN" in err.value.message
    await assert_outcome_unknown_kept(gw)


async def test_timed_out_after_sending_is_deadline_exceeded_then_outcome_unknown(gw: Gateway) -> None:
    gw.upstream.will("echo", timed_out(sent=True))
    with pytest.raises(DeadlineExceeded) as err:
        await gw.call()
    assert "may have partly run" in err.value.message
    await assert_outcome_unknown_kept(gw)


async def test_a_hung_tool_meets_the_callers_deadline_then_outcome_unknown(gw: Gateway) -> None:
    gw.upstream.will("echo", hang())
    started = time.monotonic()
    with pytest.raises(DeadlineExceeded):
        await gw.call(deadline_s=0.3)
    assert time.monotonic() - started < 5
    await assert_outcome_unknown_kept(gw)


async def test_a_hung_tool_whose_caller_cancels_is_cancelled_upstream_then_outcome_unknown(gw: Gateway) -> None:
    gw.upstream.will("echo", hang())
    caller = asyncio.create_task(gw.call())
    upstream_call = await gw.upstream.next_call()
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    await asyncio.wait_for(upstream_call.finished.wait(), 5)
    assert upstream_call.cancelled  # the upstream request is cancelled with its caller
    await gw.gateway.drain()  # the record and the log entry are written by an owned task
    await assert_outcome_unknown_kept(gw)


# -- another attempt of the request_id is in flight, or was when its gateway died ------------------------------
async def test_a_retry_while_a_live_gateway_runs_the_call_waits_then_deadline_exceeded(gw: Gateway) -> None:
    await gw.store.heartbeat_owner("gw-2", 60)
    await gw.store.claim_request(call_scope(SID), "r1", "gw-2")
    with pytest.raises(DeadlineExceeded, match="still being processed"):
        await gw.call(deadline_s=0.3)
    assert gw.upstream.calls == []
    assert await gw.record() == ("pending", None)


async def test_a_retry_waiting_on_a_live_gateway_is_bounded_by_its_deadline_even_if_the_store_hangs(
    gw: Gateway,
) -> None:
    await gw.store.heartbeat_owner("gw-2", 60)
    await gw.store.claim_request(call_scope(SID), "r1", "gw-2")
    polling = asyncio.Event()
    owner_alive = gw.store.owner_alive

    async def checked(owner: str) -> bool:  # the retry has found the record and is waiting on its owner
        alive = await owner_alive(owner)
        polling.set()
        return alive

    gw.store.owner_alive = checked  # type: ignore[method-assign]
    retry = asyncio.create_task(gw.call(deadline_s=0.5))
    started = time.monotonic()
    await asyncio.wait_for(polling.wait(), 5)
    async with gw.store.paused():  # the store stops answering while the retry polls the record
        with pytest.raises(DeadlineExceeded, match="still being processed") as err:
            await asyncio.wait_for(retry, 5)
    assert time.monotonic() - started < 0.5 + 4 and err.value.retry_after_s  # its deadline, not the paused store
    assert any(d.DESCRIPTOR.name == "RetryInfo" for d in err.value.details())


async def test_owner_died_is_outcome_unknown_and_the_tool_is_not_run(gw: Gateway) -> None:
    await gw.store.heartbeat_owner("gw-dead", 0)  # its lease lapses at once: the process is gone
    await gw.store.claim_request(call_scope(SID), "r1", "gw-dead")
    response = await gw.call()
    assert kind(response) == "TOOL_ERROR_KIND_OUTCOME_UNKNOWN" and "died" in response.result.error_message
    assert gw.upstream.calls == []
    again = await gw.call()  # answered the same way every time, still without running the tool
    assert kind(again) == "TOOL_ERROR_KIND_OUTCOME_UNKNOWN" and again.replayed and gw.upstream.calls == []


async def test_owner_died_is_logged_and_recorded_with_what_the_retry_sent(gw: Gateway) -> None:
    await gw.store.heartbeat_owner("gw-dead", 0)
    await gw.store.claim_request(call_scope(SID), "r1", "gw-dead")
    response = await gw.call(arguments='{"x": 2}')
    assert await gw.record() == ("done", response)
    (entry,) = await gw.store.list_tool_calls(SID)
    assert (entry.request_id, entry.error_kind, entry.tool, entry.arguments) == (
        "r1",
        "OUTCOME_UNKNOWN",
        "echo",
        {"x": 2},
    )
    assert entry.result_summary.startswith(ORPHAN_NOTE) and entry.endpoint == ""  # the retry's, and says so
    assert (await gw.call(arguments='{"x": 2}')).replayed and await gw.logged() == [("r1", "OUTCOME_UNKNOWN")]


@pytest.mark.parametrize(
    "hint",
    [mt.ToolAnnotations(read_only_hint=True), mt.ToolAnnotations(idempotent_hint=True)],
    ids=["read-only", "idempotent"],
)
async def test_owner_died_on_a_read_only_tool_runs_it_again_once_and_counts_the_fault(
    gw: Gateway, hint: mt.ToolAnnotations
) -> None:
    gw.upstream.tools["*"] = [echo_tool(), mt.Tool(name="peek", input_schema={"type": "object"},
                                                   annotations=hint)]  # fmt: skip
    await gw.store.heartbeat_owner("gw-dead", 0)
    await gw.store.claim_request(call_scope(SID), "r1", "gw-dead")
    response = await gw.call(name="peek")
    assert not response.result.is_error and response.result.content[0].text.text == "ok"  # the model sees a result
    assert gw.upstream.runs("peek") == 1
    (entry,) = await gw.store.list_tool_calls(SID)
    assert (entry.error_kind, entry.infra_fault) == ("", "tool_reruns")  # the ledger says it ran again
    session = await gw.store.get_session(SID)
    assert session is not None and session.infra_faults == {"tool_reruns": 1}
    again = await gw.call(name="peek")  # once: a repeat replays it
    assert again.replayed and gw.upstream.runs("peek") == 1


async def test_owner_died_on_another_tool_stays_outcome_unknown_and_counts_the_fault(gw: Gateway) -> None:
    writes = mt.ToolAnnotations(read_only_hint=False, destructive_hint=True)
    gw.upstream.tools["*"] = [mt.Tool(name="echo", input_schema={"type": "object"}, annotations=writes)]
    await gw.store.heartbeat_owner("gw-dead", 0)
    await gw.store.claim_request(call_scope(SID), "r1", "gw-dead")
    response = await gw.call()
    assert kind(response) == "TOOL_ERROR_KIND_OUTCOME_UNKNOWN" and gw.upstream.calls == []
    (entry,) = await gw.store.list_tool_calls(SID)
    assert entry.infra_fault == "outcome_unknown"
    session = await gw.store.get_session(SID)
    assert session is not None and session.infra_faults == {"outcome_unknown": 1}


async def test_a_lost_call_counts_an_outcome_unknown_fault(gw: Gateway) -> None:
    gw.upstream.will("echo", lost())
    with pytest.raises(Unavailable):
        await gw.call()
    await gw.recorded_done()
    session = await gw.store.get_session(SID)
    assert session is not None and session.infra_faults == {"outcome_unknown": 1}


async def test_retries_racing_for_a_dead_gateways_call_log_and_record_it_once(gw: Gateway) -> None:
    await gw.store.heartbeat_owner("gw-dead", 0)
    ids = [f"r{i}" for i in range(10)]
    for request_id in ids:
        await gw.store.claim_request(call_scope(SID), request_id, "gw-dead")
    other = await gw.replica()

    async def after(steps: int, gateway: Gateway, request_id: str) -> toolgateway_pb2.CallToolResponse:
        for _ in range(steps):  # staggered by a few store round trips, so every interleaving is tried
            await asyncio.sleep(0)
        return await gateway.call(request_id)

    answers = await asyncio.gather(*(after(i * (g is other), g, rid) for i, rid in enumerate(ids) for g in (gw, other)))
    assert all(kind(a) == "TOOL_ERROR_KIND_OUTCOME_UNKNOWN" for a in answers)
    for first, second in zip(answers[::2], answers[1::2], strict=True):  # one of each pair wrote it
        assert sorted([first.replayed, second.replayed]) == [False, True]
    assert sorted(await gw.logged()) == sorted((rid, "OUTCOME_UNKNOWN") for rid in ids)
    assert gw.upstream.calls == []
    await other.gateway.drain()


# -- the store fails on the DONE write, after the tool ran ------------------------------------------------------
async def test_a_done_write_failing_once_is_recorded_by_the_ledger_and_replayed(gw: Gateway) -> None:
    gw.store.fail("commit")  # the log entry + DONE record write; the ledger then records the response alone
    first = await gw.call()
    assert not first.result.is_error
    assert await gw.record() == ("done", first)
    again = await asyncio.wait_for(gw.call(deadline_s=5), 10)
    assert again.replayed and gw.upstream.runs("echo") == 1


async def test_a_done_write_failing_once_still_logs_the_call(gw: Gateway) -> None:
    gw.store.fail("commit")
    await gw.call()
    assert await gw.logged() == [("r1", "")]
    assert (await gw.call()).replayed and await gw.logged() == [("r1", "")]  # never logged twice


async def test_a_done_write_that_keeps_failing_is_answered_from_memory_then_recorded_once_the_store_heals(
    gw: Gateway,
) -> None:
    gw.store.fail("commit", times=None)  # a full disk: every write of the record and the log fails
    with pytest.raises(Unavailable) as err:
        await gw.call()
    assert err.value.reason == "STORE_UNAVAILABLE" and err.value.retry_after_s
    assert await gw.record() == ("pending", None)
    started = time.monotonic()
    retry = await gw.call(deadline_s=10.0)  # the answer this live gateway holds, without waiting
    assert time.monotonic() - started < 5 and retry.replayed and retry.result.content[0].text.text == "ok"
    other = await gw.replica()  # another gateway cannot have it: bounded by its deadline, with RetryInfo
    with pytest.raises(DeadlineExceeded) as waited:
        await other.call(deadline_s=0.3)
    assert waited.value.retry_after_s
    gw.store.heal()  # the disk frees: the real answer is recorded with its log entry, in the background
    recorded = await gw.recorded_done()
    assert not recorded.result.is_error and recorded.result == retry.result
    assert await gw.logged() == [("r1", "")]
    assert (await other.call()).result == retry.result
    assert gw.upstream.runs("echo") == 1


async def test_a_gateway_that_dies_holding_an_unwritten_answer_leaves_outcome_unknown(gw: Gateway) -> None:
    gw.store.fail("commit", times=None)
    with pytest.raises(Unavailable):
        await gw.call()
    await gw.gateway.drain(0)  # the process goes away: its background write with it ...
    await gw.store.heartbeat_owner(OWNER, 0)  # ... and its lease lapses
    gw.store.heal()
    other = await gw.replica()
    taken_over = await other.call()
    assert kind(taken_over) == "TOOL_ERROR_KIND_OUTCOME_UNKNOWN" and not taken_over.replayed
    assert await gw.record() == ("done", taken_over)
    assert await gw.logged() == [("r1", "OUTCOME_UNKNOWN")]
    assert gw.upstream.runs("echo") == 1
    await other.gateway.drain()


async def test_drain_cancels_bookkeeping_that_outlives_it(gw: Gateway) -> None:
    """Shutdown waits for the gateway's own background work up to its bound, then cancels what is left, so
    no task outlives the loop it runs on."""
    stuck = gw.gateway.recorder.in_background(asyncio.Event().wait())
    started = time.monotonic()
    await gw.gateway.drain(0.2)
    assert stuck.cancelled() and time.monotonic() - started < 5
