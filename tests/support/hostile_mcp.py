"""A hostile MCP server for both eras: answers `server/discover` (2026-07-28, stateless) or `initialize` +
`Mcp-Session-Id` (legacy), then attacks the peer with what it sends back.

Test code standing in for a malicious or broken upstream, so responses are written by hand as raw ASGI
messages (no MCP SDK on this side): a well-behaved SDK server could never send most of them.

URL: `/{era}/{attack}/{phase}/{nonce}/mcp`
- era: `modern` (discover answered) or `legacy` (discover refused with HTTP 400, as Fleet images do today).
- phase: which response carries a transport attack: `reset` every `tools/list` (the orchestrator's
  discovery during Reset), `list` every `tools/list` but the first (the first is the orchestrator's, so
  Reset succeeds and the gateway's own listing is attacked), `call` `tools/call`. Content attacks (schemas,
  tool names, tool counts) are in every listing whatever the phase.
- nonce: any text; a new one gives new URLs (the orchestrator caches tool lists by endpoint URL).

Attacks (`ATTACKS`): endless body, huge body, one-byte drip, SSE without newlines, giant (10 MB) and big
(4 MB) JSON-RPC errors, schemas nested past any parser's limit or past rlgate's bound only, `$ref` cycles,
10,000 tools, deeply nested structured content, tool names and errors carrying forged log lines, a
JSON-RPC error in the servers' own range (-32000), and results under the reply cap that are large in other
ways: 20,000 empty content blocks, structured content of 200,000 numbers. `none` is a well-behaved
server (one tool, `echo`).

Run: `python -m tests.support.hostile_mcp --port N [--huge-bytes B] [--tools N] [--depth D]`; GET /health
answers 200 once it serves; GET /stats counts requests per attack and what the streams sent.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
Headers = Sequence[tuple[bytes, bytes]]

MODERN = "2026-07-28"
LEGACY = "2025-11-25"
CHUNK = 64 * 1024
DRIP_PADDING = 4096  # bytes of whitespace the drip sends before its reply ends (~14 minutes at 0.2 s a byte)
FORGED_PREFIX = "1999-01-01 00:00:00,000 CRITICAL"  # no real log line starts with this timestamp
FORGED_LINE = f"{FORGED_PREFIX} toolgateway rlgate.forged trace=- session=- FORGED LOG LINE"
# Line breaks a log reader may honour: every one must be escaped by the servers' log formatter. NEL (U+0085,
# a line break to Python's str.splitlines and to Unicode) forges a line of its own, with its own prefix.
BREAKS = ("\n", "\r", "\r\n", "\u2028", "\u2029", "\x0b", "\x0c", "\x1c", "\x1d", "\x1e")
NEL_FORGED_PREFIX = "1999-01-02 00:00:00,000 CRITICAL"
NEL_FORGED_LINE = f"{NEL_FORGED_PREFIX} toolgateway rlgate.forged trace=- session=- FORGED LOG LINE (NEL)"

TRANSPORT_ATTACKS = ("endless", "huge", "drip", "sse-no-newline", "giant-error", "big-error")
CONTENT_ATTACKS = (
    "deep-schema",
    "deepish-schema",
    "ref-cycle",
    "many-tools",
    "forged-names",
    "nested-structured",
    "server-error",
    "many-blocks",
    "big-structured",
)
ATTACKS = ("none", *TRANSPORT_ATTACKS, *CONTENT_ATTACKS)


@dataclass
class Sizes:
    huge_bytes: int = 100 * 2**20  # the huge body, announced in Content-Length
    giant_error_bytes: int = 10 * 2**20  # the giant JSON-RPC error message (over the gateway's reply limit)
    big_error_bytes: int = 4 * 2**20  # an error message under the reply limit (it reaches rlgate whole)
    tools: int = 10_000  # tools in the many-tools listing
    depth: int = 10_000  # nesting of the deep schema and of the deep structured content
    # Empty text blocks in the many-blocks result (~0.5 MB). The legacy era's SDK parses a reply whole
    # before rlgate sees it, a parsed object per block: the reply cap bounds that, not the block count.
    blocks: int = 20_000
    structured_items: int = 200_000  # numbers in the big-structured result's structuredContent (~400 KB)
    endless_cap_bytes: int = 4 * 2**30  # an endless stream stops here (a peer that never stops reading)
    drip_interval_s: float = 0.2  # between the drip's bytes
    drip_cap_s: float = 600.0


@dataclass
class Stats:
    requests: Counter[str] = field(default_factory=Counter)  # "attack phase method" -> count
    streamed: Counter[str] = field(default_factory=Counter)  # attack -> bytes sent by streaming attacks
    disconnects: Counter[str] = field(default_factory=Counter)  # attack -> streams the peer closed early


class HostileMcp:
    """The ASGI app."""

    def __init__(self, sizes: Sizes) -> None:
        self.sizes = sizes
        self.stats = Stats()
        self.listings: Counter[str] = Counter()  # path -> tools/list requests seen
        self.sessions: set[str] = set()  # legacy-era session ids handed out
        self._deep = {
            json.dumps(DEEP_SCHEMA).encode(): deep_schema_text(sizes.depth),
            json.dumps(DEEPISH_SCHEMA).encode(): deep_schema_text(DEEPISH_SCHEMA_DEPTH),
            json.dumps(DEEP_VALUE).encode(): deep_value_text(sizes.depth),
            json.dumps(DEEPISH_VALUE).encode(): deep_value_text(DEEPISH_VALUE_DEPTH),
        }

    # -- routing ------------------------------------------------------------------------------------------
    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        if scope["type"] != "http":
            return
        path = scope["path"]
        if path == "/health":
            return await self._json(send, 200, {"ok": True})
        if path == "/stats":
            stats = {"requests": dict(self.stats.requests), "streamed": dict(self.stats.streamed),
                     "disconnects": dict(self.stats.disconnects)}  # fmt: skip
            return await self._json(send, 200, stats)
        parts = path.strip("/").split("/")
        if len(parts) != 5 or parts[0] not in ("modern", "legacy") or parts[1] not in ATTACKS or parts[4] != "mcp":
            return await self._json(send, 404, {"error": "no MCP endpoint here"})
        era, attack, phase = parts[0], parts[1], parts[2]
        method = scope["method"]
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if method == "GET":  # the legacy era's push stream: not offered
            return await self._raw(send, 405, b"", "text/plain")
        if method == "DELETE":
            self.sessions.discard(headers.get("mcp-session-id", ""))
            return await self._raw(send, 200, b"", "application/json")
        if method != "POST":
            return await self._raw(send, 405, b"", "text/plain")
        body = await read_body(receive)
        try:
            message = json.loads(body)
        except ValueError:
            return await self._rpc_error(send, None, -32700, "parse error", status=400)
        if not isinstance(message, dict):
            return await self._rpc_error(send, None, -32600, "batches are not served", status=400)
        rpc = str(message.get("method", ""))
        self.stats.requests[f"{attack} {phase} {rpc}"] += 1
        if "id" not in message:  # a notification
            return await self._raw(send, 202, b"", "application/json", self._session_header(headers))
        rid = message["id"]
        if rpc == "server/discover":
            if era == "legacy":
                return await self._rpc_error(send, None, -32600, "Bad Request: unsupported protocol version", 400)
            result = {"supportedVersions": [MODERN], "capabilities": {"tools": {"listChanged": False}},
                      "resultType": "complete", "ttlMs": 0, "cacheScope": "private"}  # fmt: skip
            return await self._result(send, rid, result)
        if rpc == "initialize":
            sid = uuid.uuid4().hex
            self.sessions.add(sid)
            result = {"protocolVersion": LEGACY, "capabilities": {"tools": {"listChanged": False}},
                      "serverInfo": {"name": f"hostile-{attack}", "version": "1"}}  # fmt: skip
            return await self._result(send, rid, result, [(b"mcp-session-id", sid.encode())])
        extra = self._session_header(headers)
        if era == "legacy" and headers.get("mcp-session-id") not in self.sessions:
            return await self._rpc_error(send, rid, -32600, "Session not found", 404)
        if rpc == "tools/list":
            self.listings[path] += 1
            hostile = phase == "reset" or (phase == "list" and self.listings[path] > 1)
            if hostile and attack in TRANSPORT_ATTACKS:
                return await self._transport(attack, send, receive, rid, extra)
            listing = {"tools": self._tools(attack), **_modern_extras(era, cacheable=True)}
            return await self._result(send, rid, listing, extra)
        if rpc == "tools/call":
            if phase == "call" and attack in TRANSPORT_ATTACKS:
                return await self._transport(attack, send, receive, rid, extra)
            result = self._call_result(attack, message.get("params") or {}, era)
            error = result.get("error")
            if isinstance(error, dict):
                return await self._rpc_error(send, rid, int(error["code"]), str(error["message"]), 200, extra)
            return await self._result(send, rid, result, extra)
        return await self._rpc_error(send, rid, -32601, f"method {rpc!r} not found", 200, extra)

    @staticmethod
    def _session_header(headers: dict[str, str]) -> list[tuple[bytes, bytes]]:
        sid = headers.get("mcp-session-id")
        return [(b"mcp-session-id", sid.encode())] if sid else []

    # -- content ------------------------------------------------------------------------------------------
    def _tools(self, attack: str) -> list[dict[str, Any]]:
        echo = {"name": "echo", "description": "Echo the text back.",
                "inputSchema": {"type": "object", "properties": {"text": {"type": "string"}}}}  # fmt: skip
        if attack == "deep-schema":  # the placeholders become deep JSON text when the reply is written
            return [echo, {"name": "deep", "description": "A schema nested deeper than any parser allows.",
                           "inputSchema": DEEP_SCHEMA}]  # fmt: skip
        if attack == "deepish-schema":
            return [echo, {"name": "deepish", "description": "A schema nested past rlgate's JSON depth bound only.",
                           "inputSchema": DEEPISH_SCHEMA}]  # fmt: skip
        if attack == "ref-cycle":
            return [echo, *ref_cycle_tools()]
        if attack == "many-tools":
            return [echo] + [
                {"name": f"tool_{i:06d}", "description": f"Tool number {i}.",
                 "inputSchema": {"type": "object", "properties": {"n": {"type": "integer", "minimum": i}}}}
                for i in range(self.sizes.tools - 1)
            ]  # fmt: skip
        if attack == "forged-names":
            return [echo] + [
                {"name": f"forged{i}{brk}{FORGED_LINE} name", "description": f"{brk}{FORGED_LINE} description",
                 "inputSchema": {"type": "object"}}
                for i, brk in enumerate(BREAKS)
            ]  # fmt: skip
        return [echo]

    def _call_result(self, attack: str, params: dict[str, Any], era: str) -> dict[str, Any]:
        arguments = params.get("arguments") or {}
        text = str(arguments.get("text", "")) if isinstance(arguments, dict) else ""
        if attack == "nested-structured":
            value = DEEP_VALUE if text != "deepish" else DEEPISH_VALUE
            return {"content": [{"type": "text", "text": "deep"}], "structuredContent": value, "isError": False,
                    **_modern_extras(era)}  # fmt: skip
        if attack == "many-blocks":  # no bytes for an output limit to cut, only a count
            blocks = [{"type": "text", "text": ""}] * self.sizes.blocks + [{"type": "text", "text": "end"}]
            return {"content": blocks, "isError": False, **_modern_extras(era)}
        if attack == "big-structured":  # under the reply cap, far over the output limit
            numbers = {"items": [0] * self.sizes.structured_items}
            return {"content": [{"type": "text", "text": "big"}], "structuredContent": numbers, "isError": False,
                    **_modern_extras(era)}  # fmt: skip
        if attack == "server-error":  # -32000: the JSON-RPC range servers use for their own errors
            return {"error": {"code": -32000, "message": "Server error: database is locked"}}
        if attack == "forged-names":  # a tool error whose text forges a log line after BREAKS[int(text)]
            if text == "nel":
                message = f"failed\x85{NEL_FORGED_LINE}"
            else:
                message = f"failed{BREAKS[int(text) % len(BREAKS)] if text.isdigit() else chr(10)}{FORGED_LINE}"
            return {"content": [{"type": "text", "text": message}], "isError": True, **_modern_extras(era)}
        return {"content": [{"type": "text", "text": text}], "structuredContent": {"echo": text}, "isError": False,
                **_modern_extras(era)}  # fmt: skip

    # -- transport attacks --------------------------------------------------------------------------------
    async def _transport(self, attack: str, send: Send, receive: Receive, rid: Any, extra: Headers) -> None:
        head = json.dumps({"jsonrpc": "2.0", "id": rid})[:-1].encode()  # '{"jsonrpc": "2.0", "id": 1'
        if attack == "endless":
            opening = head + b', "result": {"content": [{"type": "text", "text": "'
            return await self._stream(attack, send, receive, 200, "application/json", extra, opening,
                                      _endless(b"x" * CHUNK, self.sizes.endless_cap_bytes))  # fmt: skip
        if attack == "sse-no-newline":
            opening = b"event: message\ndata: " + head + b', "result": {"content": [{"type": "text", "text": "'
            return await self._stream(attack, send, receive, 200, "text/event-stream", extra, opening,
                                      _endless(b"y" * CHUNK, self.sizes.endless_cap_bytes))  # fmt: skip
        if attack == "huge":
            opening = head + b', "result": {"content": [{"type": "text", "text": "'
            closing = b'"}], "isError": false}}'
            filler = self.sizes.huge_bytes - len(opening) - len(closing)
            length = [(b"content-length", str(self.sizes.huge_bytes).encode())]
            return await self._stream(attack, send, receive, 200, "application/json", [*extra, *length], opening,
                                      _sized(b"z" * CHUNK, filler, closing))  # fmt: skip
        if attack == "drip":
            body = json.dumps({"jsonrpc": "2.0", "id": rid, "result": {"content": [], "tools": []}}).encode()
            body = body[:-1] + b" " * DRIP_PADDING + b"}"  # whitespace: outlasts every bound rlgate has
            length = [(b"content-length", str(len(body)).encode())]
            return await self._stream(attack, send, receive, 200, "application/json", [*extra, *length], b"",
                                      _drip(body, self.sizes.drip_interval_s, self.sizes.drip_cap_s))  # fmt: skip
        size = self.sizes.giant_error_bytes if attack == "giant-error" else self.sizes.big_error_bytes
        # a big error message that also tries to forge log lines and carries control characters
        unit = "E" * 1000 + "".join(f"{brk}{FORGED_LINE}" for brk in BREAKS[:2]) + "\x1b[31m"
        message = (unit * (size // len(unit) + 1))[:size]
        return await self._rpc_error(send, rid, -32603, message, 200, extra)

    async def _stream(
        self,
        attack: str,
        send: Send,
        receive: Receive,
        status: int,
        content_type: str,
        extra: Headers,
        opening: bytes,
        chunks: AsyncIterator[bytes],
    ) -> None:
        """Send `opening` then `chunks` until they end or the peer disconnects (watched concurrently: a
        server that writes into a closed connection never learns it otherwise)."""
        gone = asyncio.Event()

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            gone.set()

        watcher = asyncio.create_task(watch())
        try:
            headers = [(b"content-type", content_type.encode()), *extra]
            await send({"type": "http.response.start", "status": status, "headers": headers})
            await send({"type": "http.response.body", "body": opening, "more_body": True})
            async for chunk in chunks:
                if gone.is_set():
                    self.stats.disconnects[attack] += 1
                    return
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                self.stats.streamed[attack] += len(chunk)
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:
            self.stats.disconnects[attack] += 1
        finally:
            watcher.cancel()

    # -- plain responses ----------------------------------------------------------------------------------
    async def _raw(self, send: Send, status: int, body: bytes, content_type: str, extra: Headers = ()) -> None:
        headers = [(b"content-type", content_type.encode()), (b"content-length", str(len(body)).encode()), *extra]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def _json(self, send: Send, status: int, obj: Any, extra: Headers = ()) -> None:
        body = json.dumps(obj).encode()
        for placeholder, text in self._deep.items():  # built as text: json.dumps recurses per level
            body = body.replace(placeholder, text)
        await self._raw(send, status, body, "application/json", extra)

    async def _result(self, send: Send, rid: Any, result: Any, extra: Headers = ()) -> None:
        await self._json(send, 200, {"jsonrpc": "2.0", "id": rid, "result": result}, extra)

    async def _rpc_error(
        self, send: Send, rid: Any, code: int, message: str, status: int = 200,
        extra: Headers = (),
    ) -> None:  # fmt: skip
        error = {"code": code, "message": message}
        await self._json(send, status, {"jsonrpc": "2.0", "id": rid, "error": error}, extra)


def _modern_extras(era: str, *, cacheable: bool = False) -> dict[str, Any]:
    """Fields a 2026-07-28 result carries (a cacheable one, such as tools/list, says for how long)."""
    if era != "modern":
        return {}
    return {"resultType": "complete", **({"ttlMs": 0, "cacheScope": "private"} if cacheable else {})}


async def read_body(receive: Callable[[], Awaitable[Mapping[str, Any]]]) -> bytes:
    """An ASGI request's whole body."""
    body = b""
    while True:
        message = await receive()
        body += bytes(message.get("body", b""))
        if not message.get("more_body"):
            return body


