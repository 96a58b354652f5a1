"""The OpenEnv side of step_vs_openenv; runs INSIDE the separate OpenEnv virtualenv (openenv-core 0.3.0).

Not importable from the rlgate venv (and imports nothing from rlgate or bench). Two commands:

  serve  an `MCPEnvironment` served by openenv-core's own FastAPI server (`create_fastapi_app`, WebSocket
         `/ws`, one environment per connection) under uvicorn on 127.0.0.1. Its one FastMCP tool either
         forwards the `CallToolAction` to a localfleet instance's MCP endpoint (--mode forward: each
         session maps onto one of the given --upstream URLs round-robin and holds one persistent mcp
         client to it, the best case for this design), or answers in-process with a canned result of the same size
         (--mode local: the ceiling, no tool hop). Prints its port once ready.
  drive  openenv-core's own client (`GenericEnvClient`, one WebSocket session per worker). Prints "ready",
         then for each stdin line {"url", "total", "sessions", "warmup", "duration_s"}: connect and reset
         `sessions` clients, run `warmup` then up to `total` steps of one `CallToolAction` spread over
         them (none started after `duration_s`), and print one JSON line
         {"latencies_s": [...], "elapsed_s": ...}. A step whose observation carries an error fails the run.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import socket
import sys
import time
from typing import Any

import httpx2
import uvicorn
from fastmcp import FastMCP
from fastmcp.tools.base import Tool, ToolResult
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from openenv.core.env_server.http_server import create_fastapi_app
from openenv.core.env_server.mcp_environment import MCPEnvironment
from openenv.core.env_server.mcp_types import CallToolAction, CallToolObservation
from openenv.core.env_server.types import Observation, State
from openenv.core.generic_client import GenericEnvClient
from pydantic import PrivateAttr

TIMEOUT_S = 60.0


class Upstream:
    """One persistent mcp client to one MCP endpoint, owned by one task (enter and exit in that task)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._client: Client | None = None
        self._ready: asyncio.Event | None = None
        self._error = ""

    async def client(self) -> Client:
        if self._ready is None:
            self._ready = asyncio.Event()
            OWNERS.add(asyncio.get_running_loop().create_task(self._own(self._ready)))
        await self._ready.wait()
        if self._client is None:
            raise RuntimeError(f"upstream {self.url} unavailable: {self._error}")
        return self._client

    async def _own(self, ready: asyncio.Event) -> None:
        try:
            async with (
                httpx2.AsyncClient(timeout=httpx2.Timeout(30.0, read=TIMEOUT_S)) as http,
                Client(streamable_http_client(self.url, http_client=http), read_timeout_seconds=TIMEOUT_S) as client,
            ):
                self._client = client
                ready.set()
                await asyncio.Event().wait()  # held until the server process ends
        except Exception as exc:  # reported to the caller of client()
            self._error = repr(exc)
            self._client = None
        finally:
            ready.set()


OWNERS: set[asyncio.Task[None]] = set()


class ForwardTool(Tool):
    """A FastMCP tool that forwards its call to the same tool on a remote MCP endpoint.

    Each environment (= WebSocket session) has its own tool and so its own upstream client, as each
    rlgate session has its own upstream client in the gateway. (One client shared by all sessions,
    entered from the first session's request context, ran 2-3x slower under concurrency.)
    """

    upstream_url: str
    _upstream: Upstream | None = PrivateAttr(default=None)

    async def run(self, arguments: dict[str, Any]) -> ToolResult:
        if self._upstream is None:
            self._upstream = Upstream(self.upstream_url)
        client = await self._upstream.client()
        result = await client.call_tool(self.name, arguments)
        return ToolResult(
            content=result.content, structured_content=result.structured_content, is_error=result.is_error
        )


class LocalTool(Tool):
    """The same tool answered in-process (a canned result of the real one's size): no tool hop at all."""

    canned: dict[str, Any]

    async def run(self, arguments: dict[str, Any]) -> ToolResult:
        return ToolResult(structured_content=self.canned)


