"""The shared gRPC bootstrap: health, reflection, API keys, trace ids, request parsing, metrics, graceful
shutdown. rlgate's RPCs are unary; health's and reflection's streams pass the interceptors untouched, any
other stream is refused."""

from __future__ import annotations

import asyncio
import gc
import logging
import uuid
from collections.abc import AsyncIterable, AsyncIterator, Callable

import grpc
import pytest
import uvloop
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from rlgate.runtime import eventloop
from rlgate.runtime.auth import mint_agent_token
from rlgate.runtime.grpc_server import start_server, watch_dependency
from rlgate.runtime.interceptors import MAX_BUILT_METHODS, ApiKeys, Pipeline, ReplyBudget, RpcMetrics
from rlgate.runtime.logs import trace_id_var
from rlgate.store import StoreFull
from rlgate.v1 import toolgateway_pb2, toolgateway_pb2_grpc


class _Servicer(toolgateway_pb2_grpc.ToolGatewayServiceServicer):
    """ListTools logs the trace id; CallTool raises (an unexpected bug) to exercise the INTERNAL path."""

    async def ListTools(
        self, request: toolgateway_pb2.ListToolsRequest, context: grpc.aio.ServicerContext
    ) -> toolgateway_pb2.ListToolsResponse:
        logging.getLogger("test.servicer").info("listing for %s", trace_id_var.get())
        return toolgateway_pb2.ListToolsResponse()

    async def CallTool(
        self, request: toolgateway_pb2.CallToolRequest, context: grpc.aio.ServicerContext
    ) -> toolgateway_pb2.CallToolResponse:
        raise RuntimeError("boom with a secret detail")


def _register(server: grpc.aio.Server) -> list[str]:
    toolgateway_pb2_grpc.add_ToolGatewayServiceServicer_to_server(_Servicer(), server)
    return ["rlgate.v1.ToolGatewayService"]


async def _health(channel: grpc.aio.Channel) -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    # types-grpcio-health-checking gives HealthStub no methods.
    reply = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)  # type: ignore[attr-defined]
    return int(reply.status)


async def test_health_serving_then_not_serving_during_drain() -> None:
    running = await start_server("127.0.0.1:0", _register, interceptors=[Pipeline()])
    seen_during_drain: list[int] = []
    async with grpc.aio.insecure_channel(running.address) as channel:
        assert await _health(channel) == health_pb2.HealthCheckResponse.SERVING

        async def drain() -> None:
            seen_during_drain.append(await _health(channel))

        await running.shutdown(grace=1.0, drain=drain)
    assert seen_during_drain == [health_pb2.HealthCheckResponse.NOT_SERVING]


async def test_reflection_lists_services() -> None:
    # Through the interceptors a server runs with: reflection's stream passes them, and needs no API key.
    running = await start_server("127.0.0.1:0", _register, interceptors=[Pipeline(ApiKeys(["k-123"]))])
    try:
        async with grpc.aio.insecure_channel(running.address) as channel:
            # types-grpcio-reflection: the stub takes a blocking channel only, its method is binascii.Incomplete.
            stub = reflection_pb2_grpc.ServerReflectionStub(channel)  # type: ignore[arg-type]

            async def requests() -> AsyncIterator[reflection_pb2.ServerReflectionRequest]:
                yield reflection_pb2.ServerReflectionRequest(list_services="")

            names: list[str] = []
            async for reply in stub.ServerReflectionInfo(requests(), timeout=5):  # type: ignore[operator]
                names = [s.name for s in reply.list_services_response.service]
        assert "rlgate.v1.ToolGatewayService" in names and "grpc.health.v1.Health" in names
    finally:
        await running.shutdown(grace=0)


