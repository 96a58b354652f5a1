"""A real MCP upstream (the SDK's `MCPServer` under uvicorn, in either era) whose front answers chosen
`tools/call`s itself, as a misbehaving server would: a reply far past any limit, a reply that never comes, a
connection dropped mid-call, a compressed reply. Everything else (the handshake, `tools/list`, the `add` tool)
is the SDK's own server.

The front records what happened on the wire, so tests observe cut-offs and cancellation from the server's
side: per hostile call, the body bytes the server got out and whether the client went away."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import math
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Annotated, Any

import uvicorn
from mcp.server import MCPServer
from mcp_types.version import HANDSHAKE_PROTOCOL_VERSIONS
from pydantic import Field
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from rlgate.localfleet.connections import ConnectionTracker
from rlgate.localfleet.counters import Counters
from tests.support.hostile_mcp import read_body
from tests.support.ports import free_port
from tests.support.wait import wait_until

CHUNK = 64 * 1024
ERAS = ["modern", "legacy"]  # 2026-07-28, and initialize + Mcp-Session-Id (the modern probe answered 400)
HOSTILE_TOOLS = ["flood", "hang", "drop", "squeezed", "asks", "status"]


@dataclass(eq=False)
class HostileCall:
    """One `tools/call` the front answers itself."""

    message: dict[str, Any]
    scope: Scope
    send: Send
    upstream: HostileUpstream
    sent: int = 0  # body bytes handed to the connection (uvicorn applies flow control: a client not reading
    # holds `send` back, so this is what the client read plus what the socket buffers hold)
    disconnected: asyncio.Event = field(default_factory=asyncio.Event)  # the client closed the connection

    @property
    def arguments(self) -> dict[str, Any]:
        return dict(self.message.get("params", {}).get("arguments") or {})

    async def head(self, content_type: str, *extra: tuple[bytes, bytes]) -> None:
        headers = [(b"content-type", content_type.encode()), *extra]
        await self.send({"type": "http.response.start", "status": 200, "headers": headers})

    async def body(self, data: bytes, *, more: bool = True) -> bool:
        """Send `data`; False once the client has gone (uvicorn then drops what is sent)."""
        if self.disconnected.is_set():
            return False
        await self.send({"type": "http.response.body", "body": data, "more_body": more})
        # Once the client has gone, uvicorn's send returns at once without yielding: yield, so the watcher
        # that sets `disconnected` runs (else the whole reply "is sent" in one go and the watcher is cancelled).
        await asyncio.sleep(0)
        if self.disconnected.is_set():
            return False
        self.sent += len(data)
        await self.upstream.note()
        return True

    def abort(self) -> None:
        """Drop the connection (RST), as a server crashing mid-call would."""
        assert self.upstream.tracker.abort(self.scope["client"])

    def result_prefix(self) -> bytes:
        """A JSON-RPC result whose one text block is still open: what follows is the text."""
        return (
            b'{"jsonrpc":"2.0","id":'
            + json.dumps(self.message["id"]).encode()
            + b',"result":{"resultType":"complete","content":[{"type":"text","text":"'
        )


RESULT_END = b'"}]}}'


async def flood(call: HostileCall) -> None:
    """A reply of `total` bytes of text (endless without `total`), as `kind`: `json` (one body), `sse` (one
    event), or `sse-events` (many small notifications, each well under any event limit)."""
    kind, total = call.arguments.get("kind", "json"), call.arguments.get("total")
    if kind == "sse-events":
        await call.head("text/event-stream")
        note = json.dumps(
            {
                "jsonrpc": "2.0",
                "method": "notifications/message",
                "params": {"level": "info", "data": "x" * (CHUNK - 200)},
            }
        )
        event = f"event: message\ndata: {note}\n\n".encode()
        while total is None or call.sent < total:
            if not await call.body(event):
                return
        done = call.result_prefix() + b"done" + RESULT_END
        await call.body(b"event: message\ndata: " + done + b"\n\n", more=False)
        return
    sse = kind == "sse"
    await call.head("text/event-stream" if sse else "application/json")
    if not await call.body((b"event: message\ndata: " if sse else b"") + call.result_prefix()):
        return
    filler = b"x" * CHUNK
    while total is None or call.sent < total:
        if not await call.body(filler):
            return
    await call.body(RESULT_END + (b"\n\n" if sse else b""), more=False)


async def hang(call: HostileCall) -> None:
    """No reply at all, until the client goes away."""
    await call.disconnected.wait()


async def drop(call: HostileCall) -> None:
    """Drop the connection: before any reply (`when`: `before`), or in the middle of a JSON or SSE reply."""
    when = call.arguments.get("when", "before")
    if when == "json":
        await call.head("application/json")
        await call.body(call.result_prefix() + b"partial")
    elif when == "sse":
        await call.head("text/event-stream")
        await call.body(
            b'event: message\ndata: {"jsonrpc":"2.0","method":"notifications/message",'
            b'"params":{"level":"info","data":"working"}}\n\n'
        )
    call.abort()


async def squeezed(call: HostileCall) -> None:
    """A whole, valid result, gzip-compressed although the client asked for none."""
    body = gzip.compress(call.result_prefix() + b"ok" + RESULT_END)
    await call.head("application/json", (b"content-encoding", b"gzip"))
    await call.body(body, more=False)


async def asks(call: HostileCall) -> None:
    """A 2026-07-28 InputRequiredResult: the tool wants the client to answer an elicitation first."""
    result = {
        "resultType": "input_required",
        "inputRequests": {"confirm": {"method": "elicitation/create", "params": {"message": "sure?"}}},
        "requestState": "opaque",
    }
    body = json.dumps({"jsonrpc": "2.0", "id": call.message["id"], "result": result}).encode()
    await call.head("application/json")
    await call.body(body, more=False)


async def status(call: HostileCall) -> None:
    """HTTP `status` (and a JSON-RPC error body, unless `code` is 0): how a server refuses a call at the HTTP
    level."""
    code, http_status = call.arguments.get("code", 0), call.arguments.get("status", 400)
    body = b""
    if code:
        error = {"code": code, "message": f"refused with {code}"}
        body = json.dumps({"jsonrpc": "2.0", "id": call.message["id"], "error": error}).encode()
    headers = [(b"content-type", b"application/json" if code else b"text/plain")]
    await call.send({"type": "http.response.start", "status": http_status, "headers": headers})
    await call.send({"type": "http.response.body", "body": body, "more_body": False})


BEHAVIOURS: dict[str, Callable[[HostileCall], Awaitable[None]]] = {
    "flood": flood,
    "hang": hang,
    "drop": drop,
    "squeezed": squeezed,
    "asks": asks,
    "status": status,
}


@dataclass
class SlowCalls:
    """What the SDK's own handler of the `slow` tool saw: calls started, finished, and cancelled (by a
    `notifications/cancelled`, or the server seeing the client go)."""

    started: int = 0
    finished: int = 0
    cancelled: int = 0


def mcp_server(slow_calls: SlowCalls | None = None) -> MCPServer:
    server = MCPServer("hostile")
    seen = slow_calls if slow_calls is not None else SlowCalls()

    @server.tool()
    async def slow(seconds: float = 5.0) -> str:
        """Sleeps `seconds` in the SDK's own handler, recording whether it was cancelled."""
        seen.started += 1
        try:
            await asyncio.sleep(seconds)
        except asyncio.CancelledError:
            seen.cancelled += 1
            raise
        seen.finished += 1
        return "slept"

    @server.tool()
    def add(n: int) -> str:
        """n + 1."""
        return str(n + 1)

    @server.tool()
    def forecast(region: Annotated[str, Field(json_schema_extra={"x-mcp-header": "Region"})], days: int = 1) -> str:
        """The region's argument is mirrored in an `Mcp-Param-Region` header, which the server checks."""
        return f"{region}: sunny for {days} day(s)"

    def hostile(
        kind: str = "json", total: int | None = None, when: str = "before", code: int = 0, status: int = 400
    ) -> str:
        return ""  # never reached: the front answers these calls

    for name in HOSTILE_TOOLS:
        server.add_tool(hostile, name=name, description=f"hostile: {name}")
    return server


