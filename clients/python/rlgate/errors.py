"""The client's exception hierarchy: one class per gRPC status the services document, plus
`VerifierError` for an episode whose verifier failed or timed out (never reported as reward 0).

`error_from_rpc` turns any grpc / grpc.aio `RpcError` into the matching `RlgateError`; the original
status code, message, trace id and the rich `google.rpc.Status` (when the server sent one) stay on it.
Only the wire format is read here (google.rpc details): the client never imports the services' code."""

from __future__ import annotations

from typing import Any

import grpc
from google.rpc import error_details_pb2, status_pb2


class RlgateError(Exception):
    """Base of every error the rlgate client raises for a failed call.

    `code` is the gRPC status, `trace_id` the call's `x-rlgate-trace-id` (search the services' logs for it)
    and `rich_status` the server's google.rpc.Status with its details (ErrorInfo, RetryInfo, BadRequest,
    QuotaFailure) when it sent one."""

    code: grpc.StatusCode | None = None

    def __init__(
        self,
        message: str,
        *,
        code: grpc.StatusCode | None = None,
        trace_id: str | None = None,
        rich_status: status_pb2.Status | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        self.trace_id = trace_id
        # google.rpc.status_pb2.Status with details (ErrorInfo, RetryInfo, ...) when the server sent one.
        self.rich_status = rich_status

    def __str__(self) -> str:
        code = self.code.name if self.code is not None else "ERROR"
        suffix = f" (trace id {self.trace_id})" if self.trace_id else ""
        return f"{code}: {self.message}{suffix}"

    def __reduce__(self) -> tuple[Any, ...]:
        # Picklable across process boundaries (the Tinker cookbook may ship errors between workers).
        return (_rebuild, (type(self), self.message, self.code, self.trace_id))


def _rebuild(cls: type[RlgateError], message: str, code: grpc.StatusCode | None, trace_id: str | None) -> RlgateError:
    return cls(message, code=code, trace_id=trace_id)


class Unauthenticated(RlgateError):
    """UNAUTHENTICATED: a missing or unknown credential (the orchestrator's API key, or an agent token the
    gateway never issued)."""

    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(RlgateError):
    """PERMISSION_DENIED: the credential is valid but may not do this (rlgate's services do not send it
    today; a proxy in front of them may)."""

    code = grpc.StatusCode.PERMISSION_DENIED


class NotFound(RlgateError):
    """NOT_FOUND: an unknown task, environment or session."""

    code = grpc.StatusCode.NOT_FOUND


class FailedPrecondition(RlgateError):
    """FAILED_PRECONDITION: the session or episode is in the wrong state (done, closed, expired; an ended
    agent token), with the reason in the message."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class InvalidArgument(RlgateError):
    """INVALID_ARGUMENT: a request field is malformed (the server's BadRequest names it), or the client
    refused arguments it cannot send before sending anything."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class ResourceExhausted(RlgateError):
    """RESOURCE_EXHAUSTED: a limit was reached (sessions, instances, sizes); QuotaFailure says which."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(RlgateError):
    """UNAVAILABLE: a service or its dependency is down or draining; raised once the retries are spent."""

    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceeded(RlgateError, TimeoutError):
    """DEADLINE_EXCEEDED: the call's deadline (retries included) ran out; also a TimeoutError."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Cancelled(RlgateError):
    """CANCELLED: the call was cancelled (by the caller, or by a server shutting down)."""

    code = grpc.StatusCode.CANCELLED


class Internal(RlgateError):
    """INTERNAL: a bug in a service; the trace id finds its log lines."""

    code = grpc.StatusCode.INTERNAL


class VerifierError(RlgateError):
    """The episode ended but its verifier produced no score (status ERROR or TIMEOUT).

    This is an infrastructure failure, not a reward of 0: trainers should drop or retry the rollout."""

    def __init__(
        self,
        message: str,
        *,
        status: str = "ERROR",
        session_id: str = "",
        task_key: str = "",
        code: grpc.StatusCode | None = None,
        trace_id: str | None = None,
        rich_status: status_pb2.Status | None = None,
    ) -> None:
        super().__init__(message, code=code, trace_id=trace_id, rich_status=rich_status)
        self.status = status
        self.session_id = session_id
        self.task_key = task_key

    def __str__(self) -> str:
        where = f" task {self.task_key!r}" if self.task_key else ""
        sess = f" session {self.session_id}" if self.session_id else ""
        return f"verifier {self.status}{where}{sess}: {self.message}"

    def __reduce__(self) -> tuple[Any, ...]:
        return (
            _rebuild_verifier,
            (type(self), self.message, self.status, self.session_id, self.task_key, self.trace_id),
        )


def _rebuild_verifier(
    cls: type[VerifierError], message: str, status: str, session_id: str, task_key: str, trace_id: str | None
) -> VerifierError:
    return cls(message, status=status, session_id=session_id, task_key=task_key, trace_id=trace_id)


_BY_CODE: dict[grpc.StatusCode, type[RlgateError]] = {
    cls.code: cls
    for cls in (
        Unauthenticated,
        PermissionDenied,
        NotFound,
        FailedPrecondition,
        InvalidArgument,
        ResourceExhausted,
        Unavailable,
        DeadlineExceeded,
        Cancelled,
        Internal,
    )
}


def error_class(code: grpc.StatusCode | None) -> type[RlgateError]:
    """The exception class for a status code (RlgateError for codes without their own class)."""
    if code is None:
        return RlgateError
    return _BY_CODE.get(code, RlgateError)


_DETAILS_KEY = "grpc-status-details-bin"


def rich_status_of(err: grpc.RpcError) -> status_pb2.Status | None:
    """The google.rpc.Status the server attached (`grpc-status-details-bin`), or None; never raises.

    Both services send one (ErrorInfo, RetryInfo, BadRequest, ...). Unlike grpc_status's `from_call`, a status
    message that differs from the call's details (a proxy may rewrite it) does not drop the details; a status
    whose code differs from the call's is not this call's and is ignored."""
    trailing = getattr(err, "trailing_metadata", None)
    try:
        metadata = trailing() if callable(trailing) else None
        for key, value in metadata or ():
            if key == _DETAILS_KEY:
                status = status_pb2.Status.FromString(value)
                code = status_code(err)
                return status if code is not None and code.value[0] == status.code else None
    except Exception:  # a malformed trailer is no reason to lose the call's own error
        return None
    return None


def retry_delay(status: status_pb2.Status | None) -> float:
    """The RetryInfo delay in a google.rpc.Status, in seconds; 0 when it has none."""
    for detail in status.details if status is not None else ():
        info = error_details_pb2.RetryInfo()
        if detail.Unpack(info):  # False for a detail of another type
            return max(0.0, info.retry_delay.seconds + info.retry_delay.nanos / 1e9)
    return 0.0


def error_reason(status: status_pb2.Status | None) -> str:
    """The ErrorInfo reason in a google.rpc.Status (e.g. "REPLY_BUDGET"); "" when it has none."""
    for detail in status.details if status is not None else ():
        info = error_details_pb2.ErrorInfo()
        if detail.Unpack(info):
            return info.reason
    return ""


def status_code(err: BaseException) -> grpc.StatusCode | None:
    """The gRPC status code of a grpc / grpc.aio error, or None for anything else; never raises."""
    code = getattr(err, "code", None)
    if callable(code):
        try:
            value = code()
        except Exception:
            return None
        return value if isinstance(value, grpc.StatusCode) else None
    return None


def error_from_rpc(err: grpc.RpcError, *, trace_id: str | None = None, context: str = "") -> RlgateError:
    """Map a grpc/grpc.aio RpcError onto the hierarchy. `context` names the call ("Reset", ...)."""
    code = status_code(err)
    details_fn = getattr(err, "details", None)
    details = details_fn() if callable(details_fn) else str(err)
    if not details:  # a status with no message (a proxy, a bare abort): say so rather than end on ": "
        details = f"no message from the server (status {code.name if code is not None else 'unknown'})"
    message = f"{context}: {details}" if context else str(details)
    return error_class(code)(message, code=code, trace_id=trace_id, rich_status=rich_status_of(err))
