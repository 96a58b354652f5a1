"""The one error hierarchy of rlgate, servers' and client's alike, and how an error becomes a
`google.rpc.Status` and back.

Both services raise these classes in their logic code; a servicer sends `to_status()`: the gRPC code, the
message and machine-readable details (ErrorInfo with domain `rlgate.dev`, a reason and metadata; BadRequest
naming the field; QuotaFailure naming the limit; RetryInfo when a retry later can succeed). The client reads
a failed call back into the same class (`error_from_rpc`), with the code, the trace id and the rich status,
and the reason, metadata, field, subject and retry delay the server put in its details.

Nothing in an error grows with the request: request values are echoed through `clip`, and the message and
every metadata value are clipped again here, so the trailers stay far below a client's metadata limit
(16 KiB by default; past it the caller sees RESOURCE_EXHAUSTED "Stream removed" instead of the status). An
endpoint URL in a message or a metadata value is shown without what may carry a key (`redact_urls`).
"""

from __future__ import annotations

from typing import Any, TypeVar

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.protobuf.message import Message
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from rlgate.core.redact import redact_urls

DOMAIN = "rlgate.dev"
MAX_ECHO = 64  # characters of a request value repeated in an error
MAX_MESSAGE = 1024  # characters of an error message (a backstop: call sites clip what they echo)

_E = TypeVar("_E", bound="RlgateError")
_D = TypeVar("_D", bound=Message)


def clip(value: object, limit: int = MAX_ECHO) -> str:
    """`value` fit to echo in an error: at most `limit` characters, "…" marks a cut.

    Args:
        value: what to echo (its `str`).
        limit: the most characters kept.
    """
    text = str(value)
    return text if len(text) <= limit else text[:limit] + "…"


class RlgateError(Exception):
    """Base of every rlgate error: a failure with a gRPC status code.

    `code` is the gRPC status (None for an error that is no status, such as `VerifierError`), `reason` and
    `metadata` the ErrorInfo, `retry_after_s` the RetryInfo delay (None without one), `trace_id` the call's
    `x-rlgate-trace-id` (search the services' logs for it) and `rich_status` the google.rpc.Status a failed
    call carried (ErrorInfo, RetryInfo, BadRequest, QuotaFailure), when the server sent one.

    Args:
        message: what a human can act on (clipped, and URLs shown without their credentials).
        reason: the ErrorInfo reason (e.g. "SESSION_CLOSED"); defaults to the class's.
        metadata: the ErrorInfo metadata (values clipped; None values dropped).
        retry_after_s: the RetryInfo delay a retry should wait, in seconds; None for no RetryInfo.
        code: the status code, for the base class only (a subclass has its own).
        trace_id: the call's trace id.
        rich_status: the google.rpc.Status the error was read from.
    """

    code: grpc.StatusCode | None = None
    reason: str = ""

    def __init__(
        self,
        message: str,
        *,
        reason: str | None = None,
        metadata: dict[str, Any] | None = None,
        retry_after_s: float | None = None,
        code: grpc.StatusCode | None = None,
        trace_id: str | None = None,
        rich_status: status_pb2.Status | None = None,
    ) -> None:
        message = clip(redact_urls(message), MAX_MESSAGE)  # an endpoint URL may carry a key
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        self.reason = reason or type(self).reason or _code_name(self.code)
        self.metadata = {k: clip(redact_urls(str(v))) for k, v in (metadata or {}).items() if v is not None}
        self.retry_after_s = retry_after_s
        self.trace_id = trace_id
        self.rich_status = rich_status

    def __str__(self) -> str:
        suffix = f" (trace id {self.trace_id})" if self.trace_id else ""
        return f"{_code_name(self.code, 'ERROR')}: {self.message}{suffix}"

    def __reduce__(self) -> tuple[Any, ...]:
        # Picklable across process boundaries (the Tinker cookbook may ship errors between workers), whatever
        # the subclass's constructor takes.
        state = dict(self.__dict__)
        rich = state.pop("rich_status", None)
        return (_rebuild, (type(self), state, rich.SerializeToString() if rich is not None else b""))

    # -- the server's side: the error as a google.rpc.Status

    def details(self) -> list[Message]:
        """The status details: ErrorInfo, the class's own (BadRequest, QuotaFailure), then RetryInfo."""
        info = error_details_pb2.ErrorInfo(reason=self.reason, domain=DOMAIN, metadata=self.metadata)
        retry = [] if self.retry_after_s is None else [_retry_info(self.retry_after_s)]
        return [info, *self._own_details(), *retry]

    def _own_details(self) -> list[Message]:
        return []

    def to_status(self) -> status_pb2.Status:
        """The google.rpc.Status a server sends for this error (a code-less error is INTERNAL)."""
        packed = []
        for detail in self.details():
            item = any_pb2.Any()
            item.Pack(detail)
            packed.append(item)
        code = self.code or grpc.StatusCode.INTERNAL
        return status_pb2.Status(code=code.value[0], message=self.message, details=packed)

    def to_grpc_status(self) -> grpc.Status:
        """`to_status()` in the form `grpc.aio` servers abort with (`context.abort_with_status`)."""
        return rpc_status.to_status(self.to_status())

    # -- the client's side: the error a failed call carried

    @classmethod
    def from_status(
        cls: type[_E],
        message: str,
        *,
        code: grpc.StatusCode | None,
        trace_id: str | None = None,
        rich_status: status_pb2.Status | None = None,
    ) -> _E:
        """The error as a caller receives it: this class, with what `rich_status`'s details say.

        Args:
            message: the message to show (the call's details, prefixed with the RPC's name).
            code: the call's status code.
            trace_id: the call's trace id.
            rich_status: the google.rpc.Status the call carried, if any.
        """
        error = cls.__new__(cls, message)
        info = _detail(rich_status, error_details_pb2.ErrorInfo)
        retry = _detail(rich_status, error_details_pb2.RetryInfo)
        RlgateError.__init__(
            error,
            message,
            reason=info.reason if info is not None else "",
            metadata=dict(info.metadata) if info is not None else None,
            retry_after_s=_seconds(retry.retry_delay) if retry is not None else None,
            code=code,
            trace_id=trace_id,
            rich_status=rich_status,
        )
        error._read_details(rich_status)
        return error

    def _read_details(self, status: status_pb2.Status | None) -> None:
        """Set the subclass's own attributes from a received status (its BadRequest, QuotaFailure, ...)."""


