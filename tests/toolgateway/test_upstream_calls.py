"""Tool calls (the mcp SDK session in the legacy era, one POST of `mcpclient.stateless` in the 2026-07-28 era)
against a misbehaving upstream (`http_server`): what a failure means (never sent / lost / timed out /
answered with an error), the reply limit, and that a call that ends stops reading its reply; tool listings:
lost or answered with an error, and the bound of one page. The server's side of the wire is observed: bytes
it got out, the client leaving.

Behaviours this module adds to the front (`server_error`, `sse_ends`) are registered in its `BEHAVIOURS`
here; `ListingUpstream` answers `tools/list` itself when told to."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import secrets
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import pytest
import uvicorn
from mcp_types import CONNECTION_CLOSED, INTERNAL_ERROR, INVALID_REQUEST, METHOD_NOT_FOUND, REQUEST_TIMEOUT
from mcp_types.jsonrpc import HEADER_MISMATCH
from starlette.types import Receive, Scope, Send

from rlgate.mcpclient.catalog import MAX_TOOL_BYTES, MAX_TOOLS
from rlgate.mcpclient.discovery import discover_tools
from rlgate.mcpclient.errors import (
    CallLost,
    CallNotSent,
    CallRejected,
    CallTimedOut,
    ReplyTooLarge,
    UpstreamUnavailable,
)
from rlgate.mcpclient.pool import PoolSettings, UpstreamPool
from rlgate.mcpclient.session import SessionUpstreams
from rlgate.mcpclient.stateless import StatelessCalls
from rlgate.mcpclient.transport import MAX_PAGE_BYTES, MAX_REPLY_BYTES, NOTIFICATION_WAIT_S, HttpSettings
from rlgate.runtime.auth import token_hash
from rlgate.store import Session, SessionStatus, SessionStore
from rlgate.toolgateway.server import start_gateway
from rlgate.v1 import common_pb2, toolgateway_pb2, toolgateway_pb2_grpc
from tests.support.wait import wait_until, wait_until_sync
from tests.toolgateway.conftest import gateway_config
from tests.toolgateway.http_server import (
    BEHAVIOURS,
    ERAS,
    HostileCall,
    HostileUpstream,
    hostile_upstream,
    read_body,
    replay,
)

MiB = 2**20
# What the server can get out past the limit before it sees the client go: loopback socket buffers at both
# ends plus uvicorn's. Far below the 100 MiB it tries to send.
SLACK = 24 * MiB


@pytest.fixture(params=ERAS)
async def upstream(request: pytest.FixtureRequest) -> AsyncIterator[HostileUpstream]:
    async with hostile_upstream(str(request.param)) as up:
        yield up


async def session_on(
    upstream: HostileUpstream, max_reply_bytes: int = MAX_REPLY_BYTES
) -> tuple[UpstreamPool, SessionUpstreams]:
    pool = UpstreamPool(
        PoolSettings(upstream_timeout_s=10.0, http=HttpSettings.create(max_reply_bytes=max_reply_bytes))
    )
    ups = pool.session("s1", [upstream.url])
    await ups.catalog(10.0)
    return pool, ups


@pytest.fixture
async def ups(upstream: HostileUpstream) -> AsyncIterator[SessionUpstreams]:
    pool, session = await session_on(upstream)
    yield session
    await pool.close()


async def test_calls_work_in_either_era(upstream: HostileUpstream, ups: SessionUpstreams) -> None:
    result = await ups.call(upstream.url, "add", {"n": 1}, 10.0)
    assert result.content[0].text == "2"  # type: ignore[union-attr]
    link = ups.clients[upstream.url]._link
    assert link is not None
    assert (link.era == "2026-07-28") == (upstream.era == "modern")


# 1. The reply limit, in both eras, for a JSON body, one SSE event and a stream of small SSE events


@pytest.mark.parametrize("kind", ["json", "sse", "sse-events"])
async def test_a_reply_past_the_limit_is_cut_off_and_its_connection_dropped(
    upstream: HostileUpstream, ups: SessionUpstreams, kind: str
) -> None:
    with pytest.raises(ReplyTooLarge, match=f"larger than {MAX_REPLY_BYTES} bytes"):
        await ups.call(upstream.url, "flood", {"kind": kind, "total": 100 * MiB}, 30.0)
    [flood] = upstream.hostile
    await upstream.wait(flood.disconnected.is_set)  # the client closed the connection
    # What was read is bounded by the limit, not by the reply: the server could not get its 100 MiB out.
    assert MAX_REPLY_BYTES < flood.sent < MAX_REPLY_BYTES + SLACK
    assert upstream.calls["flood"] == 1  # not retried
    # The client is unharmed: the next call works on the same link.
    link = ups.clients[upstream.url]._link
    assert (await ups.call(upstream.url, "add", {"n": 2}, 10.0)).content[0].text == "3"  # type: ignore[union-attr]
    assert ups.clients[upstream.url]._link is link


@pytest.mark.parametrize("kind", ["json", "sse"])
async def test_a_reply_under_the_limit_is_read_whole(
    upstream: HostileUpstream, ups: SessionUpstreams, kind: str
) -> None:
    # 2 MiB in one SSE event: past the SDK's default event limit (1 MiB), inside the reply limit.
    result = await ups.call(upstream.url, "flood", {"kind": kind, "total": 2 * MiB}, 30.0)
    assert len(result.content[0].text) >= 2 * MiB  # type: ignore[union-attr]


async def test_a_compressed_reply_is_refused(upstream: HostileUpstream, ups: SessionUpstreams) -> None:
    with pytest.raises(CallRejected, match="compressed the reply") as err:
        await ups.call(upstream.url, "squeezed", {}, 10.0)
    assert not isinstance(err.value, ReplyTooLarge)


# 2. A call that ends early stops reading: cancelled, or timed out


@pytest.mark.parametrize("how", ["cancel", "timeout"])
async def test_a_call_that_ends_stops_reading_its_reply(upstream: HostileUpstream, how: str) -> None:
    pool, ups = await session_on(upstream, max_reply_bytes=2**40)  # no limit in reach: only the end stops it
    try:
        timeout = 1.0 if how == "timeout" else 30.0
        task = asyncio.create_task(ups.call(upstream.url, "flood", {"kind": "sse"}, timeout))  # endless
        await upstream.wait(lambda: bool(upstream.hostile) and upstream.hostile[0].sent > MiB)
        flood = upstream.hostile[0]
        if how == "cancel":
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        else:
            with pytest.raises(CallTimedOut) as err:
                await task
            assert err.value.sent
        await upstream.wait(flood.disconnected.is_set)  # the server sees the connection closed
        sent = flood.sent
        assert (await ups.call(upstream.url, "add", {"n": 1}, 10.0)).content[0].text == "2"  # type: ignore[union-attr]
        assert flood.sent == sent  # nothing more got out
    finally:
        await pool.close()


async def test_a_call_timing_out_before_any_reply_closes_its_request(
    upstream: HostileUpstream, ups: SessionUpstreams
) -> None:
    with pytest.raises(CallTimedOut) as err:
        await ups.call(upstream.url, "hang", {}, 0.5)
    assert err.value.sent
    [hang] = upstream.hostile
    # 2026-07-28: the SDK aborts the POST; legacy: the gateway stops waiting, and the SDK's cancel
    # notification (that era's way to cancel) still reaches the server.
    await upstream.wait(hang.disconnected.is_set)
    if upstream.era == "legacy":
        await upstream.wait(lambda: upstream.methods["notifications/cancelled"] == 1)


@pytest.mark.parametrize("reply", ["json", "sse"])
@pytest.mark.parametrize("how", ["timeout", "cancel"])
@pytest.mark.parametrize("era", ERAS)
async def test_a_call_that_ends_stops_the_sdk_handler(era: str, reply: str, how: str) -> None:
    """The SDK's own server (not the front) runs a 5 s tool: a 1 s deadline, or the caller's cancel, stops
    its handler in both eras and both reply forms (legacy: by `notifications/cancelled`; 2026-07-28: the
    POST is closed). An SSE reply is the SDK's default, as FastMCP and mcp-proxy serve."""
    async with hostile_upstream(era, sse=reply == "sse") as upstream:
        pool, ups = await session_on(upstream)
        try:
            started = time.monotonic()
            call = asyncio.create_task(
                ups.call(upstream.url, "slow", {"seconds": 5.0}, 1.0 if how == "timeout" else 30.0)
            )
            await wait_until(lambda: upstream.slow.started == 1, 10, "the slow tool started", interval=0.02)
            if how == "cancel":
                call.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await call
            else:
                with pytest.raises(CallTimedOut):
                    await call
            await wait_until(lambda: upstream.slow.cancelled == 1, 3, "the slow tool cancelled", interval=0.02)
            assert time.monotonic() - started < 4.0
            assert upstream.slow.finished == 0
            if era == "legacy":
                assert upstream.methods["notifications/cancelled"] == 1
        finally:
            await pool.close()