async def test_api_keys_and_trace_ids(caplog: pytest.LogCaptureFixture) -> None:
    running = await start_server("127.0.0.1:0", _register, interceptors=[Pipeline(ApiKeys(["k-123"]))])
    try:
        async with grpc.aio.insecure_channel(running.address) as channel:
            stub = toolgateway_pb2_grpc.ToolGatewayServiceStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as missing:
                await stub.ListTools(toolgateway_pb2.ListToolsRequest(), timeout=5)
            assert missing.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.aio.AioRpcError) as wrong:
                await stub.ListTools(
                    toolgateway_pb2.ListToolsRequest(), timeout=5, metadata=[("authorization", "Bearer nope")]
                )
            assert wrong.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "nope" not in (wrong.value.details() or "")
            with caplog.at_level(logging.INFO):
                await stub.ListTools(
                    toolgateway_pb2.ListToolsRequest(),
                    timeout=5,
                    metadata=[("authorization", "Bearer k-123"), ("x-rlgate-trace-id", "trace-abc")],
                )
            assert any("trace-abc" in r.getMessage() for r in caplog.records)
            # health stays reachable without a key (probes)
            assert await _health(channel) == health_pb2.HealthCheckResponse.SERVING
            with pytest.raises(grpc.aio.AioRpcError) as bug:
                await stub.CallTool(
                    toolgateway_pb2.CallToolRequest(name="x"), timeout=5, metadata=[("authorization", "Bearer k-123")]
                )
            assert bug.value.code() == grpc.StatusCode.INTERNAL
            assert "secret detail" not in (bug.value.details() or "")
    finally:
        await running.shutdown(grace=0)


@pytest.mark.parametrize("keys", [[], ["k-123"]])
async def test_an_agent_token_never_reaches_the_orchestration_plane(keys: list[str]) -> None:
    running = await start_server("127.0.0.1:0", _register, interceptors=[Pipeline(ApiKeys(keys))])
    agent_token = mint_agent_token("s-1")
    try:
        async with grpc.aio.insecure_channel(running.address) as channel:
            stub = toolgateway_pb2_grpc.ToolGatewayServiceStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as denied:
                await stub.ListTools(
                    toolgateway_pb2.ListToolsRequest(), timeout=5, metadata=[("authorization", f"Bearer {agent_token}")]
                )
            assert denied.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "agent token" in (denied.value.details() or "")
            assert agent_token not in (denied.value.details() or "")
            if not keys:  # without API keys, anything else still passes
                await stub.ListTools(toolgateway_pb2.ListToolsRequest(), timeout=5)
    finally:
        await running.shutdown(grace=0)


async def test_unbindable_address_is_an_error() -> None:
    running = await start_server("127.0.0.1:0", _register)
    try:
        with pytest.raises((OSError, RuntimeError)):
            await start_server(f"127.0.0.1:{running.port}", _register)
    finally:
        await running.shutdown(grace=0)
        await asyncio.sleep(0)


async def test_bytes_that_are_not_a_request_are_invalid_argument() -> None:
    running = await start_server("127.0.0.1:0", _register, interceptors=[Pipeline()])
    try:
        async with grpc.aio.insecure_channel(running.address) as channel:
            raw: grpc.aio.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary(
                "/rlgate.v1.ToolGatewayService/ListTools"
            )
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await raw(b"\xff\xff\xff", timeout=5)  # not a ListToolsRequest (a truncated field)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "ListTools" in (err.value.details() or "")
    finally:
        await running.shutdown(grace=0)


async def test_internal_errors_carry_the_callers_trace_id() -> None:
    running = await start_server("127.0.0.1:0", _register, interceptors=[Pipeline()])
    try:
        async with grpc.aio.insecure_channel(running.address) as channel:
            stub = toolgateway_pb2_grpc.ToolGatewayServiceStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.CallTool(
                    toolgateway_pb2.CallToolRequest(name="x"), timeout=5, metadata=[("x-rlgate-trace-id", "trace-xyz")]
                )
            assert err.value.code() == grpc.StatusCode.INTERNAL
            assert "trace-xyz" in (err.value.details() or "")
    finally:
        await running.shutdown(grace=0)


