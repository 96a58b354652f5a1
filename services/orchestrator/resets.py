"""Reset: start an episode. Every path runs under the request ledger (the request_id scoped to the caller and
bound to the request's parameters), and each answers with a fresh agent token:

- a new session (task_key or env_key): admitted, an instance acquired (from a warm pool or created) and reset,
  its tools listed, the session registered;
- the next episode of a session (session_id): its instance reset (replaced when that fails), the episode
  counter advanced, the previous episode's token revoked;
- a repeat of a finished Reset: the recorded answer with a fresh token while its episode still runs;
- a retry that took over the request of a dead process: the session or episode that attempt already started
  is resumed (checked against this request's parameters) instead of started twice.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
import uuid
import zlib
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any

from rlgate.core.errors import FailedPrecondition, InvalidArgument, clip
from rlgate.ledger import Claim, RequestLedger, scope
from rlgate.orchestrator.admission import Admission
from rlgate.orchestrator.closing import Closing
from rlgate.orchestrator.config import OrchestratorConfig
from rlgate.orchestrator.creates import create_client
from rlgate.orchestrator.instances import Instances
from rlgate.orchestrator.providers.base import InstanceHandle, Provider, TaskDef
from rlgate.orchestrator.sessions import Sessions
from rlgate.orchestrator.tasks import TaskCatalog
from rlgate.orchestrator.tools import ToolCache
from rlgate.orchestrator.views import instance_info, task_info
from rlgate.runtime.auth import mint_agent_token, revoke_agent_token, token_hash
from rlgate.runtime.deadline import Deadline
from rlgate.runtime.logs import session_id_var
from rlgate.store import ConflictError, DoneReason, Intent, RequestExists, RequestRecord, Session, SessionStatus
from rlgate.v1 import common_pb2, orchestrator_pb2

log = logging.getLogger(__name__)


@dataclass
class ResetParams:
    request_id: str = ""
    session_id: str = ""
    task_key: str = ""
    env_key: str = ""
    max_turns: int = 0
    labels: dict[str, str] = field(default_factory=dict)
    run_id: str = ""
    caller: str = ""  # who asked (the API key's hash; "" without keys): request ids are the caller's own

    def bound(self) -> dict[str, Any]:
        """What the request_id is bound to (the ledger's parameters), in the order errors name them."""
        return {
            "session_id": self.session_id,
            "task_key": self.task_key,
            "env_key": self.env_key,
            "max_turns": self.max_turns,
            "labels": self.labels,
            "run_id": self.run_id,
        }


def session_id_for_request(caller: str, request_id: str) -> str:
    """A new session's id is derived from the caller and the Reset's request_id, so a retry after a crash
    converges on it, and another caller's same request_id names another session."""
    return "s-" + hashlib.sha256(f"reset:{scope('reset', caller)}:{request_id}".encode()).hexdigest()[:24]


class Resets:
    def __init__(
        self,
        config: OrchestratorConfig,
        sessions: Sessions,
        admission: Admission,
        instances: Instances,
        closing: Closing,
        provider: Provider,
        catalog: TaskCatalog,
        tools: ToolCache,
        ledger: RequestLedger,
    ) -> None:
        self._config = config
        self._sessions = sessions
        self._admission = admission
        self._instances = instances
        self._closing = closing
        self._provider = provider
        self._catalog = catalog
        self._tools = tools
        self._ledger = ledger

    async def reset(self, params: ResetParams, deadline: Deadline) -> orchestrator_pb2.ResetResponse:
        """Id lengths and labels are checked before this (`limits.check_request`, by the servicer)."""
        if params.max_turns < 0:
            raise InvalidArgument("max_turns", "must be >= 0 (0 uses the task's default)")
        if params.session_id and (params.task_key or params.env_key):
            raise InvalidArgument("session_id", "mutually exclusive with task_key and env_key")
        if not (params.session_id or params.task_key or params.env_key):
            raise InvalidArgument("task_key", "one of session_id, task_key or env_key is required")
        if params.task_key and not params.session_id:
            self._catalog.get(params.task_key)  # NOT_FOUND before any work

        def work(claim: Claim) -> Awaitable[orchestrator_pb2.ResetResponse]:
            if params.session_id:
                return self._next_episode(params, deadline, claim.prior)
            return self._new_session(params, deadline, claim)

        return await self._ledger.run(
            scope("reset", params.caller),
            params.request_id,
            params.bound(),
            deadline,
            orchestrator_pb2.ResetResponse,
            work,
            # A new session on a provider that creates no instances changes nothing before it registers the
            # session, and that write records the answer (`_start_session`): no claim is needed first. One
            # that creates an instance claims first, so a repeat waits for it rather than creating another.
            lazy=not params.session_id and not self._provider.manages_instances,
            redact=_without_token,
            replay=self._replay,
        )

    async def _replay(self, recorded: orchestrator_pb2.ResetResponse) -> orchestrator_pb2.ResetResponse:
        """A repeat of a finished Reset. Its record holds no token (tokens are stored only as hashes), so the
        episode gets a fresh one, which revokes the one handed out before: only the latest reply's holder
        acts. Once the episode is over or superseded: FAILED_PRECONDITION naming the session."""
        _, token = await self.rotate_token(recorded.session_id, recorded.episode)
        answer = orchestrator_pb2.ResetResponse()
        answer.CopyFrom(recorded)
        answer.agent_token = token
        return answer

    # -- a new session ------------------------------------------------------------------------------------
    async def _new_session(
        self, params: ResetParams, deadline: Deadline, claim: Claim
    ) -> orchestrator_pb2.ResetResponse:
        task = self._catalog.get(params.task_key) if params.task_key else None
        env_key = task.env_key if task else params.env_key
        session_id = (
            session_id_for_request(params.caller, params.request_id)
            if params.request_id
            else f"s-{uuid.uuid4().hex[:24]}"
        )
        session_id_var.set(session_id)
        max_turns = self._effective_max_turns(params.max_turns, task)
        # A retried Reset whose first owner died after registering the session resumes it. It is looked up
        # first where that can be (a request taken over from a dead owner) or where acquiring an instance
        # costs a create; else registering finds it (a record released or pruned since) and it is resumed
        # then, so the common Reset makes no extra read.
        look_first = claim.prior is not None or self._provider.manages_instances
        existing = await self._sessions.store.get_session(session_id) if look_first else None
        if existing is None:
            try:
                return await self._start_session(params, deadline, claim, task, env_key, session_id, max_turns)
            except _Registered as registered:
                existing = registered.session
        _check_registered(existing, params, env_key, max_turns)
        return await self._resume_registered(existing, task)

    async def _start_session(
        self,
        params: ResetParams,
        deadline: Deadline,
        claim: Claim,
        task: TaskDef | None,
        env_key: str,
        session_id: str,
        max_turns: int,
    ) -> orchestrator_pb2.ResetResponse:
        """Admit, acquire and reset an instance, list its tools and register the session; `_Registered` (what
        was made released) when a session of this id exists already. Without an intent to bind after it, the
        session is registered with the request's record in one write."""
        tool_filter = self._provider.session_filter(env_key, task)  # modality, allow / deny
        modality = tool_filter["modality"]
        async with self._admission.new_session():
            handle: InstanceHandle | None = None
            intent: Intent | None = None
            claimed = ""
            try:
                client = create_client(params.caller, params.run_id)
                handle, intent, reused = await self._instances.acquire(env_key, task, deadline, client=client)
                claimed = intent.intent_id if intent is not None and reused else ""
                handle, intent = await self._instances.reset(
                    handle, intent, reused, env_key, task, deadline, client=client
                )
                tools = await self._tools.get(
                    env_key, handle.endpoints, tool_filter, per_instance=self._provider.manages_instances
                )
                token = mint_agent_token(session_id)
                now = time.time()
                session = Session(
                    session_id=session_id,
                    env_key=env_key,
                    task_key=task.key if task else "",
                    status=SessionStatus.ACTIVE,
                    run_id=params.run_id,
                    orchestrator_run=self._config.run_id,
                    modality=modality,
                    episode=1,
                    turn=0,
                    max_turns=max_turns,
                    labels=dict(params.labels),
                    provider=self._provider.name,
                    instance_id=handle.instance_id,
                    intent_id=intent.intent_id if intent else "",
                    instance=handle.to_record(),
                    endpoints=list(handle.endpoints),
                    tool_filter=tool_filter,
                    token_hash=token_hash(token),
                    created_at=now,
                    updated_at=now,
                    last_active_at=now,
                    expires_at=now + self._config.session_ttl_s,
                )
                response = self._reset_response(session, task, tools, token)
                try:
                    if intent is None:
                        await claim.commit(response=response, session=session, new_session=True)
                    else:
                        await self._sessions.store.create_session(session)
                except RequestExists:
                    raise  # another attempt of this request_id recorded its answer first: the ledger replays it
                except ConflictError:
                    if (existing := await self._sessions.store.get_session(session_id)) is None:
                        raise  # not the id: the token (see create_session)
                    raise _Registered(existing) from None
                if intent is not None:
                    await self._instances.bind(intent, session_id)
            except BaseException:
                if handle is not None:
                    await self._instances.discard(handle, intent)
                raise
            finally:
                self._instances.settled(claimed)
        log.info("session %s started on %s (%s)", session_id, handle.instance_id or env_key, env_key)
        return response

    # -- what a dead attempt started ----------------------------------------------------------------------
    async def _resume_registered(self, session: Session, task: TaskDef | None) -> orchestrator_pb2.ResetResponse:
        """Finish a Reset whose session exists (its first owner died before answering): fresh token."""
        if not session.is_open or session.episode != 1 or session.status != SessionStatus.ACTIVE or session.turn:
            raise FailedPrecondition(
                f"session {session.session_id} of this request_id has moved on "
                f"({session.status}, episode {session.episode}, turn {session.turn})",
                reason="SESSION_NOT_RESUMABLE",
            )
        return await self._resume_episode(session, task)

    async def _resume_episode(self, session: Session, task: TaskDef | None) -> orchestrator_pb2.ResetResponse:
        """Answer for an episode that a dead attempt started: same episode, a fresh token."""
        session, token = await self.rotate_token(session.session_id, session.episode)
        tools = await self._tools.get(
            session.env_key, session.endpoints, session.tool_filter, per_instance=self._provider.manages_instances
        )
        return self._reset_response(session, task, tools, token)

    async def rotate_token(self, session_id: str, episode: int) -> tuple[Session, str]:
        """A fresh agent token for `episode` while it is the session's running episode. Compare-and-set:
        concurrent rotations serialise and the last one's token is the valid one."""
        token = mint_agent_token(session_id)

        def rotate(s: Session) -> bool:
            if s.status != SessionStatus.ACTIVE or s.episode != episode:
                raise FailedPrecondition(
                    f"session {s.session_id} of this request_id has moved on ({s.status}, episode {s.episode}, "
                    f"turn {s.turn}; the request started episode {episode})",
                    reason="SESSION_NOT_RESUMABLE",
                    metadata={"session_id": s.session_id, "status": s.status, "episode": s.episode},
                )
            revoke_agent_token(s)  # the earlier reply's token: the gateway can say it was replaced
            s.token_hash = token_hash(token)
            s.last_active_at = time.time()
            return True

        session, _ = await self._sessions.mutate(session_id, rotate)
        return session, token

    # -- the next episode of a session --------------------------------------------------------------------
    async def _next_episode(
        self, params: ResetParams, deadline: Deadline, prior: RequestRecord | None = None
    ) -> orchestrator_pb2.ResetResponse:
        session = await self._sessions.get(params.session_id)
        task = self._sessions.task_of(session)
        max_turns = self._effective_max_turns(params.max_turns, task)
        if (
            prior is not None
            and session.status == SessionStatus.ACTIVE
            and session.turn == 0
            and session.episode > 1
            and session.updated_at >= prior.created_at
        ):
            # The dead attempt already started this episode; its token was never delivered: rotate it. Its
            # parameters are unrecorded, so what the episode shows is checked against this request's.
            if session.max_turns != max_turns:
                raise InvalidArgument(
                    "max_turns",
                    f"differs from the first request with request_id "
                    f"{clip(params.request_id)!r} (it started episode "
                    f"{session.episode} with max_turns {session.max_turns})",
                )
            return await self._resume_episode(session, task)

        def begin(s: Session) -> bool:
            if not s.is_open:
                raise FailedPrecondition(f"session {s.session_id} is {s.status}", reason="SESSION_CLOSED")
            if s.status == SessionStatus.PROVISIONING:
                raise FailedPrecondition("a reset of this session is already in progress", reason="RESET_IN_PROGRESS")
            s.status = SessionStatus.PROVISIONING
            revoke_agent_token(s)  # the previous episode's token stops working now
            return True

        session, _ = await self._sessions.mutate(params.session_id, begin)
        handle = (
            InstanceHandle.from_record(session.instance)
            if session.instance
            else InstanceHandle(instance_id=session.instance_id, env_key=session.env_key, endpoints=session.endpoints)
        )
        intent = (
            Intent(
                intent_id=session.intent_id,
                run_id=self._config.run_id,
                env_key=session.env_key,
                instance_id=session.instance_id,
            )
            if session.intent_id
            else None
        )
        try:
            client = create_client(params.caller, session.run_id)
            new_handle, new_intent = await self._instances.reset(
                handle, intent, True, session.env_key, task, deadline, client=client
            )
        except BaseException as exc:
            await asyncio.shield(self._closing.fail(session.session_id, f"reset failed: {exc}"))
            raise
        token = mint_agent_token(session.session_id)

        def start(s: Session) -> bool:
            if s.status != SessionStatus.PROVISIONING:  # closed or reaped while we were resetting
                raise FailedPrecondition(
                    f"session {s.session_id} was {s.status} during the reset", reason="SESSION_CLOSED"
                )
            s.status = SessionStatus.ACTIVE
            s.episode += 1
            s.turn = 0
            s.max_turns = max_turns
            s.done_reason = DoneReason.NONE
            s.reward = None
            s.verification = None
            s.infra_faults = {}
            s.instance_id = new_handle.instance_id
            s.intent_id = new_intent.intent_id if new_intent else ""
            s.instance = new_handle.to_record()
            s.endpoints = list(new_handle.endpoints)
            s.token_hash = token_hash(token)
            s.last_active_at = time.time()
            return True

        try:
            session, _ = await self._sessions.mutate(session.session_id, start)
        except BaseException:
            if new_handle.instance_id != handle.instance_id:  # the replacement belongs to no one now
                await self._instances.discard(new_handle, new_intent)
            raise
        if new_intent is not None and new_handle.instance_id != handle.instance_id:
            await self._instances.bind(new_intent, session.session_id)
        tools = await self._tools.get(
            session.env_key, session.endpoints, session.tool_filter, per_instance=self._provider.manages_instances
        )
        log.info("session %s episode %d started", session.session_id, session.episode)
        return self._reset_response(session, task, tools, token)

    # -- shared -------------------------------------------------------------------------------------------
    def _effective_max_turns(self, requested: int, task: TaskDef | None) -> int:
        if requested < 0:
            raise InvalidArgument("max_turns", "must be >= 0 (0 uses the task's default)")
        return requested or (task.max_turns if task else 0) or self._config.default_max_turns

    def _reset_response(
        self, session: Session, task: TaskDef | None, tools: list[common_pb2.ToolSpec], token: str
    ) -> orchestrator_pb2.ResetResponse:
        prompt = task.prompt if task else ""
        return orchestrator_pb2.ResetResponse(
            session_id=session.session_id,
            episode=session.episode,
            prompt=prompt,
            messages=[common_pb2.ChatMessage(role="user", content=prompt)] if prompt else [],
            tools=tools,
            agent_token=token,
            gateway_address=gateway_for(self._config.gateway_address, session.session_id),
            task=task_info(task, session.env_key, session.max_turns),
            max_turns=session.max_turns,
            modality=session.modality,
            instance=instance_info(session),
        )


def gateway_for(addresses: str, session_id: str) -> str:
    """The toolgateway a session's agent calls: one of the configured addresses (comma-separated: several
    gateway processes), always the same for a session, so its calls share that process's upstream clients."""
    choices = [a.strip() for a in addresses.split(",") if a.strip()]
    if len(choices) < 2:
        return addresses.strip()
    return choices[zlib.crc32(session_id.encode()) % len(choices)]


class _Registered(Exception):
    """Registering a new session found one of its id (registered by an earlier attempt of its request)."""

    def __init__(self, session: Session) -> None:
        super().__init__(session.session_id)
        self.session = session


def _check_registered(session: Session, params: ResetParams, env_key: str, max_turns: int) -> None:
    """A retried Reset found the session a dead attempt of its request_id registered. That attempt's
    parameters are unrecorded (the ledger records them with the response), so the session is checked against
    this request's: another task, env, max_turns, labels or run_id is INVALID_ARGUMENT naming the field."""
    seen = {
        "task_key": (session.task_key, params.task_key),
        "env_key": (session.env_key, env_key),
        "max_turns": (session.max_turns, max_turns),
        "labels": (session.labels, params.labels),
        "run_id": (session.run_id, params.run_id),
    }
    for name, (first, now) in seen.items():
        if first != now:
            raise InvalidArgument(
                name,
                f"differs from the first request with request_id {clip(params.request_id)!r}"
                "; a request_id names one request: use a new one for another request",
            )


def _without_token(response: orchestrator_pb2.ResetResponse) -> orchestrator_pb2.ResetResponse:
    """What Reset's request record keeps: the response minus the agent token (stored only as a hash)."""
    kept = orchestrator_pb2.ResetResponse()
    kept.CopyFrom(response)
    kept.ClearField("agent_token")
    return kept
