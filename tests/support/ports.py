"""Loopback helpers shared by all tests: free ports, waiting for a port, CI detection."""

from __future__ import annotations

import os
import socket

import pytest

from rlgate.devtools.stack import free_port
from tests.support.wait import wait_until_sync

__all__ = ["IN_CI", "free_port", "require_binary", "wait_for_port"]

IN_CI = os.environ.get("CI", "").lower() in {"1", "true", "yes"}


def wait_for_port(port: int, timeout: float = 20.0, host: str = "127.0.0.1") -> None:
    """Block until something accepts TCP connections on host:port (an AssertionError after `timeout`)."""

    def accepts() -> bool:
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return True
        except OSError:
            return False

    wait_until_sync(accepts, timeout, f"something listening on {host}:{port}")


def require_binary(name: str) -> str:
    """Path of a system binary; skip the test without it, but fail under CI=true."""
    import shutil

    path = shutil.which(name)
    if path is None:
        message = f"{name} is not installed (.ci/run installs it)"
        if IN_CI:
            pytest.fail(message)
        pytest.skip(message)
    return path
