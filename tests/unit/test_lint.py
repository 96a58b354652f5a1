"""ruff (lint and format) and mypy stay clean: run in the suite so CI enforces what `make lint` checks."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_ruff_is_clean() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "."], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]


def test_ruff_format_is_applied() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--check", "."], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]


def test_mypy_is_clean() -> None:
    # As `make lint` runs it: over the package-dir namespace laid out in .mypy-tree (see the script).
    result = subprocess.run(
        [sys.executable, "scripts/typecheck.py"], cwd=ROOT, capture_output=True, text=True, timeout=900
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