@pytest.mark.parametrize("reply", ["json", "sse"])
async def test_a_cancel_left_unanswered_does_not_stall_the_session(reply: str) -> None:
    """A legacy server takes a timed-out call's `notifications/cancelled` and never answers its POST. The SDK
    sends a client's notifications one at a time and every later message waits behind them, so unless the
    transport sends the cancel itself and bounds its wait, the session's next call is never sent. The next
    call runs, and the unanswered POST's connection is closed."""
    async with hostile_upstream("legacy", sse=reply == "sse", cancel_answer_s=math.inf) as upstream:
        pool, ups = await session_on(upstream)
        try:
            with pytest.raises(CallTimedOut):
                await ups.call(upstream.url, "slow", {"seconds": 5.0}, 1.0)
            await upstream.wait(lambda: upstream.methods["notifications/cancelled"] == 1)
            [cancel] = upstream.hostile
            started = time.monotonic()
            result = await asyncio.wait_for(ups.call(upstream.url, "add", {"n": 1}, 10.0), NOTIFICATION_WAIT_S + 5)
            assert result.content[0].text == "2"  # type: ignore[union-attr]
            assert time.monotonic() - started < NOTIFICATION_WAIT_S + 3
            await upstream.wait(cancel.disconnected.is_set)
        finally:
            await pool.close()


