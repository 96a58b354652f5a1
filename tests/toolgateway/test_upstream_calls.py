"""Tool calls through the one upstream path (the mcp SDK session, both eras) against a misbehaving upstream
(`http_server`): what a failure means (never sent / lost / timed out), the reply limit, and that a call that
ends stops reading its reply. The server's side of the wire is observed: bytes it got out, the client leaving."""

from __future__ import annotations

import asyncio
import json
import secrets
import time
import uuid
from collections.abc import AsyncIterator

import grpc
import pytest

from rlgate.mcpclient.errors import (
    CallLost,
    CallNotSent,
    CallRejected,
    CallTimedOut,
    ReplyTooLarge,
)
from rlgate.mcpclient.pool import PoolSettings, UpstreamPool
from rlgate.mcpclient.session import SessionUpstreams
from rlgate.mcpclient.transport import MAX_REPLY_BYTES, HttpSettings
from rlgate.runtime.auth import token_hash
from rlgate.store import Session, SessionStatus, SessionStore
from rlgate.toolgateway.server import start_gateway
from rlgate.v1 import common_pb2, toolgateway_pb2, toolgateway_pb2_grpc
from tests.toolgateway.conftest import gateway_config
from tests.toolgateway.http_server import ERAS, HostileUpstream, hostile_upstream

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


async def test_calls_go_through_the_sdk_session_in_either_era(upstream: HostileUpstream, ups: SessionUpstreams) -> None:
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


# 3. What a failure means: never sent (retryable), lost (outcome unknown)


async def test_a_connection_that_cannot_be_made_is_never_sent(upstream: HostileUpstream, ups: SessionUpstreams) -> None:
    assert (await ups.call(upstream.url, "add", {"n": 1}, 10.0)).content[0].text == "2"  # type: ignore[union-attr]
    await upstream.stop()
    with pytest.raises(CallNotSent, match="request not sent: ConnectError"):
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


async def test_gateway_answers_a_reply_past_the_limit_with_tool_failed(
    upstream: HostileUpstream, store: SessionStore
) -> None:
    handle = await start_gateway(gateway_config(upstream_max_reply_bytes=MiB), store)
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
