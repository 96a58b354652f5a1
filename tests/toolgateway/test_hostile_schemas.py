"""Hostile tool lists and results through the in-process gateway: `$ref` cycles, dangling and remote refs,
schemas too deep, too large or too slow to check, names no caller could send, ten thousand tools, deeply
nested structured content and a multi-megabyte JSON-RPC error message.

Every call ends with a status the caller can act on or an `is_error` result (never INTERNAL), a tool that
cannot be served is left out of the list with one logged warning, and the event loop keeps turning: the
upstream's replies are encoded before each measurement, so the loop's longest stall is the gateway's own.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import re
import threading
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import grpc
import mcp_types as mt
import pytest
import uvicorn

from rlgate.mcpclient import catalog
from rlgate.mcpclient.catalog import MAX_TOOL_BYTES, MAX_TOOLS, list_all_tools, union_tools
from rlgate.mcpclient.discovery import discover_tools
from rlgate.mcpclient.errors import UpstreamUnavailable
from rlgate.mcpclient.transport import MAX_PAGE_BYTES
from rlgate.store import SessionStore, call_scope
from rlgate.toolgateway import arguments
from rlgate.toolgateway.server import GatewayHandle, start_gateway
from rlgate.v1 import common_pb2, toolgateway_pb2, toolgateway_pb2_grpc
from tests.support.ports import free_port
from tests.toolgateway.conftest import AgentSession, byo_session, gateway_config
from tests.toolgateway.http_server import read_body

Kind = common_pb2.ToolErrorKind
MODERN, LEGACY = "2026-07-28", "2025-11-25"
OUTPUT_LIMIT = 4096
HANG = "@hang@"  # an Upstream result that never comes
ECHO = {
    "name": "echo",
    "description": "Echo.",
    "inputSchema": {"type": "object", "properties": {"text": {"type": "string"}}},
}


def deep_schema_text(depth: int) -> str:
    return '{"type": "object", "properties": {"a": ' * depth + '{"type": "string"}' + "}}" * depth


def deep_value_text(depth: int) -> str:
    return '{"a": ' * depth + '{"leaf": true}' + "}" * depth


def exponential_schema(levels: int) -> dict[str, Any]:
    """No cycle, but every level refers to the next twice in an anyOf: checking a value visits 2^levels
    subschemas (a schema of a few hundred bytes that keeps a validator busy for hours)."""
    defs: dict[str, dict[str, Any]] = {
        f"d{i}": {"anyOf": [{"$ref": f"#/$defs/d{i + 1}"}, {"$ref": f"#/$defs/d{i + 1}"}]} for i in range(levels)
    }
    defs[f"d{levels}"] = {"type": "string"}
    return {"type": "object", "$defs": defs, "properties": {"x": {"$ref": "#/$defs/d0"}}}


def big_schema(size: int) -> dict[str, Any]:
    """An object schema of about `size` bytes of compact JSON text."""
    unit = len('"p0000000":{"type":"string","description":""},') + 40
    props = {f"p{i:07d}": {"type": "string", "description": "x" * 40} for i in range(size // unit + 1)}
    return {"type": "object", "properties": props}


# -- a raw MCP upstream (both eras) whose replies are JSON text made in advance --------------------------
@dataclass
class Upstream:
    tools: list[dict[str, Any]]
    results: dict[str, str] = field(default_factory=dict)  # tool -> the JSON text of its reply's result or error
    placeholders: dict[str, str] = field(default_factory=dict)  # '"@x@"' in a listing -> JSON text
    calls: list[str] = field(default_factory=list)
    other_paths: list[str] = field(default_factory=list)  # requests to anything but /{era}/mcp
    sessions: set[str] = field(default_factory=set)
    sse: bool = False  # results as one server-sent event (as SDK servers answer by default)
    delete_status: int = 200  # the answer to a legacy session's DELETE (404: the server forgot it)
    listings: int = 0  # tools/list requests answered
    list_error: str = ""  # a JSON-RPC error (JSON text) answering every tools/list instead
    handshake_error: str = ""  # a JSON-RPC error answering server/discover and initialize instead

    def __post_init__(self) -> None:
        listing = json.dumps({"tools": self.tools}, separators=(",", ":"))
        for placeholder, text in self.placeholders.items():
            listing = listing.replace(placeholder, text)
        self.listing = listing[1:-1]  # the result's members; the era's extras are added per reply

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        era = scope["path"].strip("/").split("/")[0]
        if scope["path"] not in ("/modern/mcp", "/legacy/mcp"):
            self.other_paths.append(scope["path"])
            return await self._raw(send, 404, "{}")
        if scope["method"] == "DELETE":
            return await self._raw(send, self.delete_status, "")
        if scope["method"] != "POST":
            return await self._raw(send, 405, "")
        body = await read_body(receive)
        request = json.loads(body)
        if "id" not in request:
            return await self._raw(send, 202, "")
        rid, method = json.dumps(request["id"]), request["method"]
        headers = {k.decode().lower(): v.decode() for k, v in scope["headers"]}
        sid = [(b"mcp-session-id", headers["mcp-session-id"].encode())] if "mcp-session-id" in headers else []
        extras = ', "resultType": "complete"' if era == "modern" else ""
        if self.handshake_error and method in ("server/discover", "initialize"):
            return await self._raw(send, 200, f'{{"jsonrpc": "2.0", "id": {rid}, "error": {self.handshake_error}}}')
        if method == "server/discover":
            if era == "legacy":
                return await self._raw(send, 400, '{"jsonrpc": "2.0", "id": null, "error": {"code": -32600, '
                                       '"message": "unsupported protocol version"}}')  # fmt: skip
            result = {"supportedVersions": [MODERN], "capabilities": {"tools": {"listChanged": False}},
                      "resultType": "complete", "ttlMs": 0, "cacheScope": "private"}  # fmt: skip
            return await self._reply(send, rid, json.dumps(result))
        if method == "initialize":
            sid = [(b"mcp-session-id", f"s{len(self.sessions)}".encode())]
            self.sessions.add(sid[0][1].decode())
            result = {"protocolVersion": LEGACY, "capabilities": {"tools": {"listChanged": False}},
                      "serverInfo": {"name": "hostile-schemas", "version": "1"}}  # fmt: skip
            return await self._reply(send, rid, json.dumps(result), sid)
        if method == "tools/list":
            self.listings += 1
            if self.list_error:
                return await self._raw(send, 200, f'{{"jsonrpc": "2.0", "id": {rid}, "error": {self.list_error}}}', sid)
            cache = ', "ttlMs": 0, "cacheScope": "private"' if era == "modern" else ""
            return await self._reply(send, rid, "{" + self.listing + extras + cache + "}", sid)
        if method == "tools/call":
            name = request["params"]["name"]
            self.calls.append(name)
            reply = self.results.get(name, '{"content": [{"type": "text", "text": "ok"}], "isError": false}')
            if reply == HANG:  # answers only once the caller is gone
                while (await receive())["type"] != "http.disconnect":
                    pass
                return
            if reply.startswith('{"code"'):  # a JSON-RPC error
                return await self._raw(send, 200, f'{{"jsonrpc": "2.0", "id": {rid}, "error": {reply}}}', sid)
            return await self._reply(send, rid, reply[:-1] + extras + "}", sid)
        return await self._raw(send, 200, f'{{"jsonrpc": "2.0", "id": {rid}, "error": {{"code": -32601, '
                               f'"message": "no such method"}}}}', sid)  # fmt: skip

    async def _reply(self, send: Any, rid: str, result: str, extra: list[tuple[bytes, bytes]] | None = None) -> None:
        body = f'{{"jsonrpc": "2.0", "id": {rid}, "result": {result}}}'
        if self.sse:
            return await self._raw(send, 200, f"event: message\ndata: {body}\n\n", extra, "text/event-stream")
        await self._raw(send, 200, body, extra)

    @staticmethod
    async def _raw(
        send: Any,
        status: int,
        body: str,
        extra: list[tuple[bytes, bytes]] | None = None,
        kind: str = "application/json",
    ) -> None:
        data = body.encode()
        headers = [(b"content-type", kind.encode()), (b"content-length", str(len(data)).encode()), *(extra or [])]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": data})


@contextlib.asynccontextmanager
async def serving(upstream: Upstream) -> AsyncIterator[str]:
    """`upstream` on a loopback port in this loop; yields its base URL."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(upstream, host="127.0.0.1", port=port, log_level="warning", lifespan="on"))
    task = asyncio.create_task(server.serve())
    try:
        for _ in range(500):  # uvicorn offers no started event: poll, bounded
            if server.started or task.done():
                break
            await asyncio.sleep(0.02)
        if not server.started:
            task.result() if task.done() else None
            raise TimeoutError("uvicorn did not start")
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 10)


