"""One W3C trace per episode, from the client through the orchestrator and the gateway to the upstream MCP
server and Fleet's HTTP API, under the trace id the services' log lines show.

Everything runs in this process so one OpenTelemetry SDK (an in-memory exporter) sees every span: the
client, the orchestrator and the gateway (grpc.aio on 127.0.0.1:0), and localfleet under uvicorn, whose MCP
servers (the mcp SDK) make a SERVER span for each request from the trace context in its `_meta`. An ASGI
wrapper records the `traceparent` header of every HTTP request localfleet receives (Fleet's control plane,
the instance manager, the MCP endpoints).
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import os
import sys
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
import uvicorn
from opentelemetry import trace
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

import rlgate
from rlgate.localfleet.config import LocalfleetConfig
from rlgate.localfleet.server import create_app
from rlgate.orchestrator.config import OrchestratorConfig
from rlgate.orchestrator.server import OrchestratorHandle, start_orchestrator
from rlgate.runtime import tracing
from rlgate.runtime.logs import setup_logging
from rlgate.store.sqlite import SqliteStore
from rlgate.toolgateway.config import GatewayConfig
from rlgate.toolgateway.server import GatewayHandle, start_gateway
from rlgate.v1 import orchestrator_pb2, orchestrator_pb2_grpc, toolgateway_pb2, toolgateway_pb2_grpc
from tests.support.localfleet import tiny_environments
from tests.support.ports import free_port
from tests.support.wait import wait_until

# No verifier code: localfleet would run it in a subprocess forked from this process, and a fork beside
# grpc's threads can crash the child. The verifier's span is there all the same (it skips).
TASK = {"key": "notes-star", "prompt": "Star note 7.", "env_id": "notes", "version": "v1", "task_modality": "tool_use"}
WAIT_S = 30.0


@pytest.fixture(scope="module")
def exporter() -> Iterator[InMemorySpanExporter]:
    """The process's tracer provider (installed once, as a service's `setup` would) sending to memory."""
    memory = InMemorySpanExporter()
    if tracing.use_global_provider():  # another module installed one first
        trace.get_tracer_provider().add_span_processor(SimpleSpanProcessor(memory))  # type: ignore[attr-defined]
    else:
        assert tracing.setup("rlgate-e2e", exporter=memory)
    yield memory
    memory.shutdown()  # later tests' spans are dropped, not kept


@dataclass
class Request:
    method: str
    path: str
    traceparent: str


@dataclass
class HeaderRecorder:
    """ASGI middleware: each HTTP request's method, path and `traceparent`, then the app."""

    app: Any
    seen: list[Request] = field(default_factory=list)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            headers = dict(scope["headers"])
            self.seen.append(Request(scope["method"], scope["path"], headers.get(b"traceparent", b"").decode()))
        await self.app(scope, receive, send)


@dataclass
class Stack:
    fleet: HeaderRecorder
    orchestrator: OrchestratorHandle
    gateway: GatewayHandle


@pytest.fixture
async def stack(tmp_path: Path, exporter: InMemorySpanExporter) -> AsyncIterator[Stack]:
    port = free_port()
    app = create_app(
        LocalfleetConfig(listen=f"127.0.0.1:{port}", data_dir=str(tmp_path / "localfleet")),
        specs=tiny_environments(),
        tasks=[TASK],
    )
    recorder = HeaderRecorder(app)
    server = uvicorn.Server(
        uvicorn.Config(recorder, host="127.0.0.1", port=port, lifespan="on", ws="none", log_level="warning")
    )
    serving = asyncio.create_task(server.serve())
    store = await SqliteStore.open(str(tmp_path / "store.db"))
    try:
        await wait_until(lambda: server.started, WAIT_S, "localfleet started")
        gateway = await start_gateway(GatewayConfig(listen="127.0.0.1:0"), store)
        try:
            config = OrchestratorConfig(
                listen="127.0.0.1:0",
                provider="fleet",
                fleet_base_url=f"http://127.0.0.1:{port}",
                fleet_api_key="test",
                run_id=f"trace-{uuid.uuid4().hex[:10]}",
                gateway_address=gateway.address,
                verify_timeout_s=30.0,
            )
            orchestrator = await start_orchestrator(config, store)
            try:
                await orchestrator.orchestrator.wait_tasks_loaded()
                exporter.clear()
                recorder.seen.clear()
                yield Stack(recorder, orchestrator, gateway)
            finally:
                await orchestrator.stop(grace=5.0)
        finally:
            await gateway.stop()
    finally:
        await store.close()
        server.should_exit = True
        await serving


