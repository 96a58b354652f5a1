"""Create admission in Redis: `admit:<account>` holds the account's `AdmissionState` JSON, changed only by the
Lua scripts admit_create, release_create and throttle_creates (rlgate.store.admission, mirrored in
lua/admission_lib.lua), on the server's clock."""

from __future__ import annotations

from rlgate.store.admission import CreateGrant, CreateLimits
from rlgate.store.redis.connection import RedisBase


def _limits(limits: CreateLimits) -> list[str]:
    return [
        str(v)
        for v in (
            limits.max_in_flight,
            limits.max_rate,
            limits.min_rate,
            limits.burst,
            limits.recover_per_s,
            limits.slot_ttl_s,
            limits.wait_ttl_s,
            limits.cut_factor,
            limits.cut_window_s,
        )
    ]


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


class RedisAdmission(RedisBase):
    """The `CreateAdmission` of the Redis store."""

    async def admit_create(
        self, account: str, slot_id: str, run: str, priority: str, limits: CreateLimits
    ) -> CreateGrant:
        admitted, wait, in_flight, rate, reason = await self._script(
            "admit_create", "admit_create", account, slot_id, run, priority, *_limits(limits)
        )
        return CreateGrant(bool(admitted), float(_text(wait)), int(in_flight), float(_text(rate)), _text(reason))

    async def release_create(self, account: str, slot_id: str) -> None:
        await self._script("release_create", "release_create", account, slot_id)

    async def throttle_creates(self, account: str, retry_after_s: float, limits: CreateLimits) -> float:
        rate = await self._script("throttle_creates", "throttle_creates", account, str(retry_after_s), *_limits(limits))
        return float(_text(rate))
