"""A real `redis-server` for tests, with append-only persistence so restarts lose nothing acknowledged.

Fixture `redis_server` (function scope): a fresh server on a free 127.0.0.1 port with its own data dir.

    async def test_x(redis_server):
        store = await open_store(redis_server.url)        # redis://127.0.0.1:PORT/0
        await redis_server.restart_async()                # stop + start on the same port/dir, wait for PING
        redis_server.stop(kill=True)                      # SIGKILL (crash) or default SIGTERM

`.restart()`, `.stop()` and `.start()` block (for sync code and threads); in async tests use
`restart_async()` / `stop_async()` / `start_async()` so the event loop keeps running during the outage.
Without a `redis-server` binary the test is skipped locally and FAILS under CI=true. The process is killed
at teardown whatever the test did. Other fixtures can build on `RedisServer` directly (e.g. a module-scoped
server): `RedisServer.launch(directory)` and `.close()`.
"""

from __future__ import annotations

import asyncio
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.ports import free_port, require_binary
from tests.support.wait import wait_until_sync


def _ping(port: int, timeout: float = 0.5) -> bool:
    """True once the server answers PING with PONG (not while it is still loading its AOF)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
            sock.settimeout(timeout)
            sock.sendall(b"PING\r\n")
            return sock.recv(64).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    """One redis-server process bound to 127.0.0.1:`port`, persisting to `directory`."""

    def __init__(self, binary: str, port: int, directory: Path) -> None:
        self.binary = binary
        self.port = port
        self.directory = directory
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = directory / "redis.log"

    @classmethod
    def launch(cls, directory: Path) -> RedisServer:
        """Start a server on a free port (skips/fails like require_binary when redis-server is missing)."""
        server = cls(require_binary("redis-server"), free_port(), directory)
        server.start()
        return server

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def answers(self) -> bool:
        """Whether the server answers PING now (not while it is down or still loading its AOF)."""
        return _ping(self.port)

    def start(self, timeout: float = 20.0) -> None:
        """Start on the same port and dir; return once it answers PING (AOF replayed)."""
        if self.running:
            raise RuntimeError("redis-server is already running")
        self.directory.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [
                    self.binary,
                    "--port", str(self.port),
                    "--bind", "127.0.0.1",
                    "--appendonly", "yes",
                    "--appendfsync", "always",
                    "--save", "",
                    "--dir", str(self.directory),
                    "--daemonize", "no",
                    "--protected-mode", "yes",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )  # fmt: skip
        proc = self.proc

        def answers() -> bool:
            if proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {proc.returncode}: {self._log_tail()}")
            return _ping(self.port)

        try:
            wait_until_sync(answers, timeout, f"redis-server on port {self.port} answering PING", interval=0.02)
        except AssertionError:
            self.stop(kill=True)
            raise

    def stop(self, kill: bool = False, timeout: float = 10.0) -> None:
        """Stop the server: SIGTERM (clean shutdown) or, with kill=True, SIGKILL (a crash)."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        if kill:
            proc.kill()
        else:
            proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout)

    def restart(self, kill: bool = False) -> None:
        """Stop, then start again on the same port and data dir (every acknowledged write survives)."""
        self.stop(kill=kill)
        self.start()

    async def start_async(self) -> None:
        await asyncio.to_thread(self.start)

    async def stop_async(self, kill: bool = False) -> None:
        await asyncio.to_thread(self.stop, kill)

    async def restart_async(self, kill: bool = False, down_for: float = 0.0) -> None:
        """Restart without blocking the event loop; `down_for` keeps the server away that long."""
        await self.stop_async(kill)
        if down_for:
            await asyncio.sleep(down_for)
        await self.start_async()

    def close(self) -> None:
        self.stop(kill=True)

    def _log_tail(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-2000:]
        except OSError:
            return ""


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A fresh redis-server (append-only, fsync always) on a free loopback port; killed at teardown."""
    server = RedisServer.launch(tmp_path / "redis")
    try:
        yield server
    finally:
        server.close()
