"""`http_calls`: modern-era requests over pooled HTTP/1.1 connections, against a scripted loopback server
(`http_server`) that answers raw bytes, and end to end through the gateway against localfleet."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import warnings
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from mcp import MCPError
from mcp_types import INTERNAL_ERROR, INVALID_PARAMS, INVALID_REQUEST, METHOD_NOT_FOUND, PARSE_ERROR, JSONRPCResponse
from prometheus_client import REGISTRY

from rlgate.store import SessionStore
from rlgate.toolgateway import http_calls
from rlgate.toolgateway.catalog import UpstreamUnavailable
from rlgate.toolgateway.http_calls import (
    HttpCaller,
    HttpCallSettings,
    Origin,
    RequestTimedOut,
    ResponseLost,
    SendFailed,
)
from rlgate.toolgateway.server import GatewayHandle
from rlgate.v1.toolgateway_pb2_grpc import ToolGatewayServiceStub as Stub
from tests.support.localfleet import LocalfleetProcess
from tests.support.ports import free_port
from tests.toolgateway.conftest import make_session
from tests.toolgateway.http_server import (
    LAST_CHUNK,
    SSE_HEAD,
    Exchange,
    Responder,
    ScriptedServer,
    chunk,
    echo,
    echo_then_close,
    fixed,
    hang,
    json_rpc_error,
    json_rpc_result,
    response_bytes,
    result_for,
)
from tests.toolgateway.test_gateway import call, text

DATA = {"method": "tools/call", "params": {"name": "add", "arguments": {"n": 1}}}
HEADERS = {"mcp-protocol-version": "2026-07-28", "mcp-method": "tools/call", "mcp-name": "add"}


@contextlib.contextmanager
def no_unclosed_streams() -> Iterator[None]:
    """Fail if a connection is left to the garbage collector ("unclosed StreamWriter" / transport): the GC
    closing a socket would otherwise pass for the pool closing it."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        yield
        gc.collect()
    unclosed = [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)
                and any(kind in str(w.message) for kind in ("StreamWriter", "transport", "socket"))]
    assert not unclosed, unclosed


@pytest.fixture(autouse=True)
def _connections_closed_explicitly(request: pytest.FixtureRequest) -> Iterator[None]:
    if "stub" in request.fixturenames:  # end to end: the gateway's own clients are not under test here
        yield
        return
    with no_unclosed_streams():
        yield


@pytest.fixture
async def server() -> AsyncIterator[ScriptedServer]:
    srv = await ScriptedServer().start()
    yield srv
    await srv.close()


@pytest.fixture
async def caller() -> AsyncIterator[HttpCaller]:
    c = HttpCaller(HttpCallSettings(connect_timeout_s=5.0))
    yield c
    c.close()


async def request(caller: HttpCaller, server: ScriptedServer, *, timeout: float = 5.0,  # noqa: ASYNC109
                  gate: asyncio.Semaphore | None = None, target: str = "/mcp") -> dict[str, Any]:
    return await caller.request(server.url(target), DATA, HEADERS, timeout, gate=gate)


def sse_answer(*parts: bytes | str, end: bool = True, keep: bool = True) -> Responder:
    """200 chunked text/event-stream: each part is one chunk; "{result}" in a part becomes the JSON-RPC
    response to the request (so the id matches); `end` adds the terminating chunk in the same write."""
    async def respond(ex: Exchange) -> bool:
        response = json.dumps({"jsonrpc": "2.0", "id": ex.request.rpc_id, "result": result_for(ex)})
        out = SSE_HEAD
        for part in parts:
            raw = part.replace("{result}", response).encode() if isinstance(part, str) else part
            out += chunk(raw)
        await ex.send(out + (LAST_CHUNK if end else b""))
        return keep
    return respond


# 1. The JSON answer and what the request carries


