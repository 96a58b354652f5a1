"""Step: one turn of an episode — counted on the session, and the episode ended when the turn gives a final
answer, says done or reaches max_turns (its scoring is then `endings`').

With a request_id the turn goes through the request ledger, lazily claimed: an ordinary turn is one store
call that reads the session, counts the turn and records its response together, only if the request_id is
new (`SessionStore.change_session`). So is a turn that ends an episode no verifier scores: its SKIPPED
outcome is known at once and written with it, as is the close `close_when_done` asks for. A turn that ends
an episode a verifier scores claims the request_id before its write, since it is scored after it (a repeat
waits for the verifier's outcome instead of replaying a turn without it); its close is written with the
outcome.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from rlgate.core.convert import InvalidJsonValue, arguments_of
from rlgate.core.errors import FailedPrecondition, InvalidArgument, clip
from rlgate.core.faults import MAX_CLIENT_RETRIES
from rlgate.ledger import Claim, RequestLedger, scope
from rlgate.orchestrator.closing import Closing, end_session
from rlgate.orchestrator.endings import Endings
from rlgate.orchestrator.sessions import Sessions, unknown_session
from rlgate.orchestrator.views import step_response
from rlgate.runtime.deadline import Deadline
from rlgate.runtime.logs import session_id_var
from rlgate.store import DoneReason, Session, SessionStatus, add_infra_fault
from rlgate.v1 import orchestrator_pb2

log = logging.getLogger(__name__)


class Steps:
    def __init__(self, sessions: Sessions, endings: Endings, closing: Closing, ledger: RequestLedger) -> None:
        self._sessions = sessions
        self._endings = endings
        self._closing = closing
        self._ledger = ledger

    async def step(
        self, request: orchestrator_pb2.StepRequest, deadline: Deadline, caller: str = ""
    ) -> orchestrator_pb2.StepResponse:
        """One turn; `caller` owns the request_id (the API key's hash; "" without keys)."""
        if not request.session_id:
            raise InvalidArgument("session_id", "required")
        params = step_params(request)
        session_id_var.set(request.session_id)
        return await self._ledger.run(
            scope("step", caller),
            request.request_id,
            params,
            deadline,
            orchestrator_pb2.StepResponse,
            lambda claim: self._turn(request, claim),
            lazy=True,
        )

    async def _turn(self, request: orchestrator_pb2.StepRequest, claim: Claim) -> orchestrator_pb2.StepResponse:
        final_answer = request.final_answer if request.HasField("final_answer") else None
        close = request.close_when_done
        if claim.prior is not None:
            current = await self._sessions.get(request.session_id)
            if _ended_by(current, close) and current.updated_at >= claim.prior.created_at:
                # The dead attempt ended the episode (or was ending it): answer with that ending and
                # finish its verification if it never ran, instead of FAILED_PRECONDITION.
                log.warning(
                    "step %s taken over after its owner died: returning the episode's ending", clip(request.request_id)
                )
                if current.verification is None:
                    current = await self._endings.score(current, final_answer, close=close)
                return step_response(current)

        def count(s: Session) -> bool:
            if s.status == SessionStatus.DONE:
                raise FailedPrecondition(
                    "the episode is already done; Reset with session_id starts the next", reason="EPISODE_DONE"
                )
            if s.status != SessionStatus.ACTIVE:
                raise FailedPrecondition(f"session {s.session_id} is {s.status}", reason="SESSION_NOT_ACTIVE")
            _count_turn(s, request)
            if claim.prior is not None:  # the orchestrator that ran this Step first died under it
                add_infra_fault(s, "orchestrator_restarts")
            return True

        responses: list[orchestrator_pb2.StepResponse] = []
        as_read: list[Session] = []  # the session before a turn that ends the episode: where its write starts

        def turn(s: Session) -> orchestrator_pb2.StepResponse | None:
            """The turn's response, recorded with the turn; None for a turn that ends an episode a verifier
            must score (an episode without one is recorded SKIPPED here, ending and all)."""
            before = s.copy()  # `count` sets fields only: a shallow copy stays as read
            count(s)
            if s.status == SessionStatus.DONE:
                if not self._endings.unscored(s):
                    as_read.append(before)
                    return None
                if close:
                    end_session(s, SessionStatus.CLOSED)
            responses.append(step_response(s))  # the write changes no field of it (version, updated_at)
            return responses[-1]

        # Read, count and record in one store call (one transaction on SQLite's thread): every turn but one
        # that ends an episode with a verifier.
        session, written = await claim.change(request.session_id, turn)
        if session is None:
            raise unknown_session(request.session_id)
        if written:
            _log_turn(session, request)
            if session.done_reason != DoneReason.NONE:
                self._endings.ended_unscored()
            if session.status == SessionStatus.CLOSED:
                await self._closing.ended(session, "its last Step, close_when_done")
            return responses[-1]

        # This turn ends an episode a verifier scores: the request_id is held first, since the episode is
        # scored after the write (a repeat waits for the verifier's outcome instead of replaying a turn
        # without it).
        async def write(s: Session) -> Session | None:
            if s.status == SessionStatus.DONE:
                await claim.hold()  # scored after this write: repeats wait for the outcome
                written = asyncio.ensure_future(self._sessions.store.update_session(s))
                try:
                    return await asyncio.shield(written)
                except asyncio.CancelledError:
                    # The caller went away (or a drain cut the call) mid-write: the write lands or fails
                    # regardless, and the record follows it in the background (scored, or released).
                    claim.keep()
                    self._endings.start_after(written, final_answer, claim, close=close)
                    raise
            return await claim.commit(session=s, response=step_response(s))

        # From the session as the first call read it (no second read); a write in between fails the
        # compare-and-set and the turn is counted again on a fresh read.
        start = as_read[-1] if as_read else None
        session, _ = await self._sessions.mutate(request.session_id, count, start=start, write=write)
        _log_turn(session, request)
        if session.status != SessionStatus.DONE:
            return step_response(session)
        # The episode has ended: its verification and the request's record finish even if this caller goes
        # away now (a retry then gets the outcome instead of FAILED_PRECONDITION on an unscored episode).
        claim.keep()
        return await asyncio.shield(self._endings.start(session, final_answer, claim, close=close))


def step_params(request: orchestrator_pb2.StepRequest) -> dict[str, Any]:
    """What a Step's request_id is bound to. INVALID_ARGUMENT for tool-call arguments that are not a JSON
    object (the ledger compares them as JSON, whichever form they came in)."""
    if not 0 <= request.client_retries <= MAX_CLIENT_RETRIES:
        raise InvalidArgument("client_retries", f"{request.client_retries}; must be 0..{MAX_CLIENT_RETRIES}")
    calls = []
    for i, call in enumerate(request.tool_calls):
        if not call.name:
            raise InvalidArgument(f"tool_calls[{i}].name", "required")
        try:
            arguments = arguments_of(call)
        except InvalidJsonValue as exc:
            raise InvalidArgument(f"tool_calls[{i}].{call.WhichOneof('args')}", str(exc)) from exc
        calls.append(
            {
                "name": call.name,
                "arguments": arguments,
                "request_id": call.request_id,
                "is_error": call.is_error,
                "error_kind": call.error_kind,
            }
        )
    return {
        "session_id": request.session_id,
        "assistant_text": request.assistant_text,
        "tool_calls": calls,
        "final_answer": request.final_answer if request.HasField("final_answer") else None,
        "done": request.done,
        # Bound only when asked for, so a request_id recorded before the field existed still matches.
        **({"close_when_done": True} if request.close_when_done else {}),
        # not client_retries: a report about the calls before this Step, not part of the turn. A caller that
        # repeats a Step may have counted more retries meanwhile; the repeat still gets the recorded answer.
    }


def _ended_by(session: Session, close: bool) -> bool:
    """Whether `session` is as a turn that ended its episode left it: DONE, or closed by the write that
    recorded its outcome (`close`: a close_when_done close is never written without one). A session a Close
    ended before its outcome was written is neither: its instance is gone, so there is nothing to score."""
    if session.status == SessionStatus.DONE:
        return True
    return close and session.status == SessionStatus.CLOSED and session.verification is not None


def _count_turn(session: Session, request: orchestrator_pb2.StepRequest) -> None:
    """Apply one Step to an active session: the turn, and the episode's end if this turn ends it."""
    session.turn += 1
    session.last_active_at = time.time()
    add_infra_fault(session, "client_retries", request.client_retries)
    if request.HasField("final_answer"):
        session.done_reason = DoneReason.FINAL_ANSWER
    elif request.done:
        session.done_reason = DoneReason.AGENT_DONE
    elif session.max_turns and session.turn >= session.max_turns:
        session.done_reason = DoneReason.MAX_TURNS
    if session.done_reason != DoneReason.NONE:
        session.status = SessionStatus.DONE
        session.verification = None
        session.reward = None


def _log_turn(session: Session, request: orchestrator_pb2.StepRequest) -> None:
    if log.isEnabledFor(logging.INFO):
        log.info(
            "turn %d: %d tool call(s)%s%s",
            session.turn,
            len(request.tool_calls),
            ", final answer" if request.HasField("final_answer") else "",
            f", done ({session.done_reason})" if session.done_reason != DoneReason.NONE else "",
        )
