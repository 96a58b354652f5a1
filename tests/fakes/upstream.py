"""A fake of the MCP side of the gateway: what `ToolGateway` calls on `rlgate.mcpclient.pool.UpstreamPool`
(`session`) and on a session's `SessionUpstreams` (`cached_catalog`, `catalog`, `call`,
`last_forced_refresh`), with no connection behind it.

Every endpoint serves the tools it was given (the catalog is built by the real `rlgate.mcpclient` code, so
precedence and filters are the real ones). Each tool call takes the next scripted `Outcome` of its tool (or
the default answer) and is recorded in `calls`; `call(...)` honours `timeout_s` as `EndpointClient` does
(CallTimedOut, sent). Tests wait with `next_call()` and `FakeCall.finished` instead of sleeping."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import mcp_types as mt

from rlgate.mcpclient.catalog import union_tools
from rlgate.mcpclient.errors import (
    CallLost,
    CallNotSent,
    CallRejected,
    CallTimedOut,
    ReplyTooLarge,
)
from rlgate.mcpclient.session import SessionCatalog

ENDPOINT = "http://upstream.invalid/mcp"


@dataclass
class FakeCall:
    """One tool call that reached the fake upstream."""

    session_id: str
    endpoint: str
    name: str
    arguments: dict[str, Any]
    timeout_s: float
    finished: asyncio.Event = field(default_factory=asyncio.Event)
    cancelled: bool = False
    ran: bool = False  # the tool's side effect happened (an answer, a lost reply, a reply too large)


Outcome = Callable[[FakeCall], Awaitable[mt.CallToolResult]]


def answer(text: str = "ok", *, structured: Any = None, is_error: bool = False) -> Outcome:
    """The tool ran and answered."""

    async def outcome(call: FakeCall) -> mt.CallToolResult:
        call.ran = True
        return mt.CallToolResult(content=[mt.TextContent(text=text)], structured_content=structured, is_error=is_error)

    return outcome


def not_sent(message: str = "connection refused") -> Outcome:
    """The call provably never reached the upstream."""

    async def outcome(call: FakeCall) -> mt.CallToolResult:
        raise CallNotSent(message)

    return outcome


def lost(message: str = "connection reset after the request was written") -> Outcome:
    """The tool ran; the connection died before its reply."""

    async def outcome(call: FakeCall) -> mt.CallToolResult:
        call.ran = True
        raise CallLost(message)

    return outcome


def timed_out(*, sent: bool = True) -> Outcome:
    """The call timeout passed (sent: the request went out and the tool may have partly run)."""

    async def outcome(call: FakeCall) -> mt.CallToolResult:
        call.ran = sent
        raise CallTimedOut(f"tools/call {call.name!r} timed out", sent=sent)

    return outcome


def rejected(code: int = -32602, message: str = "invalid params") -> Outcome:
    """The upstream answered with a JSON-RPC error."""

    async def outcome(call: FakeCall) -> mt.CallToolResult:
        raise CallRejected(message, code)

    return outcome


def too_large() -> Outcome:
    """The tool ran; its reply passed the reply limit and was cut off unread."""

    async def outcome(call: FakeCall) -> mt.CallToolResult:
        call.ran = True
        raise ReplyTooLarge("reply larger than 8388608 bytes", -32603)

    return outcome


def hang() -> Outcome:
    """The tool runs and never answers: the call ends only when it is cancelled (or its timeout passes)."""

    async def outcome(call: FakeCall) -> mt.CallToolResult:
        call.ran = True
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    return outcome


class FakeSessionUpstreams:
    """A session's upstreams, as `ToolGateway` uses `SessionUpstreams`."""

    def __init__(self, pool: FakeUpstreamPool, session_id: str, endpoints: Sequence[str]) -> None:
        self._pool = pool
        self.session_id = session_id
        self.endpoints = tuple(endpoints)
        self.last_forced_refresh = 0.0
        self.listings = 0  # catalog() calls that listed (not served from the cache)

    def _build(self, tool_filter: Mapping[str, Any] | None, modality: str) -> SessionCatalog:
        served = [(url, self._pool.tools.get(url, self._pool.tools.get("*", []))) for url in self.endpoints]
        down = {url: self._pool.unavailable[url] for url in self.endpoints if url in self._pool.unavailable}
        listed = [(url, tools) for url, tools in served if url not in down]
        return SessionCatalog.build(union_tools(listed), down, tool_filter, modality)

    def cached_catalog(self, tool_filter: Mapping[str, Any] | None = None, modality: str = "") -> SessionCatalog | None:
        return None if self._pool.unavailable else self._build(tool_filter, modality)

    async def catalog(
        self,
        timeout_s: float,
        tool_filter: Mapping[str, Any] | None = None,
        modality: str = "",
        *,
        refresh: bool = False,
    ) -> SessionCatalog:
        await asyncio.sleep(0)  # a listing is a round trip: other tasks run meanwhile
        self.listings += 1
        return self._build(tool_filter, modality)

    async def call(self, endpoint: str, name: str, arguments: dict[str, Any], timeout_s: float) -> mt.CallToolResult:
        call = FakeCall(self.session_id, endpoint, name, dict(arguments), timeout_s)
        self._pool.calls.append(call)
        self._pool.arrivals.put_nowait(call)
        script = self._pool.script.get(name)
        outcome = script.popleft() if script else self._pool.default
        start = time.monotonic()
        try:
            async with asyncio.timeout(timeout_s):
                return await outcome(call)
        except TimeoutError:  # as EndpointClient: the call timeout passed after the request went out
            raise CallTimedOut(
                f"tools/call {name!r} did not answer within {time.monotonic() - start:.2f}s", sent=True
            ) from None
        except asyncio.CancelledError:
            call.cancelled = True
            raise
        finally:
            call.finished.set()