async def test_json_answer_and_the_request_on_the_wire(server: ScriptedServer, caller: HttpCaller) -> None:
    result = await request(caller, server, target="/instances/i-1/mcp?token=a%20b&x=1")
    assert result == {"content": [{"type": "text", "text": "ok"}], "echo": DATA["params"], "conn": 0}
    [got] = server.requests
    assert got.request_line == "POST /instances/i-1/mcp?token=a%20b&x=1 HTTP/1.1"
    assert got.header("host") == f"127.0.0.1:{server.port}"
    assert got.header("content-type") == "application/json"
    assert {t.strip() for t in (got.header("accept") or "").split(",")} == {"application/json", "text/event-stream"}
    assert got.header("content-length") == str(len(got.body))
    for name, value in HEADERS.items():
        assert got.header(name) == value
    body = got.json
    assert body["jsonrpc"] == "2.0" and isinstance(body["id"], int)
    assert (body["method"], body["params"]) == (DATA["method"], DATA["params"])
    assert DATA == {"method": "tools/call", "params": {"name": "add", "arguments": {"n": 1}}}  # not mutated


# 2. Connection reuse


async def test_sequential_requests_share_one_connection(server: ScriptedServer, caller: HttpCaller) -> None:
    results = [await request(caller, server) for _ in range(5)]
    assert server.connections == 1
    assert [r["conn"] for r in results] == [0] * 5
    ids = [r.rpc_id for r in server.requests]
    assert len(set(ids)) == 5  # a fresh JSON-RPC id per request
    assert caller.idle_connections() == 1


async def test_connection_close_header_then_a_new_connection(server: ScriptedServer, caller: HttpCaller) -> None:
    async def closing(ex: Exchange) -> bool:
        body = json_rpc_result(ex.request.rpc_id, result_for(ex))
        await ex.send(response_bytes(200, [("content-type", "application/json"), ("connection", "close")], body))
        return False

    server.answer(closing)
    assert (await request(caller, server))["conn"] == 0
    assert caller.idle_connections() == 0  # not pooled: the server said it closes
    assert (await request(caller, server))["conn"] == 1
    assert server.connections == 2


async def test_server_closing_an_idle_connection_then_a_new_connection(server: ScriptedServer,
                                                                       caller: HttpCaller) -> None:
    server.answer(echo_then_close)  # keep-alive promised, then closed (an idle timeout)
    assert (await request(caller, server))["conn"] == 0
    await asyncio.sleep(0.1)  # the client's loop sees the server's FIN on the idle connection
    assert (await request(caller, server))["conn"] == 1  # no error: the dead idle connection is not used
    assert server.connections == 2


async def test_interim_100_continue_then_json_with_charset(server: ScriptedServer, caller: HttpCaller) -> None:
    async def respond(ex: Exchange) -> bool:
        body = json_rpc_result(ex.request.rpc_id, {"content": [], "n": 1})
        await ex.send(b"HTTP/1.1 100 Continue\r\n\r\n"
                      + response_bytes(200, [("Content-Type", "Application/JSON; charset=utf-8")], body))
        return True

    server.answer(respond)
    assert await request(caller, server) == {"content": [], "n": 1}
    assert (await request(caller, server))["conn"] == 0  # complete exchange: the connection is reused


async def test_body_delimited_by_close(server: ScriptedServer, caller: HttpCaller) -> None:
    async def respond(ex: Exchange) -> bool:
        body = json_rpc_result(ex.request.rpc_id, {"content": [], "n": 2})
        await ex.send(b"HTTP/1.0 200 OK\r\ncontent-type: application/json\r\n\r\n" + body)
        return False  # the end of the body is the end of the connection

    server.answer(respond)
    assert await request(caller, server) == {"content": [], "n": 2}
    assert caller.idle_connections() == 0
    assert (await request(caller, server))["conn"] == 1


# 3. SSE answers


async def test_sse_answer_after_a_notification_and_a_ping(server: ScriptedServer, caller: HttpCaller) -> None:
    note = json.dumps({"jsonrpc": "2.0", "method": "notifications/message", "params": {"level": "info", "data": "x"}})
    server.answer(sse_answer(f"event: message\r\ndata: {note}\r\n\r\n", ": ping\r\n\r\n",
                             "event: message\r\nid: 7\r\ndata: {result}\r\n\r\n"))
    result = await request(caller, server)
    assert result["echo"] == DATA["params"]


