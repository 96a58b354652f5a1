"""How sessions end: Close, CloseSessions, expiry (the reaper) and failure (a reset that failed, an instance
that vanished). Each is one compare-and-set on the session that exactly one caller wins — of a Close racing the
reaper on another replica, one closes and the other finds it closed — then the agent token is revoked and the
instance released."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping

from rlgate.core.errors import InvalidArgument, NotFound
from rlgate.orchestrator.instances import Instances
from rlgate.orchestrator.sessions import Sessions
from rlgate.orchestrator.views import SESSION_STATUS
from rlgate.runtime.auth import revoke_agent_token
from rlgate.store import Session, SessionStatus
from rlgate.v1 import orchestrator_pb2

log = logging.getLogger(__name__)


class Closing:
    def __init__(self, sessions: Sessions, instances: Instances) -> None:
        self._sessions = sessions
        self._instances = instances

    async def close(self, session_id: str) -> orchestrator_pb2.CloseResponse:
        session, closed = await self._finish(session_id, SessionStatus.CLOSED, "closed by the caller")
        return orchestrator_pb2.CloseResponse(already_closed=not closed, status=SESSION_STATUS[session.status])

    async def close_sessions(self, labels: Mapping[str, str], run_id: str) -> list[str]:
        """Close every open session matching the filters; the ids of those this call closed."""
        if not labels and not run_id:
            raise InvalidArgument("labels", "at least one filter (labels or run_id) is required")
        targets = await self._sessions.open_sessions(labels=labels, run_id=run_id)
        sem = asyncio.Semaphore(16)

        async def one(s: Session) -> str | None:
            async with sem:
                try:
                    _, changed = await self._finish(s.session_id, SessionStatus.CLOSED, "CloseSessions")
                except NotFound:
                    return None
                return s.session_id if changed else None

        results = await asyncio.gather(*(one(s) for s in targets))
        return [r for r in results if r]

    async def expire(self, session_id: str, reason: str, only_if: Callable[[Session], bool] | None = None) -> bool:
        """EXPIRED (the reaper: TTL or idle), if still open and `only_if` holds on the fresh record; whether
        this call expired it."""
        try:
            _, changed = await self._finish(session_id, SessionStatus.EXPIRED, reason, only_if=only_if)
        except NotFound:
            return False
        return changed

    async def fail(self, session_id: str, reason: str, *, instance_id: str | None = None) -> bool:
        """Provisioning or reset failed irrecoverably, or the instance vanished: FAILED, token revoked,
        instance released. With `instance_id`, only while the session still uses that instance and is not
        mid-reset (reconciliation's view may be stale)."""

        def still(s: Session) -> bool:
            return instance_id is None or (s.instance_id == instance_id and s.status != SessionStatus.PROVISIONING)

        try:
            _, changed = await self._finish(session_id, SessionStatus.FAILED, reason, only_if=still)
            return changed
        except Exception:
            log.exception("could not mark session %s failed", session_id)
            return False

    async def _finish(
        self, session_id: str, status: SessionStatus, reason: str, only_if: Callable[[Session], bool] | None = None
    ) -> tuple[Session, bool]:
        """Move an open session to CLOSED/EXPIRED/FAILED (exactly one caller wins), revoke its token and
        release its instance. Returns (session, whether this call closed it)."""
        previous: dict[str, SessionStatus] = {}

        def end(s: Session) -> bool:
            if not s.is_open or (only_if is not None and not only_if(s)):
                return False
            previous["status"] = s.status
            end_session(s, status)
            return True

        session, changed = await self._sessions.mutate(session_id, end)
        if changed:
            # Only a session closed in service returns its instance to a pool: one mid-reset may be dirty.
            in_service = status == SessionStatus.CLOSED and previous.get("status") != SessionStatus.PROVISIONING
            await self.ended(session, reason, pool_ok=in_service)
        return session, changed

    async def ended(self, session: Session, reason: str, *, pool_ok: bool = True) -> None:
        """After the write that ended `session` (`end_session`): logged, and its instance released (shielded:
        a caller going away does not leave it held)."""
        log.info("session %s %s (%s)", session.session_id, session.status, reason)
        await asyncio.shield(self._instances.release(session, pool_ok=pool_ok))


def end_session(session: Session, status: SessionStatus) -> None:
    """End an open session with `status` (CLOSED, EXPIRED or FAILED): its agent token revoked, the time it
    closed. Pure, for the write that ends it (it may run on the store's thread); `Closing.ended` follows."""
    session.status = status
    revoke_agent_token(session)
    session.closed_at = time.time()
