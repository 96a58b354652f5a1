"""`RequestLedger`: runs a request's first attempt, and answers its repeats from the first attempt's record
(see the package docstring)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from google.protobuf.message import Message

from rlgate.core.backoff import Backoff
from rlgate.core.errors import DeadlineExceeded, clip
from rlgate.ledger.binding import check_binding, decode_result, fingerprint
from rlgate.ledger.claim import Claim, LedgerStore, Unwritten
from rlgate.runtime.deadline import Deadline
from rlgate.store import RequestExists, RequestRecord, RequestState, StoreError

log = logging.getLogger(__name__)
M = TypeVar("M", bound=Message)
T = TypeVar("T")

# A DONE write the store refused is tried again after 0.05 s, doubling up to 5 s between attempts (a full disk
# may take long to free).
REWRITE_BACKOFF = Backoff(0.05, 5.0, jitter=0.0)
IN_PROGRESS_RETRY_S = 1.0  # RetryInfo of a repeat whose deadline passed while an earlier attempt ran


def _in_progress(request_id: str) -> DeadlineExceeded:
    return DeadlineExceeded(
        f"request_id {clip(request_id)!r} is still being processed; retry later", retry_after_s=IN_PROGRESS_RETRY_S
    )


# ---- the work's handle on its record -------------------------------------------------------------------


@dataclass
class _Running:
    """A first attempt running in this process: repeats here wait on `done` (the recorded payload)."""

    params: dict[str, str]
    done: asyncio.Future[str]


class _Again(Exception):
    """The record went away, or this repeat took it over (`taken`, from `prior`): look again from the top."""

    def __init__(self, prior: RequestRecord | None = None, taken: RequestRecord | None = None) -> None:
        super().__init__()
        self.prior = prior
        self.taken = taken


class RequestLedger:
    """Request records of one process (`owner`: its `SessionStore.heartbeat_owner` id)."""

    def __init__(self, store: LedgerStore, owner: str, poll_s: float = 0.1) -> None:
        self.store = store
        self.owner = owner
        self._poll = poll_s
        self._running: dict[tuple[str, str], _Running] = {}
        self._unwritten: dict[tuple[str, str], Unwritten] = {}  # answered; DONE written in the background

    async def run(
        self,
        scope: str,
        request_id: str,
        params: Mapping[str, Any],
        deadline: Deadline,
        message: type[M],
        work: Callable[[Claim], Awaitable[M]],
        *,
        lazy: bool = False,
        claim: Callable[[], Awaitable[tuple[RequestRecord, bool]]] | None = None,
        redact: Callable[[M], M] | None = None,
        replay: Callable[[M], Awaitable[M]] | None = None,
        orphan: Callable[[Claim], Awaitable[M]] | None = None,
    ) -> M:
        """The request's response: run by this call, or an earlier attempt's (see the package docstring)."""
        if not request_id:
            return await work(Claim(self.store, self.owner, scope, "", {}, held=False))
        digests = fingerprint(params)
        key = (scope, request_id)
        prior: RequestRecord | None = None
        taken: RequestRecord | None = None  # the dead owner's record (`prior`) this repeat holds now
        while True:
            unwritten = self._unwritten.get(key) if taken is None else None
            if unwritten is not None:  # answered here, its record still being written: answer from memory
                recorded, kept = decode_result(unwritten.payload)
                check_binding(request_id, recorded, digests)
                return await self._repeat(message, kept, replay)
            running = self._running.get(key) if taken is None else None
            if running is not None:
                check_binding(request_id, running.params, digests)
                data = await self._await_running(running, deadline)
                if data is None:
                    continue  # the first attempt gave no answer (cancelled, or another replica's record won)
                return await self._repeat(message, data, replay)
            if lazy and prior is None:
                record: RequestRecord | None = None
                handle = Claim(self.store, self.owner, scope, request_id, digests, held=False, redact=redact)
                try:
                    return await self._own(key, handle, work)
                except RequestExists as exc:
                    if handle.taken is None and (handle.held or handle.recorded is not None):
                        raise  # not the claim's: the work's own business
                    record = exc.record
                except Exception:
                    if handle.held or handle.recorded is not None:
                        raise
                    # Failed before claiming anything: maybe because an earlier attempt already acted (a
                    # repeat of a turn that ended the episode finds it done). Then its record answers.
                    record = await self.store.get_request(scope, request_id)
                    if record is None:
                        raise
            else:
                if taken is not None:
                    record, created, taken = taken, True, None
                else:
                    record, created = await (
                        claim() if claim is not None else self.store.claim_request(scope, request_id, self.owner)
                    )
                if created:
                    handle = Claim(
                        self.store, self.owner, scope, request_id, digests, held=True, prior=prior, redact=redact
                    )
                    try:
                        return await self._own(key, handle, orphan if prior is not None and orphan else work)
                    except RequestExists as exc:
                        if handle.taken is None:
                            raise  # not the claim's: the work's own business
                        record = exc.record  # taken over while this attempt ran: that answer stands
            try:
                return await self._answer(record, key, digests, deadline, message, replay)
            except _Again as again:
                prior, taken = again.prior, again.taken

    async def _answer(
        self,
        record: RequestRecord | None,
        key: tuple[str, str],
        digests: dict[str, str],
        deadline: Deadline,
        message: type[M],
        replay: Callable[[M], Awaitable[M]] | None,
    ) -> M:
        """The answer from an earlier attempt's record: replayed when DONE, waited for while PENDING (bounded
        by the deadline). Raises `_Again` (with the dead owner's record this repeat took over, if it did)
        when the caller should run the request itself."""
        scope, request_id = key
        while True:
            if record is None or key in self._running or key in self._unwritten:
                raise _Again()  # released (the first attempt failed), or a local attempt started or answered
            if record.state == RequestState.DONE:
                recorded, data = decode_result(record.result)
                check_binding(request_id, recorded, digests)
                return await self._repeat(message, data, replay)
            if record.owner != self.owner and not await self._within(
                deadline, request_id, self.store.owner_alive(record.owner)
            ):
                taken, took = await self._within(
                    deadline, request_id, self.store.take_over_request(scope, request_id, record.owner, self.owner)
                )
                if took:
                    log.warning("request %s/%s: owner %s is gone; taken over", scope, clip(request_id), record.owner)
                    raise _Again(record, taken)
                record = taken  # another repeat took it over first, or it was completed or released
                continue
            if deadline.expired():
                raise _in_progress(request_id)
            await asyncio.sleep(min(self._poll, deadline.remaining()))
            record = await self._within(deadline, request_id, self.store.get_request(scope, request_id))

    @staticmethod
    async def _within(deadline: Deadline, request_id: str, op: Awaitable[T]) -> T:
        """A store call of a wait, bounded by the caller's deadline (a hung store must not hold it)."""
        try:
            async with asyncio.timeout(deadline.remaining()):
                return await op
        except TimeoutError:
            raise _in_progress(request_id) from None

    async def _own(self, key: tuple[str, str], handle: Claim, work: Callable[[Claim], Awaitable[M]]) -> M:
        """Run the work as the request's first attempt, then make sure its response is recorded."""
        done: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._running[key] = _Running(handle.params, done)
        try:
            response = await work(handle)
            if handle.taken is not None:  # the work's write found the record taken over: that answer stands
                raise RequestExists(handle.taken)
            if handle.recorded is None:  # not recorded by the work's own write (or that failed): record it now
                carried = handle.unwritten.tool_call if handle.unwritten is not None else None  # its log entry too
                await asyncio.shield(handle.commit(response=response, tool_call=carried))
        except BaseException as exc:
            # An answer exists when the store refused its write (kept, written later) or another process took
            # the record over (its answer): a repeat looks again and finds it.
            answered = handle.unwritten is not None or handle.taken is not None
            if handle.held and handle.recorded is None and not handle.kept and not answered:
                await asyncio.shield(self.store.release_request(*key))
            if handle.held and isinstance(exc, Exception) and not answered:
                done.set_exception(exc)  # a repeat waiting here gets the same error
                done.exception()  # marked retrieved: nobody may be waiting
            else:
                done.cancel()  # no answer from here (or, lazy, maybe an earlier record's): a repeat looks again
            raise
        finally:
            self._running.pop(key, None)
            handle._attempt_over(self._write_later)
        assert handle.recorded is not None  # by the work's write or the one above (a failed write raised)
        done.set_result(handle.recorded)
        return response

    def _write_later(self, key: tuple[str, str], unwritten: Unwritten) -> None:
        """Answer repeats here from memory and write the record again in the background until it lands."""
        previous = self._unwritten.get(key)
        if previous is not None and previous.task is not None:
            previous.task.cancel()
        log.warning(
            "request %s/%s: answered, but the store did not take its record; writing it again in the background",
            key[0],
            clip(key[1]),
        )
        self._unwritten[key] = unwritten
        unwritten.task = asyncio.get_running_loop().create_task(self._rewrite(key, unwritten))

    async def _rewrite(self, key: tuple[str, str], unwritten: Unwritten) -> None:
        attempts = 0
        try:
            for delay in REWRITE_BACKOFF.delays():
                await asyncio.sleep(delay)  # backoff between attempts
                attempts += 1
                try:
                    await self.store.commit(
                        request=(*key, unwritten.payload),
                        tool_call=unwritten.tool_call,
                        new_request=unwritten.new_request,
                        held_by="" if unwritten.new_request else self.owner,
                    )
                except RequestExists as exc:
                    log.warning(
                        "request %s/%s: another attempt recorded it meanwhile (%s by %r); that answer stands",
                        key[0],
                        clip(key[1]),
                        exc.record.state,
                        exc.record.owner,
                    )
                    return
                except StoreError as exc:
                    log.debug("request %s/%s: background write %d failed: %s", key[0], clip(key[1]), attempts, exc)
                    continue
                log.warning("request %s/%s: recorded by background write %d", key[0], clip(key[1]), attempts)
                return
        except Exception:  # a bug, not the store: stop (the record stays PENDING until this process is gone)
            log.exception("request %s/%s: background write failed", key[0], clip(key[1]))
        finally:
            if self._unwritten.get(key) is unwritten:
                del self._unwritten[key]

    async def drain(self, timeout_s: float) -> None:
        """Shutdown: background DONE writes get up to `timeout_s` to land, then the rest are cancelled (their
        records stay PENDING; once this process stops heartbeating, a repeat elsewhere takes them over)."""
        tasks = {u.task for u in self._unwritten.values() if u.task is not None}
        if tasks and timeout_s > 0:
            await asyncio.wait(tasks, timeout=timeout_s)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _await_running(self, running: _Running, deadline: Deadline) -> bytes | None:
        """The serialised recorded response of the first attempt running here, or None when it gave none."""
        try:
            payload = await asyncio.wait_for(asyncio.shield(running.done), deadline.remaining() or 0.001)
        except TimeoutError as exc:
            raise DeadlineExceeded(
                "the first attempt of this request_id is still running; retry later", retry_after_s=IN_PROGRESS_RETRY_S
            ) from exc
        except asyncio.CancelledError:
            if running.done.cancelled():
                return None
            raise
        return decode_result(payload)[1]

    @staticmethod
    async def _repeat(message: type[M], data: bytes, replay: Callable[[M], Awaitable[M]] | None) -> M:
        recorded = message.FromString(data)
        return await replay(recorded) if replay is not None else recorded
