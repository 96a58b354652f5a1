"""The gateway's logic, independent of the gRPC server: auth, ListTools, CallTool, idempotency, the log.

Handlers in `servicer.py` only translate between gRPC and these methods; every caller-visible failure is an
`RlgateError` (rlgate.core.errors), and every model mistake is an `is_error` result.
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
from rlgate.core.errors import (
    MAX_MESSAGE,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    RlgateError,
    Unauthenticated,
    Unavailable,
    clip,
)
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
from rlgate.runtime import metrics
from rlgate.runtime.auth import session_of_token, token_hash
from rlgate.runtime.deadline import Deadline
from rlgate.runtime.ledger import Claim, RequestLedger
from rlgate.runtime.logs import session_id_var
from rlgate.store import (
    RequestRecord,
    Session,
    SessionStatus,
    SessionStore,
    StoreError,
    ToolCallEntry,
    call_scope,
)
from rlgate.toolgateway import results
from rlgate.toolgateway.arguments import check_arguments
from rlgate.v1 import common_pb2, toolgateway_pb2

log = logging.getLogger(__name__)
Kind = common_pb2.ToolErrorKind

MAX_REQUEST_ID = 128
DEADLINE_MARGIN_S = 0.05  # our timeout fires just before the caller's, so we answer DEADLINE_EXCEEDED ourselves
UNKNOWN_TOOL_REFRESH_S = 2.0  # an unknown tool name re-lists the upstreams at most this often per session
# How the log marks an orphaned call's entry: its name and arguments are the retry's, not the dead attempt's.
ORPHAN_NOTE = "[tool and arguments as the retry sent them; the attempt that died did not record its own]"
UNKNOWN_LABEL = "(unknown)"  # the metrics label of a tool name no endpoint owns: a model's invention mints no series

_calls = metrics.counter("rlgate_toolgateway_calls_total", "Tool calls", ["tool", "endpoint", "outcome"])
_errors = metrics.counter("rlgate_toolgateway_call_errors_total", "Tool call errors by kind", ["kind"])
_latency = metrics.histogram("rlgate_toolgateway_call_seconds", "Upstream tool call latency", ["tool", "endpoint"])


@dataclass
class GatewaySettings:
    call_timeout_s: float = 60.0  # when the caller sets no deadline
    upstream_timeout_s: float = 30.0  # handshake + tools/list when the caller sets no deadline
    max_output_bytes: int = 262144
    max_arguments_bytes: int = 1 << 20


@functools.lru_cache(maxsize=4096)
def endpoint_label(url: str) -> str:
    """A bounded-cardinality metrics label for an endpoint URL (`mcp`, `api/v1/mcp`, ...)."""
    path = url.split("?", 1)[0].rstrip("/")
    if path.endswith("/api/v1/mcp"):
        return "api/v1/mcp"
    return path.rsplit("/", 1)[-1] or "root"


def kind_name(kind: int) -> str:
    return "" if kind == Kind.TOOL_ERROR_KIND_UNSPECIFIED else Kind.Name(kind).removeprefix("TOOL_ERROR_KIND_")


# -- requests -----------------------------------------------------------------------------------------------
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
    return ToolCall(name, request.request_id, arguments, size)


# -- sessions -----------------------------------------------------------------------------------------------
def _episode_over(session: Session, episode: int, *, revoked: bool) -> FailedPrecondition | None:
    """Why a token of `episode` of `session` cannot call tools (None: it can, or, for a revoked token, it
    was replaced within its episode)."""
    sid, status = session.session_id, session.status
    meta = {"session_id": sid, "episode": episode}
    if episode < session.episode:
        return FailedPrecondition(
            f"episode {episode} of session {sid} ended: a later Reset started episode {episode + 1}",
            reason="EPISODE_SUPERSEDED",
            metadata=meta,
        )
    if status == SessionStatus.CLOSED:
        return FailedPrecondition(f"session {sid} was closed", reason="SESSION_CLOSED", metadata=meta)
    if status == SessionStatus.EXPIRED:
        return FailedPrecondition(f"session {sid} expired", reason="SESSION_EXPIRED", metadata=meta)
    if session.expires_at and time.time() >= session.expires_at:
        return FailedPrecondition(f"session {sid} expired (its TTL passed)", reason="SESSION_EXPIRED", metadata=meta)
    if status == SessionStatus.FAILED:
        return FailedPrecondition(f"session {sid} failed", reason="SESSION_FAILED", metadata=meta)
    if status == SessionStatus.DONE:
        why = f" ({session.done_reason})" if session.done_reason else ""
        return FailedPrecondition(
            f"episode {episode} of session {sid} is done{why}; Reset with the session_id starts the next one",
            reason="EPISODE_DONE",
            metadata=meta,
        )
    if status == SessionStatus.PROVISIONING:
        if revoked:
            return FailedPrecondition(
                f"episode {episode} of session {sid} ended: a Reset is starting episode {episode + 1}",
                reason="EPISODE_SUPERSEDED",
                metadata=meta,
            )
        return FailedPrecondition(
            f"session {sid} is not active yet (provisioning)", reason="SESSION_NOT_ACTIVE", metadata=meta
        )
    if status != SessionStatus.ACTIVE:
        return FailedPrecondition(f"session {sid} is {status}", reason="SESSION_NOT_ACTIVE", metadata=meta)
    return None


def _admit(session: Session) -> Session:
    """The session of a current token if it may call tools now, else the FailedPrecondition saying why not."""
    session_id_var.set(session.session_id)
    refused = _episode_over(session, session.episode, revoked=False)
    if refused is not None:
        raise refused
    if not session.endpoints:
        raise FailedPrecondition(
            f"session {session.session_id} has no MCP endpoints",
            reason="NO_ENDPOINTS",
            metadata={"session_id": session.session_id},
        )
    return session


def _store_down(exc: StoreError) -> Unavailable:
    return Unavailable(f"session store unavailable: {exc}", reason="STORE_UNAVAILABLE")


@dataclass
class _CallState:
    """How far a call got: `sent` once it is handed to the upstream client (it may run from then on)."""

    sent: bool = False
    endpoint: str = ""


async def _replayed(recorded: toolgateway_pb2.CallToolResponse) -> toolgateway_pb2.CallToolResponse:
    recorded.replayed = True
    return recorded


class ToolGateway:
    """ListTools / CallTool for the session an agent token selects."""

    def __init__(
        self, store: SessionStore, pool: UpstreamPool, owner: str, settings: GatewaySettings | None = None
    ) -> None:
        self.store = store
        self.pool = pool
        self.owner = owner
        self.settings = settings or GatewaySettings()
        self.ledger = RequestLedger(store, owner)
        self._background: set[asyncio.Task[Any]] = set()

    # -- auth ---------------------------------------------------------------------------------------------
    async def authenticate(self, token: str | None) -> Session:
        hashed = self._token_hash(token)
        try:
            session = await self.store.session_by_token(hashed)
        except StoreError as exc:
            raise _store_down(exc) from exc
        if session is None:
            raise await self._refusal(token or "", hashed)
        return _admit(session)

    async def _authorize(
        self, token: str | None, call: ToolCall | None
    ) -> tuple[Session, tuple[RequestRecord, bool] | None]:
        """`authenticate` plus the claim of the call's request_id (if any) in one store round trip: the
        session and the claim's (record, created), or None when nothing was claimed."""
        hashed = self._token_hash(token)
        request_id = call.request_id if call is not None else ""
        try:  # a claim landing after this call was cancelled is released by the store
            session, record, created = await self.store.authorize_call(hashed, request_id, self.owner)
        except StoreError as exc:
            raise _store_down(exc) from exc
        if session is None:
            raise await self._refusal(token or "", hashed)
        try:
            _admit(session)
        except RlgateError:
            if created:  # claimed, then refused (e.g. TTL passed): free the id again
                await self._shielded(self._release(call_scope(session.session_id), request_id))
            raise
        return session, None if record is None else (record, created)

    @staticmethod
    def _token_hash(token: str | None) -> str:
        if not token:
            raise Unauthenticated("missing agent token: send 'authorization: Bearer <agent token>' from Reset")
        return token_hash(token)

    async def _refusal(self, token: str, hashed: str) -> RlgateError:
        """Why a token that is no session's current one is refused: FAILED_PRECONDITION with the reason when
        the session it names revoked it (kept among its last revoked hashes), else UNAUTHENTICATED."""
        session_id = session_of_token(token)
        try:
            session = await self.store.get_session(session_id) if session_id else None
        except StoreError as exc:
            return _store_down(exc)
        episode = session.revoked_tokens.get(hashed) if session is not None else None
        if session is None or episode is None:
            return Unauthenticated("unknown agent token: use the token Reset returned for the current episode")
        session_id_var.set(session.session_id)
        return _episode_over(session, episode, revoked=True) or FailedPrecondition(
            f"this agent token of episode {episode} of session {session.session_id} was replaced: a repeated "
            "Reset returned a new one",
            reason="TOKEN_REPLACED",
            metadata={"session_id": session.session_id, "episode": episode},
        )

    # -- tools --------------------------------------------------------------------------------------------
    async def _catalog(self, session: Session, deadline: Deadline, *, refresh: bool = False) -> SessionCatalog:
        ups = self.pool.session(session.session_id, session.endpoints)
        if not refresh and (cached := ups.cached_catalog(session.tool_filter, session.modality)) is not None:
            return cached  # every endpoint's listing is cached and fresh: nothing to wait for
        if deadline.expired():
            raise DeadlineExceeded("deadline exceeded before listing tools")
        try:
            async with asyncio.timeout(deadline.remaining()):
                cat = await ups.catalog(
                    deadline.cap(self.settings.upstream_timeout_s),
                    session.tool_filter,
                    session.modality,
                    refresh=refresh,
                )
        except TimeoutError:
            raise DeadlineExceeded("deadline exceeded while listing tools") from None
        if cat.unavailable:
            if not cat.catalog.tools:
                raise Unavailable(
                    "no MCP endpoint reachable: " + "; ".join(cat.unavailable.values()), reason="UPSTREAM_UNAVAILABLE"
                )
            log.warning(
                "endpoints unavailable (partial tool list): %s", clip("; ".join(cat.unavailable.values()), MAX_MESSAGE)
            )
        return cat

    async def list_tools(self, token: str | None, deadline: Deadline) -> toolgateway_pb2.ListToolsResponse:
        session = await self.authenticate(token)
        cat = await self._catalog(session, deadline)
        return toolgateway_pb2.ListToolsResponse(tools=[t.spec() for t in cat.visible.tools])

    # -- calls --------------------------------------------------------------------------------------------
    async def call_tool(
        self, token: str | None, request: toolgateway_pb2.CallToolRequest, deadline: Deadline
    ) -> toolgateway_pb2.CallToolResponse:
        try:
            call: ToolCall | None = parse_call(request, self.settings.max_arguments_bytes)
            problem = None
        except InvalidArgument as exc:
            call, problem = None, exc
        # A malformed request claims nothing; the token is still checked first (UNAUTHENTICATED wins).
        session, claimed = await self._authorize(token, call)
        if problem is not None:
            raise problem
        assert call is not None
        scope, request_id = call_scope(session.session_id), call.request_id

        async def claim() -> tuple[RequestRecord, bool]:
            """The ledger's claim: the one `authorize_call` made, then (a released record) a new one."""
            nonlocal claimed
            if claimed is not None:
                first, claimed = claimed, None
                return first
            return await self.store.claim_request(scope, request_id, self.owner)

        started = time.monotonic()
        try:
            return await self.ledger.run(
                scope,
                request_id,
                call.params(),
                deadline,
                toolgateway_pb2.CallToolResponse,
                functools.partial(self._run, session, call, deadline),
                claim=claim,
                replay=_replayed,
                orphan=functools.partial(self._orphaned, session, call),
            )
        except StoreError as exc:
            raise _store_down(exc) from exc
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
        self, session: Session, call: ToolCall, deadline: Deadline, claim: Claim
    ) -> toolgateway_pb2.CallToolResponse:
        """The call as its request_id's first attempt. A failure raised before the tool could have run lets
        the ledger release the request_id; once it may have run, the record is kept (`claim.keep`) and
        completed here as OUTCOME_UNKNOWN, so a retry never runs the tool again."""
        started = time.monotonic()
        state = _CallState()
        try:
            result, endpoint = await self._execute(session, call, deadline, state)
        except CallNotSent as exc:
            self._count(call.name, state.endpoint, "unavailable")
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
                await asyncio.shield(self._finish_unknown(claim, session, call, state.endpoint, started, msg))
            self._count(call.name, state.endpoint, "unavailable")
            raise Unavailable(msg, reason="UPSTREAM_UNAVAILABLE") from exc
        except CallTimedOut as exc:
            self._count(call.name, state.endpoint, "deadline")
            if not exc.sent:
                raise DeadlineExceeded(f"deadline exceeded: {exc}") from exc
            msg = f"deadline exceeded: {exc}; the upstream call was cancelled and may have partly run"
            await asyncio.shield(self._finish_unknown(claim, session, call, state.endpoint, started, msg))
            raise DeadlineExceeded(msg) from exc
        except StoreError as exc:
            if state.sent:
                why = f"store failed: {exc}; the tool may have run"
                await asyncio.shield(self._finish_unknown(claim, session, call, state.endpoint, started, why))
            raise _store_down(exc) from exc
        except RlgateError:
            raise  # raised before anything was sent
        except Exception as exc:  # a bug: if the tool may have run, record so (else the ledger releases the id)
            if state.sent:
                why = f"internal error: {exc}; the tool may have run"
                await asyncio.shield(self._finish_unknown(claim, session, call, state.endpoint, started, why))
            raise
        except asyncio.CancelledError:
            # The caller went away (cancel or deadline) while the call ran: the upstream request is cancelled
            # with us. The record and log are written by an owned task, since this one is being cancelled.
            if state.sent:
                why = "the call was cancelled by the caller; the tool may have partly run"
                self._finish_unknown(claim, session, call, state.endpoint, started, why)
            raise

        response = toolgateway_pb2.CallToolResponse(result=result)
        # The log entry, the session touch and the DONE record in one store round trip, before the reply. The
        # tool ran: from here the record is never released, whatever happens to this task.
        claim.keep()
        await self._shielded(self._record(claim, session, call, endpoint, response, started))
        return response

    async def _execute(
        self, session: Session, call: ToolCall, deadline: Deadline, state: _CallState
    ) -> tuple[common_pb2.ToolResult, str]:
        """(result, endpoint). Model mistakes come back as is_error results."""
        name = call.name
        if session.call_budget > 0:
            used = await self.store.count_tool_calls(session.session_id, session.episode)
            if used >= session.call_budget:
                return results.error_result(
                    Kind.TOOL_ERROR_KIND_BUDGET_EXHAUSTED,
                    f"The tool-call budget of this episode ({session.call_budget} calls) is spent; "
                    "the tool was not called. Give your final answer.",
                ), ""
        ups = self.pool.session(session.session_id, session.endpoints)
        cat = await self._catalog(session, deadline)
        tool = cat.find(name)
        stale = time.monotonic() - ups.last_forced_refresh > UNKNOWN_TOOL_REFRESH_S
        if tool is None and stale and name not in cat.catalog.left_out:  # a left-out tool stays left out
            ups.last_forced_refresh = time.monotonic()  # the upstream's tool list may have changed
            cat = await self._catalog(session, deadline, refresh=True)
            tool = cat.find(name)
        if tool is None:
            if cat.unavailable and cat.catalog.get(name) is None:
                raise CallNotSent("the tool list is incomplete: " + "; ".join(cat.unavailable.values()))
            return self._unknown_tool(cat, name), ""
        try:
            verdict = await check_arguments(name, call.arguments, tool.input_schema, call.size, deadline.remaining())
        except TimeoutError:
            raise CallTimedOut(f"deadline passed while checking the arguments of {name!r}", sent=False) from None
        if verdict is not None:
            return results.error_result(verdict.kind, verdict.message), tool.endpoint
        timeout_s = deadline.remaining()
        if timeout_s <= 0:
            raise CallTimedOut(f"no time left to call {name!r}", sent=False)
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
            result = results.tool_result(mcp_result, self.settings.max_output_bytes)
        finally:
            _latency.labels(name, endpoint_label(tool.endpoint)).observe(time.perf_counter() - start)
        return results.truncate(result, self.settings.max_output_bytes), tool.endpoint

    def _unknown_tool(self, cat: SessionCatalog, name: str) -> common_pb2.ToolResult:
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

    async def _orphaned(self, session: Session, call: ToolCall, claim: Claim) -> toolgateway_pb2.CallToolResponse:
        """A repeat that took over the record of a first attempt whose gateway died mid-call (`claim.prior`):
        the tool may have run, and never runs twice. The call is logged OUTCOME_UNKNOWN and the record
        completed with that answer, once: the takeover's claim decides which repeat writes them. The dead
        attempt's record holds no name or arguments, so the entry has this repeat's (which the request_id
        binds from now on), and says so."""
        prior = claim.prior
        assert prior is not None
        claim.keep()  # whatever the store does now, the answer is OUTCOME_UNKNOWN
        _errors.labels("OUTCOME_UNKNOWN").inc()
        log.info("request %s: first attempt's owner %s died mid-call", clip(call.request_id), prior.owner)
        response = toolgateway_pb2.CallToolResponse(
            result=results.error_result(
                Kind.TOOL_ERROR_KIND_OUTCOME_UNKNOWN,
                f"An earlier attempt of request {clip(call.request_id)!r} was in flight when its gateway process "
                "died; the tool may or may not have run and is not run again. Check the state before retrying "
                "with a new request_id.",
            )
        )
        entry = self._entry(session, call, "", time.monotonic(), response.result)
        entry.result_summary = f"{ORPHAN_NOTE} {entry.result_summary}"
        await self._shielded(self._commit(claim, entry, response))
        return response

    # -- bookkeeping --------------------------------------------------------------------------------------
    def _count(self, tool: str, endpoint: str, outcome: str) -> None:
        label = tool if endpoint else UNKNOWN_LABEL
        _calls.labels(label, endpoint_label(endpoint) if endpoint else "-", outcome).inc()

    def _entry(
        self, session: Session, call: ToolCall, endpoint: str, started: float, result: common_pb2.ToolResult
    ) -> ToolCallEntry:
        return ToolCallEntry(
            session_id=session.session_id,
            episode=session.episode,
            # the log names every call; a caller without a request_id gets one made up here
            request_id=call.request_id or f"gw-{uuid.uuid4().hex}",
            tool=call.name,
            arguments=call.arguments,
            is_error=result.is_error,
            error_kind=kind_name(result.error_kind),
            result_summary=results.summary(result),
            endpoint=endpoint,
            duration_ms=round((time.monotonic() - started) * 1000, 3),
        )

    async def _record(
        self,
        claim: Claim,
        session: Session,
        call: ToolCall,
        endpoint: str,
        response: toolgateway_pb2.CallToolResponse,
        started: float,
    ) -> None:
        result = response.result
        kind = kind_name(result.error_kind)
        self._count(call.name, endpoint, "error" if result.is_error else "ok")
        if kind:
            _errors.labels(kind).inc()
            log.info("tool %s -> %s: %s", call.name, kind, result.error_message[:200])
        await self._commit(claim, self._entry(session, call, endpoint, started, result), response)

    async def _commit(self, claim: Claim, entry: ToolCallEntry, response: toolgateway_pb2.CallToolResponse) -> None:
        """Append the log entry, touch the session and (with a request_id) record the response as DONE: one
        atomic store write, so a retry never finds a DONE record whose call is missing from the log. If it
        fails, the ledger writes both again (the entry is logged once per request_id): at once when the work
        returns, then in the background until the store takes them."""
        await self._store_quietly(claim.commit(response=response, tool_call=entry))

    def _finish_unknown(
        self, claim: Claim, session: Session, call: ToolCall, endpoint: str, started: float, message: str
    ) -> asyncio.Task[None]:
        """The tool may have run: keep the record from now on, and log the call and make a retry of the
        request_id answer OUTCOME_UNKNOWN in an owned task (it must finish even if the caller is gone)."""
        claim.keep()
        _errors.labels("OUTCOME_UNKNOWN").inc()
        response = toolgateway_pb2.CallToolResponse(
            result=results.error_result(Kind.TOOL_ERROR_KIND_OUTCOME_UNKNOWN, message)
        )
        entry = self._entry(session, call, endpoint, started, response.result)
        return self._in_background(self._commit(claim, entry, response))

    async def _release(self, scope: str, request_id: str) -> None:
        if request_id:
            await self._store_quietly(self.store.release_request(scope, request_id))

    async def _store_quietly(self, op: Any) -> None:
        try:
            await op
        except StoreError:
            log.warning("session store write failed", exc_info=True)

    def _in_background(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def _shielded(self, coro: Any) -> Any:
        """Bookkeeping that must finish even if the caller's deadline cancels this RPC right now: a request
        record left PENDING under a live owner would make every retry wait instead of answering."""
        return await asyncio.shield(self._in_background(coro))

    async def drain(self, timeout_s: float = 5.0) -> None:
        """Let bookkeeping of cancelled calls and DONE writes the store refused finish (shutdown), within
        `timeout_s`; what is still running then is cancelled (a retry elsewhere takes its records over)."""
        end = time.monotonic() + timeout_s
        if self._background:
            late = set(self._background)
            if timeout_s > 0:
                _, late = await asyncio.wait(late, timeout=timeout_s)
            for task in late:
                task.cancel()
            await asyncio.gather(*late, return_exceptions=True)
        await self.ledger.drain(end - time.monotonic())