async def test_calls_whose_caller_gives_up_as_they_time_out_are_each_cancelled() -> None:
    """The gateway's MCP timeout fires just before the caller's gRPC deadline, which then cancels the waiting
    task as well; on a busy loop both land together. Parallel legacy calls ending so (their server answering
    each cancel a round trip later) each get their `notifications/cancelled` to the server: a second
    cancellation while the SDK hands a notification to its writer no longer drops it. Without that, about
    one round in two lost a cancel here, and its tool ran on."""
    n, rounds = 8, 3
    async with hostile_upstream("legacy", sse=True, cancel_answer_s=0.3) as upstream:
        pool, ups = await session_on(upstream)

        async def given_up() -> None:
            with contextlib.suppress(CallTimedOut, TimeoutError):
                await asyncio.wait_for(ups.call(upstream.url, "slow", {"seconds": 5.0}, 0.95), 0.96)

        def all_cancelled() -> bool:
            return upstream.slow.cancelled == upstream.slow.started

        try:
            for _ in range(rounds):
                await asyncio.gather(*(given_up() for _ in range(n)))
                await wait_until(all_cancelled, 3, "every slow tool cancelled", interval=0.02)
            assert upstream.slow.started == rounds * n and upstream.slow.finished == 0
            assert upstream.methods["notifications/cancelled"] == rounds * n
        finally:
            await pool.close()


# 3. What a failure means: never sent (retryable), lost (outcome unknown)


async def test_a_connection_that_cannot_be_made_is_never_sent(upstream: HostileUpstream, ups: SessionUpstreams) -> None:
    assert (await ups.call(upstream.url, "add", {"n": 1}, 10.0)).content[0].text == "2"  # type: ignore[union-attr]
    await upstream.stop()
    # httpx2's ConnectError under the SDK (legacy era), aiohttp's ClientConnectorError for a 2026-07-28 call.
    with pytest.raises(CallNotSent, match=r"request not sent: (ConnectError|ClientConnectorError)"):
        await ups.call(upstream.url, "add", {"n": 1}, 10.0)


@pytest.mark.parametrize("when", ["before", "json", "sse"])
async def test_a_connection_dropped_during_the_call_is_lost(
    upstream: HostileUpstream, ups: SessionUpstreams, when: str
) -> None:
    with pytest.raises(CallLost, match="connection lost"):
        await ups.call(upstream.url, "drop", {"when": when}, 10.0)
    assert upstream.calls["drop"] == 1  # never retried: the tool may have run
    assert (await ups.call(upstream.url, "add", {"n": 5}, 10.0)).content[0].text == "6"  # type: ignore[union-attr]


async def test_a_reply_limit_of_the_settings_applies(upstream: HostileUpstream) -> None:
    pool, ups = await session_on(upstream, max_reply_bytes=MiB)
    try:
        with pytest.raises(ReplyTooLarge, match=f"larger than {MiB} bytes"):
            await ups.call(upstream.url, "flood", {"kind": "json", "total": 4 * MiB}, 30.0)
    finally:
        await pool.close()


# 4. Through the gateway: a reply past the limit is a TOOL_FAILED result, recorded, never run again


async def open_session(store: SessionStore, upstream: HostileUpstream) -> str:
    """An active session on `upstream` in the store; its agent token."""
    token = secrets.token_urlsafe(24)
    await store.create_session(
        Session(
            session_id=uuid.uuid4().hex,
            env_key="hostile:v1",
            status=SessionStatus.ACTIVE,
            modality="tool_use",
            instance_id="i-hostile",
            endpoints=[upstream.url],
            tool_filter={"modality": "tool_use"},
            token_hash=token_hash(token),
            expires_at=time.time() + 3600,
        )
    )
    return token


async def test_gateway_answers_a_reply_past_the_limit_with_tool_failed(
    upstream: HostileUpstream, store: SessionStore
) -> None:
    handle = await start_gateway(gateway_config(upstream_max_reply_bytes=MiB), store)
    token = await open_session(store, upstream)
    request = toolgateway_pb2.CallToolRequest(
        name="flood", request_id="big-1", arguments_json=json.dumps({"kind": "sse", "total": 100 * MiB})
    )
    try:
        async with grpc.aio.insecure_channel(handle.address) as channel:
            stub = toolgateway_pb2_grpc.ToolGatewayServiceStub(channel)
            metadata = (("authorization", f"Bearer {token}"),)
            first = await stub.CallTool(request, metadata=metadata, timeout=30)
            again = await stub.CallTool(request, metadata=metadata, timeout=30)
    finally:
        await handle.stop(grace=0)
    result = first.result
    assert result.is_error and result.error_kind == common_pb2.TOOL_ERROR_KIND_TOOL_FAILED
    assert f"larger than {MiB} bytes" in result.error_message and "the tool ran" in result.error_message
    assert again.replayed and again.result == result
    assert upstream.calls["flood"] == 1


