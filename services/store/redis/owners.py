"""Owners' heartbeats (`hb:<owner>`) and leases (`lease:<name>`) in Redis, expiring by key TTL."""

from __future__ import annotations

import time

from rlgate.store.redis.codec import score, ttl_ms
from rlgate.store.redis.connection import RedisBase


class RedisOwners(RedisBase):
    """The `Owners` of the Redis store."""

    async def heartbeat_owner(self, owner: str, ttl_s: float) -> None:
        key, value, ttl = self._key(f"hb:{owner}"), score(time.time()), int(ttl_ms(ttl_s))
        await self._call("heartbeat_owner", lambda: self._client.set(key, value, px=ttl))

    async def owner_alive(self, owner: str) -> bool:
        key = self._key(f"hb:{owner}")
        return bool(await self._call("owner_alive", lambda: self._client.exists(key)))


class RedisLeases(RedisBase):
    """The `Leases` of the Redis store."""

    async def acquire_lease(self, name: str, holder: str, ttl_s: float) -> bool:
        return bool(await self._script("acquire_lease", "acquire_lease", name, holder, ttl_ms(ttl_s)))

    async def release_lease(self, name: str, holder: str) -> None:
        await self._script("release_lease", "release_lease", name, holder)
