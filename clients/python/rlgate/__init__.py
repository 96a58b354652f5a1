"""rlgate: gRPC clients, generated stubs and trainer adapters for the rlgate services.

`import rlgate` needs only grpcio and protobuf; the SkyRL and Tinker adapters (rlgate.adapters.*) and
`rlgate rollout` import their heavier dependencies when used."""

from rlgate.client import AsyncClient, Client, ClientSettings, Timeouts
from rlgate.episode import AsyncEpisode, Episode, ToolCallRecord, TurnResult
from rlgate.errors import (
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
)
from rlgate.protocol import ParsedTurn, ToolCall, parse_assistant_text, render_system_prompt
from rlgate.retry import RetryPolicy

__version__ = "0.1.0"

__all__ = [
    "AsyncClient",
    "AsyncEpisode",
    "Cancelled",
    "Client",
    "ClientSettings",
    "DeadlineExceeded",
    "Episode",
    "FailedPrecondition",
    "Internal",
    "InvalidArgument",
    "NotFound",
    "ParsedTurn",
    "PermissionDenied",
    "ResourceExhausted",
    "RetryPolicy",
    "RlgateError",
    "Timeouts",
    "ToolCall",
    "ToolCallRecord",
    "TurnResult",
    "Unauthenticated",
    "Unavailable",
    "VerifierError",
    "__version__",
    "parse_assistant_text",
    "render_system_prompt",
]
