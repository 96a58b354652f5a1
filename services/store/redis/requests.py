"""The request ledger's records in Redis (`req:<len>:<scope>:<id>` hashes, `idx:reqdone`), and `commit`: a
result recorded with its session's compare-and-set and its log entry in one script."""

from __future__ import annotations

import time
import uuid

from rlgate.store.claims import claim_or_release
from rlgate.store.models import (
    CALL_SCOPE_PREFIX,
    RequestExists,
    RequestRecord,
    RequestState,
    Session,
    SessionStatus,
    Writes,
    call_scope,
)
from rlgate.store.redis.codec import request_from_reply, request_key, score, session_from_fields
from rlgate.store.redis.connection import RedisBase
from rlgate.store.redis.sessions import created, update_args, updated


class RedisRequests(RedisBase):
    """The `RequestRecords` of the Redis store."""

    async def _commit_writes(self, session: Session | None, writes: Writes, new_session: bool) -> Session | None:
        request, tool_call, new_request, held_by = writes.request, writes.tool_call, writes.new_request, writes.held_by
        stored, args = update_args(session, new_session) if session is not None else (None, [""] * 10)
        args = [("c" if new_session else "1") if stored is not None else "", *args]
        if request is not None:
            scope, request_id, result = request
            args += ["1", request_key(scope, request_id), scope, request_id, result, score(time.time())]
        else:
            args += [""] * 6
        if tool_call is not None:
            args += [
                "1",
                tool_call.session_id,
                str(tool_call.episode),
                tool_call.request_id,
                tool_call.to_json(),
                score(tool_call.finished_at),
            ]
        else:
            args += [""] * 6
        args += ["1", uuid.uuid4().hex] if new_request else ["", ""]
        args.append(held_by)
        reply = await self._script("commit", "commit", *args)
        if reply[0] == -3 and request is not None:
            raise RequestExists(request_from_reply(request[0], request[1], reply[1:]))
        code, last_active = reply
        if stored is None:
            return None
        return created(stored, code) if new_session else updated(stored, code, last_active)

    async def claim_request(self, scope: str, request_id: str, owner: str) -> tuple[RequestRecord, bool]:
        return await claim_or_release(
            self._claim_request(scope, request_id, owner),
            lambda claim: (scope, request_id) if claim[1] else None,
            self.release_request,
            self._background,
        )

    async def _claim_request(self, scope: str, request_id: str, owner: str) -> tuple[RequestRecord, bool]:
        reply = await self._script(
            "claim_request",
            "claim_request",
            request_key(scope, request_id),
            scope,
            request_id,
            owner,
            score(time.time()),
            uuid.uuid4().hex,
        )
        return request_from_reply(scope, request_id, reply[1:]), reply[0] == 1

    async def authorize_call(
        self, token_hash: str, request_id: str, owner: str
    ) -> tuple[Session | None, RequestRecord | None, bool]:
        if not token_hash:  # a revoked session holds ""; it must never match
            return None, None, False

        def claimed(result: tuple[Session | None, RequestRecord | None, bool]) -> tuple[str, str] | None:
            session, _, created = result
            return (call_scope(session.session_id), request_id) if created and session is not None else None

        return await claim_or_release(
            self._authorize_call(token_hash, request_id, owner), claimed, self.release_request, self._background
        )

    async def _authorize_call(
        self, token_hash: str, request_id: str, owner: str
    ) -> tuple[Session | None, RequestRecord | None, bool]:
        reply = await self._script(
            "authorize_call",
            "authorize_call",
            token_hash,
            request_id,
            owner,
            score(time.time()),
            uuid.uuid4().hex,
            CALL_SCOPE_PREFIX,
            SessionStatus.ACTIVE.value,
        )
        session = session_from_fields(reply[:3]) if reply else None
        if session is None or len(reply) == 3:
            return session, None, False
        record = request_from_reply(call_scope(session.session_id), request_id, reply[4:])
        return session, record, reply[3] == 1

    async def complete_request(self, scope: str, request_id: str, result: str) -> None:
        await self._script(
            "complete_request",
            "complete_request",
            request_key(scope, request_id),
            scope,
            request_id,
            result,
            score(time.time()),
        )

    async def release_request(self, scope: str, request_id: str) -> None:
        await self._script("release_request", "release_request", request_key(scope, request_id))

    async def take_over_request(
        self, scope: str, request_id: str, dead_owner: str, owner: str
    ) -> tuple[RequestRecord | None, bool]:
        async def give_back(scope: str, request_id: str) -> None:
            await self._take_over(scope, request_id, owner, dead_owner)

        return await claim_or_release(
            self._take_over(scope, request_id, dead_owner, owner),
            lambda taken: (scope, request_id) if taken[1] else None,
            give_back,
            self._background,
        )

    async def _take_over(
        self, scope: str, request_id: str, dead_owner: str, owner: str
    ) -> tuple[RequestRecord | None, bool]:
        reply = await self._script(
            "take_over_request",
            "take_over_request",
            request_key(scope, request_id),
            dead_owner,
            owner,
            score(time.time()),
            uuid.uuid4().hex,
        )
        if not reply:
            return None, False
        return request_from_reply(scope, request_id, reply[1:]), reply[0] == 1

    async def pending_requests(self, scope: str, limit: int) -> list[RequestRecord]:
        flat = await self._script("pending_requests", "pending_requests", scope, str(limit))
        return [request_from_reply(scope, flat[i], flat[i + 1 : i + 6]) for i in range(0, len(flat), 6)]

    async def get_request(self, scope: str, request_id: str) -> RequestRecord | None:
        key = self._key("req:" + request_key(scope, request_id))
        fields: dict[str, str] = await self._call("get_request", lambda: self._client.hgetall(key))
        if not fields:
            return None
        return RequestRecord(
            scope=scope,
            request_id=request_id,
            state=fields.get("state", RequestState.PENDING),
            owner=fields.get("owner", ""),
            result=fields.get("result", ""),
            created_at=float(fields.get("created_at", 0)),
            finished_at=float(fields.get("finished_at", 0)),
        )