async def _endless(chunk: bytes, cap: int) -> AsyncIterator[bytes]:
    sent = 0
    while sent < cap:
        yield chunk
        sent += len(chunk)


async def _sized(chunk: bytes, total: int, closing: bytes) -> AsyncIterator[bytes]:
    while total > 0:
        piece = chunk[: min(len(chunk), total)]
        total -= len(piece)
        yield piece
    yield closing


async def _drip(body: bytes, interval_s: float, cap_s: float) -> AsyncIterator[bytes]:
    started = time.monotonic()
    for i in range(len(body)):
        if time.monotonic() - started > cap_s:
            return
        yield body[i : i + 1]
        await asyncio.sleep(interval_s)


DEEP_SCHEMA, DEEPISH_SCHEMA, DEEP_VALUE, DEEPISH_VALUE = "@deep-schema@", "@deepish-schema@", "@deep@", "@deepish@"
# Past rlgate's JSON text bound (64 levels), within the SDK's JSON parser's recursion limit: a schema level
# is two JSON levels ("properties" holds the next schema), a value level one.
DEEPISH_SCHEMA_DEPTH, DEEPISH_VALUE_DEPTH = 40, 100


def deep_schema_text(depth: int) -> bytes:
    """An object schema whose property nests `depth` objects deep, as JSON text."""
    return b'{"type": "object", "properties": {"a": ' * depth + b'{"type": "string"}' + b"}}" * depth


