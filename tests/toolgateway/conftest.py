"""Fixtures for the toolgateway tests: localfleet with the gateway test environments, a real SQLite store,
an in-process gateway, and sessions pointing at localfleet instances."""

from __future__ import annotations

import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import grpc
import httpx
import pytest

from rlgate.runtime.auth import mint_agent_token, token_hash
from rlgate.store import Session, SessionStatus, SessionStore
from rlgate.toolgateway.config import GatewayConfig
from rlgate.toolgateway.server import GatewayHandle, start_gateway
from rlgate.v1 import toolgateway_pb2_grpc
from tests.support.localfleet import LocalfleetProcess
from tests.support.ports import require_binary
from tests.toolgateway.upstreams import exact_server, serve_mcp

ENVIRONMENTS = "tests.toolgateway.envs:gateway_environments"
ERAS = ["gw", "gw-legacy"]  # env ids: modern (2026-07-28) and legacy (initialize + Mcp-Session-Id)
ERA_HANDSHAKE = {"gw": "mcp_discover", "gw-legacy": "mcp_initialize"}


def new_localfleet() -> LocalfleetProcess:
    return LocalfleetProcess(environments=ENVIRONMENTS)


@pytest.fixture(scope="module")
def localfleet_environments() -> str:
    """The shared localfleet (`localfleet_module`, `lf`) serves the gateway test environments."""
    return ENVIRONMENTS


@pytest.fixture(params=ERAS)
def era(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def gateway_config(**overrides: Any) -> GatewayConfig:
    base = GatewayConfig(
        listen="127.0.0.1:0",
        call_timeout_s=30.0,
        upstream_timeout_s=15.0,
        janitor_interval_s=0.5,
        owner_ttl_s=2.0,
        drain_s=1.0,
    )
    return replace(base, **overrides)


@pytest.fixture
async def gateway(store: SessionStore) -> AsyncIterator[GatewayHandle]:
    handle = await start_gateway(gateway_config(max_output_bytes=4096), store)
    yield handle
    await handle.stop(grace=0)


def create_instance(lf: LocalfleetProcess, env_key: str, image_type: str | None = None) -> dict[str, Any]:
    """A localfleet instance; `image_type="mcp"` gives its aggregator the `computer` tool (as Fleet's), which
    localfleet creates only with a browser (skipped without `chromium`, failed under CI=true)."""
    if image_type == "mcp":
        require_binary("chromium")
    r = httpx.post(
        f"{lf.base_url}/v1/env/instances",
        json={"env_key": env_key, "image_type": image_type},
        headers={"Authorization": "Bearer test"},
        timeout=30,
    )
    r.raise_for_status()
    return dict(r.json())


@dataclass
class AgentSession:
    session: Session
    token: str
    instance: dict[str, Any]

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.token}"),)


async def make_session(
    store: SessionStore,
    lf: LocalfleetProcess,
    env_key: str = "gw",
    *,
    instance: dict[str, Any] | None = None,
    **fields: Any,
) -> AgentSession:
    """An ACTIVE session on a (new) localfleet instance, as the orchestrator would write it (a screen
    instance, `image_type="mcp"`, for any modality but tool_use)."""
    modality = fields.pop("modality", "tool_use")
    inst = instance or create_instance(lf, env_key, image_type=None if modality == "tool_use" else "mcp")
    session_id = uuid.uuid4().hex
    token = mint_agent_token(session_id)
    urls = inst["urls"]["mcp"]
    session = Session(
        session_id=session_id,
        env_key=f"{env_key}:v1",
        status=SessionStatus.ACTIVE,
        modality=modality,
        instance_id=inst["instance_id"],
        endpoints=[urls["api"], urls["aggregator"]],
        tool_filter={"modality": modality, **fields.pop("tool_filter", {})},
        token_hash=token_hash(token),
        expires_at=time.time() + 3600,
        **fields,
    )
    created = await store.create_session(session)
    return AgentSession(created, token, inst)


async def byo_session(store: SessionStore, endpoints: Sequence[str], **fields: Any) -> AgentSession:
    """An ACTIVE session on bring-your-own MCP endpoints (no instance)."""
    session_id = uuid.uuid4().hex
    token = mint_agent_token(session_id)
    session = Session(
        session_id=session_id,
        env_key="byo:v1",
        status=SessionStatus.ACTIVE,
        provider="mcp",
        endpoints=list(endpoints),
        token_hash=token_hash(token),
        expires_at=time.time() + 3600,
        **fields,
    )
    return AgentSession(await store.create_session(session), token, {})


@dataclass
class ExactUpstream:
    url: str
    calls: Counter[str]  # tool name -> times it ran


@pytest.fixture
async def exact_upstream() -> AsyncIterator[ExactUpstream]:
    """tests.toolgateway.upstreams.exact_server, served in this event loop."""
    calls: Counter[str] = Counter()
    async with serve_mcp(exact_server(calls)) as url:
        yield ExactUpstream(url, calls)


@pytest.fixture
async def stub(gateway: GatewayHandle) -> AsyncIterator[toolgateway_pb2_grpc.ToolGatewayServiceStub]:
    async with grpc.aio.insecure_channel(gateway.address) as channel:
        yield toolgateway_pb2_grpc.ToolGatewayServiceStub(channel)
