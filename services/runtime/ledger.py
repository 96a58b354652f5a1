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
- **Owners die.** A PENDING record whose owner's heartbeat lapsed is taken over by default: released and
  run again by the repeat, whose work is told which record it took over (`Claim.prior`) so it converges
  instead of repeating (a dead attempt never recorded its parameters' fingerprint in the store, so the work
  checks what it finds against its own parameters). `orphan=` answers instead (the gateway: a tool never
  runs twice, so the repeat answers OUTCOME_UNKNOWN).

API (`RequestLedger(store, owner)`; one per process and plane):

    response = await ledger.run(scope, request_id, params, deadline, ResponseMessage, work, ...)

- `params`: the request's parameters as {field: JSON value} (protobuf Structs through
  `rlgate.convert.arguments_of` or `json_from_struct`); compared field by field, in the given order.
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
- `orphan(record)`: the answer to a repeat whose first attempt's owner died mid-flight (default: take over).
- Without a request_id, `run` just runs `work` (with a claim that records nothing).

What a DONE record holds (`RequestRecord.result`): JSON text {"params": {field: digest}, "response":
base64 of the serialised (redacted) response}. A record written before the ledger (bare base64) replays
without a parameter check.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from google.protobuf.message import Message

from rlgate.convert import InvalidJsonValue, json_text, parse_json_text
from rlgate.runtime.deadline import Deadline
from rlgate.runtime.errors import DeadlineExceeded, InvalidArgument, clip
from rlgate.store import RequestExists, RequestRecord, RequestState, Session, SessionStore, ToolCallEntry

log = logging.getLogger(__name__)
M = TypeVar("M", bound=Message)

ANONYMOUS = "-"  # the caller when no credentials identify one (no API keys configured)
DIGEST_CHARS = 16  # hex characters per field digest (64 bits: a collision is no practical concern)


def scope(kind: str, caller: str) -> str:
    """The records of one kind of request ("reset", "step") of one caller (an API key's hash, or "")."""
    return f"{kind}:{caller or ANONYMOUS}"


# ---- binding: a request_id to the parameters it was first used with -----------------------------------


def fingerprint(params: Mapping[str, Any]) -> dict[str, str]:
    """{field: digest of its canonical JSON value}. Object keys are sorted and whole floats are integers
    (JSON does not tell 1 from 1.0), so equal values digest equally whichever form they arrived in."""
    return {
        name: hashlib.sha256(json_text(_canonical(value)).encode()).hexdigest()[:DIGEST_CHARS]
        for name, value in params.items()
    }


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
    if isinstance(value, Mapping):
        return {str(k): _canonical(value[k]) for k in sorted(value, key=str)}
    if isinstance(value, list | tuple):
        return [_canonical(v) for v in value]
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def encode_result(params: Mapping[str, str], response: Message) -> str:
    """A DONE record's payload: the parameters' digests and the serialised response."""
    return json_text({"params": dict(params), "response": base64.b64encode(response.SerializeToString()).decode()})


def decode_result(raw: str) -> tuple[dict[str, str] | None, bytes]:
    """(digests or None when the record predates them, serialised response) of a DONE record's payload."""
    if not raw.startswith("{"):
        return None, base64.b64decode(raw)
    try:
        data = parse_json_text(raw, "request record")
        return dict(data["params"]), base64.b64decode(data["response"])
    except (InvalidJsonValue, KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"corrupt request record payload: {exc}") from exc


