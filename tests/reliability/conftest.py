"""Sizes (quick in `make test`, full with RLGATE_FULL=1), hypothesis profiles, the figures recorder and the
session-wide secret audit of the reliability suite.

Figures land in `.rlgate/reliability/figures-<quick|full>.json` (git-ignored), in the pytest basetemp, and in
$RLGATE_RELIABILITY_FIGURES when set; docs/reliability.md quotes a real run of them. The terminal summary
prints where they are.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

from tests.reliability.harness import REPO, Audit, env_flag

FULL = env_flag("RLGATE_FULL")


@dataclass(frozen=True)
class Sizes:
    examples_per_rpc: int  # hypothesis examples per RPC
    load_episodes: int  # concurrent episodes in the load test
    load_calls: int  # tool calls (turns) per episode
    soak_s: float  # soak duration
    soak_sample_s: float  # RSS / fd sampling period
    soak_concurrency: int  # episodes running at once during the soak


QUICK = Sizes(examples_per_rpc=200, load_episodes=40, load_calls=10, soak_s=30, soak_sample_s=1.0, soak_concurrency=4)
FULL_SIZES = Sizes(
    examples_per_rpc=5000, load_episodes=200, load_calls=20, soak_s=600, soak_sample_s=5.0, soak_concurrency=8
)
SIZES = FULL_SIZES if FULL else QUICK

# Applied per test (`@settings(parent=PROFILE)`) rather than loaded globally, so other suites keep theirs.
settings.register_profile(
    "rlgate-reliability",
    max_examples=SIZES.examples_per_rpc,
    deadline=None,
    database=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.function_scoped_fixture,
        HealthCheck.data_too_large,
        HealthCheck.filter_too_much,
    ],
    print_blob=True,
)
PROFILE = settings.get_profile("rlgate-reliability")


class Figures:
    """Measured figures by section; written as JSON at the end of the session."""

    def __init__(self) -> None:
        self.data: dict[str, Any] = {
            "sizes": {"mode": "full" if FULL else "quick", **asdict(SIZES)},
            "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }

    def record(self, section: str, name: str, value: Any) -> None:
        self.data.setdefault(section, {})[name] = value

    def append(self, section: str, value: Any) -> None:
        self.data.setdefault(section, [])
        self.data[section].append(value)

    def write(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.data, indent=2, sort_keys=True, default=str))


_FIGURES = Figures()
_AUDIT = Audit()
_WRITTEN: list[Path] = []


@pytest.fixture(scope="session")
def figures(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Figures]:
    yield _FIGURES
    _FIGURES.data["finished_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    mode = "full" if FULL else "quick"
    targets = [
        tmp_path_factory.getbasetemp() / "reliability-figures.json",
        REPO / ".rlgate" / "reliability" / f"figures-{mode}.json",
    ]
    if os.environ.get("RLGATE_RELIABILITY_FIGURES"):
        targets.append(Path(os.environ["RLGATE_RELIABILITY_FIGURES"]))
    for path in targets:
        _FIGURES.write(path)
        _WRITTEN.append(path)


@pytest.fixture(scope="session")
def audit() -> Audit:
    """Every stack, agent token and error detail of the session (scanned by test_security)."""
    return _AUDIT


def pytest_terminal_summary(terminalreporter: Any) -> None:
    for path in _WRITTEN:
        terminalreporter.write_line(f"reliability figures: {path}")