@pytest.mark.parametrize("reply", ["json", "sse"])
@pytest.mark.parametrize("how", ["timeout", "cancel"])
async def test_gateway_calls_ending_together_are_each_cancelled_upstream(
    reply: str, how: str, store: SessionStore
) -> None:
    """A caller's parallel calls on one legacy session end together (one deadline, or cancelled at once)
    while the server answers each `notifications/cancelled` a round trip later (0.5 s). Each cancel reaches
    the server within 3 s and stops its handler: none waits behind the others' answers (the SDK's writer sends
    notifications one at a time: 8 in a row took 4 s, and with the caller's deadline cutting the waits short,
    some never went out and their tools ran on). 8 calls: every connection of the session's client."""
    n = 8
    async with hostile_upstream("legacy", sse=reply == "sse", cancel_answer_s=0.5) as upstream:
        handle = await start_gateway(gateway_config(), store)
        token = await open_session(store, upstream)
        try:
            async with grpc.aio.insecure_channel(handle.address) as channel:
                stub = toolgateway_pb2_grpc.ToolGatewayServiceStub(channel)
                metadata = (("authorization", f"Bearer {token}"),)
                calls = [
                    stub.CallTool(
                        toolgateway_pb2.CallToolRequest(name="slow", request_id=f"slow-{i}", arguments_json="{}"),
                        metadata=metadata,
                        timeout=1.0 if how == "timeout" else 30.0,
                    )
                    for i in range(n)
                ]
                await wait_until(lambda: upstream.slow.started == n, 10, "the slow tools started", interval=0.02)
                if how == "cancel":
                    for call in calls:
                        call.cancel()
                outcomes = await asyncio.gather(*calls, return_exceptions=True)
                assert all(isinstance(o, grpc.aio.AioRpcError | asyncio.CancelledError) for o in outcomes), outcomes
                await wait_until(lambda: upstream.slow.cancelled == n, 3, "every slow tool cancelled", interval=0.02)
                assert upstream.methods["notifications/cancelled"] == n and upstream.slow.finished == 0
        finally:
            await handle.stop(grace=0)


@pytest.mark.parametrize("reply", ["json", "sse"])
@pytest.mark.parametrize("how", ["timeout", "cancel"])
@pytest.mark.parametrize("era", ERAS)
async def test_a_gateway_call_that_ends_stops_the_sdk_handler(
    era: str, reply: str, how: str, store: SessionStore
) -> None:
    """Through the gateway: a 5 s tool of the SDK's own server under a 1 s gRPC deadline, or cancelled by its
    caller, is stopped at the server in both eras and both reply forms."""
    async with hostile_upstream(era, sse=reply == "sse") as upstream:
        handle = await start_gateway(gateway_config(), store)
        token = await open_session(store, upstream)
        request = toolgateway_pb2.CallToolRequest(name="slow", request_id="slow-1", arguments_json='{"seconds": 5}')
        try:
            async with grpc.aio.insecure_channel(handle.address) as channel:
                stub = toolgateway_pb2_grpc.ToolGatewayServiceStub(channel)
                metadata = (("authorization", f"Bearer {token}"),)
                started = time.monotonic()
                call = stub.CallTool(request, metadata=metadata, timeout=1.0 if how == "timeout" else 30.0)
                if how == "cancel":
                    await wait_until(lambda: upstream.slow.started == 1, 10, "the slow tool started", interval=0.02)
                    call.cancel()
                with pytest.raises((grpc.aio.AioRpcError, asyncio.CancelledError)):
                    await call
                await wait_until(lambda: upstream.slow.cancelled == 1, 3, "the slow tool cancelled", interval=0.02)
                assert time.monotonic() - started < 4.0 and upstream.slow.finished == 0
                if era == "legacy":
                    assert upstream.methods["notifications/cancelled"] == 1
        finally:
            await handle.stop(grace=0)


async def test_a_call_after_its_session_was_closed_opens_no_connection(upstream: HostileUpstream) -> None:
    """The janitor closes a session's upstream clients while one of its calls is still on its way (authorized,
    checking its arguments): the call is not sent, and no connection is opened that nothing would close."""
    pool, ups = await session_on(upstream)
    try:
        await ups.close()
        with pytest.raises(CallNotSent, match="closed"):
            await ups.call(upstream.url, "add", {"n": 1}, 10.0)
        assert ups.clients[upstream.url]._link is None and upstream.calls["add"] == 0
    finally:
        await pool.close()


async def test_a_call_to_a_legacy_endpoint_that_went_away_is_never_sent(store: SessionStore) -> None:
    """The instance is deleted under a live session: its session is refused (404), and so is the handshake of
    the new one. Nothing ran: UNAVAILABLE, the request_id released (a retry is answered the same way, not
    OUTCOME_UNKNOWN), never INTERNAL, and never an agent's mistake (an unknown tool) for what the
    infrastructure did: an endpoint that served tools and then answers 404 went away, it is not one the
    instance lacks (dropped at discovery)."""
    async with hostile_upstream("legacy") as upstream:
        pool, ups = await session_on(upstream)
        try:
            upstream.gone = True
            with pytest.raises(CallNotSent, match="404"):
                await ups.call(upstream.url, "add", {"n": 1}, 10.0)
        finally:
            await pool.close()
        upstream.gone = False
        handle = await start_gateway(gateway_config(), store)
        token = await open_session(store, upstream)
        request = toolgateway_pb2.CallToolRequest(name="add", request_id="gone-1", arguments_json='{"n": 1}')
        try:
            async with grpc.aio.insecure_channel(handle.address) as channel:
                stub = toolgateway_pb2_grpc.ToolGatewayServiceStub(channel)
                metadata = (("authorization", f"Bearer {token}"),)
                assert (await stub.CallTool(request, metadata=metadata, timeout=30)).result.content[0].text.text == "2"
                upstream.gone = True
                for _ in range(2):
                    with pytest.raises(grpc.aio.AioRpcError) as caught:
                        await stub.CallTool(
                            toolgateway_pb2.CallToolRequest(name="add", request_id="gone-2", arguments_json='{"n": 1}'),
                            metadata=metadata,
                            timeout=30,
                        )
                    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE, caught.value.details()
                    assert "answered 404" in (caught.value.details() or "")  # by the call, then by its listing
        finally:
            await handle.stop(grace=0)


