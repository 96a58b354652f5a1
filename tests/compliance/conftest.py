"""Fixtures for the compliance suite run against rlgate: one localfleet and one server loop per module, and
rlgate stacks on them started when a test class first asks — open, with API keys, and with a short
session TTL for the expiry test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.compliance.servers import LoopThread, Servers, start_servers
from tests.support.localfleet import LocalfleetProcess

API_KEY = "compliance-key-1"
OTHER_API_KEY = "compliance-key-2"
SHORT_SESSION_TTL_S = 3.0


@pytest.fixture(scope="module")
def server_loop() -> Iterator[LoopThread]:
    loop = LoopThread()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def fleet() -> Iterator[LocalfleetProcess]:
    with LocalfleetProcess() as lf:
        yield lf


def _serve(
    loop: LoopThread, fleet: LocalfleetProcess, tmp: pytest.TempPathFactory, name: str, **orchestrator: object
) -> Iterator[Servers]:
    servers = loop.run(start_servers(fleet, tmp.mktemp(name), **orchestrator))
    yield servers
    loop.run(servers.stop())


@pytest.fixture(scope="module")
def open_servers(
    server_loop: LoopThread, fleet: LocalfleetProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Servers]:
    yield from _serve(server_loop, fleet, tmp_path_factory, "open")


@pytest.fixture(scope="module")
def keyed_servers(
    server_loop: LoopThread, fleet: LocalfleetProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Servers]:
    yield from _serve(server_loop, fleet, tmp_path_factory, "keyed", api_keys=[API_KEY, OTHER_API_KEY])


@pytest.fixture(scope="module")
def expiring_servers(
    server_loop: LoopThread, fleet: LocalfleetProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Servers]:
    """Sessions expire SHORT_SESSION_TTL_S after Reset (no API keys: the keyed variant's key is ignored)."""
    yield from _serve(server_loop, fleet, tmp_path_factory, "expiring", session_ttl_s=SHORT_SESSION_TTL_S)