async def test_metrics_count_each_rpc_by_method_and_code() -> None:
    from prometheus_client import REGISTRY

    service = f"runtime-test-{uuid.uuid4().hex[:8]}"
    running = await start_server("127.0.0.1:0", _register, interceptors=[Pipeline(metrics=RpcMetrics(service))])

    def count(method: str, code: str) -> float:
        labels = {"service": service, "method": method, "code": code}
        return REGISTRY.get_sample_value("rlgate_grpc_requests_total", labels) or 0.0

    try:
        async with grpc.aio.insecure_channel(running.address) as channel:
            stub = toolgateway_pb2_grpc.ToolGatewayServiceStub(channel)
            for _ in range(2):
                await stub.ListTools(toolgateway_pb2.ListToolsRequest(), timeout=5)
            with pytest.raises(grpc.aio.AioRpcError):
                await stub.CallTool(toolgateway_pb2.CallToolRequest(name="x"), timeout=5)
        assert (count("ListTools", "OK"), count("CallTool", "INTERNAL")) == (2.0, 1.0)
    finally:
        await running.shutdown(grace=0)


@pytest.mark.parametrize(
    "interceptor",
    [
        Pipeline,
        lambda: Pipeline(metrics=RpcMetrics(f"stream-probe-{uuid.uuid4().hex[:8]}")),
        lambda: Pipeline(ReplyBudget(), ApiKeys([])),
    ],
    ids=["bare", "metrics", "layers"],
)
async def test_a_streaming_rlgate_method_is_refused(
    interceptor: Callable[[], grpc.aio.ServerInterceptor], caplog: pytest.LogCaptureFixture
) -> None:
    """A pipeline, whatever its layers, refuses a stream it cannot check (UNIMPLEMENTED, and an error in the
    log naming the method) instead of passing it on unchecked; health's stream still passes."""
    ran: list[str] = []

    async def watch(request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        ran.append("watch")
        yield request

    async def chat(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        ran.append("chat")
        async for request in requests:
            yield request

    def register(server: grpc.aio.Server) -> list[str]:
        handlers: dict[str, grpc.RpcMethodHandler[bytes, bytes]] = {
            "WatchTools": grpc.unary_stream_rpc_method_handler(watch),
            "ChatTools": grpc.stream_stream_rpc_method_handler(chat),
        }
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("rlgate.v1.StreamProbe", handlers),))
        return _register(server)

    running = await start_server("127.0.0.1:0", register, interceptors=[interceptor()])

    async def one() -> AsyncIterator[bytes]:
        yield b"hi"

    try:
        async with grpc.aio.insecure_channel(running.address) as channel:
            watch_tools: grpc.aio.UnaryStreamMultiCallable[bytes, bytes]
            chat_tools: grpc.aio.StreamStreamMultiCallable[bytes, bytes]
            watch_tools = channel.unary_stream("/rlgate.v1.StreamProbe/WatchTools")
            chat_tools = channel.stream_stream("/rlgate.v1.StreamProbe/ChatTools")
            calls: dict[str, AsyncIterable[bytes]] = {
                "WatchTools": watch_tools(b"hi", timeout=5),
                "ChatTools": chat_tools(one(), timeout=5),
            }
            for method, call in calls.items():
                with pytest.raises(grpc.aio.AioRpcError) as err, caplog.at_level(logging.ERROR):
                    async for _ in call:
                        pass
                assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
                assert f"/rlgate.v1.StreamProbe/{method} is a streaming method" in str(err.value.details())
                assert f"StreamProbe/{method} is a streaming method" in caplog.text
            # types-grpcio-health-checking gives HealthStub no methods.
            watching = health_pb2_grpc.HealthStub(channel).Watch(  # type: ignore[attr-defined]
                health_pb2.HealthCheckRequest(service=""), timeout=5
            )
            assert (await watching.read()).status == health_pb2.HealthCheckResponse.SERVING
            watching.cancel()
            await stub_list_tools(channel)  # the unary methods beside them are served
        assert ran == []
    finally:
        await running.shutdown(grace=0)