# 5. An error the server answers is its answer, also with the codes the SDK uses for its own failures: -32000
# (its "connection closed") and -32001 (its "request timed out") open the range servers use for their own
# errors. A reply that never came is still a lost connection.

SERVER_ERROR = "Server error: database is locked"


def rpc_error(rid: object, code: int, message: str = SERVER_ERROR) -> bytes:
    return json.dumps({"jsonrpc": "2.0", "id": rid, "error": {"code": code, "message": message}}).encode()


async def server_error(call: HostileCall) -> None:
    """A JSON-RPC error with `code` as the reply to the call: as a JSON body (`kind` json), at HTTP 500
    (status), as one SSE event ending the stream (sse) or one the stream stays open after (sse-open)."""
    kind, code = call.arguments.get("kind", "json"), int(call.arguments.get("code", CONNECTION_CLOSED))
    error = rpc_error(call.message["id"], code)
    if kind == "status":
        await call.send({"type": "http.response.start", "status": 500,
                         "headers": [(b"content-type", b"application/json")]})  # fmt: skip
        await call.body(error, more=False)
    elif kind == "json":
        await call.head("application/json")
        await call.body(error, more=False)
    else:
        await call.head("text/event-stream")
        await call.body(b"event: message\ndata: " + error + b"\n\n", more=kind == "sse-open")
        if kind == "sse-open":
            await call.disconnected.wait()


async def sse_ends(call: HostileCall) -> None:
    """An SSE reply that ends cleanly after a notification, without the response."""
    await call.head("text/event-stream")
    note = b'{"jsonrpc":"2.0","method":"notifications/message","params":{"level":"info","data":"working"}}'
    await call.body(b"event: message\ndata: " + note + b"\n\n", more=False)


BEHAVIOURS.update({"server_error": server_error, "sse_ends": sse_ends})


@pytest.mark.parametrize("code", [CONNECTION_CLOSED, REQUEST_TIMEOUT])
@pytest.mark.parametrize("kind", ["json", "status", "sse", "sse-open"])
async def test_an_error_the_server_answers_is_its_answer(
    upstream: HostileUpstream, ups: SessionUpstreams, kind: str, code: int
) -> None:
    link = ups.clients[upstream.url]._link
    with pytest.raises(CallRejected, match="database is locked") as err:
        await ups.call(upstream.url, "server_error", {"kind": kind, "code": code}, 10.0)
    assert err.value.code == code and not isinstance(err.value, ReplyTooLarge)
    assert upstream.calls["server_error"] == 1  # not retried
    assert ups.clients[upstream.url]._link is link  # the connection is kept: nothing was lost
    assert (await ups.call(upstream.url, "add", {"n": 1}, 10.0)).content[0].text == "2"  # type: ignore[union-attr]


async def test_an_sse_reply_ending_without_the_response_is_lost(
    upstream: HostileUpstream, ups: SessionUpstreams
) -> None:
    with pytest.raises(CallLost, match="connection lost"):
        await ups.call(upstream.url, "sse_ends", {}, 10.0)
    assert upstream.calls["sse_ends"] == 1


# 6. Tool listings: an error the server answers fails the listing (no new connection); a connection lost
# under it is listed again on a new one; one page is bounded (MAX_PAGE_BYTES), MAX_TOOLS ordinary tools fit.

Listing = Callable[[Scope, Send, dict[str, Any]], Awaitable[None]]


class ListingUpstream(HostileUpstream):
    """Answers `tools/list` with `listing` while it is set (else the SDK's server lists `add` and the hostile
    tools); `listed` counts the listings it answered."""

    def __init__(self, era: str) -> None:
        super().__init__(era)
        self.listing: Listing | None = None
        self.listed = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.listing is None or scope["type"] != "http" or scope["method"] != "POST":
            await super().__call__(scope, receive, send)
            return
        body = await read_body(receive)
        request = json.loads(body) if body else {}
        if request.get("method") != "tools/list":
            await super().__call__(scope, replay(body, receive), send)
            return
        self.listed += 1
        await self.listing(scope, send, request)


async def answer(send: Send, body: bytes) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": body})


def ordinary_tools(n: int) -> list[dict[str, Any]]:
    """`n` tools of an ordinary size (~200 bytes each: a name, a sentence, a schema with two properties)."""
    return [
        {"name": f"lookup_{i:05d}", "description": f"Look up record {i} by its key.",
         "inputSchema": {"type": "object", "properties": {"key": {"type": "string"}, "limit": {"type": "integer"}}}}
        for i in range(n)
    ]  # fmt: skip


def tools_reply(era: str, rid: object, tools: list[dict[str, Any]]) -> bytes:
    result: dict[str, Any] = {"tools": tools}
    if era == "modern":  # what a 2026-07-28 listing carries
        result.update(resultType="complete", ttlMs=0, cacheScope="private")
    return json.dumps({"jsonrpc": "2.0", "id": rid, "result": result}).encode()


@pytest.fixture(params=ERAS)
async def lister(request: pytest.FixtureRequest) -> AsyncIterator[ListingUpstream]:
    upstream = ListingUpstream(str(request.param))
    await upstream.start()
    try:
        yield upstream
    finally:
        await upstream.stop()


