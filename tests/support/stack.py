"""Fixtures that run the whole local stack (localfleet + orchestrator + toolgateway) as processes.

- `stack`: one stack per test module, embedded defaults (SQLite store under a temp dir).
- `stack_factory`: build stacks with custom settings (faults, flags, Redis store); all stopped at teardown.
Every process is stopped (SIGTERM, then SIGKILL) when the fixture ends, and its log is kept in the
temp dir for failure messages.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from rlgate.devtools.stack import LocalStack, StackSettings


@pytest.fixture
def stack_factory(tmp_path: Path) -> Iterator[Callable[..., LocalStack]]:
    started: list[LocalStack] = []

    def make(**kwargs: Any) -> LocalStack:
        kwargs.setdefault("data_dir", tmp_path / f"stack{len(started)}")
        stack = LocalStack(StackSettings(**kwargs))
        started.append(stack)
        return stack.start()

    yield make
    for stack in started:
        stack.stop()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    with LocalStack(StackSettings(data_dir=tmp_path_factory.mktemp("stack"))) as running:
        yield running
