"""The MCP endpoints of every instance: `{root}mcp` (the app's tools) and `{root}api/v1/mcp` (aggregator:
the same tools, plus the `computer` tool on instances created with `image_type="mcp"`, as Fleet's).

One `MCPServer` per environment per endpoint kind, not per instance: the ASGI router below picks the
instance from the URL path (`/instances/{id}/mcp`), stores its id in the ASGI scope, and the tools find it
through `instance_db(ctx)` (resolver installed here). The router calls the session manager directly, so
`{root}mcp` answers without the trailing-slash redirect a Starlette `Mount` would add.

Eras: a `modern` environment is served as the mcp SDK serves it (2026-07-28 stateless, plus the
`initialize` era for old clients). A `legacy` environment answers the modern `server/discover` probe (any
non-handshake `MCP-Protocol-Version`) with HTTP 400, so clients fall back to `initialize` +
`Mcp-Session-Id`, as real Fleet images do today; its responses are plain JSON.

Faults and counters are applied here too: `call_tool` is the one place every tool call passes through.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
from collections.abc import Awaitable, Callable
from typing import Any, Literal

import anyio
from mcp.server import MCPServer
from mcp.server.mcpserver import Context
from mcp.server.mcpserver.exceptions import ToolError
from mcp.server.streamable_http_manager import StreamableHTTPSessionManager
from mcp.server.transport_security import TransportSecuritySettings
from mcp_types.version import HANDSHAKE_PROTOCOL_VERSIONS
from starlette.types import Message, Receive, Scope, Send

from rlgate.localfleet.connections import ConnectionTracker
from rlgate.localfleet.counters import Counters
from rlgate.localfleet.environments.base import EnvironmentSpec, InstanceNotFound, set_instance_resolver
from rlgate.localfleet.faults import FaultRegistry
from rlgate.localfleet.instances import Instance, InstanceGone, InstanceRegistry, db_call_scope

log = logging.getLogger(__name__)

Kind = Literal["mcp", "aggregator", "screen"]  # screen: the aggregator of image_type="mcp" instances
SCOPE_KEY = "localfleet.instance_id"
MCP_PATH = re.compile(r"^/instances/(?P<id>[A-Za-z0-9_-]+)/(?P<ep>mcp|api/v1/mcp)/?$")
SESSION_HEADER = b"mcp-session-id"
VERSION_HEADER = b"mcp-protocol-version"
SCREEN_IMAGE_TYPE = "mcp"  # Fleet's image type whose aggregator has the `computer` tool


class InstanceMCPServer(MCPServer):
    """An environment's MCP server whose every tool call goes through localfleet's faults and counters."""

    def __init__(self, spec: EnvironmentSpec, kind: Kind, endpoints: MCPEndpoints) -> None:
        super().__init__(f"{spec.env_id}-{kind}", version=spec.version, instructions=spec.description)
        self.spec = spec
        self.kind = kind
        self.endpoints = endpoints

    async def call_tool(self, name: str, arguments: dict[str, Any], context: Context[Any, Any] | None = None) -> Any:
        ep = self.endpoints
        env_id = self.spec.env_id
        faults = ep.faults.for_env(env_id, self.spec.version)
        request = _request_of(context)
        ep.counters.inc_env(env_id, "tool_calls")
        try:
            with db_call_scope():
                if faults.tool_latency_s:
                    await asyncio.sleep(faults.tool_latency_s)
                if faults.crashes(name):
                    ep.counters.inc_env(env_id, "crashes")
                    client = request.scope.get("client") if request is not None else None
                    if ep.connections is None or not ep.connections.abort(client):
                        log.warning("crash fault: no connection to drop for %s", client)
                    raise ToolError("the MCP endpoint crashed (injected fault)")
                if faults.hangs(name):
                    await asyncio.Event().wait()  # until the client cancels
                if ep.faults.injected_error(faults):
                    ep.counters.inc_env(env_id, "tool_errors_injected")
                    raise ToolError(f"injected fault: {name} failed (tool not run)")
                return await super().call_tool(name, arguments, context)
        except asyncio.CancelledError:
            ep.counters.inc_env(env_id, "cancellations")
            raise
        finally:
            if faults.forget_sessions and request is not None:
                sid = request.headers.get("mcp-session-id")
                if sid:
                    ep.forget_after_response.add(sid)


def _request_of(context: Context[Any, Any] | None) -> Any:
    if context is None:
        return None
    try:
        return context.request_context.request
    except ValueError:  # no request (in-memory client)
        return None


class MCPEndpoints:
    """Builds the per-environment servers and routes `/instances/{id}/(mcp|api/v1/mcp)` to them."""

    def __init__(
        self,
        specs: list[EnvironmentSpec],
        registry: InstanceRegistry,
        faults: FaultRegistry,
        counters: Counters,
        allowed_hosts: list[str],
        register_computer: Callable[[MCPServer], None],
    ) -> None:
        self.registry = registry
        self.faults = faults
        self.counters = counters
        self.connections: ConnectionTracker | None = None
        self.forget_after_response: set[str] = set()
        # instance id -> the legacy-era sessions opened on it (manager key, session id). A client that never
        # sends DELETE, or sends it after the instance is gone (404 here), would otherwise leave its session,
        # with its server task and streams, in the SDK's manager until the idle timeout.
        self._sessions: dict[str, set[tuple[tuple[str, Kind], str]]] = {}
        registry.on_stopped.append(self.discard_instance)
        security = TransportSecuritySettings(
            enable_dns_rebinding_protection=True,
            allowed_hosts=allowed_hosts,
            allowed_origins=[f"http://{h}" for h in allowed_hosts],
        )
        self.servers: dict[tuple[str, Kind], InstanceMCPServer] = {}
        self.managers: dict[tuple[str, Kind], StreamableHTTPSessionManager] = {}
        for spec in specs:
            kinds: tuple[Kind, ...] = ("mcp", "aggregator", "screen")
            for kind in kinds:
                server = InstanceMCPServer(spec, kind, self)
                spec.register_tools(server)
                if kind == "screen":
                    register_computer(server)
                # Modern: json_response=False, because only the SSE-capable path watches for the client
                # closing the POST (how a modern client cancels); short calls are still plain JSON.
                # Legacy: plain JSON responses, as the images speak them; cancellation is a notification.
                server.streamable_http_app(
                    json_response=spec.mcp_era == "legacy",
                    stateless_http=False,
                    transport_security=security,
                    session_idle_timeout=600.0,
                )
                self.servers[(spec.env_key, kind)] = server
                self.managers[(spec.env_key, kind)] = server.session_manager
        set_instance_resolver(self.resolve)

    def resolve(self, ctx: Any) -> Instance | None:
        request = _request_of(ctx)
        if request is None:
            return None
        instance_id = request.scope.get(SCOPE_KEY)
        if instance_id is None:
            return None
        try:
            return self.registry.running(instance_id)
        except InstanceGone as exc:
            raise InstanceNotFound(str(exc)) from exc

    @contextlib.asynccontextmanager
    async def running(self) -> Any:
        """Run every session manager (their task groups live as long as the server)."""
        async with contextlib.AsyncExitStack() as stack:
            for manager in self.managers.values():
                await stack.enter_async_context(manager.run())
            yield

    async def forget_all_sessions(self) -> int:
        """Drop every legacy-era MCP session now (clients then see 'Session not found')."""
        n = 0
        for (env_key, _), manager in self.managers.items():
            n += await self._forget(manager, None, env_key)
        return n

    async def discard_instance(self, instance_id: str) -> None:
        """End every MCP session opened on a stopped instance (they can never serve anything again)."""
        for key, sid in self._sessions.pop(instance_id, set()):
            await _end_sessions(self.managers[key], sid)

    async def _track_session(self, instance_id: str, key: tuple[str, Kind], sid: str) -> None:
        if sid not in _live_sessions(self.managers[key]):  # refused, or already ended
            return
        if instance_id not in self.registry.live:  # deleted while its opening request was served
            await _end_sessions(self.managers[key], sid)
            return
        mine = self._sessions.setdefault(instance_id, set())
        # Sessions the SDK already ended (DELETE, idle timeout) are dropped here, so the set stays small.
        mine.difference_update({s for s in mine if s[1] not in _live_sessions(self.managers[s[0]])})
        mine.add((key, sid))

    async def _forget(self, manager: StreamableHTTPSessionManager, sid: str | None, env_key: str) -> int:
        n = await _end_sessions(manager, sid)
        if n:
            self.counters.inc_env(env_key.partition(":")[0], "sessions_forgotten", n)
        return n

    @staticmethod
    def match(path: str) -> tuple[str, Kind] | None:
        m = MCP_PATH.match(path)
        if m is None:
            return None
        return m.group("id"), ("mcp" if m.group("ep") == "mcp" else "aggregator")

    async def handle(self, scope: Scope, receive: Receive, send: Send, instance_id: str, kind: Kind) -> None:
        try:
            inst = self.registry.running(instance_id)
        except InstanceGone as exc:
            await _json(send, 404, {"detail": str(exc)})
            return
        spec = inst.spec
        faults = self.faults.for_env(spec.env_id, spec.version)
        if kind == "mcp" and faults.mcp_404:
            self.counters.inc_env(spec.env_id, "mcp_404")
            await _json(send, 404, {"detail": "Not Found"})
            return
        receive = await self._count_methods(scope, receive, spec.env_id)
        headers = dict(scope.get("headers") or [])
        version = headers.get(VERSION_HEADER, b"").decode("latin-1")
        if spec.mcp_era == "legacy" and version and version not in HANDSHAKE_PROTOCOL_VERSIONS:
            await _json(
                send,
                400,
                {
                    "jsonrpc": "2.0",
                    "id": None,
                    "error": {"code": -32600, "message": f"Unsupported protocol version: {version}"},
                },
            )
            return
        scope = dict(scope)
        scope[SCOPE_KEY] = instance_id
        if kind == "aggregator" and inst.image_type == SCREEN_IMAGE_TYPE:
            kind = "screen"
        key: tuple[str, Kind] = (spec.env_key, kind)
        manager = self.managers[key]
        opened: list[str] = []

        async def send_noting_session(message: Message) -> None:
            if message["type"] == "http.response.start" and not headers.get(SESSION_HEADER):
                opened.extend(v.decode("latin-1") for k, v in message.get("headers") or [] if k == SESSION_HEADER)
            await send(message)

        if spec.mcp_era == "modern" and version and version not in HANDSHAKE_PROTOCOL_VERSIONS:
            # A 2026-07-28 request runs its tool in this request's task, and closing the POST is how its
            # client cancels: watch for that here, whatever response mode the SDK's handler uses.
            await _cancel_on_disconnect(manager.handle_request, scope, receive, send_noting_session)
        else:
            await manager.handle_request(scope, receive, send_noting_session)
        for new_sid in opened:
            await self._track_session(instance_id, key, new_sid)
        sid = headers.get(SESSION_HEADER, b"").decode("latin-1")
        if sid and sid in self.forget_after_response:
            self.forget_after_response.discard(sid)
            await self._forget(manager, sid, spec.env_key)

    async def _count_methods(self, scope: Scope, receive: Receive, env_id: str) -> Receive:
        """Read the request body (to count JSON-RPC methods) and hand back a receive that replays it."""
        if scope.get("method") != "POST":
            return receive
        chunks: list[bytes] = []
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return _replay(b"", receive, first=message)
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        body = b"".join(chunks)
        try:
            doc = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError):
            doc = None
        for item in doc if isinstance(doc, list) else [doc]:
            if isinstance(item, dict) and isinstance(item.get("method"), str):
                self.counters.mcp_method(env_id, item["method"])
        return _replay(body, receive)


async def _cancel_on_disconnect(app: ASGIHandler, scope: Scope, receive: Receive, send: Send) -> None:
    """Run `app` for one request, cancelling it if the client disconnects before the response is complete.

    `receive` is read by the watcher only; `app` gets the first message (the body), then `http.disconnect`
    once it happened (the SDK's own watcher, if any, keeps working).
    """
    first = await receive()
    disconnected = anyio.Event()
    given = responded = False

    async def app_receive() -> Message:
        nonlocal given
        if not given:
            given = True
            return first
        await disconnected.wait()
        return {"type": "http.disconnect"}

    async def app_send(message: Message) -> None:
        nonlocal responded
        if message["type"] == "http.response.body" and not message.get("more_body"):
            responded = True
        await send(message)

    async with anyio.create_task_group() as tg:

        async def watch() -> None:
            if first["type"] != "http.disconnect":
                while (await receive())["type"] != "http.disconnect":
                    pass
            disconnected.set()
            if not responded:
                tg.cancel_scope.cancel()

        tg.start_soon(watch)
        await app(scope, app_receive, app_send)
        tg.cancel_scope.cancel()


def _live_sessions(manager: StreamableHTTPSessionManager) -> dict[str, Any]:
    return getattr(manager, "_server_instances", {})


async def _end_sessions(manager: StreamableHTTPSessionManager, sid: str | None) -> int:
    """End one session of `manager` (or all with `sid=None`); how many there were."""
    # The SDK has no public "end session" call; _discard_session is what its own DELETE handling uses.
    sessions = _live_sessions(manager)
    victims = list(sessions.items()) if sid is None else [(sid, sessions[sid])] if sid in sessions else []
    for session_id, transport in victims:
        await manager._discard_session(session_id, transport)
    return len(victims)


def _replay(body: bytes, receive: Receive, first: Message | None = None) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return first or {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # later calls: wait for the disconnect, as the SDK expects

    return replay


async def _json(send: Send, status: int, payload: Any) -> None:
    body = json.dumps(payload).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})


ASGIHandler = Callable[[Scope, Receive, Send], Awaitable[None]]