# ---- the work's handle on its record -------------------------------------------------------------------


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
        request_id is new, else `RequestExists` and nothing is written. Returns what `commit` returns."""
        if not self.request_id:
            return await self._store.commit(session=session, tool_call=tool_call)
        payload = self.payload(response)
        written = await self._store.commit(
            session=session,
            tool_call=tool_call,
            new_request=not self.held,
            request=(self.scope, self.request_id, payload),
        )
        self.recorded = payload
        return written

    def keep(self) -> None:
        """The work's outcome may have happened although it fails (the gateway: the tool may have run), and
        the work records that itself: the ledger does not release the record."""
        self.kept = True


@dataclass
class _Running:
    """A first attempt running in this process: repeats here wait on `done` (the recorded payload)."""

    params: dict[str, str]
    done: asyncio.Future[str]


class _Again(Exception):
    """The record went away or was taken over: look again from the top."""


class RequestLedger:
    """Request records of one process (`owner`: its `SessionStore.heartbeat_owner` id)."""

    def __init__(self, store: SessionStore, owner: str, poll_s: float = 0.1) -> None:
        self.store = store
        self.owner = owner
        self._poll = poll_s
        self._running: dict[tuple[str, str], _Running] = {}

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
        orphan: Callable[[RequestRecord], Awaitable[M]] | None = None,
    ) -> M:
        """The request's response: run by this call, or an earlier attempt's (see the module docstring)."""
        if not request_id:
            return await work(Claim(self.store, self.owner, scope, "", {}, held=False))
        digests = fingerprint(params)
        key = (scope, request_id)
        prior: RequestRecord | None = None
        while True:
            running = self._running.get(key)
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
                    if handle.held or handle.recorded is not None:
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
                record, created = await (
                    claim() if claim is not None else self.store.claim_request(scope, request_id, self.owner)
                )
                if created:
                    handle = Claim(
                        self.store, self.owner, scope, request_id, digests, held=True, prior=prior, redact=redact
                    )
                    return await self._own(key, handle, work)
            try:
                return await self._answer(record, key, digests, deadline, message, replay, orphan)
            except _Again as again:
                prior = again.args[0] if again.args else None

    async def _answer(
        self,
        record: RequestRecord | None,
        key: tuple[str, str],
        digests: dict[str, str],
        deadline: Deadline,
        message: type[M],
        replay: Callable[[M], Awaitable[M]] | None,
        orphan: Callable[[RequestRecord], Awaitable[M]] | None,
    ) -> M:
        """The answer from an earlier attempt's record: replayed when DONE, waited for while PENDING. Raises
        `_Again` (with the record taken over, if any) when the caller should run the request itself."""
        scope, request_id = key
        while True:
            if record is None or key in self._running:
                raise _Again()  # released (the first attempt failed), or a local attempt started meanwhile
            if record.state == RequestState.DONE:
                recorded, data = decode_result(record.result)
                check_binding(request_id, recorded, digests)
                return await self._repeat(message, data, replay)
            if record.owner != self.owner and not await self.store.owner_alive(record.owner):
                if orphan is not None:
                    return await orphan(record)
                log.warning("request %s/%s: owner %s is gone; taking over", scope, clip(request_id), record.owner)
                await self.store.release_request(scope, request_id)
                raise _Again(record)
            if deadline.expired():
                raise DeadlineExceeded(f"request_id {clip(request_id)!r} is still being processed; retry later")
            await asyncio.sleep(min(self._poll, deadline.remaining()))
            record = await self.store.get_request(scope, request_id)

    async def _own(self, key: tuple[str, str], handle: Claim, work: Callable[[Claim], Awaitable[M]]) -> M:
        """Run the work as the request's first attempt, then make sure its response is recorded."""
        done: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._running[key] = _Running(handle.params, done)
        try:
            response = await work(handle)
            if handle.recorded is None:  # the work did not record it with its own write: record it now
                payload = handle.payload(response)
                if handle.held:
                    await asyncio.shield(self.store.complete_request(*key, payload))
                else:
                    await asyncio.shield(self.store.commit(request=(*key, payload), new_request=True))
                handle.recorded = payload
        except BaseException as exc:
            if handle.held and handle.recorded is None and not handle.kept:
                await asyncio.shield(self.store.release_request(*key))
            if handle.held and isinstance(exc, Exception):
                done.set_exception(exc)  # a repeat waiting here gets the same error
                done.exception()  # marked retrieved: nobody may be waiting
            else:
                done.cancel()  # no answer from here (or, lazy, maybe an earlier record's): a repeat looks again
            raise
        finally:
            self._running.pop(key, None)
        done.set_result(handle.recorded)
        return response

    async def _await_running(self, running: _Running, deadline: Deadline) -> bytes | None:
        """The serialised recorded response of the first attempt running here, or None when it gave none."""
        try:
            payload = await asyncio.wait_for(asyncio.shield(running.done), deadline.remaining() or 0.001)
        except TimeoutError as exc:
            raise DeadlineExceeded("the first attempt of this request_id is still running; retry later") from exc
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
