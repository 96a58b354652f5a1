"""An episode's ending: the verifier scores the episode the last turn ended, and the outcome and the turn's
answer are recorded. Each ending runs in a task of its own: it finishes even if the Step that ended the episode
goes away (a retry then gets the outcome instead of FAILED_PRECONDITION on an unscored episode), and shutdown
waits for the endings in flight or hands them back to other replicas."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

from rlgate.core.convert import json_text
from rlgate.ledger import Claim
from rlgate.orchestrator.closing import Closing, end_session
from rlgate.orchestrator.providers.base import InstanceHandle, Provider
from rlgate.orchestrator.sessions import Sessions
from rlgate.orchestrator.verifier import Outcome, Verifier
from rlgate.orchestrator.views import step_response
from rlgate.runtime import tracing
from rlgate.store import Session, SessionStatus, ToolCallEntry, ToolCallLog, VerificationStatus, add_infra_fault
from rlgate.v1 import orchestrator_pb2

log = logging.getLogger(__name__)

# The tool-call log a verifier is handed, at most: it is held here and written for the verifier's child,
# whose address space is capped (runtime/sandbox.py). Calls carry up to the gateway's max_arguments_bytes
# each and the call budget may be unlimited, so the log is read page by page and stops past this bound.
VERIFIER_LOG_BYTES = 64 << 20
_READ_PAGE = 16  # entries per store read: 16 x max_arguments_bytes at most in flight


class LogTooLarge(Exception):
    """The episode's tool-call log weighs more than a verifier is given."""


def entry_bytes(entry: ToolCallEntry) -> int:
    """What an entry weighs in the verifier's input, about (its arguments as JSON and its summary)."""
    return len(json_text(entry.arguments)) + len(entry.result_summary) + 256


async def verifier_log(
    log_store: ToolCallLog, session_id: str, episode: int, limit_bytes: int = VERIFIER_LOG_BYTES
) -> list[ToolCallEntry]:
    """The episode's log, oldest first, read page by page; LogTooLarge once it passes `limit_bytes`."""
    entries: list[ToolCallEntry] = []
    used, after = 0, 0
    while True:
        page, next_after = await log_store.tool_calls(session_id, episode=episode, after=after, limit=_READ_PAGE)
        for entry in page:
            used += entry_bytes(entry)
            if used > limit_bytes:
                raise LogTooLarge(f"the episode's tool-call log exceeds the {limit_bytes} bytes a verifier is given")
            entries.append(entry)
        if next_after is None:
            return entries
        after = next_after


def record_outcome(session: Session, outcome: Outcome) -> None:
    """The verifier's outcome on the session: its verification, and the reward only for an OK score."""
    session.verification = outcome.verification()
    session.reward = outcome.score if outcome.status == VerificationStatus.OK else None
    if outcome.status in (VerificationStatus.ERROR, VerificationStatus.TIMEOUT):
        add_infra_fault(session, "verifier_errors")  # no reward for a reason that is not the model's


