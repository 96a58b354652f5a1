"""CallTool's semantics: the request checked, its request_id run through the ledger, the tool looked up, its
arguments validated, the upstream called, and the result (or why there is none) answered and recorded.

Every caller-visible failure is an `RlgateError`; every model mistake is an `is_error` result. A tool never
runs twice for one request_id: once it may have run, a failure leaves the record as OUTCOME_UNKNOWN. The one
exception is a read-only or idempotent tool whose first attempt's gateway died (`_orphaned`). Either way the
log entry names the infrastructure fault, and the episode counts it.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any

from rlgate.core.convert import InvalidJsonValue, arguments_of
from rlgate.core.errors import DeadlineExceeded, InvalidArgument, RlgateError, Unavailable, clip
from rlgate.ledger import Claim, RequestLedger
from rlgate.mcpclient import results
from rlgate.mcpclient.catalog import TOOL_NAME
from rlgate.mcpclient.errors import (
    CallLost,
    CallNotSent,
    CallRejected,
    CallTimedOut,
    ReplyTooLarge,
    UpstreamUnavailable,
)
from rlgate.mcpclient.pool import UpstreamPool
from rlgate.mcpclient.session import SessionCatalog
from rlgate.runtime.deadline import Deadline
from rlgate.store import RequestRecord, Session, SessionStore, StoreError, call_scope
from rlgate.toolgateway.arguments import check_arguments
from rlgate.toolgateway.auth import Authenticator, store_down
from rlgate.toolgateway.catalog import Catalogs
from rlgate.toolgateway.recording import ORPHAN_NOTE, Recorder
from rlgate.v1 import common_pb2, toolgateway_pb2

log = logging.getLogger(__name__)
Kind = common_pb2.ToolErrorKind

MAX_REQUEST_ID = 128


@dataclass
class ToolCall:
    """A well-formed CallTool request: its name, request_id, exact arguments and their size on the wire."""

    name: str
    request_id: str
    arguments: dict[str, Any]
    size: int = 0

    def params(self) -> dict[str, Any]:
        """What the request_id is bound to (the ledger's parameters), named as the request's fields."""
        return {"name": self.name, "arguments": self.arguments}


def parse_call(request: toolgateway_pb2.CallToolRequest, max_arguments_bytes: int) -> ToolCall:
    """The request as a `ToolCall`, or InvalidArgument naming the field. The arguments' size is checked
    before they are parsed."""
    name = request.name
    if not TOOL_NAME.fullmatch(name):
        raise InvalidArgument(
            "name", f"{clip(name)!r} is not a tool name: 1-128 characters of [A-Za-z0-9._-] (see ListTools)"
        )
    if len(request.request_id) > MAX_REQUEST_ID:
        raise InvalidArgument("request_id", f"{len(request.request_id)} characters; at most {MAX_REQUEST_ID}")
    form = request.WhichOneof("args") or "arguments"
    size = len(request.arguments_json.encode()) if form == "arguments_json" else request.arguments.ByteSize()
    if size > max_arguments_bytes:
        raise InvalidArgument(form, f"{size} bytes; at most {max_arguments_bytes}")
    try:
        arguments = arguments_of(request)
    except InvalidJsonValue as exc:
        raise InvalidArgument(form, str(exc)) from exc
    # A call without a request_id gets one here, so every call has its ledger record: PENDING while it runs
    # (what Fork looks for: `pending_requests`), and the log's request_id for it is a real key to retry with.
    return ToolCall(name, request.request_id or f"gw-{uuid.uuid4().hex}", arguments, size)


@dataclass
class _CallState:
    """How far a call got: `sent` once it is handed to the upstream client (it may run from then on)."""

    sent: bool = False
    endpoint: str = ""


async def _replayed(recorded: toolgateway_pb2.CallToolResponse) -> toolgateway_pb2.CallToolResponse:
    recorded.replayed = True
    return recorded


class Calls:
    """CallTool for the session an agent token selects."""

    def __init__(
        self,
        store: SessionStore,
        pool: UpstreamPool,
        owner: str,
        *,
        auth: Authenticator,
        catalogs: Catalogs,
        recorder: Recorder,
        ledger: RequestLedger,
        max_output_bytes: int,
        max_arguments_bytes: int,
    ) -> None:
        self._store = store
        self._pool = pool
        self._owner = owner
        self._auth = auth
        self._catalogs = catalogs
        self._recorder = recorder
        self._ledger = ledger
        self._max_output_bytes = max_output_bytes
        self._max_arguments_bytes = max_arguments_bytes

    async def call_tool(
        self, token: str | None, request: toolgateway_pb2.CallToolRequest, deadline: Deadline
    ) -> toolgateway_pb2.CallToolResponse:
        try:
            call: ToolCall | None = parse_call(request, self._max_arguments_bytes)
            problem = None
        except InvalidArgument as exc:
            call, problem = None, exc
        # A malformed request claims nothing; the token is still checked first (UNAUTHENTICATED wins).
        session, claimed = await self._auth.authorize(token, call.request_id if call is not None else "")
        if problem is not None:
            raise problem
        assert call is not None
        scope, request_id = call_scope(session.session_id), call.request_id

        async def claim() -> tuple[RequestRecord, bool]:
            """The ledger's claim: the one `authorize` made, then (a released record) a new one."""
            nonlocal claimed
            if claimed is not None:
                first, claimed = claimed, None
                return first
            return await self._store.claim_request(scope, request_id, self._owner)

        started = time.monotonic()
        try:
            return await self._ledger.run(
                scope,
                request_id,
                call.params(),
                deadline,
                toolgateway_pb2.CallToolResponse,
                functools.partial(self._run, session, call, deadline),
                claim=claim,
                replay=_replayed,
                orphan=functools.partial(self._orphaned, session, call, deadline),
            )
        except StoreError as exc:
            raise store_down(exc) from exc
        except DeadlineExceeded as exc:  # the caller's status, so one line here is the event's only trace
            log.warning("tool %s in session %s: deadline exceeded after %.3fs: %s", call.name, session.session_id,
                        time.monotonic() - started, exc.message)  # fmt: skip
            raise
        except asyncio.CancelledError:
            # gRPC cancels the handler when the caller's deadline passes before ours (a stalled process):
            # the same event as DeadlineExceeded, so the same line.
            if deadline.expired():
                log.warning("tool %s in session %s: deadline exceeded after %.3fs (cancelled by gRPC)", call.name,
                            session.session_id, time.monotonic() - started)  # fmt: skip
            else:
                log.info("tool %s in session %s: cancelled by the caller after %.3fs", call.name, session.session_id,
                         time.monotonic() - started)  # fmt: skip
            raise

    async def _run(
        self, session: Session, call: ToolCall, deadline: Deadline, claim: Claim, *, rerun: bool = False
    ) -> toolgateway_pb2.CallToolResponse:
        """The call as its request_id's first attempt (`rerun`: its second, see `_orphaned`). A failure raised
        before the tool could have run lets the ledger release the request_id; once it may have run, the
        record is kept (`claim.keep`) and completed here as OUTCOME_UNKNOWN, so a retry never runs the tool
        again."""
        started = time.monotonic()
        state = _CallState()
        recorder = self._recorder
        try:
            result, endpoint = await self._execute(session, call, deadline, state)
        except CallNotSent as exc:
            recorder.count(call.name, state.endpoint, "unavailable")
            raise Unavailable(
                f"upstream unavailable (the tool did not run): {exc}", reason="UPSTREAM_UNAVAILABLE"
            ) from exc
        except UpstreamUnavailable as exc:  # CallLost or a catalog failure after the call may have started
            msg = str(exc)
            if isinstance(exc, CallLost):
                msg = (
                    f"upstream connection lost during the call: {exc}. The tool may have run; a retry with "
                    "the same request_id returns OUTCOME_UNKNOWN"
                )
                await asyncio.shield(recorder.finish_unknown(claim, session, call, state.endpoint, started, msg))
            recorder.count(call.name, state.endpoint, "unavailable")
            raise Unavailable(msg, reason="UPSTREAM_UNAVAILABLE") from exc
        except CallTimedOut as exc:
            recorder.count(call.name, state.endpoint, "deadline")
            if not exc.sent:
                raise DeadlineExceeded(f"deadline exceeded: {exc}") from exc
            msg = f"deadline exceeded: {exc}; the upstream call was cancelled and may have partly run"
            await asyncio.shield(recorder.finish_unknown(claim, session, call, state.endpoint, started, msg))
            raise DeadlineExceeded(msg) from exc
        except StoreError as exc:
            if state.sent:
                why = f"store failed: {exc}; the tool may have run"
                await asyncio.shield(recorder.finish_unknown(claim, session, call, state.endpoint, started, why))
            raise store_down(exc) from exc
        except RlgateError:
            raise  # raised before anything was sent
        except Exception as exc:  # a bug: if the tool may have run, record so (else the ledger releases the id)
            if state.sent:
                why = f"internal error: {exc}; the tool may have run"
                await asyncio.shield(recorder.finish_unknown(claim, session, call, state.endpoint, started, why))
            raise
        except asyncio.CancelledError:
            # The caller went away (cancel or deadline) while the call ran: the upstream request is cancelled
            # with us. The record and log are written by an owned task, since this one is being cancelled.
            if state.sent:
                why = "the call was cancelled by the caller; the tool may have partly run"
                recorder.finish_unknown(claim, session, call, state.endpoint, started, why)
            raise

        response = toolgateway_pb2.CallToolResponse(result=result)
        # The log entry, the session touch and the DONE record in one store round trip, before the reply. The
        # tool ran: from here the record is never released, whatever happens to this task.
        claim.keep()
        fault = "tool_reruns" if rerun else ""
        await recorder.shielded(recorder.record(claim, session, call, endpoint, response, started, fault))
        return response

    async def _execute(
        self, session: Session, call: ToolCall, deadline: Deadline, state: _CallState
    ) -> tuple[common_pb2.ToolResult, str]:
        """(result, endpoint). Model mistakes come back as is_error results."""
        name = call.name
        if session.call_budget > 0:
            used = await self._store.count_tool_calls(session.session_id, session.episode)
            if used >= session.call_budget:
                return results.error_result(
                    Kind.TOOL_ERROR_KIND_BUDGET_EXHAUSTED,
                    f"The tool-call budget of this episode ({session.call_budget} calls) is spent; "
                    "the tool was not called. Give your final answer.",
                ), ""
        tool, cat = await self._catalogs.lookup(session, name, deadline)
        if tool is None:
            if cat.unavailable and cat.catalog.get(name) is None:
                raise CallNotSent("the tool list is incomplete: " + "; ".join(cat.unavailable.values()))
            return _unknown_tool(cat, name), ""
        try:
            verdict = await check_arguments(name, call.arguments, tool.input_schema, call.size, deadline.remaining())
        except TimeoutError:
            raise CallTimedOut(f"deadline passed while checking the arguments of {name!r}", sent=False) from None
        if verdict is not None:
            return results.error_result(verdict.kind, verdict.message), tool.endpoint
        timeout_s = deadline.remaining()
        if timeout_s <= 0:
            raise CallTimedOut(f"no time left to call {name!r}", sent=False)
        ups = self._pool.session(session.session_id, session.endpoints)
        start = time.perf_counter()
        state.sent, state.endpoint = True, tool.endpoint
        try:
            mcp_result = await ups.call(tool.endpoint, name, call.arguments, timeout_s)
        except ReplyTooLarge as exc:  # the tool ran; its reply was cut off unread
            result = results.error_result(Kind.TOOL_ERROR_KIND_TOOL_FAILED, f"Tool '{name}' failed: {exc}")
        except CallRejected as exc:  # a JSON-RPC error: its message is the model's only clue
            result = results.error_result(
                Kind.TOOL_ERROR_KIND_TOOL_FAILED,
                f"Tool '{name}' was rejected by its server (JSON-RPC error {exc.code}): {exc}",
            )
        else:
            result = results.tool_result(mcp_result, self._max_output_bytes)
        finally:
            self._recorder.observe(name, tool.endpoint, time.perf_counter() - start)
        return results.truncate(result, self._max_output_bytes), tool.endpoint

    async def _orphaned(
        self, session: Session, call: ToolCall, deadline: Deadline, claim: Claim
    ) -> toolgateway_pb2.CallToolResponse:
        """A repeat that took over the record of a first attempt whose gateway died mid-call (`claim.prior`):
        the tool may have run. A tool its upstream annotates read-only or idempotent (`may_run_again`) is run
        again, once, under the same request_id, and its entry is marked as a rerun (an infrastructure fault
        of the episode). Any other tool never runs twice: the call is logged OUTCOME_UNKNOWN and the record
        completed with that answer, once: the takeover's claim decides which repeat writes them. The dead
        attempt's record holds no name or arguments, so the entry has this repeat's (which the request_id
        binds from now on), and says so."""
        prior = claim.prior
        assert prior is not None
        if await self._may_run_again(session, call, deadline):
            log.info("request %s: first attempt's owner %s died mid-call; %s is read-only or idempotent, run again",
                     clip(call.request_id), prior.owner, call.name)  # fmt: skip
            return await self._run(session, call, deadline, claim, rerun=True)
        claim.keep()  # whatever the store does now, the answer is OUTCOME_UNKNOWN
        self._recorder.outcome_unknown()
        log.info("request %s: first attempt's owner %s died mid-call", clip(call.request_id), prior.owner)
        response = toolgateway_pb2.CallToolResponse(
            result=results.error_result(
                Kind.TOOL_ERROR_KIND_OUTCOME_UNKNOWN,
                f"An earlier attempt of request {clip(call.request_id)!r} was in flight when its gateway process "
                "died; the tool may or may not have run and is not run again. Check the state before retrying "
                "with a new request_id.",
            )
        )
        entry = self._recorder.entry(session, call, "", time.monotonic(), response.result)
        entry.result_summary = f"{ORPHAN_NOTE} {entry.result_summary}"
        entry.infra_fault = "outcome_unknown"
        await self._recorder.shielded(self._recorder.commit(claim, entry, response))
        return response

    async def _may_run_again(self, session: Session, call: ToolCall, deadline: Deadline) -> bool:
        """Whether the orphaned call's tool may run a second time (see `CatalogTool.may_run_again`). A
        catalog that cannot be read says no: the call then stays at most once."""
        try:
            tool, _ = await self._catalogs.lookup(session, call.name, deadline)
        except (UpstreamUnavailable, RlgateError) as exc:
            log.info("request %s: tool list unavailable (%s); not run again", clip(call.request_id), exc)
            return False
        return tool is not None and tool.may_run_again


def _unknown_tool(cat: SessionCatalog, name: str) -> common_pb2.ToolResult:
    """The is_error result of a name no visible tool has: why, and the names there are."""
    visible = [t.name for t in cat.visible.tools]
    hidden = cat.catalog.get(name) is not None
    left_out = cat.catalog.left_out.get(name)
    why = (
        "is not available in this task"
        if hidden
        else f"was left out of this session's tools by rlgate ({left_out})"
        if left_out
        else "does not exist"
    )
    listing = ", ".join(visible[:50]) + (" …" if len(visible) > 50 else "")
    return results.error_result(
        Kind.TOOL_ERROR_KIND_UNKNOWN_TOOL,
        f"Tool '{name}' {why}. Available tools: {listing or '(none)'}. Call one of those by its exact name.",
    )