class BenchEnv(MCPEnvironment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self, tool: Tool) -> None:
        server = FastMCP("bench")
        server.add_tool(tool)
        super().__init__(server)
        self._state = State(episode_id=None, step_count=0)

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> Observation:
        self._state = State(episode_id=episode_id, step_count=0)
        return Observation(done=False, reward=None, metadata={})

    def _step_impl(self, action: Any, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        return Observation(done=False, reward=None, metadata={"error": "only MCP actions are served"})

    @property
    def state(self) -> State:
        return self._state


async def serve(args: argparse.Namespace) -> None:
    spec = json.loads(args.spec)  # {"name", "description", "input_schema", "canned"}
    urls = itertools.cycle(args.upstream or [""])

    def factory() -> BenchEnv:
        if args.mode == "forward":
            tool: Tool = ForwardTool(
                name=spec["name"],
                description=spec["description"],
                parameters=spec["input_schema"],
                upstream_url=next(urls),
            )
        else:
            tool = LocalTool(
                name=spec["name"],
                description=spec["description"],
                parameters=spec["input_schema"],
                canned=spec["canned"],
            )
        return BenchEnv(tool)

    app = create_fastapi_app(factory, CallToolAction, CallToolObservation, max_concurrent_envs=args.max_sessions)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", ws_max_size=100 * 2**20))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        if task.done():
            await task
            raise SystemExit("uvicorn stopped before it started")
        await asyncio.sleep(0.05)
    print(sock.getsockname()[1], flush=True)
    await task


async def drive(args: argparse.Namespace) -> None:
    """Print "ready", then answer each stdin line (one measurement request) with one JSON line."""
    action = {"type": "call_tool", "tool_name": args.tool, "arguments": json.loads(args.arguments)}
    print("ready", flush=True)
    loop = asyncio.get_running_loop()
    while line := await loop.run_in_executor(None, sys.stdin.readline):
        request = json.loads(line)
        result = await measure(
            request["url"], action, request["total"], request["sessions"], request["warmup"], request.get("duration_s")
        )
        print(json.dumps(result), flush=True)


async def measure(
    url: str, action: dict[str, Any], total: int, sessions: int, warmup: int, duration_s: float | None
) -> dict[str, Any]:
    """Same closed loop as bench.harness.closed_loop: no step starts after `duration_s`."""
    clients = [GenericEnvClient(base_url=url, message_timeout_s=TIMEOUT_S) for _ in range(sessions)]
    try:
        for client in clients:
            await client.connect()
            await client.reset()

        async def run(count: int, latencies: list[float] | None, deadline: float | None) -> None:
            counter = iter(range(count))

            async def worker(client: GenericEnvClient) -> None:
                for _ in counter:
                    t0 = time.perf_counter()
                    if deadline is not None and t0 >= deadline:
                        return
                    result = await client.step(action)
                    if result.observation.get("error"):
                        raise RuntimeError(f"OpenEnv step returned an error: {result.observation['error']}")
                    if latencies is not None:
                        latencies.append(time.perf_counter() - t0)

            await asyncio.gather(*(worker(c) for c in clients))

        await run(warmup, None, None)
        latencies: list[float] = []
        start = time.perf_counter()
        await run(total, latencies, None if duration_s is None else start + duration_s)
        return {"latencies_s": [round(x, 7) for x in latencies], "elapsed_s": time.perf_counter() - start}
    finally:
        for client in clients:
            await client.close()


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="openenv_side")
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve")
    s.add_argument("--mode", choices=("forward", "local"), required=True)
    s.add_argument("--spec", required=True, help="JSON: name, description, input_schema, canned")
    s.add_argument("--upstream", action="append", default=[], help="MCP endpoint URL (forward mode)")
    s.add_argument("--max-sessions", type=int, default=64)
    d = sub.add_parser("drive")
    d.add_argument("--tool", required=True)
    d.add_argument("--arguments", default="{}")
    args = parser.parse_args(argv)
    asyncio.run(serve(args) if args.command == "serve" else drive(args))


if __name__ == "__main__":
    main(sys.argv[1:])
