"""The store fixtures: every test in tests/store that takes `backend` (or `store`) runs once per backend: a SQLite
file, a real redis-server, and the in-memory store, so this suite is the executable spec of `SessionStore`.

A test about what only a file or a server has (another process opening it, its files) says where it runs with
`@pytest.mark.backends("sqlite", "redis")`; the in-memory store lives in one process only."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from rlgate.store import SessionStore, open_store
from tests.fakes.store import FaultyMemoryStore
from tests.support.redis import RedisServer

BACKENDS = ("sqlite", "redis", "memory")


@dataclass
class Backend:
    """Where the store under test lives: its URL, and the Redis server behind it (None for the others)."""

    name: str
    url: str
    redis: RedisServer | None = None


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "backends(*names): the store backends a test runs on (default: sqlite, redis and memory)"
    )


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "backend" not in metafunc.fixturenames:
        return
    marker = metafunc.definition.get_closest_marker("backends")
    names = marker.args if marker is not None else BACKENDS
    unknown = set(names) - set(BACKENDS)
    assert not unknown, f"unknown backends {unknown}"
    params = [pytest.param(n, marks=pytest.mark.redis) if n == "redis" else n for n in BACKENDS if n in names]
    metafunc.parametrize("backend", params, indirect=True)


@pytest.fixture
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    if request.param == "sqlite":
        return Backend("sqlite", f"sqlite:///{tmp_path / 'data' / 'store.db'}")
    if request.param == "memory":  # a name of this test's own: every store it opens shares the data
        return Backend("memory", f"memory://{uuid.uuid4().hex}")
    server: RedisServer = request.getfixturevalue("redis_server")
    return Backend("redis", server.url, server)


StoreFactory = Callable[[], Awaitable[SessionStore]]


@pytest.fixture
async def open_another(backend: Backend) -> AsyncIterator[StoreFactory]:
    """Opens further store objects on the same backend (a second connection / replica); all closed."""
    opened: list[SessionStore] = []

    async def factory() -> SessionStore:
        # The in-memory store with its test hooks (tests/fakes): it pauses when a test needs it busy.
        memory = backend.url.removeprefix("memory://") if backend.name == "memory" else None
        store = await (FaultyMemoryStore.open(memory) if memory is not None else open_store(backend.url))
        opened.append(store)
        return store

    yield factory
    for store in opened:
        await store.close()


@pytest.fixture
async def store(open_another: StoreFactory) -> SessionStore:
    return await open_another()
