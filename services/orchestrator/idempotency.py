"""request_id dedupe for Reset and Step, shared by every replica through the store's request records.

The first caller claims the record (PENDING, owned by this process) and runs the work; its serialised
response is recorded DONE. A retry gets the recorded response; a retry that arrives while the first attempt
is still running waits for it (in-process: on its future; across replicas: by polling the record). If the
owner died (its store heartbeat lapsed), the retry takes the record over and runs the work again, told
which record it took over: the work converges instead of repeating (Reset derives its session id from the
request id; a Step whose episode ended after the dead attempt began returns that ending).
A failed attempt releases its record, so a retry runs again instead of replaying an error.

What is recorded may be a redacted copy (`redact`: Reset clears the agent token, which the store keeps
only as a hash); `replay` turns a recorded response back into an answer (Reset mints a fresh token).
Every repeat goes through `replay`, whether it read the record or waited in-process on the first attempt.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

from google.protobuf.message import Message

from rlgate.runtime.deadline import Deadline
from rlgate.runtime.errors import DeadlineExceeded, clip
from rlgate.store import RequestRecord, RequestState, SessionStore

log = logging.getLogger(__name__)
M = TypeVar("M", bound=Message)


class Idempotency:
    def __init__(self, store: SessionStore, owner: str, poll_s: float = 0.1) -> None:
        self._store = store
        self._owner = owner
        self._poll = poll_s
        self._local: dict[tuple[str, str], asyncio.Future[bytes]] = {}
        self._committed: dict[tuple[str, str], str] = {}  # responses the work recorded itself

    @staticmethod
    def completion(scope: str, request_id: str, response: Message) -> tuple[str, str, str]:
        """The `request` argument of `store.commit` for work that records its response with its last write
        (one store call instead of update + complete). Report the commit with `committed` once it succeeded."""
        return scope, request_id, base64.b64encode(response.SerializeToString()).decode()

    def committed(self, request: tuple[str, str, str]) -> None:
        scope, request_id, encoded = request
        self._committed[(scope, request_id)] = encoded

    async def run(self, scope: str, request_id: str, deadline: Deadline, message: type[M],
                  work: Callable[[RequestRecord | None], Awaitable[M]], *,
                  redact: Callable[[M], M] | None = None,
                  replay: Callable[[M], Awaitable[M]] | None = None) -> M:
        """`work(prior)`: `prior` is the record of a dead owner's attempt this call took over, else None.
        `redact(response)`: what to record (default: the response); `replay(recorded)`: the answer to a
        repeat (default: the recorded response)."""
        if not request_id:
            return await work(None)
        response, recorded = await self._first_or_recorded(scope, request_id, deadline, message, work, redact)
        return await replay(response) if recorded and replay is not None else response

    async def _first_or_recorded(self, scope: str, request_id: str, deadline: Deadline, message: type[M],
                                 work: Callable[[RequestRecord | None], Awaitable[M]],
                                 redact: Callable[[M], M] | None) -> tuple[M, bool]:
        """(the work's response, False) as the first attempt, or (an earlier attempt's record, True)."""
        key = (scope, request_id)
        prior: RequestRecord | None = None
        while True:
            local = self._local.get(key)
            if local is not None:
                answer = await self._await_local(local, message, deadline)
                if answer is not None:
                    return answer, True
                continue  # the first attempt was cancelled and released its record: run it here
            record, created = await self._store.claim_request(scope, request_id, self._owner)
            if created:
                return await self._run_owned(key, functools.partial(work, prior), redact), False
            if record.state == RequestState.DONE:
                return message.FromString(base64.b64decode(record.result)), True
            if record.owner != self._owner and not await self._store.owner_alive(record.owner):
                log.warning("request %s/%s: owner %s is gone; taking over", scope, request_id, record.owner)
                await self._store.release_request(scope, request_id)
                prior = record
                continue
            if deadline.expired():
                raise DeadlineExceeded(f"request_id {clip(request_id)!r} is still being processed; retry later")
            await asyncio.sleep(min(self._poll, deadline.remaining()))

    async def _run_owned(self, key: tuple[str, str], work: Callable[[], Awaitable[M]],
                         redact: Callable[[M], M] | None) -> M:
        future: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self._local[key] = future
        try:
            response = await work()
        except BaseException as exc:
            await asyncio.shield(self._store.release_request(*key))
            if not future.done():
                if isinstance(exc, Exception):
                    future.set_exception(exc)
                    future.exception()  # mark retrieved: nobody may be waiting
                else:
                    future.cancel()
            raise
        finally:
            self._local.pop(key, None)
            committed = self._committed.pop(key, None)
        data = (redact(response) if redact is not None else response).SerializeToString()
        encoded = base64.b64encode(data).decode()
        if encoded != committed:  # the work did not record this very response with its last write
            await asyncio.shield(self._store.complete_request(*key, encoded))
        future.set_result(data)
        return response

    async def _await_local(self, future: asyncio.Future[bytes], message: type[M], deadline: Deadline) -> M | None:
        try:
            data = await asyncio.wait_for(asyncio.shield(future), deadline.remaining() or 0.001)
        except TimeoutError as exc:
            raise DeadlineExceeded("the first attempt of this request_id is still running; retry later") from exc
        except asyncio.CancelledError:
            if future.cancelled():
                return None
            raise
        return message.FromString(data)

