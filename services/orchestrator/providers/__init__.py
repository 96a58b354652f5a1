"""Instance providers behind one interface: `fleet` (Fleet or localfleet through fleet-python) and `mcp`
(bring-your-own MCP endpoints, no instance manager)."""

from rlgate.orchestrator.providers.base import (
    EnvNotFound,
    InstanceGone,
    InstanceHandle,
    InstanceLimit,
    Provider,
    ProviderError,
    RateLimited,
    ResetFailed,
    Retryable,
    TaskDef,
    VerifierRun,
)

__all__ = [
    "EnvNotFound",
    "InstanceGone",
    "InstanceHandle",
    "InstanceLimit",
    "Provider",
    "ProviderError",
    "RateLimited",
    "ResetFailed",
    "Retryable",
    "TaskDef",
    "VerifierRun",
]
