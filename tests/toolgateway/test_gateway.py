"""The toolgateway over gRPC against localfleet (both MCP eras) and a real SQLite store."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from dataclasses import replace
from typing import Any

import grpc
import pytest
from prometheus_client import REGISTRY

from rlgate.core.convert import struct_from_dict
from rlgate.mcpclient.discovery import discover_tools
from rlgate.mcpclient.errors import UpstreamUnavailable
from rlgate.store import DoneReason, SessionStatus, SessionStore, call_scope, open_store
from rlgate.toolgateway.server import GatewayHandle, start_gateway
from rlgate.v1 import common_pb2, toolgateway_pb2
from rlgate.v1.toolgateway_pb2_grpc import ToolGatewayServiceStub as Stub
from tests.store.sqlite_files import hold_write_lock
from tests.support.localfleet import LocalfleetProcess
from tests.support.ports import free_port
from tests.support.wait import wait_until
from tests.toolgateway.conftest import (
    ERA_HANDSHAKE,
    AgentSession,
    create_instance,
    gateway_config,
    make_session,
    new_localfleet,
)
from tests.toolgateway.envs import PNG

Kind = common_pb2.ToolErrorKind

APP_TOOLS = ["add", "where", "sleep", "fail", "big", "picture", "hang"]


async def call(
    stub: Stub,
    s: AgentSession,
    name: str,
    args: dict[str, Any] | None = None,
    *,
    request_id: str = "",
    timeout: float = 20.0,  # noqa: ASYNC109
) -> toolgateway_pb2.CallToolResponse:
    req = toolgateway_pb2.CallToolRequest(name=name, request_id=request_id, arguments=struct_from_dict(args or {}))
    return await stub.CallTool(req, metadata=s.metadata, timeout=timeout)  # type: ignore[no-any-return]


def text(resp: toolgateway_pb2.CallToolResponse) -> str:
    return "".join(b.text.text for b in resp.result.content if b.WhichOneof("kind") == "text")


async def tool_names(stub: Stub, s: AgentSession) -> list[str]:
    resp = await stub.ListTools(toolgateway_pb2.ListToolsRequest(), metadata=s.metadata, timeout=20)
    return [t.name for t in resp.tools]


async def test_list_tools_union_filtered_by_modality(
    stub: Stub, store: SessionStore, lf: LocalfleetProcess, era: str
) -> None:
    screen_instance = create_instance(lf, era, image_type="mcp")  # its aggregator has `computer`
    tool_use = await make_session(store, lf, era, instance=screen_instance)
    resp = await stub.ListTools(toolgateway_pb2.ListToolsRequest(), metadata=tool_use.metadata, timeout=20)
    assert [t.name for t in resp.tools] == APP_TOOLS  # no `computer` for tool_use
    assert all(t.endpoint.endswith("/mcp") and "/api/v1/" not in t.endpoint for t in resp.tools)
    add = next(t for t in resp.tools if t.name == "add")
    assert json.loads(add.input_schema_json)["properties"]["n"]["type"] == "integer"

    screen = await make_session(store, lf, era, instance=tool_use.instance, modality="computer_use")
    resp = await stub.ListTools(toolgateway_pb2.ListToolsRequest(), metadata=screen.metadata, timeout=20)
    assert [(t.name, t.endpoint.endswith("/api/v1/mcp")) for t in resp.tools] == [("computer", True)]

    everything = await make_session(
        store, lf, era, instance=tool_use.instance, modality="all", tool_filter={"deny": ["hang", "big"]}
    )
    assert await tool_names(stub, everything) == ["add", "where", "sleep", "fail", "picture", "computer"]


async def test_mcp_endpoint_404_falls_back_to_aggregator(
    stub: Stub, store: SessionStore, lf: LocalfleetProcess, era: str
) -> None:
    lf.set_faults({"environments": {era: {"mcp_404": True}}})
    s = await make_session(store, lf, era, modality="all")
    resp = await stub.ListTools(toolgateway_pb2.ListToolsRequest(), metadata=s.metadata, timeout=20)
    assert [t.name for t in resp.tools] == [*APP_TOOLS, "computer"]
    assert all(t.endpoint.endswith("/api/v1/mcp") for t in resp.tools)
    assert text(await call(stub, s, "where")).endswith("/api/v1/mcp")


async def test_routing_images_and_integers(stub: Stub, store: SessionStore, lf: LocalfleetProcess, era: str) -> None:
    s = await make_session(store, lf, era, modality="all")
    assert text(await call(stub, s, "where")) == f"/instances/{s.instance['instance_id']}/mcp"
    shot = await call(stub, s, "computer", {"action": "screenshot"})  # only the aggregator has it
    # (its screenshot is past this gateway's 4096-byte output limit: `picture` below checks images)
    assert not shot.result.is_error and shot.result.content[0].text.text == "screenshot"
    pic = await call(stub, s, "picture")
    assert (pic.result.content[0].image.data, pic.result.content[0].image.mime_type) == (PNG, "image/png")
    # A Struct's whole numbers reach the tool as integers (it takes StrictInt: 5.0 would fail).
    added = await call(stub, s, "add", {"n": 5, "m": 2})
    assert not added.result.is_error, added.result.error_message
    assert text(added) == "7 (int)"
    log = await store.list_tool_calls(s.session.session_id)
    assert [e.tool for e in log] == ["where", "computer", "picture", "add"]
    assert log[-1].arguments == {"n": 5, "m": 2} and type(log[-1].arguments["n"]) is int
    assert log[-1].endpoint.endswith("/mcp")
    assert log[1].endpoint.endswith("/api/v1/mcp") and log[0].duration_ms > 0


async def test_token_matrix(stub: Stub, store: SessionStore, lf: LocalfleetProcess) -> None:
    a = await make_session(store, lf, "gw")
    b = await make_session(store, lf, "gw")

    async def code_of(metadata: tuple[tuple[str, str], ...]) -> tuple[grpc.StatusCode, str]:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.ListTools(toolgateway_pb2.ListToolsRequest(), metadata=metadata, timeout=10)
        return err.value.code(), err.value.details() or ""

    assert (await code_of(()))[0] == grpc.StatusCode.UNAUTHENTICATED
    assert (await code_of((("authorization", "Bearer not-a-token"),)))[0] == grpc.StatusCode.UNAUTHENTICATED
    assert (await code_of((("authorization", "Basic abc"),)))[0] == grpc.StatusCode.UNAUTHENTICATED
    # A token reaches only its own session's instance.
    assert text(await call(stub, a, "where")).startswith(f"/instances/{a.instance['instance_id']}/")
    assert text(await call(stub, b, "where")).startswith(f"/instances/{b.instance['instance_id']}/")

    # Replaced without a record of it (as past the bound of kept revoked hashes): the old token matches nothing.
    fresh = await store.get_session(a.session.session_id)
    assert fresh is not None
    old_token = a.token
    await store.update_session(replace(fresh, token_hash="0" * 64, episode=2))
    assert (await code_of((("authorization", f"Bearer {old_token}"),)))[0] == grpc.StatusCode.UNAUTHENTICATED

    for status, expires, reason in [
        (SessionStatus.CLOSED, 0.0, "closed"),
        (SessionStatus.DONE, 0.0, "done"),
        (SessionStatus.ACTIVE, time.time() - 1, "expired"),
        (SessionStatus.EXPIRED, 0.0, "expired"),
    ]:
        s = await make_session(store, lf, "gw", instance=b.instance)
        current = await store.get_session(s.session.session_id)
        assert current is not None
        await store.update_session(
            replace(current, status=status, expires_at=expires, done_reason=DoneReason.MAX_TURNS)
        )
        code, details = await code_of(s.metadata)
        assert code == grpc.StatusCode.FAILED_PRECONDITION and reason in details, (status, details)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call(stub, s, "add", {"n": 1})
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION


async def test_model_mistakes_are_results_without_error_logs(
    stub: Stub, store: SessionStore, lf: LocalfleetProcess, era: str, caplog: pytest.LogCaptureFixture
) -> None:
    screen_instance = create_instance(lf, era, image_type="mcp")
    s = await make_session(store, lf, era, call_budget=7, instance=screen_instance)
    with caplog.at_level(logging.INFO):
        unknown = await call(stub, s, "computer")  # exists upstream, hidden by the tool_use filter
        assert unknown.result.is_error and unknown.result.error_kind == Kind.TOOL_ERROR_KIND_UNKNOWN_TOOL
        assert "not available" in unknown.result.error_message and "add" in unknown.result.error_message
        nope = await call(stub, s, "no_such_tool")
        assert nope.result.error_kind == Kind.TOOL_ERROR_KIND_UNKNOWN_TOOL and "does not exist" in text(nope)
        bad = await call(stub, s, "add", {"n": "five"})
        assert bad.result.error_kind == Kind.TOOL_ERROR_KIND_INVALID_ARGUMENTS
        assert "$.n" in bad.result.error_message and "integer" in bad.result.error_message
        frac = await call(stub, s, "add", {"n": 5.5})
        assert frac.result.error_kind == Kind.TOOL_ERROR_KIND_INVALID_ARGUMENTS
        failed = await call(stub, s, "fail", {"message": "disk full"})
        assert failed.result.is_error and failed.result.error_kind == Kind.TOOL_ERROR_KIND_TOOL_FAILED
        assert "disk full" in failed.result.error_message
        big = await call(stub, s, "big", {"size": 10_000})  # gateway limit: 4096 bytes
        assert not big.result.is_error and big.result.error_kind == Kind.TOOL_ERROR_KIND_OUTPUT_TRUNCATED
        assert "truncated" in text(big) and len(text(big)) < 4300
        ok = await call(stub, s, "add", {"n": 1})
        assert text(ok) == "2 (int)"
        spent = await call(stub, s, "add", {"n": 1})  # the 8th call of a 7-call budget
        assert spent.result.error_kind == Kind.TOOL_ERROR_KIND_BUDGET_EXHAUSTED
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], [r.getMessage() for r in caplog.records]
    log = await store.list_tool_calls(s.session.session_id)
    assert [e.error_kind for e in log] == [
        "UNKNOWN_TOOL",
        "UNKNOWN_TOOL",
        "INVALID_ARGUMENTS",
        "INVALID_ARGUMENTS",
        "TOOL_FAILED",
        "OUTPUT_TRUNCATED",
        "",
        "BUDGET_EXHAUSTED",
    ]

    for args, what in [({"n": math.nan}, "nan"), ({"n": math.inf}, "inf")]:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call(stub, s, "add", args)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and what in (err.value.details() or "")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call(stub, s, "")
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call(stub, s, "add", {"n": 1}, request_id="r" * 129)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_hanging_tool_deadline_cancels_upstream(
    stub: Stub, store: SessionStore, lf: LocalfleetProcess, era: str
) -> None:
    lf.set_faults({"environments": {era: {"hang_tools": ["hang"]}}})
    s = await make_session(store, lf, era)
    assert text(await call(stub, s, "add", {"n": 1})) == "2 (int)"  # connected and listed
    before = lf.counters()["by_env"][era]["cancellations"]
    start = time.monotonic()
    hanging = asyncio.create_task(call(stub, s, "hang", request_id="hang-1", timeout=1.0))
    await wait_until(lambda: lf.counters()["by_env"][era]["tool_calls"] >= 2, 30, "the hanging call upstream")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await hanging
    elapsed = time.monotonic() - start
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert elapsed < 1.0 + 4.0, elapsed  # the caller's 1 s deadline, not the tool's hang (room for load)
    await wait_until(lambda: lf.counters()["by_env"][era]["cancellations"] > before, 30, "the upstream call cancelled")
    # The same session keeps working, and the timed-out request_id is never run again.
    assert text(await call(stub, s, "add", {"n": 2})) == "3 (int)"
    retry = await call(stub, s, "hang", request_id="hang-1", timeout=5)
    assert retry.result.error_kind == Kind.TOOL_ERROR_KIND_OUTCOME_UNKNOWN


async def test_same_request_id_runs_once(stub: Stub, store: SessionStore, lf: LocalfleetProcess, era: str) -> None:
    s = await make_session(store, lf, era)
    await call(stub, s, "where")
    before = lf.counters()["by_env"][era]["tool_calls"]
    first = await call(stub, s, "add", {"n": 40}, request_id="req-1")
    again = await call(stub, s, "add", {"n": 40}, request_id="req-1")
    assert (first.replayed, again.replayed) == (False, True)
    assert again.result == first.result and text(again) == "41 (int)"
    # Two concurrent attempts: the second waits for the first and gets its result.
    a, b = await asyncio.gather(
        call(stub, s, "sleep", {"seconds": 0.5}, request_id="req-2"),
        call(stub, s, "sleep", {"seconds": 0.5}, request_id="req-2"),
    )
    assert sorted([a.replayed, b.replayed]) == [False, True] and a.result == b.result
    assert lf.counters()["by_env"][era]["tool_calls"] - before == 2
    log = await store.list_tool_calls(s.session.session_id)
    assert [e.request_id for e in log][1:] == ["req-1", "req-2"]
    assert log[0].request_id.startswith("gw-")  # a call without one is logged under a made-up id


async def test_fifty_concurrent_calls_share_one_client(store: SessionStore, lf: LocalfleetProcess, era: str) -> None:
    handle = await start_gateway(gateway_config(), store)
    try:
        s = await make_session(store, lf, era)
        lf.reset_counters()
        async with grpc.aio.insecure_channel(handle.address) as channel:
            stub = Stub(channel)
            results = await asyncio.gather(*(call(stub, s, "add", {"n": i}) for i in range(50)))
        assert sorted(text(r) for r in results) == sorted(f"{i + 1} (int)" for i in range(50))
        c = lf.counters()
        assert c["by_env"][era][ERA_HANDSHAKE[era]] == 2, c  # one handshake per endpoint
        assert c["by_env"][era]["mcp_tools_list"] == 2, c  # one discovery per endpoint
        assert c["by_env"][era]["tool_calls"] == 50
        # HTTP/1.1 carries one call per connection at a time; each endpoint's client keeps at most
        # `upstream_max_connections` (8), plus the legacy era's probe and GET stream.
        print(f"\n{era}: 50 concurrent calls -> {c['tcp_connections']} TCP connections for 2 endpoints")
        assert c["tcp_connections"] <= 2 * (8 + 3), c
        # A tool_use session calls no tool of the aggregator: only `{root}mcp` keeps its client.
        assert handle.pool.open_clients() == 1
    finally:
        await handle.stop(grace=0)


async def test_legacy_upstream_forgetting_sessions_rebuilds_once(
    stub: Stub, store: SessionStore, lf: LocalfleetProcess
) -> None:
    s = await make_session(store, lf, "gw-legacy")
    assert text(await call(stub, s, "add", {"n": 1})) == "2 (int)"
    rebuilds = REGISTRY.get_sample_value("rlgate_toolgateway_upstream_rebuilds_total", {"reason": "session_gone"}) or 0
    lf.set_faults({"environments": {"gw-legacy": {"forget_sessions": True}}})
    assert text(await call(stub, s, "add", {"n": 2})) == "3 (int)"  # served; its session is forgotten after
    before = lf.counters()["by_env"]["gw-legacy"]
    assert before["sessions_forgotten"] >= 1
    assert text(await call(stub, s, "add", {"n": 3}, request_id="after-forget")) == "4 (int)"
    after = lf.counters()["by_env"]["gw-legacy"]
    assert after["mcp_initialize"] - before["mcp_initialize"] == 1  # exactly one rebuild
    assert after["tool_calls"] - before["tool_calls"] == 1  # the rejected attempt never ran the tool
    assert (
        REGISTRY.get_sample_value("rlgate_toolgateway_upstream_rebuilds_total", {"reason": "session_gone"})
        == rebuilds + 1
    )


async def test_upstream_killed_mid_call_then_back(store: SessionStore, era: str) -> None:
    with new_localfleet() as lf:
        handle = await start_gateway(gateway_config(), store)
        try:
            s = await make_session(store, lf, era)
            async with grpc.aio.insecure_channel(handle.address) as channel:
                stub = Stub(channel)
                assert text(await call(stub, s, "add", {"n": 1})) == "2 (int)"
                pending = asyncio.create_task(call(stub, s, "sleep", {"seconds": 10}, request_id="lost", timeout=20))
                await wait_until(lambda: lf.counters()["tool_calls"] >= 2, 30, "the sleeping call upstream")
                start = time.monotonic()
                await asyncio.to_thread(lf.kill)
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await pending
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE
                assert time.monotonic() - start < 8.0  # at once: not the 10 s sleep nor the 20 s deadline
                with pytest.raises(grpc.aio.AioRpcError) as err:  # still down: nothing ran, retryable
                    await call(stub, s, "add", {"n": 1}, request_id="while-down")
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE
                await asyncio.to_thread(lf.start)
                assert text(await call(stub, s, "add", {"n": 5}, request_id="while-down")) == "6 (int)"
                retry = await call(stub, s, "sleep", {"seconds": 10}, request_id="lost")
                assert retry.result.error_kind == Kind.TOOL_ERROR_KIND_OUTCOME_UNKNOWN
        finally:
            await handle.stop(grace=0)


async def test_closed_session_clients_are_closed(
    gateway: GatewayHandle, stub: Stub, store: SessionStore, lf: LocalfleetProcess
) -> None:
    s = await make_session(store, lf, "gw", modality="all")  # a tool on each endpoint: both stay open
    await tool_names(stub, s)
    assert gateway.pool.open_clients() == 2
    current = await store.get_session(s.session.session_id)
    assert current is not None
    await store.update_session(replace(current, status=SessionStatus.CLOSED, token_hash=""))
    await wait_until(lambda: gateway.pool.open_clients() == 0, 30, "the closed session's clients closed")


async def test_caller_cancel_cancels_upstream(stub: Stub, store: SessionStore, lf: LocalfleetProcess, era: str) -> None:
    lf.set_faults({"environments": {era: {"hang_tools": ["hang"]}}})
    s = await make_session(store, lf, era)
    await call(stub, s, "where")
    before = lf.counters()["by_env"][era]
    rpc = stub.CallTool(
        toolgateway_pb2.CallToolRequest(name="hang", request_id="cancel-1"), metadata=s.metadata, timeout=30
    )
    await wait_until(lambda: lf.counters()["by_env"][era]["tool_calls"] > before["tool_calls"], 30, "the call upstream")
    rpc.cancel()
    with pytest.raises(asyncio.CancelledError):
        await rpc
    if era != "gw":  # see test_hanging_tool_deadline_cancels_upstream for the modern JSON path
        await wait_until(
            lambda: lf.counters()["by_env"][era]["cancellations"] > before["cancellations"],
            30,
            "the upstream call cancelled",
        )
    retry = await call(stub, s, "hang", request_id="cancel-1", timeout=10)
    assert retry.result.error_kind == Kind.TOOL_ERROR_KIND_OUTCOME_UNKNOWN
    log = await store.list_tool_calls(s.session.session_id)
    assert [(e.tool, e.error_kind) for e in log] == [("where", ""), ("hang", "OUTCOME_UNKNOWN")]


async def test_idle_clients_close_and_reconnect(store: SessionStore, lf: LocalfleetProcess) -> None:
    handle = await start_gateway(gateway_config(client_idle_s=0.3, janitor_interval_s=0.1), store)
    try:
        s = await make_session(store, lf, "gw-legacy")
        async with grpc.aio.insecure_channel(handle.address) as channel:
            stub = Stub(channel)
            assert text(await call(stub, s, "add", {"n": 1})) == "2 (int)"
            assert handle.pool.open_clients() == 1  # the aggregator owns no tool_use tool: closed after listing
            # A call longer than the idle limit keeps its clients.
            assert text(await call(stub, s, "sleep", {"seconds": 1.0})) == "slept 1.0"
            await wait_until(lambda: handle.pool.open_clients() == 0, 30, "the idle clients closed")
            assert text(await call(stub, s, "add", {"n": 2})) == "3 (int)"
    finally:
        await handle.stop(grace=0)


async def test_discover_tools_for_the_orchestrator(lf: LocalfleetProcess, era: str) -> None:
    inst = create_instance(lf, era, image_type="mcp")
    endpoints = [inst["urls"]["mcp"]["api"], inst["urls"]["mcp"]["aggregator"]]
    cat = await discover_tools(endpoints, timeout=15, tool_filter={"modality": "tool_use"})
    assert cat.names() == APP_TOOLS and not cat.dropped
    assert [s.endpoint for s in cat.specs()] == [endpoints[0]] * len(APP_TOOLS)
    screen = await discover_tools(endpoints, timeout=15, modality="computer_use")
    assert [(t.name, t.endpoint) for t in screen.tools] == [("computer", endpoints[1])]
    lf.set_faults({"environments": {era: {"mcp_404": True}}})
    cat = await discover_tools(endpoints, timeout=15, tool_filter={"modality": "tool_use"})
    assert cat.names() == APP_TOOLS and list(cat.dropped) == [endpoints[0]]
    assert all(s.endpoint == endpoints[1] for s in cat.specs())
    dead = f"http://127.0.0.1:{free_port()}/mcp"
    with pytest.raises(UpstreamUnavailable):
        await discover_tools([endpoints[1], dead], timeout=5)


@pytest.mark.redis
async def test_replicas_on_redis_are_interchangeable(redis_server: Any, lf: LocalfleetProcess) -> None:
    store = await open_store(redis_server.url)
    a = await start_gateway(gateway_config(), store)
    b = await start_gateway(gateway_config(), store)
    try:
        s = await make_session(store, lf, "gw-legacy")
        async with grpc.aio.insecure_channel(a.address) as ca, grpc.aio.insecure_channel(b.address) as cb:
            first = await call(Stub(ca), s, "add", {"n": 1}, request_id="r-1")
            again = await call(Stub(cb), s, "add", {"n": 1}, request_id="r-1")  # the other replica
            assert (first.replayed, again.replayed, text(again)) == (False, True, "2 (int)")
            assert text(await call(Stub(cb), s, "add", {"n": 2})) == "3 (int)"
        assert [e.tool for e in await store.list_tool_calls(s.session.session_id)] == ["add", "add"]
    finally:
        await a.stop(grace=0)
        await b.stop(grace=0)
        await store.close()


async def test_a_claim_whose_call_was_cancelled_does_not_block_retries(tmp_path: Any, lf: LocalfleetProcess) -> None:
    # The client's deadline cancels CallTool while its auth + claim waits for the store (another process
    # holds SQLite's write lock): the claim still lands when the lock goes, and must then be released, or
    # every retry of the request_id would wait on a PENDING record of this live gateway until its deadline.
    path = tmp_path / "store.db"
    store = await open_store(f"sqlite:///{path}")
    handle = await start_gateway(gateway_config(), store)
    try:
        s = await make_session(store, lf, "gw")
        other = hold_write_lock(path)
        async with grpc.aio.insecure_channel(handle.address) as channel:
            stub = Stub(channel)
            try:
                with pytest.raises(grpc.aio.AioRpcError) as first:
                    await call(stub, s, "add", {"n": 1}, request_id="r1", timeout=0.5)
                assert first.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            finally:
                other.execute("ROLLBACK")
                other.close()
            scope = call_scope(s.session.session_id)

            # The claim commits once the lock is gone, then the store releases it.
            async def released() -> bool:
                return await store.get_request(scope, "r1") is None

            await wait_until(released, 30, "the cancelled call's claim released")
            reply = await call(stub, s, "add", {"n": 1}, request_id="r1", timeout=10.0)
            assert text(reply) == "2 (int)" and not reply.replayed
    finally:
        await handle.stop(grace=0)
        await store.close()
