"""The agent plane: `ToolGatewayService` (ListTools / CallTool) over every MCP endpoint of a session.

Modules: `arguments` (JSON Schema validation), `results` (MCP result -> `ToolResult`, truncation),
`service` (auth, calls, idempotency, the log), `servicer` (gRPC glue), `server` (`start_gateway`, `run`).
Upstream MCP clients, tool catalogs and their errors live in the neutral `rlgate.mcpclient`, shared with the
orchestrator. See docs/toolgateway.md.
"""
