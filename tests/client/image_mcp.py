"""A real MCP server (the SDK's `MCPServer`, over streamable HTTP) whose tools answer with screens of a known
size: `screenshot` an ImageContent block, `screenshot_json` the text `{"base64_image": "data:image/png;base64,
..."}` (as Fleet's screenshot tools answer), `screenshot_failed` `{"base64_image": null}`.

    python -m tests.client.image_mcp --port N      # http://127.0.0.1:N/mcp
"""

from __future__ import annotations

import argparse
import asyncio
import json

from mcp.server.mcpserver import Image, MCPServer

from tests.client.images import data_url, png


def create_server() -> MCPServer:
    server = MCPServer("rlgate-test-screens", subscriptions=False)

    @server.tool(description="A screenshot of the screen, as an image")
    def screenshot(width: int = 64, height: int = 48) -> list[str | Image]:
        return [f"screen {width}x{height}", Image(data=png(width, height), format="png")]

    @server.tool(description="A screenshot of the screen, as base64 JSON text")
    def screenshot_json(width: int = 32, height: int = 24) -> str:
        return json.dumps({"base64_image": data_url(png(width, height, (30, 200, 30)))})

    @server.tool(description="A screenshot that fails")
    def screenshot_failed() -> str:
        return json.dumps({"base64_image": None})

    return server


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    asyncio.run(
        create_server().run_streamable_http_async(host="127.0.0.1", port=args.port, streamable_http_path="/mcp")
    )


if __name__ == "__main__":
    main()