class Stalls:
    """The event loop's longest stall while the block runs (a 1 ms sleep that comes back late): `longest`
    in wall time, and `longest_cpu`, the CPU time the loop's thread itself spent in the worst gap (what ran
    on the loop: `time.thread_time`).

    Assertions bound `longest_cpu`: on a loaded machine the loop also comes back late when the OS runs
    something else or a worker thread holds the GIL, which costs the loop's thread no CPU and is not work
    done on the loop; work done on the loop (the regressions these tests guard against) is CPU of its thread
    however loaded the machine. The test process's heap is frozen meanwhile: after a thousand tests, a full
    garbage collection of what they left behind stalls any loop for seconds, and that is not the code under
    test."""

    def __init__(self) -> None:
        self.longest = 0.0
        self.longest_cpu = 0.0
        self._task: asyncio.Task[None] | None = None

    async def _watch(self) -> None:
        while True:
            start, cpu = time.perf_counter(), time.thread_time()
            await asyncio.sleep(0.001)
            self.longest = max(self.longest, time.perf_counter() - start - 0.001)
            self.longest_cpu = max(self.longest_cpu, time.thread_time() - cpu)

    def __repr__(self) -> str:
        return f"Stalls(longest_cpu={self.longest_cpu:.3f}s, longest={self.longest:.3f}s wall)"

    async def __aenter__(self) -> Stalls:
        gc.collect()
        gc.freeze()
        self._task = asyncio.create_task(self._watch())
        await asyncio.sleep(0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        gc.unfreeze()


@pytest.fixture
async def gateway(store: SessionStore) -> AsyncIterator[GatewayHandle]:
    handle = await start_gateway(gateway_config(max_output_bytes=OUTPUT_LIMIT), store)
    yield handle
    await handle.stop(grace=0)


@pytest.fixture
async def stub(gateway: GatewayHandle) -> AsyncIterator[toolgateway_pb2_grpc.ToolGatewayServiceStub]:
    options = [("grpc.max_receive_message_length", 64 << 20)]
    async with grpc.aio.insecure_channel(gateway.address, options=options) as channel:
        yield toolgateway_pb2_grpc.ToolGatewayServiceStub(channel)


@pytest.fixture(params=["modern", "legacy"])
def era(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(params=["json", "sse"])
def framing(request: pytest.FixtureRequest) -> str:
    return str(request.param)


Call = Callable[..., Coroutine[Any, Any, toolgateway_pb2.CallToolResponse]]


def caller(stub: toolgateway_pb2_grpc.ToolGatewayServiceStub, s: AgentSession) -> Call:
    async def call(name: str, args: str = "{}", deadline_s: float = 20.0) -> toolgateway_pb2.CallToolResponse:
        request = toolgateway_pb2.CallToolRequest(name=name, arguments_json=args)
        response: toolgateway_pb2.CallToolResponse = await stub.CallTool(
            request, metadata=s.metadata, timeout=deadline_s
        )
        return response

    return call


def left_out_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "left out" in r.getMessage()]


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts with no left-out listing warned about (the catalog warns once per process)."""
    monkeypatch.setattr(catalog, "_warned", type(catalog._warned)())


# -- schemas --------------------------------------------------------------------------------------------
async def test_ref_cycles_dangling_and_remote_refs_are_is_error_results(
    stub: toolgateway_pb2_grpc.ToolGatewayServiceStub, store: SessionStore, era: str
) -> None:
    """A `$ref` loop (two steps, or a ref to itself) would recurse without end, a dangling ref raises, and
    a remote ref would make the gateway fetch a URL the upstream chose: each call is a TOOL_FAILED result
    (the tool not called), never INTERNAL; a recursive schema that ends with the value (`$ref: "#"`) works."""
    upstream = Upstream([ECHO])
    async with serving(upstream) as base:
        remote = f"{base}/remote-schema.json"  # a fetch would show up in `other_paths`
        upstream.tools += [
            {"name": "self_ref", "inputSchema": {"type": "object", "properties": {"child": {"$ref": "#"}}}},
            {"name": "ref_loop", "inputSchema": {"type": "object", "$defs": {"a": {"$ref": "#/$defs/b"},
             "b": {"$ref": "#/$defs/a"}}, "properties": {"x": {"$ref": "#/$defs/a"}}}},
            {"name": "ref_itself", "inputSchema": {"type": "object", "$defs": {"me": {"$ref": "#/$defs/me"}},
             "allOf": [{"$ref": "#/$defs/me"}]}},
            {"name": "ref_nowhere", "inputSchema": {"type": "object", "properties": {"x": {"$ref": "#/$defs/no"}}}},
            {"name": "ref_remote", "inputSchema": {"type": "object", "properties": {"x": {"$ref": remote}}}},
        ]  # fmt: skip
        upstream.__post_init__()
        s = await byo_session(store, [f"{base}/{era}/mcp"])
        call = caller(stub, s)
        listed = await stub.ListTools(toolgateway_pb2.ListToolsRequest(), metadata=s.metadata, timeout=20)
        assert [t.name for t in listed.tools] == ["echo", "self_ref", "ref_loop", "ref_itself", "ref_nowhere",
                                                  "ref_remote"]  # fmt: skip
        ok = await call("self_ref", json.dumps({"child": {"child": {"child": {}}}}))
        assert not ok.result.is_error, ok.result.error_message
        for name, args, why in [
            ("ref_loop", '{"x": 1}', "refers to itself"),
            ("ref_itself", "{}", "refers to itself"),
            ("ref_nowhere", '{"x": 1}', "cannot be resolved"),
            ("ref_remote", '{"x": 1}', "cannot be resolved"),
        ]:
            result = (await call(name, args)).result
            assert result.is_error and result.error_kind == Kind.TOOL_ERROR_KIND_TOOL_FAILED, (name, result)
            assert why in result.error_message and "was not called" in result.error_message, result.error_message
        assert upstream.calls == ["self_ref"]
        assert upstream.other_paths == []  # the remote schema was never fetched
        assert not (await call("echo", '{"text": "after"}')).result.is_error


async def test_a_schema_too_slow_to_check_is_bounded_and_the_loop_keeps_turning(
    stub: toolgateway_pb2_grpc.ToolGatewayServiceStub, store: SessionStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A few hundred bytes of schema whose check takes hours: the call is a TOOL_FAILED result within the
    check's time bound, the loop never stalls on it, and other calls are served meanwhile."""
    monkeypatch.setattr(arguments, "CHECK_TIMEOUT_S", 1.0)
    upstream = Upstream([ECHO, {"name": "slow", "inputSchema": exponential_schema(40)}])
    async with serving(upstream) as base:
        s = await byo_session(store, [f"{base}/modern/mcp"])
        call = caller(stub, s)
        assert not (await call("echo", '{"text": "warm"}')).result.is_error
        async with Stalls() as stalls:
            started = time.monotonic()
            slow = asyncio.create_task(call("slow", '{"x": 1}'))
            meanwhile = [await call("echo", '{"text": "meanwhile"}') for _ in range(5)]
            result = (await slow).result
            elapsed = time.monotonic() - started
        assert result.is_error and result.error_kind == Kind.TOOL_ERROR_KIND_TOOL_FAILED, result
        assert "took longer than" in result.error_message and "was not called" in result.error_message
        # Bounded by the check's 1 s, not the hours the check would take (nor the call's 20 s deadline);
        # the rest is room for a loaded machine.
        assert elapsed < 1.0 + 9.0, elapsed
        assert all(not r.result.is_error for r in meanwhile)
        # The check runs on a worker thread: the loop's thread spends no second of CPU on it.
        assert stalls.longest_cpu < 1.0, stalls
        again = (await call("slow", '{"x": 1}')).result  # known to be too slow: answered without a new check
        assert again.is_error and "took longer than" in again.error_message
        assert upstream.calls.count("slow") == 0


async def test_tools_that_cannot_be_served_are_left_out_with_one_warning(
    stub: toolgateway_pb2_grpc.ToolGatewayServiceStub,
    store: SessionStore,
    caplog: pytest.LogCaptureFixture,
    era: str,
) -> None:
    """Nested past the JSON text bound, larger than MAX_TOOL_BYTES, or a name CallTool would refuse: left out
    of ListTools with one warning naming them, and a call of one is an UNKNOWN_TOOL result saying why."""
    tools: list[dict[str, Any]] = [
        ECHO,
        {"name": "deepish", "inputSchema": "@deepish@"},
        {"name": "big", "inputSchema": big_schema(MAX_TOOL_BYTES + 1000)},
        {"name": "bad name\nWARNING forged", "inputSchema": {"type": "object"}},
        {"name": "n" * 129, "inputSchema": {"type": "object"}},
        {"name": "after", "inputSchema": {"type": "object"}},
    ]
    upstream = Upstream(tools, placeholders={'"@deepish@"': deep_schema_text(40)})
    async with serving(upstream) as base:
        sessions = [await byo_session(store, [f"{base}/{era}/mcp"]) for _ in range(3)]
        with caplog.at_level(logging.INFO):
            for s in sessions:  # three sessions list the same tools: one warning
                listed = await stub.ListTools(toolgateway_pb2.ListToolsRequest(), metadata=s.metadata, timeout=20)
                assert [t.name for t in listed.tools] == ["echo", "after"]
        warnings = left_out_warnings(caplog)
        assert len(warnings) == 1, warnings
        assert "'deepish'" in warnings[0] and "'big'" in warnings[0] and len(warnings[0]) < 2000, warnings
        call = caller(stub, sessions[0])
        for name, why in [("deepish", "nested deeper"), ("big", f"larger than {MAX_TOOL_BYTES}")]:
            result = (await call(name)).result
            assert result.error_kind == Kind.TOOL_ERROR_KIND_UNKNOWN_TOOL and why in result.error_message, result
        assert upstream.calls == []


# -- large lists: bounds and the loop ----------------------------------------------------------------------
def many_tools(n: int) -> list[dict[str, Any]]:
    return [
        {"name": f"tool_{i:06d}", "description": f"Tool number {i}.",
         "inputSchema": {"type": "object", "properties": {"n": {"type": "integer", "minimum": i}}}}
        for i in range(n)
    ]  # fmt: skip


async def test_ten_thousand_tools_are_listed_and_listed_again_without_stalling_the_loop(
    stub: toolgateway_pb2_grpc.ToolGatewayServiceStub, store: SessionStore, caplog: pytest.LogCaptureFixture
) -> None:
    """MAX_TOOLS tools are served, the ones past it left out with a warning, and each tool's spec is made
    once: a ListTools answered from the catalog stalls the loop briefly (it used to rebuild every spec on the
    loop, a stall that grew with the tool count). The first listing's stall is mostly the mcp SDK's (parsing
    the reply and walking every schema for x-mcp-header positions, on the loop): not bounded here."""
    upstream = Upstream(many_tools(MAX_TOOLS + 50))
    async with serving(upstream) as base:
        s = await byo_session(store, [f"{base}/modern/mcp"])
        with caplog.at_level(logging.INFO):
            listed = await stub.ListTools(toolgateway_pb2.ListToolsRequest(), metadata=s.metadata, timeout=60)
            async with Stalls() as again:
                relisted = await stub.ListTools(toolgateway_pb2.ListToolsRequest(), metadata=s.metadata, timeout=60)
        assert len(listed.tools) == MAX_TOOLS and listed.tools[-1].name == f"tool_{MAX_TOOLS - 1:06d}"
        assert relisted == listed
        warnings = left_out_warnings(caplog)
        assert len(warnings) == 1 and f"past {MAX_TOOLS} tools" in warnings[0], warnings
        result = (await caller(stub, s)(f"tool_{MAX_TOOLS - 1:06d}", '{"n": 1}')).result
        assert result.error_kind == Kind.TOOL_ERROR_KIND_INVALID_ARGUMENTS, result  # its schema is checked
        past = (await caller(stub, s)(f"tool_{MAX_TOOLS:06d}", '{"n": 1}')).result
        assert past.error_kind == Kind.TOOL_ERROR_KIND_UNKNOWN_TOOL and "left out" in past.error_message, past
        assert again.longest_cpu < 0.12, again


class PagedClient:
    """Stands in for an entered `mcp.Client`: tools/list pages already parsed (no SDK work on the loop)."""

    def __init__(self, pages: list[list[mt.Tool]]) -> None:
        self.pages = pages
        self.asked = 0

    async def list_tools(self, *, cursor: str | None, cache_mode: str) -> mt.ListToolsResult:
        index = int(cursor or 0)
        self.asked += 1
        more = str(index + 1) if index + 1 < len(self.pages) else None
        return mt.ListToolsResult.model_construct(tools=self.pages[index], next_cursor=more)  # parsed already


async def test_specs_are_made_off_the_loop_and_listings_are_bounded(caplog: pytest.LogCaptureFixture) -> None:
    """Listing a 6.9 MB schema and 5,000 tools: the specs (JSON text of every schema) are made on a worker
    thread, so the loop never stalls on them (the 6.9 MB schema's text alone stalled it for seconds); the big
    tool is left out, the union costs a lookup per tool, and a paginator that never ends is cut."""
    huge = mt.Tool(name="huge", input_schema=big_schema(6_900_000))
    small = [mt.Tool.model_validate(t) for t in many_tools(5_000)]
    client = PagedClient([[huge, *small[:2_500]], small[2_500:]])
    with caplog.at_level(logging.INFO):
        async with Stalls() as stalls:
            tools = await list_all_tools(client)  # type: ignore[arg-type]
            union = union_tools([("http://up/mcp", tools)])
    assert len(tools) == 5_000 and [t.name for t in union.tools[:1]] == ["tool_000000"]
    assert "larger than" in union.left_out["huge"] and union.tools[-1].spec().endpoint == "http://up/mcp"
    assert len(left_out_warnings(caplog)) == 1
    assert stalls.longest_cpu < 0.5, stalls  # the schema's JSON text on the loop took seconds

    endless = PagedClient([[small[0]]] * 1_000)
    assert len(await list_all_tools(endless)) == catalog.MAX_PAGES == endless.asked  # type: ignore[arg-type]


async def test_a_large_schema_is_checked_off_the_loop(
    stub: toolgateway_pb2_grpc.ToolGatewayServiceStub, store: SessionStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A schema just under MAX_TOOL_BYTES is listed and its arguments checked, on a worker thread: the loop
    keeps turning (compiling it on the loop stalled it for over a second; a 6.9 MB one for far longer).

    What is measured here is where the check runs, not how long it takes: its time bound is set far above
    what compiling this schema costs even on a loaded machine, so the check never races it (the bound is
    test_a_schema_too_slow_to_check_is_bounded_and_the_loop_keeps_turning's, with a schema that really
    exceeds a small one)."""
    monkeypatch.setattr(arguments, "CHECK_TIMEOUT_S", 60.0)
    schema = big_schema(MAX_TOOL_BYTES - 20_000)
    upstream = Upstream([ECHO, {"name": "wide", "inputSchema": schema}])
    async with serving(upstream) as base:
        s = await byo_session(store, [f"{base}/modern/mcp"])
        call = caller(stub, s)
        assert not (await call("echo", '{"text": "warm"}')).result.is_error
        async with Stalls() as stalls:
            bad = (await call("wide", '{"p0000001": 5}', deadline_s=120)).result
            good = (await call("wide", '{"p0000001": "five"}', deadline_s=120)).result
        assert bad.error_kind == Kind.TOOL_ERROR_KIND_INVALID_ARGUMENTS and "$.p0000001" in bad.error_message, bad
        assert len(bad.error_message) < 10_000  # the expected shape names 50 properties, not 4,000
        assert not good.is_error and upstream.calls == ["echo", "wide"]
        assert stalls.longest_cpu < 0.5, stalls


async def test_a_multi_megabyte_schema_is_left_out(
    stub: toolgateway_pb2_grpc.ToolGatewayServiceStub, store: SessionStore
) -> None:
    """A 1.5 MB input schema (past the per-tool bound, inside the page bound) through the gateway: left out
    of the list, and a call of it is an UNKNOWN_TOOL result saying why (a 6.9 MB one was compiled on the loop,
    which stalled it for most of a minute). A page past the page bound is the next test's."""
    upstream = Upstream([ECHO, {"name": "huge", "inputSchema": big_schema(1_500_000)}])
    async with serving(upstream) as base:
        s = await byo_session(store, [f"{base}/modern/mcp"])
        listed = await stub.ListTools(toolgateway_pb2.ListToolsRequest(), metadata=s.metadata, timeout=60)
        results = [(await caller(stub, s)("huge", "{}", deadline_s=60)).result for _ in range(2)]
    assert [t.name for t in listed.tools] == ["echo"]
    assert all(r.error_kind == Kind.TOOL_ERROR_KIND_UNKNOWN_TOOL and "left out" in r.error_message for r in results)
    assert upstream.listings == 1  # a left-out name does not make the gateway list it again


async def test_a_listing_page_past_its_bound_is_unavailable_naming_it(
    stub: toolgateway_pb2_grpc.ToolGatewayServiceStub, store: SessionStore
) -> None:
    """A 6.9 MB schema makes its tools/list page larger than MAX_PAGE_BYTES: the page is refused unread
    (parsing it on the loop would stall every session), and ListTools is UNAVAILABLE saying so."""
    upstream = Upstream([ECHO, {"name": "huge", "inputSchema": big_schema(6_900_000)}])
    async with serving(upstream) as base:
        s = await byo_session(store, [f"{base}/modern/mcp"])
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.ListTools(toolgateway_pb2.ListToolsRequest(), metadata=s.metadata, timeout=60)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value.details()
    assert str(MAX_PAGE_BYTES) in (err.value.details() or ""), err.value.details()


# -- results ----------------------------------------------------------------------------------------------
async def test_deeply_nested_structured_content_is_never_internal(
    stub: toolgateway_pb2_grpc.ToolGatewayServiceStub, store: SessionStore, era: str, framing: str
) -> None:
    """structuredContent nested 10,000 deep (past the SDK's JSON parser) and 100 deep (past rlgate's JSON
    text bound): a result, never INTERNAL; the shallow one keeps its text content."""
    deep = '{"content": [{"type": "text", "text": "deep"}], "structuredContent": %s, "isError": false}'
    upstream = Upstream(
        [
            ECHO,
            {"name": "deep", "inputSchema": {"type": "object"}},
            {"name": "deepish", "inputSchema": {"type": "object"}},
        ],
        results={"deep": deep % deep_value_text(100_000), "deepish": deep % deep_value_text(150)},
        sse=framing == "sse",
    )
    async with serving(upstream) as base:
        s = await byo_session(store, [f"{base}/{era}/mcp"])
        call = caller(stub, s)
        very = (await call("deep")).result
        assert very.is_error and very.error_kind == Kind.TOOL_ERROR_KIND_TOOL_FAILED, very
        nested = (await call("deepish")).result
        assert nested.structured_content_json == "" and nested.content[0].text.text == "deep", nested
        assert "structured content omitted" in nested.content[-1].text.text
        assert not (await call("echo", '{"text": "after"}')).result.is_error


async def test_a_huge_json_rpc_error_message_is_cut_to_the_output_limit_once(
    stub: toolgateway_pb2_grpc.ToolGatewayServiceStub, store: SessionStore
) -> None:
    """A 4 MiB JSON-RPC error message (under the 8 MiB reply limit, so it reaches the gateway whole): the
    result carries it once, cut to the output limit, plus a short error_message."""
    message = "E" * 1000 + "\nWARNING forged line\n" + "e" * (4 << 20)
    upstream = Upstream([ECHO], results={"echo": json.dumps({"code": -32603, "message": message})})
    async with serving(upstream) as base:
        s = await byo_session(store, [f"{base}/modern/mcp"])
        result = (await caller(stub, s)("echo", '{"text": "x"}')).result
    assert result.is_error and result.error_kind == Kind.TOOL_ERROR_KIND_TOOL_FAILED
    assert "JSON-RPC error -32603" in result.error_message and "E" * 100 in result.content[0].text.text
    assert "output truncated by rlgate" in result.content[0].text.text
    assert result.ByteSize() < OUTPUT_LIMIT + 1500, result.ByteSize()


# -- logs and upstream errors ---------------------------------------------------------------------------------
async def test_a_deadline_exceeded_call_leaves_one_log_line(
    stub: toolgateway_pb2_grpc.ToolGatewayServiceStub, store: SessionStore, caplog: pytest.LogCaptureFixture
) -> None:
    """A call whose upstream outlives the caller's deadline: DEADLINE_EXCEEDED, and one gateway log line
    naming the tool, the session and the time taken (there was none)."""
    upstream = Upstream([ECHO, {"name": "hang", "inputSchema": {"type": "object"}}], results={"hang": HANG})
    async with serving(upstream) as base:
        s = await byo_session(store, [f"{base}/modern/mcp"])
        call = caller(stub, s)
        assert not (await call("echo", '{"text": "warm"}')).result.is_error
        service_log = logging.getLogger("rlgate.toolgateway.calls")
        loop, logged = asyncio.get_running_loop(), asyncio.Event()

        class Seen(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                if "hang" in record.getMessage():
                    loop.call_soon_threadsafe(logged.set)

        seen = Seen()
        service_log.addHandler(seen)
        try:
            with caplog.at_level(logging.INFO, logger=service_log.name):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await call("hang", "{}", deadline_s=1.0)
                assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                # The server's line may come just after the caller's status (gRPC cancels the handler then).
                await asyncio.wait_for(logged.wait(), 10)
                await asyncio.sleep(0.2)  # and no second line follows
        finally:
            service_log.removeHandler(seen)

    def lines() -> list[logging.LogRecord]:
        return [r for r in caplog.records if r.name == service_log.name and "hang" in r.getMessage()]

    [line] = lines()
    assert line.levelno == logging.WARNING and s.session.session_id in line.getMessage()
    took = float(re.search(r"deadline exceeded after ([0-9.]+)s", line.getMessage())[1])  # type: ignore[index]
    assert 0.7 < took < 5, line.getMessage()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], [r.getMessage() for r in caplog.records]


async def test_closing_a_session_the_server_forgot_is_no_warning(
    gateway: GatewayHandle, stub: toolgateway_pb2_grpc.ToolGatewayServiceStub, store: SessionStore,
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    """A legacy-era session whose server already forgot it answers the closing DELETE with 404: expected
    (its instance went first), so a debug line, not the SDK's warning for every closed session."""
    upstream = Upstream([ECHO], delete_status=404)
    async with serving(upstream) as base:
        s = await byo_session(store, [f"{base}/legacy/mcp"])
        assert not (await caller(stub, s)("echo", '{"text": "x"}')).result.is_error
        # setup_logging (run by other tests in this process) sets the SDK's loggers to WARNING: name it too.
        with caplog.at_level(logging.DEBUG), caplog.at_level(logging.DEBUG, logger="mcp.client.streamable_http"):
            await gateway.pool.close_session(s.session.session_id)
    termination = [r for r in caplog.records if "Session termination failed" in r.getMessage()]
    assert termination and all(r.levelno == logging.DEBUG for r in termination), termination


async def test_discovery_errors_are_clipped() -> None:
    """An upstream answering its handshake or tools/list with a 4 MiB JSON-RPC error: discovery's
    UpstreamUnavailable (echoed by the orchestrator's UNAVAILABLE and logged) stays short (it carried the
    whole message from a failed handshake)."""
    error = json.dumps({"code": -32603, "message": "x" * (4 << 20)})
    for upstream in (Upstream([ECHO], handshake_error=error), Upstream([ECHO], list_error=error)):
        async with serving(upstream) as base:
            with pytest.raises(UpstreamUnavailable) as err:
                await discover_tools([f"{base}/modern/mcp"], timeout=20)
        assert len(str(err.value)) <= 1100, len(str(err.value))


# -- what an agent sends --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "request_",
    [
        toolgateway_pb2.CallToolRequest(name="n" * 15_000_000, arguments_json="{}", request_id="r1"),
        toolgateway_pb2.CallToolRequest(name="echo\nWARNING forged" + "x" * 1000, arguments_json="{}"),
        toolgateway_pb2.CallToolRequest(name="echo", arguments_json="{}", request_id="r" * 15_000_000),
        toolgateway_pb2.CallToolRequest(name="echo", arguments_json='{"text": "' + "x" * (2 << 20) + '"}'),
    ],
    ids=["15 MB name", "forged name", "15 MB request_id", "2 MiB arguments"],
)
async def test_an_agents_oversized_strings_are_refused_short_and_never_kept(
    stub: toolgateway_pb2_grpc.ToolGatewayServiceStub,
    store: SessionStore,
    caplog: pytest.LogCaptureFixture,
    request_: toolgateway_pb2.CallToolRequest,
) -> None:
    """A tool name, request_id or arguments past their bounds: INVALID_ARGUMENT with a short status (the 15 MB
    name was echoed twice), nothing logged at length, no request record or tool-call log entry written."""
    upstream = Upstream([ECHO])
    async with serving(upstream) as base:
        s = await byo_session(store, [f"{base}/modern/mcp"])
        with caplog.at_level(logging.DEBUG), pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.CallTool(request_, metadata=s.metadata, timeout=20)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and len(err.value.details() or "") < 400
    assert sum(len(v) for _, v in err.value.trailing_metadata() or ()) < 3000
    assert max((len(r.getMessage()) for r in caplog.records), default=0) < 2000
    assert upstream.calls == [] and await store.list_tool_calls(s.session.session_id) == []
    assert await store.get_request(call_scope(s.session.session_id), request_.request_id[:128]) is None


async def test_a_check_whose_caller_gave_up_while_it_waited_for_a_worker_never_runs() -> None:
    """Every worker busy: a check queued behind them whose caller's time runs out is withdrawn, so no worker
    later spends hours (and memory) on a check nobody waits for."""
    workers = arguments._Workers(1)
    release, started = threading.Event(), threading.Event()
    ran: list[str] = []

    def busy() -> str:
        started.set()
        while not release.is_set():  # pure Python: the interruption lands here if its caller gives up
            time.sleep(0.001)
        return "busy"

    def queued() -> str:
        ran.append("queued")
        return "queued"

    first = asyncio.create_task(workers.run(busy, timeout=30))
    assert await asyncio.to_thread(started.wait, 10)
    with pytest.raises(TimeoutError):
        await workers.run(queued, timeout=0.1)  # never reaches a worker in time
    release.set()
    assert await first == "busy"
    assert await workers.run(lambda: "next", timeout=10) == "next"  # the worker took the next job after it
    assert ran == []


async def test_a_check_that_swallows_its_interruption_is_interrupted_again() -> None:
    """Code inside a check (a library's broad `except`) may catch one interruption; it is interrupted again
    until it stops, so the worker is freed."""
    workers = arguments._Workers(1)
    caught: list[str] = []

    def stubborn() -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                while time.monotonic() < deadline:
                    time.sleep(0.001)
            except BaseException as exc:  # the kind of handler that swallows the first interruption
                if caught:
                    raise
                caught.append(type(exc).__name__)

    with pytest.raises(TimeoutError):
        await workers.run(stubborn, timeout=0.2)
    assert await workers.run(lambda: "freed", timeout=10) == "freed"  # the worker came back
    assert caught == ["_Abandoned"]
