"""The async adapters' clients: one `AsyncClient` per event loop and settings (grpc.aio channels belong to
the loop that made them), shared by the Tinker and VAGEN adapters."""

from __future__ import annotations

import asyncio
import weakref

from rlgate.client import ENV_ORCHESTRATOR, AsyncClient, ClientSettings
from rlgate.settings import read_env

_clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[tuple[str, str], AsyncClient]] = (
    weakref.WeakKeyDictionary()
)


def loop_client(orchestrator: str, api_key: str | None) -> AsyncClient:
    """The AsyncClient for these settings on the running event loop.

    Args:
        orchestrator: the orchestrator address(es), "host:port[,...]".
        api_key: the orchestrator API key (None: none).
    """
    per_loop = _clients.setdefault(asyncio.get_running_loop(), {})
    key = (orchestrator, api_key or "")
    client = per_loop.get(key)
    if client is None:
        client = per_loop[key] = AsyncClient(orchestrator, settings=ClientSettings.from_env(api_key=api_key))
    return client


def orchestrator_address(address: str) -> str:
    """`address`, else RLGATE_ORCHESTRATOR.

    Args:
        address: the configured address (empty: the variable).

    Raises:
        ValueError: neither is set.
    """
    resolved = address or read_env(ENV_ORCHESTRATOR) or ""
    if not resolved:
        raise ValueError(f"no orchestrator address: pass orchestrator= or set {ENV_ORCHESTRATOR}")
    return resolved