async def test_a_listing_the_server_answers_with_an_error_fails_without_reconnecting(lister: ListingUpstream) -> None:
    pool, ups = await session_on(lister)
    try:
        client = ups.clients[lister.url]
        link = client._link

        async def locked(scope: Scope, send: Send, request: dict[str, Any]) -> None:
            await answer(send, rpc_error(request["id"], CONNECTION_CLOSED))

        lister.listing = locked
        with pytest.raises(UpstreamUnavailable, match="tools/list failed: Server error: database is locked"):
            await client.list_tools(10.0, refresh=True)
        assert lister.listed == 1  # not listed again on a new connection
        assert client._link is link
    finally:
        await pool.close()


async def test_a_listing_whose_connection_drops_is_listed_again_on_a_new_one(lister: ListingUpstream) -> None:
    pool, ups = await session_on(lister)
    try:
        client = ups.clients[lister.url]
        link = client._link

        async def dropped(scope: Scope, send: Send, request: dict[str, Any]) -> None:
            lister.listing = None  # the next listing (on the new connection) is the server's own
            assert lister.tracker.abort(scope["client"])

        lister.listing = dropped
        tools = await client.list_tools(10.0, refresh=True)
        assert "add" in [t.name for t in tools]
        assert lister.listed == 1 and client._link is not link  # lost, so listed again on a new connection
    finally:
        await pool.close()


@pytest.mark.parametrize("kind", ["json", "sse"])
async def test_a_listing_page_past_its_bound_is_refused(lister: ListingUpstream, kind: str) -> None:
    """One page larger than MAX_PAGE_BYTES: cut off unread (the SDK would parse it on the event loop in one
    go), the listing refused with an error naming the bound, not tried again; the connection still calls."""
    filler = MAX_PAGE_BYTES // 150  # tools of ~185 bytes

    async def big(scope: Scope, send: Send, request: dict[str, Any]) -> None:
        body = tools_reply(lister.era, request["id"], ordinary_tools(filler))
        assert len(body) > MAX_PAGE_BYTES
        if kind == "sse":
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream")]})  # fmt: skip
            await send({"type": "http.response.body", "body": b"event: message\ndata: " + body + b"\n\n"})
        else:
            await answer(send, body)

    pool, ups = await session_on(lister)
    try:
        client = ups.clients[lister.url]
        lister.listing = big
        with pytest.raises(UpstreamUnavailable, match=f"tools/list reply was larger than {MAX_PAGE_BYTES} bytes"):
            await client.list_tools(10.0, refresh=True)
        assert lister.listed == 1
        lister.listing = None
        assert (await ups.call(lister.url, "add", {"n": 1}, 10.0)).content[0].text == "2"  # type: ignore[union-attr]
        # The orchestrator's discovery (a connection of its own) is refused the same way.
        lister.listing = big
        with pytest.raises(UpstreamUnavailable, match=f"larger than {MAX_PAGE_BYTES} bytes"):
            await discover_tools([lister.url], timeout=10.0)
    finally:
        await pool.close()


