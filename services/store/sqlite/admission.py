"""Create admission in SQLite: one `admission` row per account holding its `AdmissionState` JSON, read and
written back in one write transaction (rlgate.store.admission)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import apsw

from rlgate.store import admission
from rlgate.store.admission import AdmissionState, CreateGrant, CreateLimits
from rlgate.store.sqlite.connection import SqliteBase

T = TypeVar("T")


def _change(conn: apsw.Connection, account: str, edit: Callable[[AdmissionState, float], T]) -> T:
    row = conn.execute("SELECT data FROM admission WHERE account = ?", (account,)).fetchone()
    state = AdmissionState.from_json(row[0] if row else None)
    result = edit(state, time.time())
    conn.execute(
        "INSERT INTO admission (account, data) VALUES (?, ?) ON CONFLICT (account) DO UPDATE SET data = excluded.data",
        (account, state.to_json()),
    )
    return result


class SqliteAdmission(SqliteBase):
    """The `CreateAdmission` of the SQLite store."""

    async def admit_create(
        self, account: str, slot_id: str, run: str, priority: str, limits: CreateLimits
    ) -> CreateGrant:
        def edit(state: AdmissionState, now: float) -> CreateGrant:
            return admission.admit(state, slot_id, run, priority, limits, now)

        return await self._write(_change, account, edit)

    async def release_create(self, account: str, slot_id: str) -> None:
        def edit(state: AdmissionState, now: float) -> None:
            admission.release(state, slot_id)

        await self._write(_change, account, edit)

    async def throttle_creates(self, account: str, retry_after_s: float, limits: CreateLimits) -> float:
        def edit(state: AdmissionState, now: float) -> float:
            return admission.throttle(state, retry_after_s, limits, now)

        return await self._write(_change, account, edit)