@pytest.fixture
def service_logs() -> Iterator[Callable[[], list[dict[str, Any]]]]:
    """The services' log lines (JSON, as `--log-json` writes them) since the test started."""
    root = logging.getLogger()
    level = root.level
    setup_logging("INFO", json_format=True)
    written = io.StringIO()
    for handler in root.handlers:
        if getattr(handler, "_rlgate", False):
            handler.setStream(written)  # type: ignore[attr-defined]

    def lines() -> list[dict[str, Any]]:
        return [json.loads(line) for line in written.getvalue().splitlines()]

    yield lines
    for handler in [h for h in root.handlers if getattr(h, "_rlgate", False)]:
        root.removeHandler(handler)
    root.setLevel(level)


async def _episode(stack: Stack) -> str:
    """One episode through the client (a failing call, a starring call, a final answer); its trace id."""
    async with rlgate.AsyncClient(stack.orchestrator.address) as client:
        async with client.episode(task_key=TASK["key"]) as ep:
            missing = await ep.call_tool("star_note", {"note_id": 999})
            assert missing.result.is_error  # the gateway logs a tool error: a gateway line in the episode
            await ep.call_tool("star_note", {"note_id": 7})
            step = await ep.step(final_answer="starred")
        assert step.done
        return ep.trace_id


def _attrs(span: ReadableSpan) -> dict[str, Any]:
    return dict(span.attributes or {})


def _ancestors(span: ReadableSpan, by_id: dict[int, ReadableSpan]) -> list[str]:
    names = []
    parent = span.parent
    while parent is not None and parent.span_id in by_id:
        up = by_id[parent.span_id]
        names.append(up.name)
        parent = up.parent
    return names