async def test_a_tool_past_its_bound_in_a_page_under_the_bound_is_left_out(lister: ListingUpstream) -> None:
    """The two bounds together: a page under MAX_PAGE_BYTES is read, and its one tool larger than MAX_TOOL_BYTES
    (1 MB of schema) is left out with the reason; the others are served."""
    props = {f"p{i:06d}": {"type": "string", "description": "x" * 40} for i in range(MiB // 60)}
    huge = {"name": "huge", "inputSchema": {"type": "object", "properties": props}}

    async def listed(scope: Scope, send: Send, request: dict[str, Any]) -> None:
        body = tools_reply(lister.era, request["id"], [*ordinary_tools(3), huge])
        assert MAX_TOOL_BYTES < len(body) < MAX_PAGE_BYTES
        await answer(send, body)

    lister.listing = listed
    pool, ups = await session_on(lister)
    try:
        cat = await ups.catalog(30.0)
        assert cat.visible.names() == [f"lookup_{i:05d}" for i in range(3)] and not cat.unavailable
        assert f"larger than {MAX_TOOL_BYTES}" in cat.catalog.left_out["huge"], cat.catalog.left_out
    finally:
        await pool.close()


async def test_a_page_limit_of_the_settings_applies(lister: ListingUpstream) -> None:
    pool = UpstreamPool(PoolSettings(upstream_timeout_s=10.0, http=HttpSettings.create(max_page_bytes=512)))
    try:
        cat = await pool.session("s1", [lister.url]).catalog(10.0)  # the SDK server's listing: ~1 KB
        assert not cat.visible.tools and "larger than 512 bytes" in cat.unavailable[lister.url], cat.unavailable
    finally:
        await pool.close()


async def test_max_tools_ordinary_tools_in_one_page_are_listed(lister: ListingUpstream) -> None:
    """MAX_TOOLS tools of an ordinary size in one page fit the page bound: all listed, on both planes' paths."""
    tools = ordinary_tools(MAX_TOOLS)
    sizes: list[int] = []

    async def many(scope: Scope, send: Send, request: dict[str, Any]) -> None:
        body = tools_reply(lister.era, request["id"], tools)
        sizes.append(len(body))
        await answer(send, body)

    lister.listing = many
    pool, ups = await session_on(lister)
    try:
        cat = await ups.catalog(30.0)
        assert len(cat.visible.tools) == MAX_TOOLS and not cat.unavailable, cat.unavailable
        assert cat.visible.tools[-1].name == f"lookup_{MAX_TOOLS - 1:05d}"
        assert len((await discover_tools([lister.url], timeout=30.0)).tools) == MAX_TOOLS
    finally:
        await pool.close()
    assert sizes and all(size <= MAX_PAGE_BYTES for size in sizes)


async def test_gateway_answers_a_server_error_with_tool_failed(lister: ListingUpstream, store: SessionStore) -> None:
    """Through the gateway: the server's -32000 is an is_error TOOL_FAILED result carrying its message (not
    UNAVAILABLE 'connection lost' and OUTCOME_UNKNOWN), recorded for the request_id like any answer."""

    async def listed(scope: Scope, send: Send, request: dict[str, Any]) -> None:
        await answer(
            send, tools_reply(lister.era, request["id"], [{"name": "server_error", "inputSchema": {"type": "object"}}])
        )

    lister.listing = listed
    handle = await start_gateway(gateway_config(), store)
    token = await open_session(store, lister)
    request = toolgateway_pb2.CallToolRequest(
        name="server_error", request_id="locked-1", arguments_json=json.dumps({"kind": "json"})
    )
    try:
        async with grpc.aio.insecure_channel(handle.address) as channel:
            stub = toolgateway_pb2_grpc.ToolGatewayServiceStub(channel)
            metadata = (("authorization", f"Bearer {token}"),)
            first = await stub.CallTool(request, metadata=metadata, timeout=30)
            again = await stub.CallTool(request, metadata=metadata, timeout=30)
    finally:
        await handle.stop(grace=0)
    result = first.result
    assert result.is_error and result.error_kind == common_pb2.TOOL_ERROR_KIND_TOOL_FAILED, result
    assert SERVER_ERROR in result.error_message and str(CONNECTION_CLOSED) in result.error_message
    assert again.replayed and again.result == result
    assert lister.calls["server_error"] == 1


# 7. A stateless-era (2026-07-28) call is one POST outside the SDK's session (`mcpclient.stateless`): it carries
# what the SDK's client would send (the SDK's server checks it), and what a server answers is sorted.


@pytest.fixture
async def modern() -> AsyncIterator[HostileUpstream]:
    async with hostile_upstream("modern") as up:
        yield up


@pytest.fixture
async def modern_ups(modern: HostileUpstream) -> AsyncIterator[SessionUpstreams]:
    pool, session = await session_on(modern)
    yield session
    await pool.close()


async def test_a_stateless_call_carries_the_envelope_and_headers_the_server_checks(
    modern: HostileUpstream, modern_ups: SessionUpstreams
) -> None:
    big = 2**70  # past 64 bits: sent as the integer it is
    result = await modern_ups.call(modern.url, "forecast", {"region": "eu-west", "days": big}, 10.0)
    assert result.content[0].text == f"eu-west: sunny for {big} day(s)", result  # type: ignore[union-attr]
    headers, message = modern.requests[-1]
    assert headers[b"mcp-param-region"] == b"eu-west"  # from the tool's x-mcp-header annotation
    assert (headers[b"mcp-method"], headers[b"mcp-name"]) == (b"tools/call", b"forecast")
    assert headers[b"mcp-protocol-version"] == b"2026-07-28"
    meta = message["params"]["_meta"]
    assert meta["io.modelcontextprotocol/protocolVersion"] == "2026-07-28"
    assert meta["io.modelcontextprotocol/clientInfo"]["name"] == "rlgate"
    assert message["params"]["arguments"] == {"region": "eu-west", "days": big}
    link = modern_ups.clients[modern.url]._link
    assert link is not None
    # The check is real: the same call without its Mcp-Param header is refused by the server, not run.
    calls = StatelessCalls(HttpSettings.create())
    try:
        with pytest.raises(CallRejected, match=r"(?i)header") as err:
            await calls.call(modern.url, link.era, "forecast", {"region": "eu-west"}, {}, 10.0)
    finally:
        await calls.close()
    assert err.value.code == HEADER_MISMATCH
    assert modern.calls["forecast"] == 2


async def test_a_stateless_call_answered_input_required_is_rejected(
    modern: HostileUpstream, modern_ups: SessionUpstreams
) -> None:
    with pytest.raises(CallRejected, match="InputRequiredResult"):
        await modern_ups.call(modern.url, "asks", {}, 10.0)


@pytest.mark.parametrize(
    ("status", "code", "expected", "match"),
    [
        (400, -32602, -32602, "refused with -32602"),  # a JSON-RPC error carried by an HTTP error
        (500, 0, INTERNAL_ERROR, "HTTP 500"),
        (404, 0, METHOD_NOT_FOUND, "Not Found"),
        (202, 0, INVALID_REQUEST, "202 Accepted"),
    ],
)
async def test_a_stateless_call_refused_at_the_http_level_is_rejected_with_a_code(
    modern: HostileUpstream, modern_ups: SessionUpstreams, status: int, code: int, expected: int, match: str
) -> None:
    with pytest.raises(CallRejected, match=match) as err:
        await modern_ups.call(modern.url, "status", {"status": status, "code": code}, 10.0)
    assert err.value.code == expected
    assert modern.calls["status"] == 1  # answered: never retried
    assert (await modern_ups.call(modern.url, "add", {"n": 1}, 10.0)).content[0].text == "2"  # type: ignore[union-attr]


async def test_a_stateless_call_that_never_got_a_pooled_connection_is_not_sent(modern: HostileUpstream) -> None:
    """With the pool's one connection held by a hanging call, a second call's deadline passes in the pool's
    queue: its headers never left, so it is an unsent CallTimedOut (its record is released, a retry is
    safe), while the hanging call's timeout is a sent one. The same for a link's own bound (`slots`)."""
    calls = StatelessCalls(HttpSettings.create(), max_connections=1)
    other = StatelessCalls(HttpSettings.create())
    try:
        hanging = asyncio.create_task(calls.call(modern.url, "2026-07-28", "hang", {}, {}, 3.0))
        await modern.wait(lambda: modern.calls["hang"] == 1)
        with pytest.raises(CallTimedOut) as queued:
            await calls.call(modern.url, "2026-07-28", "add", {"n": 1}, {}, 0.3)
        assert not queued.value.sent and modern.calls["add"] == 0
        slots = asyncio.Semaphore(0)  # a link with all of its calls in flight
        with pytest.raises(CallTimedOut) as waiting:
            await other.call(modern.url, "2026-07-28", "add", {"n": 1}, {}, 0.3, slots)
        assert not waiting.value.sent and modern.calls["add"] == 0
        with pytest.raises(CallTimedOut) as hung:
            await hanging
        assert hung.value.sent
    finally:
        await calls.close()
        await other.close()


class ThreadServer:
    """uvicorn on a thread with a loop of its own, so it acts while the test's event loop is held up: it answers
    each tools/call with "ok" after `delay_s`, and closes a connection idle for `keep_alive_s` (uvicorn's
    idle timeout, counted from its last answer). Connections are counted by the client's port."""

    def __init__(self, *, keep_alive_s: float, delay_s: float = 0.0) -> None:
        self._delay_s = delay_s
        self.clients: set[int] = set()
        self.answered = threading.Semaphore(0)
        self._socket = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._socket.getsockname()[1]}/mcp"
        config = uvicorn.Config(self._app, interface="asgi3", log_level="warning", access_log=False, lifespan="off")
        config.timeout_keep_alive = keep_alive_s  # type: ignore[assignment]  # uvicorn's call_later takes a float
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=asyncio.run, args=(self._server.serve([self._socket]),), daemon=True)
        self._thread.start()

        def started() -> bool:  # uvicorn offers no started event: poll
            assert self._thread.is_alive(), "uvicorn's thread ended before it started"
            return bool(self._server.started)

        wait_until_sync(started, 30, "uvicorn started", interval=0.01)

    @property
    def connections(self) -> int:
        return len(self.clients)

    async def _app(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.clients.add(scope["client"][1])
        message = json.loads(await read_body(receive))
        await asyncio.sleep(self._delay_s)
        result = {"content": [{"type": "text", "text": "ok"}]}
        await answer(send, json.dumps({"jsonrpc": "2.0", "id": message["id"], "result": result}).encode())
        self.answered.release()

    def close(self) -> None:
        self._server.should_exit = True
        self._thread.join(10)
        assert not self._thread.is_alive()
        self._socket.close()


async def test_a_pooled_connection_the_server_has_closed_is_not_used() -> None:
    """aiohttp learns of a server's close when its loop reads the FIN, which a busy loop does late. A call made
    before that goes out on a new connection and is answered, instead of being written to the closed one and
    lost (the server never read it, yet it would count as a call that may have run: OUTCOME_UNKNOWN)."""
    server = ThreadServer(keep_alive_s=0.01)
    calls = StatelessCalls(HttpSettings.create())
    try:
        for _ in range(3):
            result = await calls.call(server.url, "2026-07-28", "add", {"n": 1}, {}, 5.0)
            assert result.content[0].text == "ok"  # type: ignore[union-attr]
            # Hold the loop (as a busy one is) while the server closes: the FIN waits unread in our socket.
            assert server.answered.acquire(timeout=5)
            time.sleep(0.2)  # noqa: ASYNC251  # holding the loop is the point
        assert server.connections == 3
    finally:
        await calls.close()
        server.close()


async def test_a_pooled_connection_counts_its_keep_alive_from_its_last_request() -> None:
    """The server's idle clock starts at its reply; the pool's starts when the request went out (never later
    than the server's, however late a busy loop reads the reply). A call that took longer than the keep-alive
    leaves a connection too old to reuse, whatever aiohttp's own clock (from the reply's reading) says."""
    server = ThreadServer(keep_alive_s=30, delay_s=0.4)
    calls = StatelessCalls(HttpSettings.create(keepalive_s=0.3))
    try:
        for _ in range(2):
            result = await calls.call(server.url, "2026-07-28", "add", {"n": 1}, {}, 5.0)
            assert result.content[0].text == "ok"  # type: ignore[union-attr]
        assert server.connections == 2  # the second call's connection was 0.4 s old: not reused
        fast = ThreadServer(keep_alive_s=30)
        try:
            for _ in range(3):
                await calls.call(fast.url, "2026-07-28", "add", {"n": 1}, {}, 5.0)
            assert fast.connections == 1  # young connections are reused
        finally:
            fast.close()
    finally:
        await calls.close()
        server.close()
