"""What a tool call leaves behind: its tool-call log entry, its request record, its metrics, and the owned
background tasks those writes run in when the caller cannot wait for them.

A call's entry, the session touch and its DONE record are one atomic store write (`Claim.commit`), so a
retry never finds a DONE record whose call is missing from the log.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any

from rlgate.ledger import Claim
from rlgate.mcpclient import results
from rlgate.runtime import metrics
from rlgate.store import RequestExists, Session, SessionStore, StoreError, ToolCallEntry, add_infra_fault
from rlgate.v1 import common_pb2, toolgateway_pb2

if TYPE_CHECKING:
    from rlgate.toolgateway.calls import ToolCall

log = logging.getLogger(__name__)
Kind = common_pb2.ToolErrorKind

# How the log marks an orphaned call's entry: its name and arguments are the retry's, not the dead attempt's.
ORPHAN_NOTE = "[tool and arguments as the retry sent them; the attempt that died did not record its own]"
UNKNOWN_LABEL = "(unknown)"  # the metrics label of a tool name no endpoint owns: a model's invention mints no series

_calls = metrics.counter("rlgate_toolgateway_calls_total", "Tool calls", ["tool", "endpoint", "outcome"])
_errors = metrics.counter("rlgate_toolgateway_call_errors_total", "Tool call errors by kind", ["kind"])
_latency = metrics.histogram("rlgate_toolgateway_call_seconds", "Upstream tool call latency", ["tool", "endpoint"])


@functools.lru_cache(maxsize=4096)
def endpoint_label(url: str) -> str:
    """A bounded-cardinality metrics label for an endpoint URL (`mcp`, `api/v1/mcp`, ...)."""
    path = url.split("?", 1)[0].rstrip("/")
    if path.endswith("/api/v1/mcp"):
        return "api/v1/mcp"
    return path.rsplit("/", 1)[-1] or "root"


@functools.lru_cache(maxsize=64)
def kind_name(kind: int) -> str:
    """The error kind's name in the log and the metrics ("" for none): computed once per kind, since looking
    names up on a protobuf enum goes through its Python wrapper."""
    return "" if kind == Kind.TOOL_ERROR_KIND_UNSPECIFIED else Kind.Name(kind).removeprefix("TOOL_ERROR_KIND_")


# A labelled child per label values, looked up once: `labels()` converts and checks the values and takes the
# metric's lock on every call. Bounded like `endpoint_label`; prometheus_client keeps every child anyway.
@functools.lru_cache(maxsize=4096)
def _calls_of(tool: str, endpoint: str, outcome: str) -> Any:
    return _calls.labels(tool, endpoint, outcome)


@functools.lru_cache(maxsize=4096)
def _latency_of(tool: str, endpoint: str) -> Any:
    return _latency.labels(tool, endpoint)


class Recorder:
    """The tool-call log and the bookkeeping of calls, and the owner of the tasks that write them."""

    def __init__(self, store: SessionStore) -> None:
        self.store = store
        self._background: set[asyncio.Task[Any]] = set()

    # -- metrics ------------------------------------------------------------------------------------------
    def count(self, tool: str, endpoint: str, outcome: str) -> None:
        label = tool if endpoint else UNKNOWN_LABEL
        _calls_of(label, endpoint_label(endpoint) if endpoint else "-", outcome).inc()

    def observe(self, tool: str, endpoint: str, seconds: float) -> None:
        """The latency of one upstream call."""
        _latency_of(tool, endpoint_label(endpoint)).observe(seconds)

    @staticmethod
    def outcome_unknown() -> None:
        _errors.labels("OUTCOME_UNKNOWN").inc()

    # -- the log ------------------------------------------------------------------------------------------
    def entry(
        self, session: Session, call: ToolCall, endpoint: str, started: float, result: common_pb2.ToolResult
    ) -> ToolCallEntry:
        return ToolCallEntry(
            session_id=session.session_id,
            episode=session.episode,
            request_id=call.request_id,
            tool=call.name,
            arguments=call.arguments,
            is_error=result.is_error,
            error_kind=kind_name(result.error_kind),
            result_summary=results.summary(result),
            endpoint=endpoint,
            duration_ms=round((time.monotonic() - started) * 1000, 3),
        )

    async def record(
        self,
        claim: Claim,
        session: Session,
        call: ToolCall,
        endpoint: str,
        response: toolgateway_pb2.CallToolResponse,
        started: float,
        infra_fault: str = "",
    ) -> None:
        """A call that ran: counted, its error kind logged, its entry (with the infrastructure fault it met,
        if any: `ToolCallEntry.infra_fault`) and response committed."""
        result = response.result
        kind = kind_name(result.error_kind)
        self.count(call.name, endpoint, "error" if result.is_error else "ok")
        if kind:
            _errors.labels(kind).inc()
            log.info("tool %s -> %s: %s", call.name, kind, result.error_message[:200])
        entry = self.entry(session, call, endpoint, started, result)
        entry.infra_fault = infra_fault
        await self.commit(claim, entry, response)

    async def commit(self, claim: Claim, entry: ToolCallEntry, response: toolgateway_pb2.CallToolResponse) -> None:
        """Append the log entry, touch the session and (with a request_id) record the response as DONE: one
        atomic store write, so a retry never finds a DONE record whose call is missing from the log. If it
        fails, the ledger writes both again (the entry is logged once per request_id): at once when the work
        returns, then in the background until the store takes them."""
        if entry.infra_fault:
            await self.store_quietly(self._commit_fault(claim, entry, response))
        else:
            await self.store_quietly(claim.commit(response=response, tool_call=entry))

    @staticmethod
    async def _commit_fault(claim: Claim, entry: ToolCallEntry, response: toolgateway_pb2.CallToolResponse) -> None:
        """`commit` of a call that met an infrastructure fault: the same writes, plus the fault counted into
        its episode on the session (`Session.infra_faults`, which Step and State answer with), atomically. A
        session that is gone, or a store that refuses the session write, still gets the entry and the record
        (the ledger's `commit` keeps those until they land); the count is then the log's alone."""

        def counted(session: Session) -> toolgateway_pb2.CallToolResponse:
            if session.episode == entry.episode:  # a later episode does not inherit the fault
                add_infra_fault(session, entry.infra_fault)
            return response

        try:
            session, _ = await claim.change(entry.session_id, counted, tool_call=entry)
        except RequestExists:
            return  # another attempt took the record over: its answer stands (the ledger replays it)
        except StoreError:
            log.warning("could not count an infrastructure fault of session %s", entry.session_id, exc_info=True)
            session = None
        if session is None:
            await claim.commit(response=response, tool_call=entry)

    def finish_unknown(
        self, claim: Claim, session: Session, call: ToolCall, endpoint: str, started: float, message: str
    ) -> asyncio.Task[None]:
        """The tool may have run: keep the record from now on, and log the call and make a retry of the
        request_id answer OUTCOME_UNKNOWN in an owned task (it must finish even if the caller is gone)."""
        claim.keep()
        self.outcome_unknown()
        response = toolgateway_pb2.CallToolResponse(
            result=results.error_result(Kind.TOOL_ERROR_KIND_OUTCOME_UNKNOWN, message)
        )
        entry = self.entry(session, call, endpoint, started, response.result)
        entry.infra_fault = "outcome_unknown"
        return self.in_background(self.commit(claim, entry, response))

    async def release(self, scope: str, request_id: str) -> None:
        if request_id:
            await self.store_quietly(self.store.release_request(scope, request_id))

    @staticmethod
    async def store_quietly(op: Awaitable[Any]) -> None:
        try:
            await op
        except StoreError:
            log.warning("session store write failed", exc_info=True)

    # -- owned tasks --------------------------------------------------------------------------------------
    def in_background(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def shielded(self, coro: Any) -> Any:
        """Bookkeeping that must finish even if the caller's deadline cancels this RPC right now: a request
        record left PENDING under a live owner would make every retry wait instead of answering."""
        return await asyncio.shield(self.in_background(coro))

    async def drain(self, timeout_s: float) -> None:
        """Let the bookkeeping still running finish within `timeout_s`; what is still running then is
        cancelled (a retry elsewhere takes its records over)."""
        if not self._background:
            return
        late = set(self._background)
        if timeout_s > 0:
            _, late = await asyncio.wait(late, timeout=timeout_s)
        for task in late:
            task.cancel()
        await asyncio.gather(*late, return_exceptions=True)
