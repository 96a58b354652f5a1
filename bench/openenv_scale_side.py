"""The OpenEnv side of scale_sessions; runs INSIDE the OpenEnv virtualenv (openenv-core 0.3.0).

Not importable from the rlgate venv (and imports nothing from rlgate or bench). Two commands:

  serve  openenv-core's own FastAPI server (`create_fastapi_app`: WebSocket `/ws`, one environment and one
         executor thread per connection) under uvicorn on 127.0.0.1; prints its port once ready.
         --mode sleep: OpenEnv's published scaling setup (openenv-scaling's benchmark environment): a plain
           `Environment` whose step sleeps `wait_seconds` in its session's executor thread.
         --mode forward: an `MCPEnvironment` whose one FastMCP tool, `wait`, forwards the `CallToolAction`
           to the same waiting MCP upstream rlgate's gateway calls (bench/scale_upstream.py). Each session
           holds its own mcp client (and HTTP connection) to it for the session's lifetime, opened with the
           session and closed with it, as the gateway holds one per session; all of them share one SSL
           context, as the gateway's do, so no session builds one (~20 ms of CPU each).
  drive  openenv-core's own client (`GenericEnvClient`). Prints "ready", then for each stdin line
         {"url", "sessions", "wait", "timeout_s", "mode"} launches `sessions` sessions at once, each:
         connect, reset, one step, close, within `timeout_s`; prints one JSON line {"sessions": [[ok,
         connect_s, reset_s, step_s, close_s, total_s, error], ...], "wall_s"}. A step whose observation
         carries an error fails its session.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import resource
import socket
import ssl
import sys
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx2
import uvicorn
from fastmcp import FastMCP
from fastmcp.tools.base import Tool, ToolResult
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from openenv.core.env_server.http_server import create_fastapi_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.mcp_environment import MCPEnvironment
from openenv.core.env_server.mcp_types import CallToolAction, CallToolObservation
from openenv.core.env_server.types import Action, Observation, State
from openenv.core.generic_client import GenericEnvClient
from pydantic import PrivateAttr

TOOL = "wait"
BACKLOG = 16384  # the batch connects at once; the kernel caps this at net.core.somaxconn
WAIT_SCHEMA = {"type": "object", "properties": {"seconds": {"type": "number"}}, "required": ["seconds"]}


def raise_nofile() -> None:
    """Soft RLIMIT_NOFILE up to the hard limit: every session holds a socket (two in forward mode)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


# -- --mode sleep: the published setup ----------------------------------------------------------------------
class WaitAction(Action):
    wait_seconds: float = 0.0


class WaitObservation(Observation):
    waited_seconds: float = 0.0


