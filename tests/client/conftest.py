"""Fixtures for the client tests: scripted gRPC servers on loopback."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.client.scripted import ScriptedServer


@pytest.fixture
def server() -> Iterator[ScriptedServer]:
    srv = ScriptedServer().start()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def server2() -> Iterator[ScriptedServer]:
    srv = ScriptedServer().start()
    try:
        yield srv
    finally:
        srv.stop()
