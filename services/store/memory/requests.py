"""The request ledger's records in memory, and `commit`: every check made before any write."""

from __future__ import annotations

import itertools
import time

from rlgate.store import _common
from rlgate.store.memory.data import MemoryBase, MemoryData
from rlgate.store.memory.sessions import (
    apply_update,
    by_token,
    check_create,
    check_update,
    store_session,
    touch_record,
)
from rlgate.store.memory.toolcalls import append_entry
from rlgate.store.models import RequestExists, RequestRecord, RequestState, Session, SessionStatus, Writes, call_scope


def claim_record(data: MemoryData, scope: str, request_id: str, owner: str) -> tuple[RequestRecord, bool]:
    existing = data.requests.get((scope, request_id))
    if existing is not None:
        return existing.copy(), False
    record = RequestRecord(scope, request_id, RequestState.PENDING.value, owner, "", time.time(), 0.0)
    data.requests[(scope, request_id)] = record
    return record.copy(), True


def complete_record(data: MemoryData, scope: str, request_id: str, result: str, now: float) -> None:
    existing = data.requests.get((scope, request_id))
    if existing is None:  # a result is never dropped, even if the PENDING record was lost or pruned
        data.requests[(scope, request_id)] = RequestRecord(
            scope, request_id, RequestState.DONE.value, "", result, now, now
        )
    else:
        data.requests[(scope, request_id)] = existing.copy(
            state=RequestState.DONE.value, result=result, finished_at=now
        )


class MemoryRequests(MemoryBase):
    """The `RequestRecords` of the in-memory store."""

    async def _commit_writes(self, session: Session | None, writes: Writes, new_session: bool) -> Session | None:
        request, tool_call, new_request, held_by = writes.request, writes.tool_call, writes.new_request, writes.held_by
        stored = _common.written(session, new_session) if session is not None else None
        now = time.time()

        def commit() -> None:
            # Every check before any write: all or nothing.
            if (new_request or held_by) and request is not None:
                existing = self.data.requests.get((request[0], request[1]))
                if existing is not None and (new_request or _common.held_elsewhere(existing, held_by, request[2])):
                    raise RequestExists(existing.copy())
            if stored is not None and new_session:
                check_create(self.data, stored)
                store_session(self.data, stored, "")
            elif stored is not None:
                apply_update(self.data, stored, check_update(self.data, stored))
            if request is not None:
                complete_record(self.data, *request, now)
            if tool_call is not None:
                append_entry(self.data, tool_call)
                touch_record(self.data, tool_call.session_id, tool_call.finished_at)

        await self._call("commit", commit)
        return stored

    async def claim_request(self, scope: str, request_id: str, owner: str) -> tuple[RequestRecord, bool]:
        return await self._call("claim_request", lambda: claim_record(self.data, scope, request_id, owner))

    async def authorize_call(
        self, token_hash: str, request_id: str, owner: str
    ) -> tuple[Session | None, RequestRecord | None, bool]:
        def authorize() -> tuple[Session | None, RequestRecord | None, bool]:
            session = by_token(self.data, token_hash)
            if session is None or not request_id or session.status != SessionStatus.ACTIVE:
                return session, None, False
            record, created = claim_record(self.data, call_scope(session.session_id), request_id, owner)
            return session, record, created

        return await self._call("authorize_call", authorize)

    async def complete_request(self, scope: str, request_id: str, result: str) -> None:
        now = time.time()
        await self._call("complete_request", lambda: complete_record(self.data, scope, request_id, result, now))

    async def release_request(self, scope: str, request_id: str) -> None:
        def release() -> None:
            record = self.data.requests.get((scope, request_id))
            if record is not None and record.state == RequestState.PENDING:
                del self.data.requests[(scope, request_id)]

        await self._call("release_request", release)

    async def take_over_request(
        self, scope: str, request_id: str, dead_owner: str, owner: str
    ) -> tuple[RequestRecord | None, bool]:
        def take() -> tuple[RequestRecord | None, bool]:
            record = self.data.requests.get((scope, request_id))
            if record is None or record.state != RequestState.PENDING or record.owner != dead_owner:
                return (record.copy() if record is not None else None), False
            taken = RequestRecord(scope, request_id, RequestState.PENDING.value, owner, "", time.time(), 0.0)
            self.data.requests[(scope, request_id)] = taken
            return taken.copy(), True

        return await self._call("take_over_request", take)

    async def get_request(self, scope: str, request_id: str) -> RequestRecord | None:
        def get() -> RequestRecord | None:
            record = self.data.requests.get((scope, request_id))
            return record.copy() if record is not None else None

        return await self._call("get_request", get)

    async def pending_requests(self, scope: str, limit: int) -> list[RequestRecord]:
        def pending() -> list[RequestRecord]:
            # A scan: the in-memory store serves tests and single-process runs, and Fork is its only reader.
            found = (r for (s, _), r in self.data.requests.items() if s == scope and r.state == RequestState.PENDING)
            return [r.copy() for r in itertools.islice(found, limit)]

        return await self._call("pending_requests", pending)