class FakeUpstreamPool:
    """Stands in for `UpstreamPool`. `tools[url]` (or `tools["*"]` for every endpoint): what each endpoint
    lists; `unavailable[url]`: endpoints that cannot be listed (the reason); `will(name, *outcomes)`: the
    next calls of a tool; `calls`: every call that reached an upstream, in order."""

    def __init__(self, tools: Sequence[mt.Tool] = (), *, default: Outcome | None = None) -> None:
        self.tools: dict[str, list[mt.Tool]] = {"*": list(tools) or [echo_tool()]}
        self.unavailable: dict[str, str] = {}
        self.script: dict[str, deque[Outcome]] = {}
        self.default = default or answer()
        self.calls: list[FakeCall] = []
        self.arrivals: asyncio.Queue[FakeCall] = asyncio.Queue()  # every call as it arrives (`next_call`)
        self.sessions: dict[str, FakeSessionUpstreams] = {}

    def will(self, name: str, *outcomes: Outcome) -> None:
        """The next calls of tool `name` end with these outcomes, in order (then the default answer)."""
        self.script.setdefault(name, deque()).extend(outcomes)

    async def next_call(self, timeout_s: float = 10.0) -> FakeCall:
        """The next call to arrive (bounded wait)."""
        return await asyncio.wait_for(self.arrivals.get(), timeout_s)

    def runs(self, name: str) -> int:
        """How many calls of `name` ran the tool (or may have)."""
        return sum(c.ran for c in self.calls if c.name == name)

    def session(self, session_id: str, endpoints: Sequence[str]) -> FakeSessionUpstreams:
        current = self.sessions.get(session_id)
        if current is None or current.endpoints != tuple(endpoints):
            current = self.sessions[session_id] = FakeSessionUpstreams(self, session_id, endpoints)
        return current

    async def close_session(self, session_id: str) -> None:
        self.sessions.pop(session_id, None)

    async def close(self) -> None:
        self.sessions.clear()


def echo_tool(name: str = "echo") -> mt.Tool:
    """A tool taking any object."""
    return mt.Tool(name=name, input_schema={"type": "object"})