async def test_sse_skips_priming_and_non_message_events(server: ScriptedServer, caller: HttpCaller) -> None:
    # As the SDK's transport: an empty `data:` (a resumability priming event) and events of another type
    # carry no JSON-RPC message; parsing them would fail the call.
    server.answer(sse_answer("id: 0\r\ndata:\r\n\r\n", "event: endpoint\r\ndata: /not-json\r\n\r\n",
                             "data: {result}\r\n\r\n"))
    assert (await request(caller, server))["echo"] == DATA["params"]


async def test_sse_multiline_data_split_across_chunks(server: ScriptedServer, caller: HttpCaller) -> None:
    async def respond(ex: Exchange) -> bool:
        # One JSON document over three data: lines (joined with "\n", which JSON allows between tokens),
        # chunk boundaries inside a line and between the CR and LF of a line ending.
        rid = ex.request.rpc_id
        stream = (": ping\r\n\r\nevent: message\r\ndata: {\"jsonrpc\": \"2.0\",\r\ndata: \"id\": " + str(rid)
                  + ",\r\ndata:\"result\": {\"content\": [], \"v\": \"a\\nb\"}}\r\n\r\n").encode()
        cuts = [5, 30, stream.index(b"\r\ndata: \"id\"") + 1, len(stream) - 3]
        pieces = [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)], strict=True)]
        await ex.send(SSE_HEAD)
        for piece in pieces:
            await ex.send(chunk(piece))
            await asyncio.sleep(0.01)  # separate reads on the client
        await ex.send(LAST_CHUNK)
        return True

    server.answer(respond)
    assert await request(caller, server) == {"content": [], "v": "a\nb"}


async def test_sse_data_lines_are_joined_with_newlines(server: ScriptedServer, caller: HttpCaller) -> None:
    async def respond(ex: Exchange) -> bool:
        # Split inside a number: joined with "\n" (the SSE rule) this is not JSON; joined with "" it would be 12.
        head = '{"jsonrpc": "2.0", "id": ' + str(ex.request.rpc_id) + ', "result": {"v": 1'
        await sse_answer(f"data: {head}\r\ndata: 2}}}}\r\n\r\n")(ex)
        return True

    server.answer(respond)
    with pytest.raises(MCPError) as err:
        await request(caller, server)
    assert err.value.code == PARSE_ERROR


async def test_sse_with_lf_line_endings_and_no_space_after_colon(server: ScriptedServer, caller: HttpCaller) -> None:
    server.answer(sse_answer("event: message\ndata:{result}\n\n"))
    assert (await request(caller, server))["echo"] == DATA["params"]


async def test_sse_answer_ending_the_stream_keeps_the_connection(server: ScriptedServer, caller: HttpCaller) -> None:
    # The SDK's modern server writes the final event and the end of the body in one send.
    server.answer(sse_answer(": ping\r\n\r\n", "event: message\r\ndata: {result}\r\n\r\n"))
    await request(caller, server)
    assert (await request(caller, server))["conn"] == 0
    assert server.connections == 1


async def test_sse_stream_still_open_after_the_response_is_not_reused(server: ScriptedServer,
                                                                      caller: HttpCaller) -> None:
    async def respond(ex: Exchange) -> bool:
        await sse_answer("event: message\r\ndata: {result}\r\n\r\n", end=False)(ex)
        await ex.wait_client_close()  # the stream never ends: the client must drop the connection
        return False

    server.answer(respond)
    assert (await request(caller, server))["echo"] == DATA["params"]
    await server.wait(lambda: 0 in server.client_closed)
    assert (await request(caller, server))["conn"] == 1


# 4. HTTP answers that are errors (as the SDK's transport reports them)


def _json(status: int, body: bytes, *extra: tuple[str, str]) -> bytes:
    return response_bytes(status, [("content-type", "application/json"), *extra], body)