class Endings:
    def __init__(self, sessions: Sessions, provider: Provider, verifier: Verifier, closing: Closing) -> None:
        self._sessions = sessions
        self._provider = provider
        self.verifier = verifier
        self._closing = closing
        self._running: set[asyncio.Task[orchestrator_pb2.StepResponse]] = set()

    def start(
        self, session: Session, final_answer: str | None, claim: Claim, *, close: bool = False
    ) -> asyncio.Task[orchestrator_pb2.StepResponse]:
        """Score the episode `session` has just ended and record the request's answer (the claim is held);
        with `close` (the Step's close_when_done), the session is closed by the write of its outcome."""
        return self._spawn(self._end(session, final_answer, claim, close))

    def start_after(
        self, written: asyncio.Future[Session], final_answer: str | None, claim: Claim, *, close: bool = False
    ) -> asyncio.Task[orchestrator_pb2.StepResponse]:
        """The ending of a turn whose caller left during the write that ends the episode: scored if the
        write lands, the request's record released if it fails."""
        return self._spawn(self._end_after(written, final_answer, claim, close))

    async def wait(self) -> None:
        """Until every episode ending of this process is scored and recorded (shutdown: an ending whose
        caller went away still finishes here, so a retry anywhere replays it)."""
        while pending := {task for task in self._running if not task.done()}:
            await asyncio.wait(pending)

    async def abandon(self) -> None:
        """Cancel the endings still being scored (shutdown, after the drain). Their request records stay
        PENDING: once this process is declared dead, a retry on another replica takes them over and
        answers with the episode's ending."""
        endings = set(self._running)
        for task in endings:
            task.cancel()
        if endings:
            log.warning("shutdown: %d episode ending(s) not scored yet; handed back to other replicas", len(endings))
            await asyncio.gather(*endings, return_exceptions=True)

    def unscored(self, session: Session) -> bool:
        """For a session whose episode has just ended (not yet written): True, with the SKIPPED outcome
        recorded on it, when its task has no verifier; the turn's own write then holds the whole ending.
        False when a verifier must run (`start`, after the write). Pure: may run on the store's thread."""
        if self.verifier.runs_for(self._sessions.task_of(session)):
            return False
        record_outcome(session, Verifier.skipped())
        return True

    def ended_unscored(self) -> None:
        """An episode ended with its SKIPPED outcome in the turn's write (`unscored`): counted, logged and
        traced (its own `rlgate.verify` span) as every outcome is."""
        with tracing.span("rlgate.verify"):
            self.verifier.observe(Verifier.skipped())

    async def score(self, session: Session, final_answer: str | None, *, close: bool = False) -> Session:
        """Run the verifier for the episode that just ended and record its outcome (once: a concurrent or
        later scoring of the same episode leaves the first outcome). With `close`, the same write closes
        the session (once scored: the verifier reads the instance), and its instance is released after."""
        task = self._sessions.task_of(session)
        handle = (
            InstanceHandle.from_record(session.instance)
            if session.instance
            else InstanceHandle(instance_id=session.instance_id, env_key=session.env_key)
        )
        try:
            extra: dict[str, Any] = {}
            if task is not None and self._provider.wants_tool_calls(task):
                extra["tool_calls"] = await verifier_log(self._sessions.store, session.session_id, session.episode)
            outcome = await self.verifier.run(task, handle, final_answer, **extra)
        except LogTooLarge as exc:  # an honest failure, not a score on part of the log
            log.warning("session %s: %s", session.session_id, exc)
            outcome = Outcome(VerificationStatus.ERROR, message=str(exc))
        episode = session.episode
        closed: list[bool] = []  # set when this write closes the session (not a Close that came first: it released)

        def record(s: Session) -> bool:
            if s.episode != episode or s.verification is not None:
                return False
            record_outcome(s, outcome)
            closed.clear()
            if close and s.status == SessionStatus.DONE:
                end_session(s, SessionStatus.CLOSED)
                closed.append(True)
            return True

        updated, changed = await self._sessions.mutate(session.session_id, record, start=session)
        if changed and closed:
            await self._closing.ended(updated, "its last Step, close_when_done")
        return updated

    def _spawn(
        self, ending: Coroutine[Any, Any, orchestrator_pb2.StepResponse]
    ) -> asyncio.Task[orchestrator_pb2.StepResponse]:
        task = asyncio.create_task(ending)
        self._running.add(task)
        task.add_done_callback(self._ended)
        return task

    def _ended(self, task: asyncio.Task[orchestrator_pb2.StepResponse]) -> None:
        self._running.discard(task)
        if not task.cancelled() and task.exception() is not None:  # retrieved here: its caller may be gone
            log.warning("scoring the episode failed: %s", task.exception())

    async def _end_after(
        self, written: asyncio.Future[Session], final_answer: str | None, claim: Claim, close: bool
    ) -> orchestrator_pb2.StepResponse:
        try:
            session = await written
        except asyncio.CancelledError:
            raise  # shutdown: the record is handed back PENDING (see `_end`)
        except BaseException:
            await asyncio.shield(self._sessions.store.release_request(claim.scope, claim.request_id))  # nothing written
            raise
        return await self._end(session, final_answer, claim, close)

    async def _end(
        self, session: Session, final_answer: str | None, claim: Claim, close: bool
    ) -> orchestrator_pb2.StepResponse:
        try:
            response = step_response(await self.score(session, final_answer, close=close))
        except asyncio.CancelledError:
            # Shutdown: the record stays PENDING, handed back with this process (`Orchestrator.stop`). A
            # released record would make a retry elsewhere find the episode done with no record of its
            # ending (FAILED_PRECONDITION); a PENDING one of a dead owner is taken over and scored there.
            raise
        except BaseException:
            if claim.request_id:  # not scored: a retry runs again rather than waiting on a live owner
                await asyncio.shield(self._sessions.store.release_request(claim.scope, claim.request_id))
            raise
        if claim.request_id:
            # A write the store refuses raises, and the ledger keeps the scored ending: repeats here get it
            # and it is written again in the background (never released: that would lose the ending).
            await claim.commit(response=response)
        return response
