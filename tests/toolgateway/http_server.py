"""A scripted HTTP/1.1 server for the `http_calls` tests: real loopback sockets, raw response bytes.

Each request is answered by the next responder queued with `answer(...)` (or `default`). A responder gets
the request and the connection's streams, writes whatever bytes it likes and says whether the connection
stays open. The server records every request, how many TCP connections it accepted, and which of them the
client closed (EOF seen), so tests can observe connection reuse and cancellation from the server's side."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

MAX_HEAD = 64 * 1024


@dataclass
class Received:
    """One request as it arrived on the wire."""

    conn: int  # which TCP connection (0-based, in accept order)
    request_line: str
    headers: list[tuple[str, str]]  # names lower-cased, in wire order
    body: bytes

    def header(self, name: str) -> str | None:
        values = [v for k, v in self.headers if k == name.lower()]
        assert len(values) <= 1, f"header {name!r} sent {len(values)} times"
        return values[0] if values else None

    @property
    def json(self) -> Any:
        return json.loads(self.body)

    @property
    def rpc_id(self) -> Any:
        return self.json["id"]


@dataclass
class Exchange:
    request: Received
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    server: ScriptedServer

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def wait_client_close(self) -> None:
        """Read until the client closes the connection (EOF or reset): how an aborted call looks here."""
        with contextlib.suppress(OSError):
            while await self.reader.read(65536):
                pass
        self.server.client_closed.add(self.request.conn)


Responder = Callable[[Exchange], Awaitable[bool]]  # True: keep the connection open for the next request


def response_bytes(status: int, headers: Sequence[tuple[str, str]] = (), body: bytes = b"", *,
                   reason: str = "X", content_length: bool = True) -> bytes:
    lines = [f"HTTP/1.1 {status} {reason}"] + [f"{k}: {v}" for k, v in headers]
    if content_length:
        lines.append(f"content-length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


LAST_CHUNK = b"0\r\n\r\n"
SSE_HEAD = response_bytes(200, [("content-type", "text/event-stream"), ("transfer-encoding", "chunked")],
                          content_length=False)


def json_rpc_result(request_id: Any, result: dict[str, Any]) -> bytes:
    return json.dumps({"jsonrpc": "2.0", "id": request_id, "result": result}).encode()


def json_rpc_error(request_id: Any, code: int, message: str) -> bytes:
    return json.dumps({"jsonrpc": "2.0", "id": request_id, "error": {"code": code, "message": message}}).encode()


def result_for(ex: Exchange) -> dict[str, Any]:
    """The result the echo responders send: names the request it answers."""
    return {"content": [{"type": "text", "text": "ok"}], "echo": ex.request.json.get("params"),
            "conn": ex.request.conn}


async def echo(ex: Exchange) -> bool:
    """200 application/json with the result for this request; keep-alive."""
    body = json_rpc_result(ex.request.rpc_id, result_for(ex))
    await ex.send(response_bytes(200, [("content-type", "application/json")], body))
    return True


async def echo_then_close(ex: Exchange) -> bool:
    """As `echo` (no `connection: close`), then close the connection: a server's keep-alive timeout."""
    await echo(ex)
    return False


def fixed(data: bytes, keep: bool = True) -> Responder:
    """Answer these exact bytes."""
    async def respond(ex: Exchange) -> bool:
        await ex.send(data)
        return keep
    return respond


async def hang(ex: Exchange) -> bool:
    """Never answer; return once the client has closed the connection."""
    await ex.wait_client_close()
    return False


@dataclass
class ScriptedServer:
    default: Responder = echo
    requests: list[Received] = field(default_factory=list)
    connections: int = 0  # accepted
    client_closed: set[int] = field(default_factory=set)  # connections whose client side closed (EOF seen)
    _queue: list[Responder] = field(default_factory=list)
    _server: asyncio.Server | None = None
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)
    _changed: asyncio.Condition = field(default_factory=asyncio.Condition)

    async def start(self) -> ScriptedServer:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    @property
    def port(self) -> int:
        assert self._server is not None
        return int(self._server.sockets[0].getsockname()[1])

    def url(self, target: str = "/mcp") -> str:
        return f"http://127.0.0.1:{self.port}{target}"

    def answer(self, *responders: Responder) -> None:
        self._queue.extend(responders)

    async def wait(self, predicate: Callable[[], bool], timeout: float = 5.0) -> None:  # noqa: ASYNC109
        """Until `predicate()` (checked whenever the server's state changes); TimeoutError otherwise."""
        async with asyncio.timeout(timeout), self._changed:
            await self._changed.wait_for(predicate)

    async def _note(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.get_running_loop().create_task(self._connection(reader, writer))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = self.connections
        self.connections += 1
        await self._note()
        try:
            while True:
                request = await self._read_request(conn, reader)
                if request is None:  # the client closed the connection between requests
                    self.client_closed.add(conn)
                    break
                self.requests.append(request)
                await self._note()
                responder = self._queue.pop(0) if self._queue else self.default
                keep = await responder(Exchange(request, reader, writer, self))
                if reader.at_eof():
                    self.client_closed.add(conn)
                if not keep:
                    break
        except (OSError, asyncio.IncompleteReadError):
            self.client_closed.add(conn)
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
            await self._note()

    @staticmethod
    async def _read_request(conn: int, reader: asyncio.StreamReader) -> Received | None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError as exc:
            if exc.partial:
                raise
            return None
        request_line, *lines = head[:-4].decode("latin-1").split("\r\n")
        headers = [(k.strip().lower(), v.strip()) for k, v in (line.split(":", 1) for line in lines)]
        length = int(next((v for k, v in headers if k == "content-length"), "0"))
        body = await reader.readexactly(length)
        return Received(conn, request_line, headers, body)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
