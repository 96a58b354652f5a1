"""Agent token → session: which session a token selects, and whether it may call tools now.

A token that is no session's current one is UNAUTHENTICATED, unless the session it names revoked it (a
later Reset, a closed or finished episode): then FAILED_PRECONDITION with the reason, so an agent learns
its episode is over rather than that its token is wrong.
"""

from __future__ import annotations

import time

from rlgate.core.errors import FailedPrecondition, RlgateError, Unauthenticated, Unavailable
from rlgate.runtime.auth import session_of_token, token_hash
from rlgate.runtime.logs import session_id_var
from rlgate.store import RequestRecord, Session, SessionStatus, SessionStore, StoreError, call_scope
from rlgate.toolgateway.recording import Recorder


def store_down(exc: StoreError) -> Unavailable:
    return Unavailable(f"session store unavailable: {exc}", reason="STORE_UNAVAILABLE")


def episode_over(session: Session, episode: int, *, revoked: bool) -> FailedPrecondition | None:
    """Why a token of `episode` of `session` cannot call tools (None: it can, or, for a revoked token, it
    was replaced within its episode)."""
    sid, status = session.session_id, session.status
    meta = {"session_id": sid, "episode": episode}
    if episode < session.episode:
        return FailedPrecondition(
            f"episode {episode} of session {sid} ended: a later Reset started episode {episode + 1}",
            reason="EPISODE_SUPERSEDED",
            metadata=meta,
        )
    if status == SessionStatus.CLOSED:
        return FailedPrecondition(f"session {sid} was closed", reason="SESSION_CLOSED", metadata=meta)
    if status == SessionStatus.EXPIRED:
        return FailedPrecondition(f"session {sid} expired", reason="SESSION_EXPIRED", metadata=meta)
    if session.expires_at and time.time() >= session.expires_at:
        return FailedPrecondition(f"session {sid} expired (its TTL passed)", reason="SESSION_EXPIRED", metadata=meta)
    if status == SessionStatus.FAILED:
        return FailedPrecondition(f"session {sid} failed", reason="SESSION_FAILED", metadata=meta)
    if status == SessionStatus.DONE:
        why = f" ({session.done_reason})" if session.done_reason else ""
        return FailedPrecondition(
            f"episode {episode} of session {sid} is done{why}; Reset with the session_id starts the next one",
            reason="EPISODE_DONE",
            metadata=meta,
        )
    if status == SessionStatus.PROVISIONING:
        if revoked:
            return FailedPrecondition(
                f"episode {episode} of session {sid} ended: a Reset is starting episode {episode + 1}",
                reason="EPISODE_SUPERSEDED",
                metadata=meta,
            )
        return FailedPrecondition(
            f"session {sid} is not active yet (provisioning)", reason="SESSION_NOT_ACTIVE", metadata=meta
        )
    if status != SessionStatus.ACTIVE:
        return FailedPrecondition(f"session {sid} is {status}", reason="SESSION_NOT_ACTIVE", metadata=meta)
    return None


def admit(session: Session) -> Session:
    """The session of a current token if it may call tools now, else the FailedPrecondition saying why not."""
    session_id_var.set(session.session_id)
    refused = episode_over(session, session.episode, revoked=False)
    if refused is not None:
        raise refused
    if not session.endpoints:
        raise FailedPrecondition(
            f"session {session.session_id} has no MCP endpoints",
            reason="NO_ENDPOINTS",
            metadata={"session_id": session.session_id},
        )
    return session


class Authenticator:
    """The session an agent token selects, admitted to call tools."""

    def __init__(self, store: SessionStore, owner: str, recorder: Recorder) -> None:
        self._store = store
        self._owner = owner
        self._recorder = recorder

    async def authenticate(self, token: str | None) -> Session:
        hashed = self._token_hash(token)
        try:
            session = await self._store.session_by_token(hashed)
        except StoreError as exc:
            raise store_down(exc) from exc
        if session is None:
            raise await self._refusal(token or "", hashed)
        return admit(session)

    async def authorize(self, token: str | None, request_id: str) -> tuple[Session, tuple[RequestRecord, bool] | None]:
        """`authenticate` plus the claim of a call's `request_id` (if any) in one store round trip: the
        session and the claim's (record, created), or None when nothing was claimed."""
        hashed = self._token_hash(token)
        try:  # a claim landing after this call was cancelled is released by the store
            session, record, created = await self._store.authorize_call(hashed, request_id, self._owner)
        except StoreError as exc:
            raise store_down(exc) from exc
        if session is None:
            raise await self._refusal(token or "", hashed)
        try:
            admit(session)
        except RlgateError:
            if created:  # claimed, then refused (e.g. TTL passed): free the id again
                await self._recorder.shielded(self._recorder.release(call_scope(session.session_id), request_id))
            raise
        return session, None if record is None else (record, created)

    @staticmethod
    def _token_hash(token: str | None) -> str:
        if not token:
            raise Unauthenticated("missing agent token: send 'authorization: Bearer <agent token>' from Reset")
        return token_hash(token)

    async def _refusal(self, token: str, hashed: str) -> RlgateError:
        """Why a token that is no session's current one is refused: FAILED_PRECONDITION with the reason when
        the session it names revoked it (kept among its last revoked hashes), else UNAUTHENTICATED."""
        session_id = session_of_token(token)
        try:
            session = await self._store.get_session(session_id) if session_id else None
        except StoreError as exc:
            return store_down(exc)
        episode = session.revoked_tokens.get(hashed) if session is not None else None
        if session is None or episode is None:
            return Unauthenticated("unknown agent token: use the token Reset returned for the current episode")
        session_id_var.set(session.session_id)
        return episode_over(session, episode, revoked=True) or FailedPrecondition(
            f"this agent token of episode {episode} of session {session.session_id} was replaced: a repeated "
            "Reset returned a new one",
            reason="TOKEN_REPLACED",
            metadata={"session_id": session.session_id, "episode": episode},
        )
