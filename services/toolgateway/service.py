"""The gateway's logic, independent of the gRPC server: auth, ListTools, CallTool, idempotency, the log.

Handlers in `servicer.py` only translate between gRPC and these methods; every caller-visible failure is a
`GatewayError` carrying the gRPC status code, and every model mistake is an `is_error` result.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import grpc

from rlgate.convert import InvalidJsonValue, dict_from_struct, ensure_json
from rlgate.runtime import metrics
from rlgate.runtime.auth import token_hash
from rlgate.runtime.logs import session_id_var
from rlgate.store import (
    RequestRecord,
    RequestState,
    Session,
    SessionStatus,
    SessionStore,
    StoreError,
    ToolCallEntry,
    call_scope,
)
from rlgate.toolgateway import results
from rlgate.toolgateway.arguments import prepare_arguments
from rlgate.toolgateway.upstream import (
    CallLost,
    CallNotSent,
    CallRejected,
    CallTimedOut,
    SessionCatalog,
    UpstreamPool,
    UpstreamUnavailable,
)
from rlgate.v1 import common_pb2, toolgateway_pb2

log = logging.getLogger(__name__)
Kind = common_pb2.ToolErrorKind

MAX_REQUEST_ID = 128
DEADLINE_MARGIN_S = 0.05  # our timeout fires just before the caller's, so we answer DEADLINE_EXCEEDED ourselves
UNKNOWN_TOOL_REFRESH_S = 2.0  # an unknown tool name re-lists the upstreams at most this often per session
REPLAY_POLL_S = 0.1

_calls = metrics.counter("rlgate_toolgateway_calls_total", "Tool calls", ["tool", "endpoint", "outcome"])
_errors = metrics.counter("rlgate_toolgateway_call_errors_total", "Tool call errors by kind", ["kind"])
_latency = metrics.histogram("rlgate_toolgateway_call_seconds", "Upstream tool call latency", ["tool", "endpoint"])


class GatewayError(Exception):
    """A caller or infrastructure error, reported as a gRPC status."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass
class GatewaySettings:
    call_timeout_s: float = 60.0  # when the caller sets no deadline
    upstream_timeout_s: float = 30.0  # handshake + tools/list when the caller sets no deadline
    max_output_bytes: int = 262144


@functools.lru_cache(maxsize=4096)
def endpoint_label(url: str) -> str:
    """A bounded-cardinality metrics label for an endpoint URL (`mcp`, `api/v1/mcp`, ...)."""
    path = url.split("?", 1)[0].rstrip("/")
    if path.endswith("/api/v1/mcp"):
        return "api/v1/mcp"
    return path.rsplit("/", 1)[-1] or "root"


def kind_name(kind: int) -> str:
    return "" if kind == Kind.TOOL_ERROR_KIND_UNSPECIFIED else Kind.Name(kind).removeprefix("TOOL_ERROR_KIND_")  # type: ignore[arg-type]


def encode_response(resp: toolgateway_pb2.CallToolResponse) -> str:
    return base64.b64encode(resp.SerializeToString()).decode()


def decode_response(raw: str) -> toolgateway_pb2.CallToolResponse:
    return toolgateway_pb2.CallToolResponse.FromString(base64.b64decode(raw))


def _request_problem(name: str, request_id: str, arguments: dict[str, Any]) -> str:
    """Why a CallTool request is malformed (INVALID_ARGUMENT), or ""."""
    if not name:
        return "name is empty: give a tool name from ListTools"
    if len(request_id) > MAX_REQUEST_ID:
        return f"request_id is {len(request_id)} characters; at most {MAX_REQUEST_ID}"
    try:
        ensure_json(arguments)
    except InvalidJsonValue as exc:
        return f"arguments: {exc}"
    return ""


class _Deadline:
    def __init__(self, timeout_s: float) -> None:
        self.at = time.monotonic() + timeout_s

    def remaining(self) -> float:
        return self.at - time.monotonic()

    def check(self, what: str) -> float:
        left = self.remaining()
        if left <= 0:
            raise GatewayError(grpc.StatusCode.DEADLINE_EXCEEDED, f"deadline exceeded {what}")
        return left


