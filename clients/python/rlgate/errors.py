"""The client's exceptions: one class per gRPC status the services document, plus `VerifierError` for an
episode whose verifier failed or timed out (never reported as reward 0).

This module is the public import path for them. The classes are defined once, in `rlgate.core.errors`, the
hierarchy the services raise too, and re-exported here: a failed call raises the class its status code
names (`error_from_rpc`), with the code, message, trace id and the rich `google.rpc.Status` the server sent
(and what its details say: `reason`, `metadata`, `field`, `subject`, `retry_after_s`)."""

from rlgate.core.errors import (
    Cancelled,
    DeadlineExceeded,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    RlgateError,
    Unauthenticated,
    Unavailable,
    VerifierError,
    error_from_rpc,
    rich_status_of,
)

__all__ = [
    "Cancelled",
    "DeadlineExceeded",
    "FailedPrecondition",
    "Internal",
    "InvalidArgument",
    "NotFound",
    "PermissionDenied",
    "ResourceExhausted",
    "RlgateError",
    "Unauthenticated",
    "Unavailable",
    "VerifierError",
    "error_from_rpc",
    "rich_status_of",
]
