"""Provisioning intents in memory: their JSON by id."""

from __future__ import annotations

from rlgate.store import _common
from rlgate.store.memory.data import MemoryBase
from rlgate.store.models import Intent


class MemoryIntents(MemoryBase):
    """The `IntentRecords` of the in-memory store."""

    async def put_intent(self, intent: Intent) -> None:
        raw = intent.to_json()

        def put() -> None:
            self.data.intents[intent.intent_id] = raw

        await self._call("put_intent", put)

    async def get_intent(self, intent_id: str) -> Intent | None:
        def get() -> Intent | None:
            raw = self.data.intents.get(intent_id)
            return _common.decode(Intent, raw) if raw is not None else None

        return await self._call("get_intent", get)

    async def list_intents(self, run_id: str = "") -> list[Intent]:
        def list_all() -> list[Intent]:
            found = [_common.decode(Intent, raw) for raw in self.data.intents.values()]
            return sorted(
                (i for i in found if not run_id or i.run_id == run_id), key=lambda i: (i.created_at, i.intent_id)
            )

        return await self._call("list_intents", list_all)

    async def delete_intent(self, intent_id: str) -> None:
        await self._call("delete_intent", lambda: self.data.intents.pop(intent_id, None))
