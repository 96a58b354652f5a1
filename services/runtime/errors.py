"""The one error type of both services, and how it becomes a gRPC status.

Logic classes (orchestrator and toolgateway alike) raise `RlgateError` subclasses; the servicers turn them
into a `google.rpc.Status` with details (ErrorInfo, RetryInfo, QuotaFailure, BadRequest) via grpcio-status,
so clients see a precise code, a message a human can act on, and machine-readable details (a client honours
RetryInfo the same way whichever service sent it).

Nothing in an error grows with the request: request values are echoed through `clip`, and the message and
every metadata value are clipped again here, so the trailers stay far below a client's metadata limit
(16 KiB by default; past it the caller sees RESOURCE_EXHAUSTED "Stream removed" instead of the status).
"""

from __future__ import annotations

from typing import Any

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from rlgate.runtime.redact import redact_urls

DOMAIN = "rlgate.dev"
MAX_ECHO = 64  # characters of a request value repeated in an error
MAX_MESSAGE = 1024  # characters of an error message (a backstop: call sites clip what they echo)


def clip(value: object, limit: int = MAX_ECHO) -> str:
    """`value` fit to echo in an error: at most `limit` characters, "…" marks a cut."""
    text = str(value)
    return text if len(text) <= limit else text[:limit] + "…"


class RlgateError(Exception):
    """A caller-visible failure with a gRPC status code."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL
    reason: str = "INTERNAL"

    def __init__(self, message: str, *, reason: str | None = None, metadata: dict[str, Any] | None = None) -> None:
        message = clip(redact_urls(message), MAX_MESSAGE)  # an endpoint URL may carry a key
        super().__init__(message)
        self.message = message
        if reason:
            self.reason = reason
        self.metadata = {k: clip(redact_urls(str(v))) for k, v in (metadata or {}).items() if v is not None}

    def details(self) -> list[Any]:
        return [error_details_pb2.ErrorInfo(reason=self.reason, domain=DOMAIN, metadata=self.metadata)]

    def to_status(self) -> status_pb2.Status:
        packed = []
        for detail in self.details():
            item = any_pb2.Any()
            item.Pack(detail)
            packed.append(item)
        return status_pb2.Status(code=_CODES[self.code], message=self.message, details=packed)

    def to_grpc_status(self) -> grpc.Status:
        return rpc_status.to_status(self.to_status())


class InvalidArgument(RlgateError):
    code = grpc.StatusCode.INVALID_ARGUMENT
    reason = "INVALID_ARGUMENT"

    def __init__(self, field: str, message: str) -> None:
        field = clip(field)
        super().__init__(f"{field}: {message}", metadata={"field": field})
        self.field = field

    def details(self) -> list[Any]:
        violation = error_details_pb2.BadRequest.FieldViolation(field=self.field, description=self.message)
        return [*super().details(), error_details_pb2.BadRequest(field_violations=[violation])]


class NotFound(RlgateError):
    code = grpc.StatusCode.NOT_FOUND
    reason = "NOT_FOUND"


class FailedPrecondition(RlgateError):
    code = grpc.StatusCode.FAILED_PRECONDITION
    reason = "FAILED_PRECONDITION"


class ResourceExhausted(RlgateError):
    """A limit: max sessions, or the provider's instance limit."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    reason = "RESOURCE_EXHAUSTED"

    def __init__(
        self,
        message: str,
        *,
        subject: str,
        reason: str,
        metadata: dict[str, Any] | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message, reason=reason, metadata=metadata)
        self.subject = clip(subject)
        self.retry_after_s = retry_after_s

    def details(self) -> list[Any]:
        quota = error_details_pb2.QuotaFailure(
            violations=[error_details_pb2.QuotaFailure.Violation(subject=self.subject, description=self.message)]
        )
        out: list[Any] = [*super().details(), quota]
        if self.retry_after_s is not None:
            out.append(_retry_info(self.retry_after_s))
        return out


class Unavailable(RlgateError):
    """A dependency is down or rate limited past the caller's deadline; safe to retry."""

    code = grpc.StatusCode.UNAVAILABLE
    reason = "UNAVAILABLE"

    def __init__(
        self,
        message: str,
        *,
        reason: str = "UNAVAILABLE",
        retry_after_s: float = 1.0,
        metadata: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message, reason=reason, metadata=metadata)
        self.retry_after_s = retry_after_s

    def details(self) -> list[Any]:
        return [*super().details(), _retry_info(self.retry_after_s)]


class Unauthenticated(RlgateError):
    code = grpc.StatusCode.UNAUTHENTICATED
    reason = "UNAUTHENTICATED"


class PermissionDenied(RlgateError):
    code = grpc.StatusCode.PERMISSION_DENIED
    reason = "PERMISSION_DENIED"


class DeadlineExceeded(RlgateError):
    """The deadline passed first; `retry_after_s` (RetryInfo) when a retry later can get the answer."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED
    reason = "DEADLINE_EXCEEDED"

    def __init__(
        self,
        message: str,
        *,
        reason: str | None = None,
        metadata: dict[str, Any] | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message, reason=reason, metadata=metadata)
        self.retry_after_s = retry_after_s

    def details(self) -> list[Any]:
        out = super().details()
        if self.retry_after_s is not None:
            out.append(_retry_info(self.retry_after_s))
        return out


class Internal(RlgateError):
    code = grpc.StatusCode.INTERNAL
    reason = "INTERNAL"


def _retry_info(seconds: float) -> error_details_pb2.RetryInfo:
    seconds = max(0.0, seconds)
    whole = int(seconds)
    return error_details_pb2.RetryInfo(
        retry_delay=duration_pb2.Duration(seconds=whole, nanos=int((seconds - whole) * 1e9))
    )


_CODES: dict[grpc.StatusCode, int] = {
    grpc.StatusCode.UNAUTHENTICATED: code_pb2.UNAUTHENTICATED,
    grpc.StatusCode.PERMISSION_DENIED: code_pb2.PERMISSION_DENIED,
    grpc.StatusCode.INVALID_ARGUMENT: code_pb2.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND: code_pb2.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION: code_pb2.FAILED_PRECONDITION,
    grpc.StatusCode.RESOURCE_EXHAUSTED: code_pb2.RESOURCE_EXHAUSTED,
    grpc.StatusCode.UNAVAILABLE: code_pb2.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED: code_pb2.DEADLINE_EXCEEDED,
    grpc.StatusCode.INTERNAL: code_pb2.INTERNAL,
}