async def test_one_trace_spans_client_orchestrator_gateway_and_upstreams(
    stack: Stack, exporter: InMemorySpanExporter, service_logs: Callable[[], list[dict[str, Any]]]
) -> None:
    trace_hex = await _episode(stack)
    trace_id = int(trace_hex, 16)

    def named(name: str) -> list[ReadableSpan]:
        return [s for s in exporter.get_finished_spans() if s.name == name]

    # Close's instance delete may finish just after Close answers.
    await wait_until(lambda: named("episode") and named("rlgate.release"), WAIT_S, "the episode's last spans")
    spans = exporter.get_finished_spans()
    by_id = {s.context.span_id: s for s in spans}
    (episode,) = named("episode")
    assert episode.parent is None and episode.context.trace_id == trace_id

    # Every RPC of the episode is a SERVER span, a child of the client's episode span, in its trace.
    rpcs = [s for s in spans if s.kind == SpanKind.SERVER and _attrs(s).get("rpc.system") == "grpc"]
    assert sorted(s.name.rsplit("/", 1)[1] for s in rpcs) == ["CallTool", "CallTool", "Close", "Reset", "Step"]
    for rpc in rpcs:
        assert rpc.context.trace_id == trace_id and rpc.parent is not None
        assert rpc.parent.span_id == episode.context.span_id, rpc.name
        assert _attrs(rpc)["rlgate.session_id"]

    # The orchestrator's work and upstream calls hang below their RPC, all in the one trace.
    reset, step, close = (f"rlgate.v1.OrchestratorService/{m}" for m in ("Reset", "Step", "Close"))
    call_tool = "rlgate.v1.ToolGatewayService/CallTool"
    below = {
        "rlgate.provision": {reset},
        "rlgate.instance_reset": {reset},
        "upstream tools/list": {reset, call_tool},  # Reset's tool discovery, the gateway's session catalog
        "rlgate.verify": {step},
        "rlgate.release": {close},
        "upstream tools/call star_note": {call_tool},
        "tools/call star_note": {"upstream tools/call star_note"},  # the upstream's SERVER span, from `_meta`
        "server/discover": {reset, call_tool},  # the upstreams' handshakes (2026-07-28 era)
    }
    for name, ancestors in below.items():
        found = named(name)
        assert found, f"no span {name!r}"
        for span in found:
            assert span.context.trace_id == trace_id, name
            assert ancestors & set(_ancestors(span, by_id)), (name, _ancestors(span, by_id))
    sends = {s.context.span_id for s in named("upstream tools/call star_note")}
    upstream_parents = {s.parent.span_id for s in named("tools/call star_note") if s.parent is not None}
    assert len(sends) == 2 and upstream_parents == sends  # each upstream request parented by `_meta`
    assert all(s.context.trace_id == trace_id for s in spans if s.kind == SpanKind.SERVER)

    # The same trace context reached localfleet as HTTP headers: the MCP requests (parent: the upstream span,
    # as in `_meta`) and Fleet's API (instance create, instance reset).
    traced = [r for r in stack.fleet.seen if r.traceparent]
    assert {r.traceparent.split("-")[1] for r in traced} == {trace_hex}
    mcp_parents = {int(r.traceparent.split("-")[2], 16) for r in traced if r.path.endswith("/mcp")}
    assert sends <= mcp_parents
    assert any(r.method == "POST" and r.path == "/v1/env/instances" for r in traced), stack.fleet.seen
    assert any(r.path.endswith("/api/v1/env/reset") for r in traced), stack.fleet.seen

    # Both services' log lines of the episode carry the trace's id.
    lines = [line for line in service_logs() if line["trace_id"] != "-"]
    assert {line["trace_id"] for line in lines} == {trace_hex}
    loggers = {line["logger"].split(".")[1] for line in lines}
    assert {"orchestrator", "toolgateway"} <= loggers, lines


