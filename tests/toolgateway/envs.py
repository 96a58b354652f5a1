"""localfleet environments for the toolgateway tests: the same tools in both MCP eras (`gw` modern,
`gw-legacy` legacy), built to make gateway behaviour observable from the tool side.

Every tool is served on both `{root}mcp` and `{root}api/v1/mcp` (localfleet registers an environment's
tools on both; the aggregator adds `computer`), so `where` tells which endpoint a call was routed to.
Loaded by localfleet with `--environments tests.toolgateway.envs:gateway_environments`.
"""

from __future__ import annotations

import asyncio
import base64
from typing import Any

from mcp.server.mcpserver import Context
from mcp.server.mcpserver.exceptions import ToolError
from mcp.types import ImageContent
from pydantic import StrictInt

from tests.support.localfleet import _NOTES_SCHEMA, _seed_notes

PNG = base64.b64decode(
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg=="
)


def _register(server: Any) -> None:
    @server.tool()
    def add(n: StrictInt, m: StrictInt = 1) -> str:
        """Add two integers (strict: a float such as 5.0 is rejected by the tool itself)."""
        return f"{n + m} ({type(n).__name__})"

    @server.tool()
    def where(ctx: Context) -> str:
        """The URL path this call was served on."""
        return str(ctx.request_context.request.url.path)  # type: ignore[union-attr]

    @server.tool()
    async def sleep(seconds: float) -> str:
        """Sleep, then answer."""
        await asyncio.sleep(seconds)
        return f"slept {seconds}"

    @server.tool()
    def fail(message: str) -> str:
        """Always fails with the given message."""
        raise ToolError(message)

    @server.tool()
    def big(size: int) -> str:
        """A text of `size` characters."""
        return "x" * size

    @server.tool()
    def picture() -> ImageContent:
        """A 1x1 PNG."""
        return ImageContent(data=base64.b64encode(PNG).decode(), mime_type="image/png")

    @server.tool()
    def hang() -> str:
        """Configured to hang by the localfleet fault plan in the tests."""
        return "did not hang"


def gateway_environments() -> list[Any]:
    from rlgate.localfleet.environments.base import EnvironmentSpec

    common: dict[str, Any] = dict(
        version="v1",
        description="toolgateway test tools",
        schema_sql=_NOTES_SCHEMA,
        seed=_seed_notes,
        register_tools=_register,
    )
    return [
        EnvironmentSpec(env_id="gw", name="Gateway tools", mcp_era="modern", **common),
        EnvironmentSpec(env_id="gw-legacy", name="Gateway tools (legacy MCP)", mcp_era="legacy", **common),
    ]