class SleepEnv(Environment):
    """Step sleeps in the session's own executor thread (openenv-core runs a sync step there)."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._state = State(episode_id=None, step_count=0)

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> WaitObservation:
        self._state = State(episode_id=episode_id, step_count=0)
        return WaitObservation()

    def step(self, action: WaitAction, timeout_s: float | None = None, **kwargs: Any) -> WaitObservation:
        self._state.step_count += 1
        if action.wait_seconds > 0:
            time.sleep(action.wait_seconds)
        return WaitObservation(waited_seconds=action.wait_seconds)

    @property
    def state(self) -> State:
        return self._state


# -- --mode forward: the same wait, as a remote MCP tool ----------------------------------------------------
class ForwardTool(Tool):
    """Forwards its call to the upstream's `wait` tool through its environment's upstream client."""

    _env: Any = PrivateAttr(default=None)  # its ForwardEnv

    async def run(self, arguments: dict[str, Any]) -> ToolResult:
        assert self._env is not None and self._env.upstream is not None, "called outside its session"
        result = await self._env.upstream.call_tool(self.name, arguments)
        return ToolResult(
            content=result.content, structured_content=result.structured_content, is_error=result.is_error
        )


class ForwardEnv(MCPEnvironment):
    """An MCPEnvironment whose session also holds one upstream mcp client.

    openenv-core enters `mcp_session()` when it creates the session and again for the WebSocket's lifetime
    (and per tool call), all from the connection's task; the upstream client is opened on the first entry
    and closed on the last exit, so it lives exactly as long as the session, entered and left in one task.
    """

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self, upstream_url: str, http: Callable[[], httpx2.AsyncClient]) -> None:
        server = FastMCP("scale")
        tool = ForwardTool(name=TOOL, description="Wait `seconds` seconds (upstream).", parameters=WAIT_SCHEMA)
        tool._env = self
        server.add_tool(tool)
        super().__init__(server)
        self._state = State(episode_id=None, step_count=0)
        self._upstream_url = upstream_url
        self._http = http  # makes this session's HTTP client
        self._depth = 0
        self._upstream_stack: contextlib.AsyncExitStack | None = None
        self.upstream: Client | None = None

    @contextlib.asynccontextmanager
    async def mcp_session(self) -> AsyncIterator[Any]:
        async with super().mcp_session() as client:
            if self._depth == 0:
                stack = contextlib.AsyncExitStack()
                http = await stack.enter_async_context(self._http())
                self.upstream = await stack.enter_async_context(
                    Client(streamable_http_client(self._upstream_url, http_client=http))
                )
                self._upstream_stack = stack
            self._depth += 1
            try:
                yield client
            finally:
                self._depth -= 1
                if self._depth == 0 and self._upstream_stack is not None:
                    stack, self._upstream_stack, self.upstream = self._upstream_stack, None, None
                    await stack.aclose()

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> Observation:
        self._state = State(episode_id=episode_id, step_count=0)
        return Observation(done=False, reward=None, metadata={})

    def _step_impl(self, action: Any, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        return Observation(done=False, reward=None, metadata={"error": "only MCP actions are served"})

    @property
    def state(self) -> State:
        return self._state


async def serve(args: argparse.Namespace) -> None:
    # IPPROTO_TCP named: asyncio sets TCP_NODELAY only on sockets whose proto says TCP (0 does not), and
    # without it a keep-alive response written in two parts waits ~40 ms for the client's delayed ACK.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    if args.mode == "sleep":
        app = create_fastapi_app(SleepEnv, WaitAction, WaitObservation, max_concurrent_envs=args.max_sessions)
    else:
        tls = ssl.create_default_context()  # built once (plain HTTP here; httpx builds one per client unless given)
        timeout = httpx2.Timeout(30.0, read=args.timeout_s)

        def http() -> httpx2.AsyncClient:
            return httpx2.AsyncClient(verify=tls, timeout=timeout, trust_env=False)

        def factory() -> ForwardEnv:
            return ForwardEnv(args.upstream, http)

        app = create_fastapi_app(factory, CallToolAction, CallToolObservation, max_concurrent_envs=args.max_sessions)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, backlog=BACKLOG))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        if task.done():
            await task
            raise SystemExit("uvicorn stopped before it started")
        await asyncio.sleep(0.05)
    print(sock.getsockname()[1], flush=True)
    await task


# -- drive ------------------------------------------------------------------------------------------------
async def session(url: str, action: dict[str, Any], timeout_s: float) -> list[Any]:
    """[ok, connect_s, reset_s, step_s, close_s, total_s, error] of one connect-reset-step-close session."""
    client = GenericEnvClient(base_url=url, connect_timeout_s=timeout_s, message_timeout_s=timeout_s)
    marks = [time.perf_counter()]
    try:
        async with asyncio.timeout(timeout_s):
            await client.connect()
            marks.append(time.perf_counter())
            await client.reset()
            marks.append(time.perf_counter())
            result = await client.step(action)
            marks.append(time.perf_counter())
            if result.observation.get("error"):
                raise RuntimeError(f"step observation carries an error: {result.observation['error']}")
            await client.close()
            marks.append(time.perf_counter())
        phases = [round(b - a, 6) for a, b in itertools.pairwise(marks)]
        return [True, *phases, round(marks[-1] - marks[0], 6), ""]
    except Exception as exc:  # the session failed; what failed is reported, the batch goes on
        with contextlib.suppress(Exception):
            if client._ws is not None:  # no graceful close after a failure: free the server's session now
                client._ws.transport.abort()
        text = " ".join(f"{type(exc).__name__}: {exc}".split())[:200]
        return [False, None, None, None, None, round(time.perf_counter() - marks[0], 6), text]


async def batch(request: dict[str, Any]) -> dict[str, Any]:
    wait = float(request["wait"])
    if request["mode"] == "sleep":
        action: dict[str, Any] = {"wait_seconds": wait}
    else:
        action = {"type": "call_tool", "tool_name": TOOL, "arguments": {"seconds": wait}}
    start = time.perf_counter()
    sessions = await asyncio.gather(
        *(session(request["url"], action, float(request["timeout_s"])) for _ in range(int(request["sessions"])))
    )
    return {"sessions": sessions, "wall_s": time.perf_counter() - start}


async def drive() -> None:
    print("ready", flush=True)
    loop = asyncio.get_running_loop()
    while line := await loop.run_in_executor(None, sys.stdin.readline):
        print(json.dumps(await batch(json.loads(line))), flush=True)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="openenv_scale_side")
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve")
    s.add_argument("--mode", choices=("sleep", "forward"), required=True)
    s.add_argument("--upstream", default="", help="the waiting MCP endpoint (forward mode)")
    s.add_argument("--max-sessions", type=int, required=True)
    s.add_argument("--timeout-s", type=float, default=120.0, help="read timeout of an upstream call")
    sub.add_parser("drive")
    args = parser.parse_args(argv)
    if args.command == "serve" and args.mode == "forward" and not args.upstream:
        parser.error("--mode forward needs --upstream")
    raise_nofile()
    asyncio.run(serve(args) if args.command == "serve" else drive())


if __name__ == "__main__":
    main(sys.argv[1:])
