"""rlgate: gRPC clients, generated stubs and trainer adapters for the rlgate services.

`import rlgate` needs only grpcio and protobuf; the SkyRL and Tinker adapters (rlgate.adapters.*) and
`rlgate rollout` import their heavier dependencies when used."""

from rlgate.client import AsyncClient, Client
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
from rlgate.inputs import EpisodeSpec, ResetFields
from rlgate.messages import ImagePart, Message, TextPart
from rlgate.protocol import ParsedTurn, ToolCall, parse_assistant_text, render_system_prompt
from rlgate.results import InfraFaults, Instance, ResetResult, StepResult, Verification
from rlgate.retry import RetryPolicy
from rlgate.settings import ClientSettings, RunSettings, Timeouts

__version__ = "0.1.0"

__all__ = [
    "AsyncClient",
    "AsyncEpisode",
    "Cancelled",
    "Client",
    "ClientSettings",
    "DeadlineExceeded",
    "Episode",
    "EpisodeSpec",
    "FailedPrecondition",
    "ImagePart",
    "InfraFaults",
    "Instance",
    "Internal",
    "InvalidArgument",
    "Message",
    "NotFound",
    "ParsedTurn",
    "PermissionDenied",
    "ResetFields",
    "ResetResult",
    "ResourceExhausted",
    "RetryPolicy",
    "RlgateError",
    "RunSettings",
    "StepResult",
    "TextPart",
    "Timeouts",
    "ToolCall",
    "ToolCallRecord",
    "TurnResult",
    "Unauthenticated",
    "Unavailable",
    "Verification",
    "VerifierError",
    "__version__",
    "parse_assistant_text",
    "render_system_prompt",
]
