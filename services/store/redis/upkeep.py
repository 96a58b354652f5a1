"""The Redis store's upkeep: retention (prune, in batches), its invariants, and the health probe."""

from __future__ import annotations

import time
import uuid

from redis.exceptions import OutOfMemoryError as RedisOutOfMemoryError
from redis.exceptions import RedisError

from rlgate.store import _common
from rlgate.store.models import Session, StoreError, StoreFull
from rlgate.store.redis.codec import label_index, score, session_args
from rlgate.store.redis.connection import RedisBase

_PRUNE_BATCH = 500


class RedisUpkeep(RedisBase):
    """The `Upkeep` of the Redis store (`close` is `RedisBase`'s)."""

    async def prune(self, closed_before: float, requests_before: float) -> int:
        removed = 0
        for script, before in (
            ("prune_sessions", closed_before),
            ("prune_requests", requests_before),
        ):
            while True:  # batches keep each script short, so Redis never stalls on a big prune
                examined, deleted = await self._script("prune", script, score(before), str(_PRUNE_BATCH))
                removed += int(deleted)
                if int(examined) < _PRUNE_BATCH:
                    break
        return removed

    async def check_invariants(self) -> list[str]:
        return await self._call("check_invariants", self._check)

    async def _scan(self, pattern: str) -> list[str]:
        return [key async for key in self._client.scan_iter(match=self._key(pattern), count=500)]

    async def _check(self) -> list[str]:
        problems: list[str] = []
        client, key = self._client, self._key
        all_ids = dict(await client.zrange(key("idx:all"), 0, -1, withscores=True))
        open_ids = dict(await client.zrange(key("idx:open"), 0, -1, withscores=True))
        closed_ids = dict(await client.zrange(key("idx:closed"), 0, -1, withscores=True))
        pipe = client.pipeline(transaction=False)
        for sid in all_ids:
            pipe.hgetall(key(f"s:{sid}"))
        hashes: list[dict[str, str]] = await pipe.execute() if all_ids else []
        loaded: dict[str, Session] = {}
        for sid, fields in zip(all_ids, hashes, strict=True):
            if not fields:
                problems.append(f"idx:all lists missing session {sid}")
                continue
            try:
                session = Session.from_json(fields["data"])
            except (KeyError, ValueError, TypeError) as exc:
                problems.append(f"session {sid}: undecodable record ({exc})")
                continue
            loaded[sid] = session
            problems.extend(_common.session_problems(session))
            expected = session_args(session)[:5]
            actual = [fields.get(f, "") for f in ("token", "run", "labels", "created", "retain")]
            if (
                session.session_id != sid
                or str(session.version) != fields.get("version")
                or any(a != e for a, e in zip(actual[:3], expected[:3], strict=True))
            ):
                problems.append(f"session {sid}: indexed fields disagree with the record")
            if all_ids[sid] != session.created_at:
                problems.append(f"session {sid}: idx:all score disagrees with created_at")
            retain = _common.retention_time(session)
            if retain is None and (sid not in open_ids or sid in closed_ids):
                problems.append(f"session {sid}: open but not indexed as open")
            if retain is not None and (sid in open_ids or closed_ids.get(sid) != retain):
                problems.append(f"session {sid}: finished but not indexed for retention")
        checks = client.pipeline(transaction=False)
        for sid, session in loaded.items():
            checks.get(key(f"tok:{session.token_hash}") if session.token_hash else key("tok:"))
            checks.zscore(key(f"idx:run:{session.run_id}"), sid)
            for k, v in session.labels.items():
                checks.zscore(key(label_index(k, v)), sid)
        results = iter(await checks.execute() if loaded else [])
        for sid, session in loaded.items():
            if session.token_hash and next(results) != sid:
                problems.append(f"session {sid}: token index does not point at it")
            elif not session.token_hash:
                next(results)
            if (next(results) is not None) != bool(session.run_id):
                problems.append(f"session {sid}: run index out of step")
            for k in session.labels:
                if next(results) is None:
                    problems.append(f"session {sid}: label {k} not indexed")
        for sid in set(open_ids) | set(closed_ids):
            if sid not in all_ids:
                problems.append(f"status index lists unknown session {sid}")
        for token_key in await self._scan("tok:*"):
            sid = await client.get(token_key)
            token = token_key[len(key("tok:")) :]
            if sid not in loaded or loaded[sid].token_hash != token:
                problems.append(f"token index entry {token[:12]}... points at {sid}, which does not hold it")
        for session_key in await self._scan("s:*"):
            if session_key[len(key("s:")) :] not in all_ids:
                problems.append(f"session record {session_key} missing from idx:all")
        return problems

    async def ping(self) -> None:
        await self._call("ping", self._client.ping)

    async def health(self) -> None:
        """PING, then SET, GET and DEL a key of this probe's in one MULTI (a write and a read, nothing left
        behind). One attempt, no retry loop: a health check answers now. A write refused for memory
        (maxmemory with noeviction: OOM) or disk (persistence failing: MISCONF ... no space) is StoreFull."""
        if self._closed:
            raise StoreError("store is closed")
        key, token = self._key(f"health:{uuid.uuid4().hex}"), str(time.time())
        try:
            await self._client.ping()
            pipe = self._client.pipeline(transaction=True)
            pipe.set(key, token, px=60_000)  # expires even if the DEL never ran
            pipe.get(key)
            pipe.delete(key)
            _, echoed, _ = await pipe.execute()
        except RedisError as exc:
            full = isinstance(exc, RedisOutOfMemoryError) or "No space left" in str(exc)
            raise (StoreFull if full else StoreError)(f"redis store {self.url}: health probe failed: {exc}") from exc
        if echoed != token:
            raise StoreError(f"redis store {self.url}: health probe read back {echoed!r}, not what it wrote")