ERROR_ANSWERS: list[tuple[str, bytes, int, str]] = [
    ("400-jsonrpc-error", _json(400, json_rpc_error(None, INVALID_PARAMS, "bad n")), INVALID_PARAMS, "bad n"),
    ("404-jsonrpc-error", _json(404, json_rpc_error(None, -32001, "no tool")), -32001, "no tool"),
    ("404-empty", response_bytes(404), METHOD_NOT_FOUND, "Not Found"),
    ("404-json-not-rpc", _json(404, b'{"detail": "nope"}'), METHOD_NOT_FOUND, "Not Found"),
    ("500-plain", response_bytes(500, [("content-type", "text/plain")], b"boom"), INTERNAL_ERROR,
     "Server returned an error response"),
    ("503-bad-json", _json(503, b"{oops"), INTERNAL_ERROR, "Server returned an error response"),
    ("202", response_bytes(202), INVALID_REQUEST, "202 Accepted"),
    ("302", response_bytes(302, [("location", "/elsewhere")]), INVALID_REQUEST, "redirect"),
    ("307", response_bytes(307, [("location", "http://127.0.0.1:1/mcp")]), INVALID_REQUEST, "redirect"),
    ("html", response_bytes(200, [("content-type", "text/html")], b"<p>hi</p>"), INVALID_REQUEST,
     "Unexpected content type: text/html"),
    ("no-content-type", response_bytes(200, [], b"{}"), INVALID_REQUEST, "Unexpected content type"),
    ("malformed-json", _json(200, b'{"jsonrpc": "2.0", "id": 1, "result": {'), PARSE_ERROR,
     "Failed to parse JSON response"),
    ("result-not-object", _json(200, b'{"jsonrpc": "2.0", "id": 1, "result": [1]}'), PARSE_ERROR, "result"),
]


@pytest.mark.parametrize(("answer", "code", "message"), [a[1:] for a in ERROR_ANSWERS],
                         ids=[a[0] for a in ERROR_ANSWERS])
async def test_http_error_answers(server: ScriptedServer, caller: HttpCaller, answer: bytes, code: int,
                                  message: str) -> None:
    # ids in the canned bodies: caller's first request has id 1
    server.answer(fixed(answer))
    with pytest.raises(MCPError) as err:
        await request(caller, server)
    assert err.value.code == code
    assert message in err.value.message
    assert len(server.requests) == 1  # nothing retried, no redirect followed
    # The connection is left in a state the next request can use (a new one if it was closed).
    assert (await request(caller, server))["echo"] == DATA["params"]


async def test_jsonrpc_error_in_a_200_json_answer(server: ScriptedServer, caller: HttpCaller) -> None:
    async def respond(ex: Exchange) -> bool:
        await ex.send(_json(200, json_rpc_error(ex.request.rpc_id, -32002, "tool exploded")))
        return True

    server.answer(respond)
    with pytest.raises(MCPError) as err:
        await request(caller, server)
    assert (err.value.code, err.value.message) == (-32002, "tool exploded")


async def test_json_answer_to_another_request_is_refused(server: ScriptedServer, caller: HttpCaller) -> None:
    async def respond(ex: Exchange) -> bool:
        await ex.send(_json(200, json_rpc_result(ex.request.rpc_id + 1000, {"content": []})))
        return True

    server.answer(respond)
    with pytest.raises(MCPError) as err:
        await request(caller, server)
    assert err.value.code == PARSE_ERROR


async def test_jsonrpc_error_in_an_sse_event(server: ScriptedServer, caller: HttpCaller) -> None:
    async def respond(ex: Exchange) -> bool:
        error = json_rpc_error(ex.request.rpc_id, -32003, "denied").decode()
        await sse_answer(": ping\r\n\r\n", f"event: message\r\ndata: {error}\r\n\r\n")(ex)
        return True

    server.answer(respond)
    with pytest.raises(MCPError) as err:
        await request(caller, server)
    assert (err.value.code, err.value.message) == (-32003, "denied")


async def test_malformed_sse_data_is_a_parse_error(server: ScriptedServer, caller: HttpCaller) -> None:
    server.answer(sse_answer("event: message\r\ndata: {not json\r\n\r\n"))
    with pytest.raises(MCPError) as err:
        await request(caller, server)
    assert err.value.code == PARSE_ERROR


