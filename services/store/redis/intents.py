"""Provisioning intents in Redis: `intent:<id>` hashes, indexed by `idx:intents` and `idx:intents:run:<run_id>`."""

from __future__ import annotations

from typing import Any

from rlgate.store import _common
from rlgate.store.models import Intent
from rlgate.store.redis.codec import score
from rlgate.store.redis.connection import RedisBase


class RedisIntents(RedisBase):
    """The `IntentRecords` of the Redis store."""

    async def put_intent(self, intent: Intent) -> None:
        await self._script(
            "put_intent",
            "put_intent",
            intent.intent_id,
            intent.to_json(),
            intent.run_id,
            score(intent.created_at),
        )

    async def get_intent(self, intent_id: str) -> Intent | None:
        key = self._key(f"intent:{intent_id}")
        data = await self._call("get_intent", lambda: self._client.hget(key, "data"))
        return _common.decode(Intent, data) if data is not None else None

    async def list_intents(self, run_id: str = "") -> list[Intent]:
        index = self._key(f"idx:intents:run:{run_id}" if run_id else "idx:intents")

        async def load() -> list[Any]:
            ids = await self._client.zrange(index, 0, -1)
            pipe = self._client.pipeline(transaction=False)
            for intent_id in ids:
                pipe.hget(self._key(f"intent:{intent_id}"), "data")
            return await pipe.execute() if ids else []

        # zrange orders equal created_at by id, as SQLite does.
        return [_common.decode(Intent, data) for data in await self._call("list_intents", load) if data is not None]

    async def delete_intent(self, intent_id: str) -> None:
        await self._script("delete_intent", "delete_intent", intent_id)
