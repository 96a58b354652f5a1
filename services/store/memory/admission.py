"""Create admission in memory: one `AdmissionState` JSON per account (rlgate.store.admission)."""

from __future__ import annotations

import time

from rlgate.store import admission
from rlgate.store.admission import AdmissionState, CreateGrant, CreateLimits
from rlgate.store.memory.data import MemoryBase


class MemoryAdmission(MemoryBase):
    """The `CreateAdmission` of the in-memory store."""

    async def admit_create(
        self, account: str, slot_id: str, run: str, priority: str, limits: CreateLimits
    ) -> CreateGrant:
        def admit() -> CreateGrant:
            state = AdmissionState.from_json(self.data.admission.get(account))
            grant = admission.admit(state, slot_id, run, priority, limits, time.time())
            self.data.admission[account] = state.to_json()
            return grant

        return await self._call("admit_create", admit)

    async def release_create(self, account: str, slot_id: str) -> None:
        def release() -> None:
            raw = self.data.admission.get(account)
            if raw:
                state = AdmissionState.from_json(raw)
                admission.release(state, slot_id)
                self.data.admission[account] = state.to_json()

        await self._call("release_create", release)

    async def throttle_creates(self, account: str, retry_after_s: float, limits: CreateLimits) -> float:
        def throttle() -> float:
            state = AdmissionState.from_json(self.data.admission.get(account))
            rate = admission.throttle(state, retry_after_s, limits, time.time())
            self.data.admission[account] = state.to_json()
            return rate

        return await self._call("throttle_creates", throttle)
