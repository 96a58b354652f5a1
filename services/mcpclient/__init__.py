"""MCP for both planes: connecting to upstream endpoints (both MCP eras, through the mcp 2.x SDK), listing
and unioning their tools, and the persistent per-(session, endpoint) clients the agent plane calls tools on.

A neutral package: the orchestrator (tool lists for Reset) and the toolgateway (ListTools / CallTool) both
import it, and it imports neither. Modules, each with one job:

- `errors`     what can go wrong upstream, sorted by whether a call may be retried
- `transport`  `HttpSettings` and the httpx2 transport under every client: reply limit, abandoned replies,
               transport failures as per-request errors with sent / never-sent noted
- `catalog`    MCP Tool -> `ToolSpec`, union with endpoint precedence, modality and allow/deny filters,
               every `tools/list` page
- `connect`    `open_client` (an entered SDK `Client`, as a forwarder) and what a failed handshake means
- `discovery`  `discover_tools`: one-off connect, list, union, filter (the orchestrator's Reset)
- `link`       one SDK client inside its owner task; tool lists shared between sessions
- `stateless`  a 2026-07-28 `tools/call` as one POST on aiohttp's pooled connector (legacy-era calls: the SDK)
- `endpoint`   `EndpointClient`: a session's link to one endpoint, its cached tools, and tool calls
- `session`    `SessionUpstreams` (a session's endpoints) and `SessionCatalog`
- `pool`       `UpstreamPool`: every session's upstreams, the links (common ones for stateless-era URLs),
               owner tasks, the janitor

See docs/toolgateway.md ("Upstream clients").
"""