def _rebuild(cls: type[RlgateError], state: dict[str, Any], rich: bytes) -> RlgateError:
    error = cls.__new__(cls, state.get("message", ""))
    error.__dict__.update(state)
    error.rich_status = status_pb2.Status.FromString(rich) if rich else None
    return error


class Unauthenticated(RlgateError):
    """UNAUTHENTICATED: a missing or unknown credential (the orchestrator's API key, or an agent token the
    gateway never issued)."""

    code = grpc.StatusCode.UNAUTHENTICATED
    reason = "UNAUTHENTICATED"


class PermissionDenied(RlgateError):
    """PERMISSION_DENIED: the credential is valid but may not do this (rlgate's services do not send it
    today; a proxy in front of them may)."""

    code = grpc.StatusCode.PERMISSION_DENIED
    reason = "PERMISSION_DENIED"


class NotFound(RlgateError):
    """NOT_FOUND: an unknown task, environment or session."""

    code = grpc.StatusCode.NOT_FOUND
    reason = "NOT_FOUND"


class FailedPrecondition(RlgateError):
    """FAILED_PRECONDITION: the session or episode is in the wrong state (done, closed, expired; an ended
    agent token), with the reason in the message."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    reason = "FAILED_PRECONDITION"


class InvalidArgument(RlgateError):
    """INVALID_ARGUMENT: a request field is malformed (`field` names it, as the status's BadRequest does), or
    the client refused arguments it cannot send before sending anything (no `field`).

    Args:
        field_or_message: the malformed field, followed by `message`; alone, the whole message.
        message: what is wrong with the field.
        reason: the ErrorInfo reason.
        metadata: the ErrorInfo metadata (the field is added as "field").
        trace_id: the call's trace id.
        rich_status: the google.rpc.Status the error was read from.
    """

    code = grpc.StatusCode.INVALID_ARGUMENT
    reason = "INVALID_ARGUMENT"
    field = ""

    def __init__(
        self,
        field_or_message: str,
        message: str | None = None,
        /,
        *,
        reason: str | None = None,
        metadata: dict[str, Any] | None = None,
        trace_id: str | None = None,
        rich_status: status_pb2.Status | None = None,
    ) -> None:
        field = clip(field_or_message) if message is not None else ""
        super().__init__(
            f"{field}: {message}" if message is not None else field_or_message,
            reason=reason,
            metadata={"field": field, **(metadata or {})} if field else metadata,
            trace_id=trace_id,
            rich_status=rich_status,
        )
        self.field = field

    def _own_details(self) -> list[Message]:
        if not self.field:
            return []
        violation = error_details_pb2.BadRequest.FieldViolation(field=self.field, description=self.message)
        return [error_details_pb2.BadRequest(field_violations=[violation])]

    def _read_details(self, status: status_pb2.Status | None) -> None:
        bad = _detail(status, error_details_pb2.BadRequest)
        if bad is not None and bad.field_violations:
            self.field = bad.field_violations[0].field


class ResourceExhausted(RlgateError):
    """RESOURCE_EXHAUSTED: a limit was reached (sessions, instances, sizes, a connection's unread replies);
    `subject` names it, as the status's QuotaFailure does.

    Args:
        message: what a human can act on.
        subject: the QuotaFailure subject (what is limited).
        reason: the ErrorInfo reason (e.g. "MAX_SESSIONS").
        metadata: the ErrorInfo metadata.
        retry_after_s: the RetryInfo delay, in seconds; None for no RetryInfo.
        trace_id: the call's trace id.
        rich_status: the google.rpc.Status the error was read from.
    """

    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    reason = "RESOURCE_EXHAUSTED"
    subject = ""

    def __init__(
        self,
        message: str,
        *,
        subject: str,
        reason: str,
        metadata: dict[str, Any] | None = None,
        retry_after_s: float | None = None,
        trace_id: str | None = None,
        rich_status: status_pb2.Status | None = None,
    ) -> None:
        super().__init__(
            message,
            reason=reason,
            metadata=metadata,
            retry_after_s=retry_after_s,
            trace_id=trace_id,
            rich_status=rich_status,
        )
        self.subject = clip(subject)

    def _own_details(self) -> list[Message]:
        violation = error_details_pb2.QuotaFailure.Violation(subject=self.subject, description=self.message)
        return [error_details_pb2.QuotaFailure(violations=[violation])]

    def _read_details(self, status: status_pb2.Status | None) -> None:
        quota = _detail(status, error_details_pb2.QuotaFailure)
        if quota is not None and quota.violations:
            self.subject = quota.violations[0].subject


class Unavailable(RlgateError):
    """UNAVAILABLE: a service or its dependency is down, draining or rate limited; safe to retry (a client
    raises it once its retries are spent). A server's carries a RetryInfo (`retry_after_s`, 1 s by default).

    Args:
        message: what a human can act on.
        reason: the ErrorInfo reason (e.g. "STORE_UNAVAILABLE").
        retry_after_s: the RetryInfo delay, in seconds.
        metadata: the ErrorInfo metadata.
        trace_id: the call's trace id.
        rich_status: the google.rpc.Status the error was read from.
    """

    code = grpc.StatusCode.UNAVAILABLE
    reason = "UNAVAILABLE"

    def __init__(
        self,
        message: str,
        *,
        reason: str | None = None,
        retry_after_s: float | None = 1.0,
        metadata: dict[str, Any] | None = None,
        trace_id: str | None = None,
        rich_status: status_pb2.Status | None = None,
    ) -> None:
        super().__init__(
            message,
            reason=reason,
            metadata=metadata,
            retry_after_s=retry_after_s,
            trace_id=trace_id,
            rich_status=rich_status,
        )


class DeadlineExceeded(RlgateError, TimeoutError):
    """DEADLINE_EXCEEDED: the call's deadline (retries included) ran out; also a TimeoutError. A server's
    carries a RetryInfo (`retry_after_s`) when a retry later can get the answer."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED
    reason = "DEADLINE_EXCEEDED"


class Cancelled(RlgateError):
    """CANCELLED: the call was cancelled (by the caller, or by a server shutting down)."""

    code = grpc.StatusCode.CANCELLED
    reason = "CANCELLED"


class Internal(RlgateError):
    """INTERNAL: a bug in a service; the trace id finds its log lines."""

    code = grpc.StatusCode.INTERNAL
    reason = "INTERNAL"


class VerifierError(RlgateError):
    """The episode ended but its verifier produced no score (status ERROR or TIMEOUT).

    This is an infrastructure failure, not a reward of 0: trainers should drop or retry the rollout.

    Args:
        message: the verifier's message.
        status: the verification status, "ERROR" or "TIMEOUT".
        session_id: the episode's session.
        task_key: the episode's task.
        trace_id: the call's trace id.
        rich_status: the google.rpc.Status the error was read from.
    """

    status = "ERROR"
    session_id = ""
    task_key = ""

    def __init__(
        self,
        message: str,
        *,
        status: str = "ERROR",
        session_id: str = "",
        task_key: str = "",
        trace_id: str | None = None,
        rich_status: status_pb2.Status | None = None,
    ) -> None:
        super().__init__(message, trace_id=trace_id, rich_status=rich_status)
        self.status = status
        self.session_id = session_id
        self.task_key = task_key

    def __str__(self) -> str:
        where = f" task {self.task_key!r}" if self.task_key else ""
        sess = f" session {self.session_id}" if self.session_id else ""
        return f"verifier {self.status}{where}{sess}: {self.message}"


def _code_name(code: grpc.StatusCode | None, default: str = "INTERNAL") -> str:
    return code.name if code is not None else default


def _retry_info(seconds: float) -> error_details_pb2.RetryInfo:
    seconds = max(0.0, seconds)
    whole = int(seconds)
    return error_details_pb2.RetryInfo(
        retry_delay=duration_pb2.Duration(seconds=whole, nanos=int((seconds - whole) * 1e9))
    )


def _seconds(delay: duration_pb2.Duration) -> float:
    return max(0.0, delay.seconds + delay.nanos / 1e9)


def _detail(status: status_pb2.Status | None, kind: type[_D]) -> _D | None:
    """The first detail of type `kind` in `status`, or None."""
    for item in status.details if status is not None else ():
        detail = kind()
        if item.Unpack(detail):  # False for a detail of another type
            return detail
    return None


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
    if cls.code is not None
}


def error_class(code: grpc.StatusCode | None) -> type[RlgateError]:
    """The exception class for a status code (RlgateError for codes without their own class).

    Args:
        code: the gRPC status code, or None.
    """
    if code is None:
        return RlgateError
    return _BY_CODE.get(code, RlgateError)


_DETAILS_KEY = "grpc-status-details-bin"


def rich_status_of(err: grpc.RpcError) -> status_pb2.Status | None:
    """The google.rpc.Status the server attached (`grpc-status-details-bin`), or None; never raises.

    Both services send one (ErrorInfo, RetryInfo, BadRequest, ...). Unlike grpc_status's `from_call`, a status
    message that differs from the call's details (a proxy may rewrite it) does not drop the details; a status
    whose code differs from the call's is not this call's and is ignored.

    Args:
        err: a failed grpc or grpc.aio call.
    """
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
    """The RetryInfo delay in a google.rpc.Status, in seconds; 0 when it has none.

    Args:
        status: the status, or None.
    """
    retry = _detail(status, error_details_pb2.RetryInfo)
    return _seconds(retry.retry_delay) if retry is not None else 0.0


def error_reason(status: status_pb2.Status | None) -> str:
    """The ErrorInfo reason in a google.rpc.Status (e.g. "REPLY_BUDGET"); "" when it has none.

    Args:
        status: the status, or None.
    """
    info = _detail(status, error_details_pb2.ErrorInfo)
    return info.reason if info is not None else ""


def status_code(err: BaseException) -> grpc.StatusCode | None:
    """The gRPC status code of a grpc / grpc.aio error, or None for anything else; never raises.

    Args:
        err: any exception.
    """
    code = getattr(err, "code", None)
    if callable(code):
        try:
            value = code()
        except Exception:
            return None
        return value if isinstance(value, grpc.StatusCode) else None
    return None


def error_from_rpc(err: grpc.RpcError, *, trace_id: str | None = None, context: str = "") -> RlgateError:
    """Map a grpc/grpc.aio RpcError onto the hierarchy, with the details the server sent.

    Args:
        err: the failed call.
        trace_id: the call's trace id.
        context: the call's name ("Reset", ...), prefixed to the message.
    """
    code = status_code(err)
    details_fn = getattr(err, "details", None)
    details = details_fn() if callable(details_fn) else str(err)
    if not details:  # a status with no message (a proxy, a bare abort): say so rather than end on ": "
        details = f"no message from the server (status {code.name if code is not None else 'unknown'})"
    message = f"{context}: {details}" if context else str(details)
    return error_class(code).from_status(message, code=code, trace_id=trace_id, rich_status=rich_status_of(err))
