"""`Claim`: what the work of one attempt knows and may do about its request record (see the package
docstring)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from google.protobuf.message import Message

from rlgate.ledger.binding import encode_result
from rlgate.store import RequestExists, RequestRecord, Session, StoreError, ToolCallEntry, Writes
from rlgate.store.protocols import Owners, RequestRecords


class LedgerStore(RequestRecords, Owners, Protocol):
    """What the ledger needs of the session store: its request records, and whether their owners live."""


@dataclass
class Unwritten:
    """A response whose DONE write the store did not take, with the log entry written with it, and the
    background task writing it again."""

    payload: str
    tool_call: ToolCallEntry | None
    new_request: bool
    task: asyncio.Task[None] | None = None


class Claim:
    """What `work` knows and may do about its request record (see the package docstring)."""

    def __init__(
        self,
        store: LedgerStore,
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
        self.unwritten: Unwritten | None = None  # a response the store did not take (written again later)
        self.taken: RequestRecord | None = None  # the record as another attempt left it, having taken it over
        # Set once the attempt returned: a write of this claim failing after that is handed to it.
        self._later: Callable[[tuple[str, str], Unwritten], None] | None = None

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
        self,
        *,
        response: Message,
        session: Session | None = None,
        tool_call: ToolCallEntry | None = None,
        new_session: bool = False,
    ) -> Session | None:
        """`SessionStore.commit` of `session` (created, with `new_session`) and `tool_call` with the record DONE
        with `response`, in one atomic write (without a request_id: just the rest). Not held: the record is
        created only if the request_id is new, else `RequestExists` and nothing is written. Held: only while
        this attempt still holds it, else `RequestExists` (another process took it over; `taken`). A write
        without a session that the store fails is kept and written again by the ledger (see the package
        docstring); the error is raised all the same. Returns what `commit` returns."""
        if not self.request_id:
            return await self._store.commit(session=session, tool_call=tool_call, new_session=new_session)
        payload = self.payload(response)
        writes = self._writes(payload, tool_call)
        try:
            written = await self._store.commit(
                session=session,
                tool_call=tool_call,
                new_request=writes.new_request,
                request=writes.request,
                held_by=writes.held_by,
                new_session=new_session,
            )
        except RequestExists as exc:
            self._refused(exc)
            raise
        except StoreError:
            if session is None:  # nothing conditional on a read: the same write can be made again later
                self.unwritten = Unwritten(payload, tool_call, writes.new_request)
                if self._later is not None:
                    self._later((self.scope, self.request_id), self.unwritten)
            raise
        self.recorded, self.unwritten = payload, None
        return written

    async def change(
        self,
        session_id: str,
        change: Callable[[Session], Message | None],
        *,
        tool_call: ToolCallEntry | None = None,
    ) -> tuple[Session | None, bool]:
        """`SessionStore.change_session` whose write records the response `change` returns (None: nothing
        written), and logs `tool_call` with it, as `commit` would: read, change and record in one step where
        the store can. `change` may run on the store's thread (see `change_session`)."""
        payloads: list[str] = []

        def staged(session: Session) -> Writes | None:
            response = change(session)
            if response is None:
                return None
            if not self.request_id:
                return Writes(tool_call=tool_call)
            payloads.append(self.payload(response))
            return self._writes(payloads[-1], tool_call)

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

    def _attempt_over(self, later: Callable[[tuple[str, str], Unwritten], None]) -> None:
        """The attempt returned: an unwritten response, now or from a write still running, goes to `later`."""
        self._later = later
        if self.unwritten is not None:
            later((self.scope, self.request_id), self.unwritten)
