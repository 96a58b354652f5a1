"""The Redis store's client and the plumbing every call runs through (`RedisBase`): connection failures
retried with backoff for up to `retry_s`, and the Lua scripts (rlgate.store.redis.scripts) loaded up front."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any, Self, TypeVar

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from rlgate.core.backoff import Backoff
from rlgate.store.claims import BackgroundWrites
from rlgate.store.models import StoreError
from rlgate.store.redis import scripts

T = TypeVar("T")

# Reconnects wait 0.05 s, doubling up to 0.5 s between attempts, within the store's `retry_s`.
RECONNECT_BACKOFF = Backoff(0.05, 0.5, jitter=0.0)


class RedisBase:
    """The client, its scripts and `_call`; the concerns' mixins (sessions, requests, ...) build on it."""

    def __init__(self, client: aioredis.Redis, url: str, prefix: str, retry_s: float) -> None:
        self.url = url
        self.prefix = prefix
        self.retry_s = retry_s
        # redis-py types replies as bytes | str; with decode_responses=True they are str, so use Any.
        self._client: Any = client
        self._closed = False
        self._background = BackgroundWrites()
        # name -> the client's Script object (EVALSHA, falling back to loading the source)
        self._scripts: dict[str, Any] = {
            name: self._client.register_script(source) for name, source in scripts.SOURCES.items()
        }

    async def _load_scripts(self) -> None:
        for script in self._scripts.values():
            script.sha = await self._client.script_load(script.script)

    @classmethod
    async def open(
        cls,
        url: str,
        *,
        prefix: str = "rlgate:",
        retry_s: float = 20.0,
        connect_timeout_s: float = 2.0,
        command_timeout_s: float = 5.0,
    ) -> Self:
        """Connect to `url` (redis://host:port/db) and check it answers. StoreError if it does not within
        `retry_s`. `retry_s` also bounds how long any later operation rides out an outage."""
        client = aioredis.Redis.from_url(
            url,
            decode_responses=True,
            socket_connect_timeout=connect_timeout_s,
            socket_timeout=command_timeout_s,
            # The store's own loop (_call) is the one retry policy; the client must not retry underneath it.
            retry=Retry(NoBackoff(), 0),
        )
        store = cls(client, url, prefix, retry_s)
        try:
            await store._call("ping", client.ping)
            # Load the scripts up front (EVALSHA falls back to loading after a server restart anyway).
            await store._call("script load", store._load_scripts)
        except BaseException:
            await client.aclose()
            raise
        return store

    def __repr__(self) -> str:
        return f"RedisStore({self.url!r}, prefix={self.prefix!r})"

    async def _call(self, what: str, op: Callable[[], Awaitable[T]]) -> T:
        """Run `op`, retrying connection failures with backoff for up to `retry_s`; StoreError after."""
        deadline = time.monotonic() + self.retry_s
        delays = RECONNECT_BACKOFF.delays()
        while True:
            if self._closed:
                raise StoreError("store is closed")
            try:
                return await op()
            except (RedisConnectionError, RedisTimeoutError) as exc:  # includes BusyLoadingError
                if self._closed:
                    raise StoreError("store is closed") from exc
                delay = next(delays)
                if time.monotonic() + delay > deadline:
                    raise StoreError(f"redis store {self.url}: {what} failed: {exc}") from exc
                await asyncio.sleep(delay)
            except RedisError as exc:
                raise StoreError(f"redis store {self.url}: {what} failed: {exc}") from exc

    def _script(self, what: str, name: str, *args: Any) -> Awaitable[Any]:
        """Run the Lua script `name` (lua/<name>.lua) with the key prefix and `args` as its ARGV."""
        script = self._scripts[name]
        return self._call(what, lambda: script(args=[self.prefix, *args]))

    def _key(self, suffix: str) -> str:
        return self.prefix + suffix

    async def close(self) -> None:
        if self._closed:
            return
        await self._background.drain()  # releases of abandoned claims, before the connection goes
        self._closed = True
        await self._client.aclose()