@dataclass
class _CallState:
    """How far a call got: `sent` once it is handed to the upstream client (it may run from then on)."""

    sent: bool = False
    endpoint: str = ""
    arguments: dict[str, Any] | None = None


class ToolGateway:
    """ListTools / CallTool for the session an agent token selects."""

    def __init__(self, store: SessionStore, pool: UpstreamPool, owner: str,
                 settings: GatewaySettings | None = None) -> None:
        self.store = store
        self.pool = pool
        self.owner = owner
        self.settings = settings or GatewaySettings()
        self._background: set[asyncio.Task[Any]] = set()

    # -- auth ---------------------------------------------------------------------------------------------
    async def authenticate(self, token: str | None) -> Session:
        try:
            session = await self.store.session_by_token(self._token_hash(token))
        except StoreError as exc:
            raise GatewayError(grpc.StatusCode.UNAVAILABLE, f"session store unavailable: {exc}") from exc
        return self._admit(session)

    async def _authorize(self, token: str | None, scope_request_id: str) -> tuple[Session, RequestRecord | None]:
        """`authenticate` plus the claim of `scope_request_id` (if any) in one store round trip: the
        session and, if this call claimed the request_id, None; else the earlier attempt's record."""
        try:  # a claim landing after this call was cancelled is released by the store
            session, record, created = await self.store.authorize_call(
                self._token_hash(token), scope_request_id, self.owner)
        except StoreError as exc:
            raise GatewayError(grpc.StatusCode.UNAVAILABLE, f"session store unavailable: {exc}") from exc
        try:
            self._admit(session)
        except GatewayError:
            if created and session is not None:  # claimed, then refused (e.g. TTL passed): free the id again
                await self._shielded(self._release(call_scope(session.session_id), scope_request_id))
            raise
        assert session is not None
        return session, None if created else record

    @staticmethod
    def _token_hash(token: str | None) -> str:
        if not token:
            raise GatewayError(grpc.StatusCode.UNAUTHENTICATED,
                               "missing agent token: send 'authorization: Bearer <agent token>' from Reset")
        return token_hash(token)

    @staticmethod
    def _admit(session: Session | None) -> Session:
        """The session if its agent token may call tools now, else the GatewayError saying why not."""
        if session is None or not session.token_hash:
            raise GatewayError(grpc.StatusCode.UNAUTHENTICATED, "unknown or revoked agent token")
        session_id_var.set(session.session_id)
        status = session.status
        if status in (SessionStatus.CLOSED, SessionStatus.EXPIRED, SessionStatus.FAILED):
            raise GatewayError(grpc.StatusCode.FAILED_PRECONDITION, f"session {session.session_id} is {status}")
        if session.expires_at and time.time() >= session.expires_at:
            raise GatewayError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"session {session.session_id} expired (TTL passed)")
        if status == SessionStatus.DONE:
            reason = f" ({session.done_reason})" if session.done_reason else ""
            raise GatewayError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"episode {session.episode} of session {session.session_id} is done{reason}; "
                               "Reset with the session_id starts the next one")
        if status != SessionStatus.ACTIVE:
            raise GatewayError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"session {session.session_id} is {status}, not active yet")
        if not session.endpoints:
            raise GatewayError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"session {session.session_id} has no MCP endpoints")
        return session

    # -- tools --------------------------------------------------------------------------------------------
    async def _catalog(self, session: Session, deadline: _Deadline, *, refresh: bool = False) -> SessionCatalog:
        ups = self.pool.session(session.session_id, session.endpoints)
        if not refresh and (cached := ups.cached_catalog(session.tool_filter, session.modality)) is not None:
            return cached  # every endpoint's listing is cached and fresh: nothing to wait for
        timeout_s = min(deadline.check("before listing tools"), self.settings.upstream_timeout_s)
        try:
            async with asyncio.timeout(deadline.remaining()):
                cat = await ups.catalog(timeout_s, session.tool_filter, session.modality, refresh=refresh)
        except TimeoutError:
            raise GatewayError(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded while listing tools") from None
        if cat.unavailable:
            if not cat.catalog.tools:
                raise GatewayError(grpc.StatusCode.UNAVAILABLE,
                                   "no MCP endpoint reachable: " + "; ".join(cat.unavailable.values()))
            log.warning("endpoints unavailable (partial tool list): %s", "; ".join(cat.unavailable.values()))
        return cat

    async def list_tools(self, token: str | None, timeout_s: float | None) -> toolgateway_pb2.ListToolsResponse:
        session = await self.authenticate(token)
        deadline = _Deadline(timeout_s if timeout_s is not None else self.settings.upstream_timeout_s)
        cat = await self._catalog(session, deadline)
        return toolgateway_pb2.ListToolsResponse(tools=[t.spec() for t in cat.visible.tools])

    # -- calls --------------------------------------------------------------------------------------------
    async def call_tool(self, token: str | None, request: toolgateway_pb2.CallToolRequest,
                        timeout_s: float | None) -> toolgateway_pb2.CallToolResponse:
        deadline = _Deadline(timeout_s if timeout_s is not None else self.settings.call_timeout_s)
        name, request_id = request.name, request.request_id
        arguments = dict_from_struct(request.arguments)
        problem = _request_problem(name, request_id, arguments)
        # A malformed request claims nothing; the token is still checked first (UNAUTHENTICATED wins).
        session, earlier = await self._authorize(token, "" if problem else request_id)
        if problem:
            raise GatewayError(grpc.StatusCode.INVALID_ARGUMENT, problem)
        scope = call_scope(session.session_id)
        if earlier is not None:
            return await self._replay(scope, request_id, earlier.state, earlier.result, earlier.owner, deadline)

        started = time.monotonic()
        endpoint = ""
        state = _CallState()
        try:
            result, endpoint, arguments = await self._execute(session, name, arguments, deadline, state)
        except CallNotSent as exc:
            await self._shielded(self._release(scope, request_id))
            self._count(name, state.endpoint, "unavailable")
            raise GatewayError(grpc.StatusCode.UNAVAILABLE,
                               f"upstream unavailable (the tool did not run): {exc}") from exc
        except UpstreamUnavailable as exc:  # CallLost or a catalog failure after the call may have started
            lost = isinstance(exc, CallLost)
            if lost:
                msg = (f"upstream connection lost during the call: {exc}. The tool may have run; a retry with "
                       "the same request_id returns OUTCOME_UNKNOWN")
                await self._shielded(self._finish_unknown(
                    session, scope, request_id, name, state.arguments or arguments, state.endpoint, started, msg))
            else:
                await self._shielded(self._release(scope, request_id))
            self._count(name, state.endpoint, "unavailable")
            raise GatewayError(grpc.StatusCode.UNAVAILABLE, str(exc) if not lost else msg) from exc
        except CallTimedOut as exc:
            self._count(name, state.endpoint, "deadline")
            if not exc.sent:
                await self._shielded(self._release(scope, request_id))
                raise GatewayError(grpc.StatusCode.DEADLINE_EXCEEDED, f"deadline exceeded: {exc}") from exc
            msg = f"deadline exceeded: {exc}; the upstream call was cancelled and may have partly run"
            await self._shielded(self._finish_unknown(
                session, scope, request_id, name, state.arguments or arguments, state.endpoint, started, msg))
            raise GatewayError(grpc.StatusCode.DEADLINE_EXCEEDED, msg) from exc
        except GatewayError:
            await self._shielded(self._release(scope, request_id))  # raised before anything was sent upstream
            raise
        except StoreError as exc:
            await self._shielded(self._settle(
                state, session, scope, request_id, name, arguments, started, f"store failed: {exc}"))
            raise GatewayError(grpc.StatusCode.UNAVAILABLE, f"session store unavailable: {exc}") from exc
        except Exception as exc:  # a bug: never leave the request PENDING under a live owner
            await self._shielded(self._settle(
                state, session, scope, request_id, name, arguments, started, f"internal error: {exc}"))
            raise
        except asyncio.CancelledError:
            # The caller went away (cancel or deadline) while the call ran: the upstream request is cancelled
            # with us. The record and log are written by an owned task, since this one is being cancelled.
            if state.sent:
                self._in_background(self._finish_unknown(
                    session, scope, request_id, name, state.arguments or arguments, state.endpoint, started,
                    "the call was cancelled by the caller; the tool may have partly run"))
            else:
                self._in_background(self._release(scope, request_id))
            raise

        response = toolgateway_pb2.CallToolResponse(result=result)
        # The log entry, the session touch and the DONE record in one store round trip, before the reply.
        await self._shielded(self._record(session, scope, request_id, name, arguments, endpoint, response, started))
        return response

    async def _execute(self, session: Session, name: str, arguments: dict[str, Any], deadline: _Deadline,
                       state: _CallState) -> tuple[common_pb2.ToolResult, str, dict[str, Any]]:
        """(result, endpoint, arguments as sent). Model mistakes come back as is_error results."""
        if session.call_budget > 0:
            used = await self.store.count_tool_calls(session.session_id, session.episode)
            if used >= session.call_budget:
                return results.error_result(
                    Kind.TOOL_ERROR_KIND_BUDGET_EXHAUSTED,
                    f"The tool-call budget of this episode ({session.call_budget} calls) is spent; "
                    "the tool was not called. Give your final answer."), "", arguments
        ups = self.pool.session(session.session_id, session.endpoints)
        cat = await self._catalog(session, deadline)
        tool = cat.find(name)
        if tool is None and time.monotonic() - ups.last_forced_refresh > UNKNOWN_TOOL_REFRESH_S:
            ups.last_forced_refresh = time.monotonic()  # the upstream's tool list may have changed
            cat = await self._catalog(session, deadline, refresh=True)
            tool = cat.find(name)
        if tool is None:
            if cat.unavailable and cat.catalog.get(name) is None:
                raise CallNotSent("the tool list is incomplete: " + "; ".join(cat.unavailable.values()))
            return self._unknown_tool(cat, name), "", arguments
        prepared, problem = prepare_arguments(name, arguments, tool.input_schema)
        if problem:
            return results.error_result(Kind.TOOL_ERROR_KIND_INVALID_ARGUMENTS, problem), tool.endpoint, prepared
        timeout_s = deadline.remaining() - DEADLINE_MARGIN_S
        if timeout_s <= 0:
            raise CallTimedOut(f"no time left to call {name!r}", sent=False)
        start = time.perf_counter()
        state.sent, state.endpoint, state.arguments = True, tool.endpoint, prepared
        try:
            mcp_result = await ups.call(tool.endpoint, name, prepared, timeout_s)
        except CallRejected as exc:
            return results.error_result(
                Kind.TOOL_ERROR_KIND_TOOL_FAILED, f"Tool '{name}' was rejected by its server: {exc}"
            ), tool.endpoint, prepared
        finally:
            _latency.labels(name, endpoint_label(tool.endpoint)).observe(time.perf_counter() - start)
        result = results.truncate(results.tool_result(mcp_result), self.settings.max_output_bytes)
        return result, tool.endpoint, prepared

    def _unknown_tool(self, cat: SessionCatalog, name: str) -> common_pb2.ToolResult:
        visible = [t.name for t in cat.visible.tools]
        hidden = cat.catalog.get(name) is not None
        why = "is not available in this task" if hidden else "does not exist"
        listing = ", ".join(visible[:50]) + (" …" if len(visible) > 50 else "")
        return results.error_result(
            Kind.TOOL_ERROR_KIND_UNKNOWN_TOOL,
            f"Tool '{name}' {why}. Available tools: {listing or '(none)'}. Call one of those by its exact name.")

    async def _replay(self, scope: str, request_id: str, state: str, raw: str, owner: str,
                      deadline: _Deadline) -> toolgateway_pb2.CallToolResponse:
        """A request_id seen before: its recorded result, OUTCOME_UNKNOWN if its owner died, or wait."""
        while True:
            if state == RequestState.DONE:
                response = decode_response(raw)
                response.replayed = True
                return response
            if not await self.store.owner_alive(owner):
                _errors.labels("OUTCOME_UNKNOWN").inc()
                log.info("request %s: first attempt's owner %s died mid-call", request_id, owner)
                return toolgateway_pb2.CallToolResponse(result=results.error_result(
                    Kind.TOOL_ERROR_KIND_OUTCOME_UNKNOWN,
                    f"An earlier attempt of request {request_id!r} was in flight when its gateway process died; "
                    "the tool may or may not have run and is not run again. Check the state before retrying "
                    "with a new request_id."))
            await asyncio.sleep(min(REPLAY_POLL_S, max(deadline.remaining(), 0)))
            deadline.check(f"waiting for the first attempt of request {request_id!r}")
            record = await self.store.get_request(scope, request_id)
            if record is None:  # released: the first attempt never reached the upstream
                raise GatewayError(grpc.StatusCode.UNAVAILABLE,
                                   f"the first attempt of request {request_id!r} failed before the tool ran; retry")
            state, raw, owner = record.state, record.result, record.owner

    # -- bookkeeping --------------------------------------------------------------------------------------
    def _count(self, tool: str, endpoint: str, outcome: str) -> None:
        _calls.labels(tool, endpoint_label(endpoint) if endpoint else "-", outcome).inc()

    async def _record(self, session: Session, scope: str, request_id: str, name: str, arguments: Mapping[str, Any],
                      endpoint: str, response: toolgateway_pb2.CallToolResponse, started: float) -> None:
        result = response.result
        kind = kind_name(result.error_kind)
        # A name the model invented must not mint a metric series: label unknown tools as one.
        label = "(unknown)" if result.error_kind == Kind.TOOL_ERROR_KIND_UNKNOWN_TOOL else name
        self._count(label, endpoint, "error" if result.is_error else "ok")
        if kind:
            _errors.labels(kind).inc()
            log.info("tool %s -> %s: %s", name, kind, result.error_message[:200])
        entry = ToolCallEntry(
            session_id=session.session_id, episode=session.episode, request_id=request_id, tool=name,
            arguments=dict(arguments), is_error=result.is_error, error_kind=kind,
            result_summary=results.summary(result), endpoint=endpoint,
            duration_ms=round((time.monotonic() - started) * 1000, 3),
        )
        await self._commit(scope, request_id, entry, response)

    async def _commit(self, scope: str, request_id: str, entry: ToolCallEntry,
                      response: toolgateway_pb2.CallToolResponse) -> None:
        """Append the log entry, touch the session and (with a request_id) record the response as DONE: one
        atomic store write, so a retry never finds a DONE record whose call is missing from the log."""
        request = (scope, request_id, encode_response(response)) if request_id else None
        await self._store_quietly(self.store.commit(request=request, tool_call=entry))

    async def _finish_unknown(self, session: Session, scope: str, request_id: str, name: str,
                              arguments: Mapping[str, Any], endpoint: str, started: float, message: str) -> None:
        """The tool may have run: log it, and make a retry of the request_id answer OUTCOME_UNKNOWN."""
        _errors.labels("OUTCOME_UNKNOWN").inc()
        entry = ToolCallEntry(
            session_id=session.session_id, episode=session.episode, request_id=request_id, tool=name,
            arguments=dict(arguments), is_error=True, error_kind="OUTCOME_UNKNOWN", result_summary=message[:500],
            endpoint=endpoint, duration_ms=round((time.monotonic() - started) * 1000, 3),
        )
        response = toolgateway_pb2.CallToolResponse(
            result=results.error_result(Kind.TOOL_ERROR_KIND_OUTCOME_UNKNOWN, message))
        await self._commit(scope, request_id, entry, response)

    async def _settle(self, state: _CallState, session: Session, scope: str, request_id: str, name: str,
                      arguments: dict[str, Any], started: float, why: str) -> None:
        """After an unexpected failure: release the record if nothing was sent, else OUTCOME_UNKNOWN."""
        if state.sent:
            await self._finish_unknown(session, scope, request_id, name, state.arguments or arguments,
                                       state.endpoint, started, f"{why}; the tool may have run")
        else:
            await self._release(scope, request_id)

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
        """Let bookkeeping of cancelled calls finish (shutdown)."""
        if self._background:
            await asyncio.wait(set(self._background), timeout=timeout_s)
