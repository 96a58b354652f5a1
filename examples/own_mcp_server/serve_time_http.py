"""Serve the reference MCP time server (`mcp-server-time`, from PyPI) over streamable HTTP.

`mcp-server-time` speaks stdio only, but its server is the MCP SDK's `MCPServer`, and the SDK serves an
`MCPServer` over streamable HTTP itself: no separate bridge process. The endpoint is
`http://HOST:PORT/mcp` (both MCP protocol eras).

    python examples/own_mcp_server/serve_time_http.py --port 8931
"""

from __future__ import annotations

import argparse
import asyncio

from mcp_server_time.server import create_server


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1", help="listen address (loopback by default)")
    parser.add_argument("--port", type=int, default=8931, help="listen port")
    parser.add_argument("--local-timezone", default="UTC", help="the server's local timezone (IANA name)")
    args = parser.parse_args()
    server = create_server(args.local_timezone)
    asyncio.run(server.run_streamable_http_async(host=args.host, port=args.port, streamable_http_path="/mcp"))


if __name__ == "__main__":
    main()
