"""The store fixtures: every test in tests/store runs once per backend (SQLite file, real redis-server)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from rlgate.store import SessionStore, open_store
from tests.support.redis import RedisServer


@dataclass
class Backend:
    """Where the store under test lives: its URL, and the Redis server behind it (None for SQLite)."""

    name: str
    url: str
    redis: RedisServer | None = None


@pytest.fixture(params=["sqlite", pytest.param("redis", marks=pytest.mark.redis)])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    if request.param == "sqlite":
        return Backend("sqlite", f"sqlite:///{tmp_path / 'data' / 'store.db'}")
    server: RedisServer = request.getfixturevalue("redis_server")
    return Backend("redis", server.url, server)


StoreFactory = Callable[[], Awaitable[SessionStore]]


@pytest.fixture
async def open_another(backend: Backend) -> AsyncIterator[StoreFactory]:
    """Opens further store objects on the same backend (a second connection / replica); all closed."""
    opened: list[SessionStore] = []

    async def factory() -> SessionStore:
        store = await open_store(backend.url)
        opened.append(store)
        return store

    yield factory
    for store in opened:
        await store.close()


@pytest.fixture
async def store(open_another: StoreFactory) -> SessionStore:
    return await open_another()
