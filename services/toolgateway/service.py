"""The gateway's logic, independent of the gRPC server, wired from its parts: `auth` (agent token →
session), `catalog` (the session's tools, ListTools), `calls` (CallTool: ledger, validation, upstream call,
results) and `recording` (the tool-call log and the bookkeeping of calls).

Handlers in `servicer.py` only translate between gRPC and these methods; every caller-visible failure is an
`RlgateError` (rlgate.core.errors), and every model mistake is an `is_error` result.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from rlgate.ledger import RequestLedger
from rlgate.mcpclient.pool import UpstreamPool
from rlgate.runtime.deadline import Deadline
from rlgate.store import SessionStore
from rlgate.toolgateway.auth import Authenticator
from rlgate.toolgateway.calls import Calls
from rlgate.toolgateway.catalog import Catalogs
from rlgate.toolgateway.recording import Recorder
from rlgate.v1 import toolgateway_pb2

DEADLINE_MARGIN_S = 0.05  # our timeout fires just before the caller's, so we answer DEADLINE_EXCEEDED ourselves


@dataclass
class GatewaySettings:
    call_timeout_s: float = 60.0  # when the caller sets no deadline
    upstream_timeout_s: float = 30.0  # handshake + tools/list when the caller sets no deadline
    max_output_bytes: int = 262144
    max_arguments_bytes: int = 1 << 20


class ToolGateway:
    """ListTools / CallTool for the session an agent token selects."""

    def __init__(
        self, store: SessionStore, pool: UpstreamPool, owner: str, settings: GatewaySettings | None = None
    ) -> None:
        self.store = store
        self.pool = pool
        self.owner = owner
        self.settings = settings = settings or GatewaySettings()
        self.ledger = RequestLedger(store, owner)
        self.recorder = Recorder(store)
        self.auth = Authenticator(store, owner, self.recorder)
        self.catalogs = Catalogs(pool, settings.upstream_timeout_s)
        self.calls = Calls(
            store,
            pool,
            owner,
            auth=self.auth,
            catalogs=self.catalogs,
            recorder=self.recorder,
            ledger=self.ledger,
            max_output_bytes=settings.max_output_bytes,
            max_arguments_bytes=settings.max_arguments_bytes,
        )

    async def list_tools(self, token: str | None, deadline: Deadline) -> toolgateway_pb2.ListToolsResponse:
        session = await self.auth.authenticate(token)
        return await self.catalogs.list_tools(session, deadline)

    async def call_tool(
        self, token: str | None, request: toolgateway_pb2.CallToolRequest, deadline: Deadline
    ) -> toolgateway_pb2.CallToolResponse:
        return await self.calls.call_tool(token, request, deadline)

    async def drain(self, timeout_s: float = 5.0) -> None:
        """Let bookkeeping of cancelled calls and DONE writes the store refused finish (shutdown), within
        `timeout_s`; what is still running then is cancelled (a retry elsewhere takes its records over)."""
        end = time.monotonic() + timeout_s
        await self.recorder.drain(timeout_s)
        await self.ledger.drain(end - time.monotonic())
