"""The `store` fixture: a real SQLite session store in the test's tmp_path, closed at teardown. Directories
with their own store matrix (tests/store) define their own `store`, which takes precedence."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from rlgate.store import SessionStore, open_store


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[SessionStore]:
    s = await open_store(f"sqlite:///{tmp_path / 'store.db'}")
    try:
        yield s
    finally:
        await s.close()