async def test_sse_stream_ending_without_the_response(server: ScriptedServer, caller: HttpCaller) -> None:
    note = json.dumps({"jsonrpc": "2.0", "method": "notifications/progress", "params": {"progress": 1}})
    server.answer(sse_answer(f"data: {note}\r\n\r\n", ": ping\r\n\r\n"))
    with pytest.raises(MCPError) as err:
        await request(caller, server)
    assert (err.value.code, err.value.message) == (INTERNAL_ERROR, "SSE stream ended without a response")


# 5. Timeouts and unreachable origins


async def test_no_answer_times_out_and_closes_the_connection(server: ScriptedServer, caller: HttpCaller) -> None:
    server.answer(hang)
    loop = asyncio.get_running_loop()
    start = loop.time()
    with pytest.raises(RequestTimedOut) as err:
        await request(caller, server, timeout=0.3)
    assert err.value.sent is True
    assert 0.25 < loop.time() - start < 3.0
    await server.wait(lambda: 0 in server.client_closed)  # the close is the call's cancellation
    assert caller.idle_connections() == 0
    assert (await request(caller, server))["conn"] == 1


async def test_nobody_listening_is_send_failed(caller: HttpCaller) -> None:
    port = free_port()  # bound and released: nothing listens there
    with pytest.raises(SendFailed) as err:
        await caller.request(f"http://127.0.0.1:{port}/mcp", DATA, HEADERS, 5.0)
    assert isinstance(err.value, UpstreamUnavailable)
    assert f"127.0.0.1:{port}" in str(err.value)
    # The failed attempt gave its pool slot back: with one slot, a second attempt fails the same way.
    one = HttpCaller(HttpCallSettings(max_connections=1, connect_timeout_s=5.0))
    try:
        for _ in range(2):
            with pytest.raises(SendFailed):
                await one.request(f"http://127.0.0.1:{port}/mcp", DATA, HEADERS, 2.0)
    finally:
        one.close()


async def test_exhausted_gate_times_out_unsent(server: ScriptedServer, caller: HttpCaller) -> None:
    gate = asyncio.Semaphore(1)
    await gate.acquire()
    with pytest.raises(RequestTimedOut) as err:
        await request(caller, server, timeout=0.2, gate=gate)
    assert err.value.sent is False
    assert server.connections == 0 and not server.requests
    gate.release()
    assert (await request(caller, server, gate=gate))["echo"] == DATA["params"]
    assert not gate.locked()  # the gate was released after the request


async def test_exhausted_pool_times_out_unsent(server: ScriptedServer) -> None:
    one = HttpCaller(HttpCallSettings(max_connections=1, connect_timeout_s=5.0))
    try:
        server.answer(hang)
        busy = asyncio.create_task(request(one, server, timeout=10.0))
        await server.wait(lambda: len(server.requests) == 1)
        with pytest.raises(RequestTimedOut) as err:
            await request(one, server, timeout=0.2)
        assert err.value.sent is False
        assert len(server.requests) == 1 and server.connections == 1
        busy.cancel()
        with pytest.raises(asyncio.CancelledError):
            await busy
    finally:
        one.close()


# 6. The connection lost mid-response


@pytest.mark.parametrize("answer", [
    response_bytes(200, [("content-type", "application/json"), ("content-length", "100")], b'{"jsonrpc":',
                   content_length=False),
    SSE_HEAD + chunk(b": ping\r\n\r\n"),
    b"HTTP/1.1 200 OK\r\ncontent-ty",
    b"",
], ids=["json-body-cut", "sse-cut", "head-cut", "closed-before-answer"])
async def test_server_closing_mid_response_is_response_lost(server: ScriptedServer, caller: HttpCaller,
                                                            answer: bytes) -> None:
    server.answer(fixed(answer, keep=False))
    with pytest.raises(ResponseLost) as err:
        await request(caller, server)
    assert isinstance(err.value, UpstreamUnavailable)
    assert (await request(caller, server))["conn"] == 1


