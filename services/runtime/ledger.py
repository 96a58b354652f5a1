"""The request ledger: what a `request_id` means, for every RPC that takes one (Reset, Step, CallTool).

A request_id names one request of one caller, and the ledger makes that true across retries, replicas and
crashes, through the session store's request records (so every replica sees the same ledger):

- **Scoped to the caller.** Records are keyed by (scope, request_id), and the scope names the caller
  (`scope(kind, caller)`): the orchestrator's caller is the API key (its hash) that authenticated the call,
  "" when no keys are configured (one anonymous caller); the gateway's is the session its agent token
  selects (`rlgate.store.call_scope`). The same request_id from another caller is another request.
- **Bound to its parameters.** The record keeps a fingerprint of the request's parameters: one short
  digest per field (`fingerprint`), so a reuse with other parameters raises `InvalidArgument` naming the
  first field that differs, and never answers with (or acts on) what the first request produced.
- **PENDING -> DONE.** The first attempt owns the record (PENDING, owner = this process, alive while the
  process heartbeats the store: `SessionStore.heartbeat_owner`) while it works; its response is recorded
  DONE. A repeat gets the recorded response (`replay`); a repeat that arrives while the first attempt runs
  waits for it: in-process on its future, across replicas by polling the record. A failed attempt releases
  its record (unless its work says the outcome may have happened and it records that itself: `Claim.keep`),
  so a retry runs again instead of replaying an error; a concurrent in-process repeat of a claimed attempt
  gets the same error.
- **Answers are never lost.** When the store does not take a response's DONE write (disk full, store down),
  the attempt fails with the store's error, but the response is kept: repeats in this process get it from
  memory, and the ledger writes it again in the background (with its log entry, if the work's write carried
  one) with backoff until it lands or the ledger is drained at shutdown. Meanwhile the record stays PENDING
  under this live process; once the process is gone, a repeat elsewhere takes it over.
- **Owners die.** A PENDING record whose owner's heartbeat lapsed is taken over: handed to the repeat in one
  atomic store step (`SessionStore.take_over_request`: of repeats racing for it exactly one gets it and the
  others wait for its answer, and the record never goes missing in between, so no retry claims it afresh)
  and run again by the repeat, whose work is told which record it took over (`Claim.prior`) so it converges
  instead of repeating (a dead attempt never recorded its parameters' fingerprint in the store, so the work
  checks what it finds against its own parameters). `orphan=` is run instead of the work then (the gateway:
  a tool never runs twice, so it records OUTCOME_UNKNOWN). A held record is completed only while this
  attempt still holds it (`commit(held_by=)`): if another process took it over meanwhile (this one was
  deemed dead), that answer stands, and this attempt answers with it as a repeat would.
- **Waits are bounded.** Every wait on an earlier attempt, its store reads included, ends by the caller's
  deadline: `DeadlineExceeded` with RetryInfo ("still being processed; retry later").

API (`RequestLedger(store, owner)`; one per process and plane):

    response = await ledger.run(scope, request_id, params, deadline, ResponseMessage, work, ...)

- `params`: the request's parameters as {field: JSON value} (protobuf Structs through
  `rlgate.core.convert.arguments_of` or `json_from_struct`); compared field by field, in the given order.
- `work(claim)`: does the request. `claim.prior` is the dead owner's record this attempt took over, else
  None. To record the response with the work's own last store write (one round trip instead of two), the
  work calls `await claim.commit(response=..., session=..., tool_call=...)` (`SessionStore.commit` with the
  request record); otherwise the ledger records the returned response after the work.
- `lazy=True`: no claim before the work. The work's `claim.commit` creates the record DONE together with
  its write, only if the request_id is new (`commit(new_request=True)`), so a request that needs nothing
  after its write costs no claim. Work with more to do after its write first calls `await claim.hold()`
  (the PENDING claim, so repeats wait for the outcome). If another attempt got there first, `hold` or
  `commit` raises `RequestExists`; work must let it propagate (it subclasses `ConflictError`: a
  compare-and-set loop re-raises it) and the ledger answers from that record. Work that fails before it
  claimed anything makes the ledger look for an earlier record (a repeat whose first attempt changed what
  the work checks, e.g. a Step repeated after its turn ended the episode) and answer from that instead.
- `claim=`: how the record is claimed, when the caller claims it together with other work in one store
  call (the gateway's `authorize_call`); returns `(record, created)` like `SessionStore.claim_request`.
- `redact(response)`: what is recorded (default: the response; Reset drops the agent token, stored only as
  a hash). `replay(recorded)`: the answer to a repeat, from the recorded (redacted) response (default: as
  recorded; Reset mints a fresh token). Every repeat goes through `replay`, whether it read the record or
  waited in-process on the first attempt.
- `orphan(claim)`: the work run instead of `work` by a repeat that took over the record of a first attempt
  whose owner died mid-flight (`claim.prior`; default: `work` itself).
- Without a request_id, `run` just runs `work` (with a claim that records nothing).
- `await ledger.drain(timeout_s)` at shutdown: background DONE writes get `timeout_s` to land, the rest are
  cancelled.

What a DONE record holds (`RequestRecord.result`): JSON text {"params": {field: digest}, "response":
base64 of the serialised (redacted) response}. A record written before the ledger (bare base64) replays
without a parameter check.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from google.protobuf.message import Message

from rlgate.core.convert import InvalidJsonValue, json_text, parse_json_text
from rlgate.core.errors import DeadlineExceeded, InvalidArgument, clip
from rlgate.runtime import jsoncodec
from rlgate.runtime.deadline import Deadline
from rlgate.store import (
    RequestExists,
    RequestRecord,
    RequestState,
    Session,
    SessionStore,
    StoreError,
    ToolCallEntry,
    Writes,
)

log = logging.getLogger(__name__)
M = TypeVar("M", bound=Message)
T = TypeVar("T")

ANONYMOUS = "-"  # the caller when no credentials identify one (no API keys configured)
DIGEST_CHARS = 16  # hex characters per field digest (64 bits: a collision is no practical concern)
REWRITE_FIRST_S = 0.05  # a DONE write the store refused is tried again after this, doubling ...
REWRITE_MAX_S = 5.0  # ... up to this between attempts (a full disk may take long to free)
IN_PROGRESS_RETRY_S = 1.0  # RetryInfo of a repeat whose deadline passed while an earlier attempt ran


def scope(kind: str, caller: str) -> str:
    """The records of one kind of request ("reset", "step") of one caller (an API key's hash, or "")."""
    return f"{kind}:{caller or ANONYMOUS}"


# ---- binding: a request_id to the parameters it was first used with -----------------------------------


def fingerprint(params: Mapping[str, Any]) -> dict[str, str]:
    """{field: digest of its canonical JSON value}. Object keys are sorted and whole floats are integers
    (JSON does not tell 1 from 1.0), so equal values digest equally whichever form they arrived in."""
    return {
        name: hashlib.sha256(_digested(_canonical(value))).hexdigest()[:DIGEST_CHARS] for name, value in params.items()
    }


def _digested(value: Any) -> bytes:
    """`json_text(value)` as bytes. The parameters were parsed and checked where they arrived, so the text is
    made directly; `json_text` runs (and names the place) only for one that JSON cannot carry."""
    try:
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode("utf-8")
    except (TypeError, ValueError, RecursionError):
        return json_text(value).encode("utf-8")


def check_binding(request_id: str, first: Mapping[str, str] | None, now: Mapping[str, str]) -> None:
    """InvalidArgument naming the first field whose digest differs (`now`'s order first); `first` None: the
    first attempt's parameters are unknown (a record from before the ledger), nothing to compare."""
    if first is None:
        return
    for name in [*now, *(k for k in first if k not in now)]:
        if first.get(name) != now.get(name):
            raise InvalidArgument(
                name,
                f"differs from the first request with request_id {clip(request_id)!r}; "
                "a request_id names one request: use a new one for another request",
            )


def _canonical(value: Any) -> Any:
    if isinstance(value, str | int | bool) or value is None:
        return value
    if isinstance(value, Mapping):
        return {str(k): _canonical(value[k]) for k in sorted(value, key=str)}
    if isinstance(value, list | tuple):
        return [_canonical(v) for v in value]
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def encode_result(params: Mapping[str, str], response: Message) -> str:
    """A DONE record's payload: the parameters' digests and the serialised response. Only strings (hex
    digests, base64), so the store's encoder writes it without `json_text`'s checks (every Step pays them)."""
    encoded = base64.b64encode(response.SerializeToString()).decode()
    return jsoncodec.dumps({"params": dict(params), "response": encoded})


def decode_result(raw: str) -> tuple[dict[str, str] | None, bytes]:
    """(digests or None when the record predates them, serialised response) of a DONE record's payload."""
    if not raw.startswith("{"):
        return None, base64.b64decode(raw)
    try:
        data = parse_json_text(raw, "request record")
        return dict(data["params"]), base64.b64decode(data["response"])
    except (InvalidJsonValue, KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"corrupt request record payload: {exc}") from exc


def _in_progress(request_id: str) -> DeadlineExceeded:
    return DeadlineExceeded(
        f"request_id {clip(request_id)!r} is still being processed; retry later", retry_after_s=IN_PROGRESS_RETRY_S
    )


# ---- the work's handle on its record -------------------------------------------------------------------


@dataclass
class _Unwritten:
    """A response whose DONE write the store did not take, with the log entry written with it, and the
    background task writing it again."""

    payload: str
    tool_call: ToolCallEntry | None
    new_request: bool
    task: asyncio.Task[None] | None = None


class Claim:
    """What `work` knows and may do about its request record (see the module docstring)."""

    def __init__(
        self,
        store: SessionStore,
        owner: str,
        scope: str,
        request_id: str,
        params: dict[str, str],
        *,
        held: bool,
        prior: RequestRecord | None = None,
        redact: Callable[[Any], Any] | None = None,
    ) -> None:
        self._store = store
        self._owner = owner
        self._redact = redact
        self.scope = scope
        self.request_id = request_id
        self.params = params
        self.held = held  # a PENDING record of this attempt exists
        self.prior = prior  # the dead owner's record this attempt took over
        self.recorded: str | None = None  # the payload recorded DONE (by the work's write or after it)
        self.kept = False
        self.unwritten: _Unwritten | None = None  # a response the store did not take (written again later)
        self.taken: RequestRecord | None = None  # the record as another attempt left it, having taken it over
        # Set once the attempt returned: a write of this claim failing after that is handed to it.
        self._later: Callable[[tuple[str, str], _Unwritten], None] | None = None

    async def hold(self) -> None:
        """Claim the record PENDING now (lazy runs; a no-op when held or without a request_id).
        `RequestExists` if another attempt holds or finished it."""
        if self.held or not self.request_id:
            return
        record, created = await self._store.claim_request(self.scope, self.request_id, self._owner)
        if not created:
            raise RequestExists(record)
        self.held = True

    def payload(self, response: Message) -> str:
        """What the record keeps for `response`: the parameters' digests and the (redacted) response."""
        return encode_result(self.params, self._redact(response) if self._redact is not None else response)

    async def commit(
        self, *, response: Message, session: Session | None = None, tool_call: ToolCallEntry | None = None
    ) -> Session | None:
        """`SessionStore.commit` of `session` and `tool_call` with the record DONE with `response`, in one
        atomic write (without a request_id: just the rest). Not held: the record is created only if the
        request_id is new, else `RequestExists` and nothing is written. Held: only while this attempt still
        holds it, else `RequestExists` (another process took it over; `taken`). A write without a session
        that the store fails is kept and written again by the ledger (see the module docstring); the error
        is raised all the same. Returns what `commit` returns."""
        if not self.request_id:
            return await self._store.commit(session=session, tool_call=tool_call)
        payload = self.payload(response)
        writes = self._writes(payload, tool_call)
        try:
            written = await self._store.commit(
                session=session,
                tool_call=tool_call,
                new_request=writes.new_request,
                request=writes.request,
                held_by=writes.held_by,
            )
        except RequestExists as exc:
            self._refused(exc)
            raise
        except StoreError:
            if session is None:  # nothing conditional on a read: the same write can be made again later
                self.unwritten = _Unwritten(payload, tool_call, writes.new_request)
                if self._later is not None:
                    self._later((self.scope, self.request_id), self.unwritten)
            raise
        self.recorded, self.unwritten = payload, None
        return written

    async def change(self, session_id: str, change: Callable[[Session], Message | None]) -> tuple[Session | None, bool]:
        """`SessionStore.change_session` whose write records the response `change` returns (None: nothing
        written), as `commit` would: read, change and record in one step where the store can. `change` may
        run on the store's thread (see `change_session`)."""
        payloads: list[str] = []

        def staged(session: Session) -> Writes | None:
            response = change(session)
            if response is None:
                return None
            if not self.request_id:
                return Writes()
            payloads.append(self.payload(response))
            return self._writes(payloads[-1], None)

        try:
            session, written = await self._store.change_session(session_id, staged)
        except RequestExists as exc:
            self._refused(exc)
            raise
        if written and self.request_id:
            self.recorded, self.unwritten = payloads[-1], None
        return session, written

    def _writes(self, payload: str, tool_call: ToolCallEntry | None) -> Writes:
        """The record's write with the work's: created DONE if the request_id is new (not held), else
        completed only while this attempt holds it."""
        new = not self.held
        request = (self.scope, self.request_id, payload)
        return Writes(request, tool_call, new_request=new, held_by="" if new else self._owner)

    def _refused(self, exc: RequestExists) -> None:
        if self.held:
            self.taken, self.unwritten = exc.record, None  # another attempt took it over: that answer stands

    def keep(self) -> None:
        """The work's outcome may have happened although it fails (the gateway: the tool may have run), and
        the work records that itself: the ledger does not release the record."""
        self.kept = True

    def _attempt_over(self, later: Callable[[tuple[str, str], _Unwritten], None]) -> None:
        """The attempt returned: an unwritten response, now or from a write still running, goes to `later`."""
        self._later = later
        if self.unwritten is not None:
            later((self.scope, self.request_id), self.unwritten)


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

    def __init__(self, store: SessionStore, owner: str, poll_s: float = 0.1) -> None:
        self.store = store
        self.owner = owner
        self._poll = poll_s
        self._running: dict[tuple[str, str], _Running] = {}
        self._unwritten: dict[tuple[str, str], _Unwritten] = {}  # answered; DONE written in the background

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
        """The request's response: run by this call, or an earlier attempt's (see the module docstring)."""
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

    def _write_later(self, key: tuple[str, str], unwritten: _Unwritten) -> None:
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

    async def _rewrite(self, key: tuple[str, str], unwritten: _Unwritten) -> None:
        delay, attempts = REWRITE_FIRST_S, 0
        try:
            while True:
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
                    delay = min(delay * 2, REWRITE_MAX_S)
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


__all__ = [
    "ANONYMOUS",
    "Claim",
    "RequestLedger",
    "check_binding",
    "decode_result",
    "encode_result",
    "fingerprint",
    "scope",
]
