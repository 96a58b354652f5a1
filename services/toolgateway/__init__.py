"""The agent plane: `ToolGatewayService` (ListTools / CallTool) over every MCP endpoint of a session.

Modules: `catalog` (tool specs, precedence union, filters, `discover_tools`; shared with the orchestrator),
`arguments` (JSON Schema validation), `results` (MCP result -> `ToolResult`, truncation),
`upstream` (persistent mcp clients, one owner task each), `service` (auth, calls, idempotency, the log),
`servicer` (gRPC glue), `server` (`start_gateway`, `run`). See docs/toolgateway.md.
"""