@pytest.mark.parametrize("answer", [b"HTTP/1.1 abc OK\r\n\r\n", b"SMTP ready\r\n\r\n",
                                    b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n"],
                         ids=["bad-status", "not-http", "bad-chunk"])
async def test_a_malformed_response_is_response_lost(server: ScriptedServer, caller: HttpCaller,
                                                     answer: bytes) -> None:
    server.answer(fixed(answer, keep=False))
    with pytest.raises(ResponseLost, match="malformed response"):
        await request(caller, server)
    assert (await request(caller, server))["conn"] == 1


async def test_endless_headers_are_refused(server: ScriptedServer, caller: HttpCaller) -> None:
    headers = [(f"x-h{i}", "v" * 100) for i in range(1000)]  # ~100 KB, past MAX_HEAD_BYTES
    server.answer(fixed(response_bytes(200, [("content-type", "application/json"), *headers], b"{}"), keep=False))
    with pytest.raises(ResponseLost, match=f"headers larger than {http_calls.MAX_HEAD_BYTES} bytes"):
        await request(caller, server)


async def test_bytes_after_a_whole_response_keep_it_and_drop_the_connection(server: ScriptedServer,
                                                                          caller: HttpCaller) -> None:
    async def respond(ex: Exchange) -> bool:
        body = json_rpc_result(ex.request.rpc_id, {"content": [], "n": 3})
        await ex.send(_json(200, body) + b"garbage that is no response")
        return False

    server.answer(respond)
    assert await request(caller, server) == {"content": [], "n": 3}
    assert caller.idle_connections() == 0  # what follows it is unknown: never reused
    server.answer(echo)
    assert (await request(caller, server))["conn"] == 1


@pytest.mark.parametrize(("name", "value"), [("x-evil", "a\r\nx-injected: 1"), ("bad name", "v"),
                                             ("x-null", "a\x00b"), ("x-utf8", "caf\u00e9")])
async def test_a_header_that_cannot_be_sent_fails_before_anything_is_sent(
        server: ScriptedServer, caller: HttpCaller, name: str, value: str) -> None:
    with pytest.raises(SendFailed, match="request not sent"):
        await caller.request(f"http://127.0.0.1:{server.port}/mcp", DATA, {**HEADERS, name: value}, 5.0)
    assert server.connections == 0 and not server.requests


# 7. Size limit


async def test_sse_answer_over_the_size_limit(server: ScriptedServer, caller: HttpCaller,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(http_calls, "MAX_RESPONSE_BYTES", 1000)
    server.answer(sse_answer(": " + "p" * 600 + "\r\n\r\n", ": " + "q" * 600 + "\r\n\r\n",
                             "event: message\r\ndata: {result}\r\n\r\n"))
    with pytest.raises(MCPError) as err:
        await request(caller, server)
    assert err.value.code == INTERNAL_ERROR and "larger than 1000 bytes" in err.value.message
    await server.wait(lambda: 0 in server.client_closed)  # not reused
    assert (await request(caller, server))["conn"] == 1


async def test_json_answer_over_the_size_limit(server: ScriptedServer, caller: HttpCaller,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(http_calls, "MAX_RESPONSE_BYTES", 1000)

    async def big(ex: Exchange) -> bool:
        body = json_rpc_result(ex.request.rpc_id, {"content": [{"type": "text", "text": "x" * 5000}]})
        await ex.send(_json(200, body))
        return True

    server.answer(big)
    with pytest.raises(MCPError) as err:
        await request(caller, server)
    assert err.value.code == INTERNAL_ERROR and "larger than" in err.value.message
    await server.wait(lambda: 0 in server.client_closed)
    assert (await request(caller, server))["conn"] == 1


async def test_json_answer_over_the_real_limit(server: ScriptedServer, caller: HttpCaller) -> None:
    """The limit as imported (64 MiB), without sending 64 MiB: the body is refused as it streams in."""
    limit = http_calls.MAX_RESPONSE_BYTES

    async def huge(ex: Exchange) -> bool:
        await ex.send(response_bytes(200, [("content-type", "application/json"),
                                           ("content-length", str(limit + 1))], content_length=False))
        block = b" " * (1 << 20)
        sent = 0
        try:
            while sent <= limit:
                ex.writer.write(block)
                await ex.writer.drain()
                sent += len(block)
        except OSError:
            pass
        await ex.wait_client_close()
        return False

    server.answer(huge)
    with pytest.raises(MCPError) as err:
        await request(caller, server, timeout=20.0)
    assert err.value.code == INTERNAL_ERROR and f"larger than {limit} bytes" in err.value.message
    await server.wait(lambda: 0 in server.client_closed)


# 8. Cancellation


async def test_cancelling_the_caller_closes_the_connection_and_frees_the_slot(server: ScriptedServer) -> None:
    one = HttpCaller(HttpCallSettings(max_connections=1, connect_timeout_s=5.0))
    try:
        server.answer(hang)
        task = asyncio.create_task(request(one, server, timeout=30.0))
        await server.wait(lambda: len(server.requests) == 1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await server.wait(lambda: 0 in server.client_closed)  # the server sees the abort
        assert one.idle_connections() == 0
        result = await request(one, server, timeout=2.0)  # the only slot is free again
        assert result["conn"] == 1
    finally:
        one.close()


# 9. Pool housekeeping


async def test_prune_closes_expired_idle_connections_and_forgets_the_origin(server: ScriptedServer) -> None:
    short = HttpCaller(HttpCallSettings(keepalive_s=0.05))
    try:
        await request(short, server)
        short.prune()  # still fresh: kept
        assert short.idle_connections() == 1 and 0 not in server.client_closed
        await asyncio.sleep(0.1)
        short.prune()
        assert short.idle_connections() == 0
        assert not short._pools  # the empty origin is forgotten
        await server.wait(lambda: 0 in server.client_closed)
        assert (await request(short, server))["conn"] == 1  # and comes back on demand
    finally:
        short.close()


async def test_expired_idle_connection_is_not_reused(server: ScriptedServer) -> None:
    short = HttpCaller(HttpCallSettings(keepalive_s=0.05))
    try:
        await request(short, server)
        await asyncio.sleep(0.1)
        assert (await request(short, server))["conn"] == 1
        await server.wait(lambda: 0 in server.client_closed)
    finally:
        short.close()


async def test_max_idle_bounds_the_kept_connections(server: ScriptedServer) -> None:
    few = HttpCaller(HttpCallSettings(max_idle=1))
    try:
        release = asyncio.Event()

        async def slow(ex: Exchange) -> bool:
            await release.wait()
            return await echo(ex)

        server.answer(slow, slow)
        both = asyncio.gather(request(few, server), request(few, server))
        await server.wait(lambda: len(server.requests) == 2)
        release.set()
        await both
        assert server.connections == 2 and few.idle_connections() == 1
        await server.wait(lambda: len(server.client_closed) == 1)
    finally:
        few.close()


async def test_close_closes_idle_connections(server: ScriptedServer) -> None:
    with no_unclosed_streams():
        c = HttpCaller()
        await request(c, server)
        assert c.idle_connections() == 1
        c.close()
        assert c.idle_connections() == 0
        await server.wait(lambda: 0 in server.client_closed)


async def test_close_during_a_request_closes_its_connection_afterwards(server: ScriptedServer) -> None:
    c = HttpCaller()
    release = asyncio.Event()

    async def slow(ex: Exchange) -> bool:
        await release.wait()
        return await echo(ex)

    server.answer(slow)
    with no_unclosed_streams():
        in_flight = asyncio.create_task(request(c, server))
        await server.wait(lambda: len(server.requests) == 1)
        c.close()
        release.set()
        assert (await in_flight)["conn"] == 0
        del in_flight
        await server.wait(lambda: 0 in server.client_closed, timeout=2.0)


# 10. Origins


@pytest.mark.parametrize(("url", "origin", "target", "host_header"), [
    ("http://example.test/mcp", Origin("http", "example.test", 80), "/mcp", "example.test"),
    ("https://example.test/a/b/mcp", Origin("https", "example.test", 443), "/a/b/mcp", "example.test"),
    ("http://127.0.0.1:8080/mcp?x=1&y=%2F", Origin("http", "127.0.0.1", 8080), "/mcp?x=1&y=%2F", "127.0.0.1:8080"),
    ("https://example.test:443/", Origin("https", "example.test", 443), "/", "example.test"),
    ("https://example.test:80/", Origin("https", "example.test", 80), "/", "example.test:80"),
    ("http://[::1]:9000/mcp", Origin("http", "::1", 9000), "/mcp", "[::1]:9000"),
    ("http://[::1]/mcp", Origin("http", "::1", 80), "/mcp", "[::1]"),
    ("http://Example.TEST", Origin("http", "example.test", 80), "/", "example.test"),
])
def test_origin_of(url: str, origin: Origin, target: str, host_header: str) -> None:
    assert Origin.of(url) == (origin, target)
    assert origin.host_header == host_header


@pytest.mark.parametrize("url", ["ftp://example.test/mcp", "example.test/mcp", "http:///mcp", "ws://h/mcp"])
def test_origin_of_rejects_non_http_urls(url: str) -> None:
    with pytest.raises(ValueError, match="not an http"):
        Origin.of(url)


async def test_ipv6_loopback_request(caller: HttpCaller) -> None:
    seen: list[str | None] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
        length = int(next(v for k, v in (line.split(": ", 1) for line in head.split("\r\n")[1:] if line)
                          if k.lower() == "content-length"))
        rid = json.loads(await reader.readexactly(length))["id"]
        seen.append(next((line.split(": ", 1)[1] for line in head.split("\r\n") if line.lower().startswith("host:")),
                         None))
        body = json_rpc_result(rid, {"content": []})
        writer.write(response_bytes(200, [("content-type", "application/json")], body))
        await writer.drain()
        writer.close()

    try:
        srv = await asyncio.start_server(serve, "::1", 0)
    except OSError:
        pytest.skip("no IPv6 loopback here")
    try:
        port = srv.sockets[0].getsockname()[1]
        assert await caller.request(f"http://[::1]:{port}/mcp", DATA, HEADERS, 5.0) == {"content": []}
        assert seen == [f"[::1]:{port}"]
    finally:
        srv.close()
        await srv.wait_closed()


# End to end: which path the gateway's calls take, by era


def _sent(path: str) -> float:
    return REGISTRY.get_sample_value("rlgate_toolgateway_upstream_calls_sent_total", {"path": path}) or 0.0


async def test_gateway_sends_modern_calls_direct_and_legacy_calls_through_the_sdk(
        gateway: GatewayHandle, stub: Stub, store: SessionStore, fleet: LocalfleetProcess, era: str) -> None:
    s = await make_session(store, fleet, era)
    direct, sdk = _sent("direct"), _sent("sdk")
    for n in range(4):
        assert text(await call(stub, s, "add", {"n": n})) == f"{n + 1} (int)"
    grew = (_sent("direct") - direct, _sent("sdk") - sdk)
    assert grew == ((4.0, 0.0) if era == "gw" else (0.0, 4.0)), (era, grew)
    # The direct calls shared one pooled connection; the legacy era never opened one.
    assert gateway.pool.http.idle_connections() == (1 if era == "gw" else 0)


def _held_listings() -> int:
    """tools/list answers still alive in this process (the SDK's JSON-RPC response objects)."""
    gc.collect()
    return sum(1 for o in gc.get_objects()
               if isinstance(o, JSONRPCResponse) and isinstance(o.result, dict) and "tools" in o.result)


async def test_a_direct_link_does_not_keep_its_raw_tool_listing(
        gateway: GatewayHandle, stub: Stub, store: SessionStore, fleet: LocalfleetProcess) -> None:
    # The SDK's reader holds the last message it received; a link whose calls go direct would otherwise
    # keep its whole raw tools/list answer for as long as the session lives (~115 KiB with a real app).
    before = _held_listings()
    sessions = [await make_session(store, fleet, "gw") for _ in range(3)]
    for s in sessions:
        assert text(await call(stub, s, "add", {"n": 1})) == "2 (int)"
    assert gateway.pool.open_clients() == 3
    assert _held_listings() - before <= 0