class HostileUpstream:
    """The server and its front; `calls` counts every `tools/call` by tool name, `methods` every message by
    method, `hostile` keeps the calls the front answered, in order."""

    def __init__(self, era: str, *, sse: bool = False, cancel_answer_s: float = 0.0) -> None:
        """`sse`: the SDK's own replies are event streams in either era (its default, as FastMCP serves);
        otherwise the legacy era answers in plain JSON. `cancel_answer_s`: each `notifications/cancelled`
        reaches the server that much later, and its POST is answered then (a server a round trip away); with
        `math.inf` the front takes it and never answers (kept in `hostile`) until the client leaves."""
        self.era = era
        self.cancel_answer_s = cancel_answer_s
        self.slow = SlowCalls()
        self.calls: Counter[str] = Counter()
        self.methods: Counter[str] = Counter()  # every JSON-RPC message POSTed, by method
        self.hostile: list[HostileCall] = []
        self.requests: list[tuple[dict[bytes, bytes], dict[str, Any]]] = []  # every tools/call: headers, message
        self.gone = False  # set: every request answers 404, as an instance that was deleted does
        self.tracker = ConnectionTracker(Counters())
        self._changed = asyncio.Condition()
        self._app: ASGIApp = mcp_server(self.slow).streamable_http_app(json_response=era == "legacy" and not sse)
        self.port = free_port()
        self._uvicorn: uvicorn.Server | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/mcp"

    async def note(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def wait(self, predicate: Callable[[], bool], timeout: float = 10.0) -> None:  # noqa: ASYNC109
        """Until `predicate()` (checked whenever the front records something); TimeoutError otherwise."""
        async with asyncio.timeout(timeout), self._changed:
            await self._changed.wait_for(predicate)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self.gone:
            await send({"type": "http.response.start", "status": 404, "headers": [(b"content-type", b"text/plain")]})
            await send({"type": "http.response.body", "body": b"Not Found"})
            return
        if scope["type"] != "http" or scope["method"] != "POST":
            await self._app(scope, receive, send)
            return
        version = dict(scope["headers"]).get(b"mcp-protocol-version", b"").decode()
        if self.era == "legacy" and version and version not in HANDSHAKE_PROTOCOL_VERSIONS:
            error = {"jsonrpc": "2.0", "id": None, "error": {"code": -32600, "message": "unsupported version"}}
            await send(
                {"type": "http.response.start", "status": 400, "headers": [(b"content-type", b"application/json")]}
            )
            await send({"type": "http.response.body", "body": json.dumps(error).encode()})
            return
        body = await read_body(receive)
        request = json.loads(body) if body else {}
        self.methods[request.get("method", "")] += 1
        name = request.get("params", {}).get("name") if request.get("method") == "tools/call" else None
        if name is not None:
            self.calls[name] += 1
            self.requests.append((dict(scope["headers"]), request))
        await self.note()
        behaviour = BEHAVIOURS.get(name) if name is not None else None
        if self.cancel_answer_s and request.get("method") == "notifications/cancelled":
            if math.isinf(self.cancel_answer_s):
                behaviour = hang
            else:
                await asyncio.sleep(self.cancel_answer_s)
        if behaviour is None:
            await self._app(scope, replay(body, receive), send)
            return
        call = HostileCall(request, scope, send, self)
        self.hostile.append(call)
        watcher = asyncio.create_task(self._watch(call, receive))
        try:
            await behaviour(call)
        finally:
            watcher.cancel()
            await self.note()

    async def _watch(self, call: HostileCall, receive: Receive) -> None:
        # With the request body read, uvicorn's receive() returns only when the client goes away.
        while (await receive())["type"] != "http.disconnect":
            pass
        call.disconnected.set()
        await self.note()

    async def start(self) -> HostileUpstream:
        config = uvicorn.Config(
            self,
            host="127.0.0.1",
            port=self.port,
            log_level="warning",
            lifespan="on",
            http=self.tracker.protocol_class(),
            timeout_graceful_shutdown=2,
        )
        self._uvicorn = uvicorn.Server(config)
        self._task = asyncio.create_task(self._uvicorn.serve())
        server, task = self._uvicorn, self._task

        def started() -> bool:  # uvicorn offers no started event: poll
            if task.done():
                task.result()  # raises why it stopped
            return bool(server.started)

        await wait_until(started, 30, "uvicorn started", interval=0.02)
        return self

    async def stop(self) -> None:
        if self._uvicorn is not None and self._task is not None:
            self._uvicorn.should_exit = True
            await asyncio.wait_for(self._task, 15)


def replay(body: bytes, receive: Receive) -> Receive:
    """`receive` for the app behind a front that has read the request body (`read_body`)."""
    replayed = False

    async def again() -> Message:
        nonlocal replayed
        if not replayed:
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return again


@contextlib.asynccontextmanager
async def hostile_upstream(
    era: str, *, sse: bool = False, cancel_answer_s: float = 0.0
) -> AsyncIterator[HostileUpstream]:
    upstream = await HostileUpstream(era, sse=sse, cancel_answer_s=cancel_answer_s).start()
    try:
        yield upstream
    finally:
        await upstream.stop()
