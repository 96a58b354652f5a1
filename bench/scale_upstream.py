"""The waiting MCP upstream of scale_sessions: one tool, `wait(seconds)`, that sleeps and answers.

`python bench/scale_upstream.py` serves an mcp SDK `MCPServer` (modern era, 2026-07-28 stateless; the
`initialize` era answered statelessly too, so no client leaves a session behind) under uvicorn on
127.0.0.1 and prints its port once ready; the endpoint is `http://127.0.0.1:PORT/mcp`. A wait is an
`asyncio.sleep`, so one process holds thousands of them at once; what it spends per call is the SDK's
request handling, the same for every system that calls it. Runs in the project's virtualenv and imports
nothing from rlgate, so both rlgate's gateway and the OpenEnv servers (their own virtualenv) call it alike.
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import socket
import sys

import uvicorn
from mcp.server import MCPServer
from starlette.applications import Starlette

TOOL = "wait"
BACKLOG = 16384  # a batch opens its connections at once; the kernel caps this at net.core.somaxconn


def raise_nofile() -> None:
    """Soft RLIMIT_NOFILE up to the hard limit: each open session may hold a connection here."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def build_app() -> Starlette:
    server = MCPServer("scale-upstream", log_level="WARNING")  # no INFO line per request

    @server.tool(name=TOOL, description="Wait `seconds` seconds, then answer with how long was asked.")
    async def wait(seconds: float) -> dict[str, float]:
        await asyncio.sleep(seconds)
        return {"waited_s": seconds}

    # json_response=False as localfleet's modern era: a modern client cancels by closing the POST, which only
    # the SSE-capable path watches; a call shorter than the SDK's ping interval is still answered as JSON.
    return server.streamable_http_app(stateless_http=True, json_response=False, session_idle_timeout=None)


async def serve(port: int) -> None:
    # IPPROTO_TCP named: asyncio sets TCP_NODELAY only on sockets whose proto says TCP (0 does not), and
    # without it a keep-alive response written in two parts waits ~40 ms for the client's delayed ACK.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    config = uvicorn.Config(build_app(), log_level="warning", access_log=False, backlog=BACKLOG, lifespan="on")
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        if task.done():
            await task
            raise SystemExit("uvicorn stopped before it started")
        await asyncio.sleep(0.05)
    print(sock.getsockname()[1], flush=True)
    await task


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="scale_upstream", description=__doc__)
    parser.add_argument("--port", type=int, default=0, help="0: any free port (printed once ready)")
    args = parser.parse_args(argv)
    raise_nofile()
    asyncio.run(serve(args.port))


if __name__ == "__main__":
    main(sys.argv[1:])