def deep_value_text(depth: int) -> bytes:
    return b'{"a": ' * depth + b'{"leaf": true}' + b"}" * depth


def ref_cycle_tools() -> list[dict[str, Any]]:
    """Schemas whose `$ref`s loop: a self-reference to the root, a two-step cycle, a ref to itself, and a
    ref that points nowhere."""
    return [
        {"name": "self_ref", "description": "Its property is the whole schema again.",
         "inputSchema": {"type": "object", "properties": {"child": {"$ref": "#"}}, "required": ["child"]}},
        {"name": "ref_loop", "description": "a -> b -> a.",
         "inputSchema": {"type": "object", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
                         "properties": {"x": {"$ref": "#/$defs/a"}}, "required": ["x"]}},
        {"name": "ref_itself", "description": "A definition that is a reference to itself.",
         "inputSchema": {"type": "object", "$defs": {"me": {"$ref": "#/$defs/me"}}, "allOf": [{"$ref": "#/$defs/me"}]}},
        {"name": "ref_nowhere", "description": "A reference to nothing.",
         "inputSchema": {"type": "object", "properties": {"x": {"$ref": "#/$defs/missing"}}}},
    ]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--huge-bytes", type=int, default=Sizes.huge_bytes)
    parser.add_argument("--giant-error-bytes", type=int, default=Sizes.giant_error_bytes)
    parser.add_argument("--tools", type=int, default=Sizes.tools)
    parser.add_argument("--depth", type=int, default=Sizes.depth)
    args = parser.parse_args()
    import uvicorn

    sizes = Sizes(huge_bytes=args.huge_bytes, giant_error_bytes=args.giant_error_bytes, tools=args.tools,
                  depth=args.depth)  # fmt: skip
    uvicorn.run(HostileMcp(sizes), host="127.0.0.1", port=args.port, log_level="warning", lifespan="on")


if __name__ == "__main__":
    main()