async def test_tracing_off_still_passes_the_callers_trace_on(
    stack: Stack,
    exporter: InMemorySpanExporter,
    service_logs: Callable[[], list[dict[str, Any]]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A service without a tracer provider makes no span, but the caller's trace still reaches the upstream
    (`_meta` and headers), Fleet, and the log lines."""
    monkeypatch.setattr(tracing, "recording", lambda: False)  # as if no SDK were installed in the services
    trace_hex = await _episode(stack)
    await wait_until(
        lambda: any(s.name == "episode" for s in exporter.get_finished_spans()), WAIT_S, "the episode span"
    )
    spans = exporter.get_finished_spans()
    assert not [s for s in spans if s.name.startswith("rlgate.")]  # no service span
    upstream = [s for s in spans if s.name == "tools/call star_note"]  # the upstream's own SERVER spans
    assert len(upstream) == 2 and {s.context.trace_id for s in upstream} == {int(trace_hex, 16)}
    traced = [r for r in stack.fleet.seen if r.traceparent]
    assert {r.traceparent.split("-")[1] for r in traced} == {trace_hex}
    assert any(r.path == "/v1/env/instances" for r in traced) and any(r.path.endswith("/mcp") for r in traced)
    lines = [line for line in service_logs() if line["trace_id"] != "-"]
    assert lines and {line["trace_id"] for line in lines} == {trace_hex}


async def test_a_caller_with_only_x_rlgate_trace_id_keeps_it(stack: Stack, exporter: InMemorySpanExporter) -> None:
    """A hex `x-rlgate-trace-id` becomes the trace id of the services' spans (a caller without OpenTelemetry,
    such as grpcurl, still finds its calls' trace); any other text is kept as an attribute."""
    hex_id, text_id = uuid.uuid4().hex, "run-42 step 3"
    async with grpc.aio.insecure_channel(stack.orchestrator.address) as channel:
        stub = orchestrator_pb2_grpc.OrchestratorServiceStub(channel)
        for trace_header in (hex_id, text_id):
            await stub.ListTasks(
                orchestrator_pb2.ListTasksRequest(), metadata=[("x-rlgate-trace-id", trace_header)], timeout=10
            )
    calls = [s for s in exporter.get_finished_spans() if s.name == "rlgate.v1.OrchestratorService/ListTasks"]
    assert [_attrs(s)["rlgate.trace_id"] for s in calls] == [hex_id, text_id]
    assert calls[0].context.trace_id == int(hex_id, 16) and calls[0].parent is None
    assert calls[1].context.trace_id != int(hex_id, 16) and calls[1].parent is None


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace receiver keeping what it is sent."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, Any]] = []  # (service.name, span)
        self.received = asyncio.Event()

    async def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: grpc.aio.ServicerContext
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        for resource_spans in request.resource_spans:
            attributes = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                self.spans.extend((attributes.get("service.name", ""), span) for span in scope_spans.spans)
        self.received.set()
        return trace_service_pb2.ExportTraceServiceResponse()


async def test_a_service_exports_its_spans_over_otlp(tmp_path: Path) -> None:
    """`rlgate toolgateway --otlp-endpoint` (a process of its own) sends its spans to an OTLP collector,
    continuing the caller's trace."""
    collector = Collector()
    receiver = grpc.aio.server()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, receiver)
    otlp_port = receiver.add_insecure_port("127.0.0.1:0")
    await receiver.start()
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env["OTEL_BSP_SCHEDULE_DELAY"] = "50"  # export within 50 ms, not 5 s
    gateway = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "rlgate.cli", "toolgateway", "--listen", f"127.0.0.1:{port}",
        "--data-dir", str(tmp_path), "--drain-s", "0", "--otlp-endpoint", f"http://127.0.0.1:{otlp_port}",
        env=env, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    trace_hex, parent_hex = uuid.uuid4().hex, uuid.uuid4().hex[:16]
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            await asyncio.wait_for(channel.channel_ready(), WAIT_S)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await toolgateway_pb2_grpc.ToolGatewayServiceStub(channel).ListTools(
                    toolgateway_pb2.ListToolsRequest(),
                    metadata=[("traceparent", f"00-{trace_hex}-{parent_hex}-01")],
                    timeout=10,
                )
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED  # no agent token: a span all the same
        await asyncio.wait_for(collector.received.wait(), WAIT_S)
    finally:
        gateway.terminate()
        await gateway.wait()
        await receiver.stop(0)
    (service, span), *_ = collector.spans
    assert service == "rlgate-toolgateway" and span.name == "rlgate.v1.ToolGatewayService/ListTools"
    assert (span.trace_id.hex(), span.parent_span_id.hex()) == (trace_hex, parent_hex)


def test_traceparent_parsing() -> None:
    good = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    ctx = tracing.parse_traceparent(good, "vendor=abc")
    assert ctx is not None and ctx.is_remote and ctx.trace_flags.sampled
    assert f"{ctx.trace_id:032x}" == "4bf92f3577b34da6a3ce929d0e0e4736" and ctx.trace_state.get("vendor") == "abc"
    future = "cc-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-later"  # a later version's extra field
    assert tracing.parse_traceparent(future) is not None
    for bad in (
        "00-00000000000000000000000000000000-00f067aa0ba902b7-01",  # all-zero trace id
        "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",  # all-zero parent id
        "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",  # version ff
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-x",  # version 00 has no more fields
        "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",  # upper case
        "garbage",
    ):
        assert tracing.parse_traceparent(bad) is None, bad


def test_setup_without_an_endpoint_installs_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_SDK_DISABLED"):
        monkeypatch.delenv(name, raising=False)
    assert tracing.otlp_endpoint("") == ""
    assert tracing.otlp_endpoint("", {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317"}) == "http://c:4317"
    assert tracing.otlp_endpoint("http://mine:4317", {"OTEL_SDK_DISABLED": "true"}) == ""
    assert tracing.setup("rlgate-test", "") is False