async def stub_list_tools(channel: grpc.aio.Channel) -> None:
    await toolgateway_pb2_grpc.ToolGatewayServiceStub(channel).ListTools(toolgateway_pb2.ListToolsRequest(), timeout=5)


async def test_health_follows_a_failing_dependency_and_its_recovery() -> None:
    running = await start_server("127.0.0.1:0", _register)
    broken = asyncio.Event()
    broken.set()
    probes = asyncio.Queue[bool]()

    async def probe() -> None:
        failing = broken.is_set()
        await probes.put(failing)
        if failing:
            raise StoreFull("disk full")

    watcher = asyncio.create_task(watch_dependency(running, "session store", probe, interval_s=0.01))
    try:
        async with grpc.aio.insecure_channel(running.address) as channel:
            assert await probes.get() is True
            assert await probes.get() is True  # the first probe's verdict is published before the second runs
            assert await _health(channel) == health_pb2.HealthCheckResponse.NOT_SERVING
            broken.clear()
            while await probes.get():  # bounded by the test timeout; each probe is 10 ms apart
                pass
            assert await probes.get() is False  # ... and the passing one's before the next
            assert await _health(channel) == health_pb2.HealthCheckResponse.SERVING
            await running.set_serving(False)  # readiness and the dependency are tracked apart
            assert await _health(channel) == health_pb2.HealthCheckResponse.NOT_SERVING
    finally:
        watcher.cancel()
        await running.shutdown(grace=0)


def test_services_run_on_uvloop_and_leave_nothing_running() -> None:
    """`eventloop.run`, what every service's command runs under: a uvloop loop on which the grpc.aio
    server, its interceptors and a client work, and which cancels what is left when its coroutine ends."""
    leftovers: list[asyncio.Task[None]] = []

    async def main() -> tuple[type[asyncio.AbstractEventLoop], int]:
        leftovers.append(asyncio.create_task(asyncio.sleep(3600)))
        running = await start_server("127.0.0.1:0", _register, interceptors=[Pipeline()])
        try:
            async with grpc.aio.insecure_channel(running.address) as channel:
                status = await _health(channel)
                with pytest.raises(grpc.aio.AioRpcError) as failed:
                    await toolgateway_pb2_grpc.ToolGatewayServiceStub(channel).CallTool(
                        toolgateway_pb2.CallToolRequest(name="x"), timeout=5
                    )
                assert failed.value.code() == grpc.StatusCode.INTERNAL
        finally:
            await running.shutdown(grace=1.0)
        return type(asyncio.get_running_loop()), status

    try:
        loop_type, status = eventloop.run(main())
        # What was alive before the loop started is out of the collector's reach (the services' startup).
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()  # this is a test process: its later tests' garbage must stay collectable
    assert issubclass(loop_type, uvloop.Loop)
    assert status == health_pb2.HealthCheckResponse.SERVING
    assert leftovers[0].cancelled()


async def test_methods_nobody_serves_cannot_grow_the_pipeline() -> None:
    """Each method nobody serves is answered UNIMPLEMENTED by a new handler; the behaviours a pipeline keeps
    stay bounded (MAX_BUILT_METHODS) however many such names a caller sends, and the served methods still
    answer."""
    pipeline = Pipeline()
    running = await start_server("127.0.0.1:0", _register, interceptors=[pipeline])
    try:
        async with grpc.aio.insecure_channel(running.address) as channel:
            for i in range(MAX_BUILT_METHODS + 20):
                unknown: grpc.aio.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary(f"/nobody.Serves/M{i}")
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await unknown(b"", timeout=5)
                assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
            await stub_list_tools(channel)
        assert len(pipeline._built) <= MAX_BUILT_METHODS
    finally:
        await running.shutdown(grace=0)
