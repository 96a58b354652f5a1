"""One-off tool discovery: connect to each endpoint, list every page, union with precedence, filter, close."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import mcp_types as mt

from rlgate.core.errors import MAX_MESSAGE, clip
from rlgate.core.redact import public_url
from rlgate.mcpclient.catalog import ToolCatalog, union_tools
from rlgate.mcpclient.connect import list_tools_forwarding, open_client
from rlgate.mcpclient.errors import EndpointNotFound, UpstreamUnavailable
from rlgate.mcpclient.transport import HttpSettings
from rlgate.runtime import tracing

log = logging.getLogger(__name__)


async def discover_tools(
    endpoints: Sequence[str],
    *,
    timeout: float = 30.0,  # noqa: ASYNC109 (bounds each endpoint; documented API name)
    tool_filter: Mapping[str, Any] | None = None,
    modality: str = "",
    http: HttpSettings | None = None,
) -> ToolCatalog:
    """The filtered union of `endpoints`' tools, connections opened and closed within this call.

    An endpoint answering 404 is dropped with a logged reason (`catalog.dropped`). Any other failure raises
    `UpstreamUnavailable` (a partial list must not be cached as the environment's tool list). `timeout`
    bounds each endpoint."""
    settings = http or HttpSettings.shared()

    async def one(url: str) -> list[mt.Tool]:
        attributes = {"mcp.method.name": "tools/list", "url.full": public_url(url)}
        with tracing.span("upstream tools/list", attributes):
            async with asyncio.timeout(timeout), open_client(url, settings, timeout) as client:
                return await list_tools_forwarding(client, url)

    results = await asyncio.gather(*(one(u) for u in endpoints), return_exceptions=True)
    per_endpoint: list[tuple[str, Sequence[mt.Tool]]] = []
    dropped: dict[str, str] = {}
    for url, res in zip(endpoints, results, strict=True):
        if isinstance(res, EndpointNotFound):
            dropped[url] = str(res)
            log.info("endpoint %s dropped: %s", url, res)
        elif isinstance(res, BaseException):
            if isinstance(res, TimeoutError):
                raise UpstreamUnavailable(f"{url}: no answer within {timeout:.1f}s") from res
            # An upstream's error message can be megabytes (up to the reply limit); callers echo and log it.
            if isinstance(res, UpstreamUnavailable):
                raise type(res)(clip(res, MAX_MESSAGE)) from res
            raise UpstreamUnavailable(clip(f"{url}: {res}", MAX_MESSAGE)) from res
        else:
            per_endpoint.append((url, res))
    return union_tools(per_endpoint, dropped).filtered(tool_filter, modality)
