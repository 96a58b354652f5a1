"""Owners' heartbeats and leases in memory, each with its expiry time."""

from __future__ import annotations

import time

from rlgate.store.memory.data import MemoryBase


class MemoryOwners(MemoryBase):
    """The `Owners` of the in-memory store."""

    async def heartbeat_owner(self, owner: str, ttl_s: float) -> None:
        def beat() -> None:
            self.data.owners[owner] = time.time() + ttl_s

        await self._call("heartbeat_owner", beat)

    async def owner_alive(self, owner: str) -> bool:
        return await self._call("owner_alive", lambda: self.data.owners.get(owner, 0.0) > time.time())


class MemoryLeases(MemoryBase):
    """The `Leases` of the in-memory store."""

    async def acquire_lease(self, name: str, holder: str, ttl_s: float) -> bool:
        def acquire() -> bool:
            now = time.time()
            current = self.data.leases.get(name)
            if current is not None and current[0] != holder and current[1] > now:
                return False  # held by another, not expired
            self.data.leases[name] = (holder, now + ttl_s)
            return True

        return await self._call("acquire_lease", acquire)

    async def release_lease(self, name: str, holder: str) -> None:
        def release() -> None:
            current = self.data.leases.get(name)
            if current is not None and current[0] == holder:
                del self.data.leases[name]

        await self._call("release_lease", release)
