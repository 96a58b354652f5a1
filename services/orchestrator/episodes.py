"""Episode lifecycle: Reset, Step, State, Close, CloseSessions, ListSessions as plain async methods.

Everything durable lives in the store (sessions updated by compare-and-set), so any replica can serve any
session and a restarted process resumes where the last one stopped. gRPC stays in the servicer; this
module raises `RlgateError`s and returns wire messages.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from typing import Any

from rlgate.convert import InvalidJsonValue, arguments_of
from rlgate.orchestrator import metrics
from rlgate.orchestrator.config import OrchestratorConfig
from rlgate.orchestrator.pool import PoolEntry, WarmPool
from rlgate.orchestrator.providers.base import EnvNotFound, InstanceHandle, Provider, ResetFailed, TaskDef
from rlgate.orchestrator.provisioning import Provisioner
from rlgate.orchestrator.tasks import TaskCatalog, decode_token, encode_token, validate_page_size
from rlgate.orchestrator.tools import ToolCache
from rlgate.orchestrator.verifier import Verifier
from rlgate.orchestrator.views import (
    SESSION_STATUS,
    instance_info,
    session_info,
    status_filter,
    step_response,
    task_info,
    tool_call_entry,
)
from rlgate.runtime import tracing
from rlgate.runtime.auth import mint_agent_token, revoke_agent_token, token_hash
from rlgate.runtime.deadline import Deadline
from rlgate.runtime.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
    clip,
)
from rlgate.runtime.ledger import Claim, RequestLedger, scope
from rlgate.runtime.logs import session_id_var
from rlgate.store import (
    OPEN_STATUSES,
    ConflictError,
    DoneReason,
    Intent,
    IntentState,
    RequestExists,
    RequestRecord,
    Session,
    SessionStatus,
    SessionStore,
    VerificationStatus,
)
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


def step_params(request: orchestrator_pb2.StepRequest) -> dict[str, Any]:
    """What a Step's request_id is bound to. INVALID_ARGUMENT for tool-call arguments that are not a JSON
    object (the ledger compares them as JSON, whichever form they came in)."""
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
    }


def _count_turn(session: Session, request: orchestrator_pb2.StepRequest) -> None:
    """Apply one Step to an active session: the turn, and the episode's end if this turn ends it."""
    session.turn += 1
    session.last_active_at = time.time()
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


class EpisodeManager:
    def __init__(
        self,
        config: OrchestratorConfig,
        store: SessionStore,
        provider: Provider,
        catalog: TaskCatalog,
        tools: ToolCache,
        verifier: Verifier,
        provisioner: Provisioner,
        pool: WarmPool,
        owner: str,
    ) -> None:
        self.config = config
        self.store = store
        self.provider = provider
        self.catalog = catalog
        self.tools = tools
        self.verifier = verifier
        self.provisioner = provisioner
        self.pool = pool
        self.owner = owner
        self.ledger = RequestLedger(store, owner)
        self._admit = asyncio.Lock()
        self._reserved = 0  # sessions being created by this process (not yet in the store)
        self._no_creations = asyncio.Event()  # set while no new-session Reset is in flight here
        self._no_creations.set()
        self.accepting = True
        self._background: set[asyncio.Task[orchestrator_pb2.StepResponse]] = set()  # episodes being scored

    # -- helpers ----------------------------------------------------------------------------------------
    def task_of(self, session: Session) -> TaskDef | None:
        if not session.task_key:
            return None
        try:
            return self.catalog.get(session.task_key)
        except NotFound:
            return None

    async def _get(self, session_id: str) -> Session:
        if not session_id:
            raise InvalidArgument("session_id", "required")
        session = await self.store.get_session(session_id)
        if session is None:
            raise NotFound(
                f"unknown session {clip(session_id)!r}", reason="SESSION_NOT_FOUND", metadata={"session_id": session_id}
            )
        session_id_var.set(session_id)
        return session

    async def _mutate(
        self,
        session_id: str,
        change: Callable[[Session], bool],
        *,
        start: Session | None = None,
        write: Callable[[Session], Awaitable[Session | None]] | None = None,
    ) -> tuple[Session, bool]:
        """Compare-and-set loop: `change` edits a fresh copy (the first time `start`, when the caller has just
        read or written it) and returns whether to write it; `write` writes it (default `update_session`).
        A lost compare-and-set reads the session again; `RequestExists` (the ledger's) propagates."""
        session = start
        while True:
            if session is None:
                session = await self._get(session_id)
            if not change(session):
                return session, False
            try:
                updated = await (write or self.store.update_session)(session)
            except RequestExists:
                raise
            except ConflictError:
                session = None
                continue
            assert updated is not None
            return updated, True

    def _effective_max_turns(self, requested: int, task: TaskDef | None) -> int:
        if requested < 0:
            raise InvalidArgument("max_turns", "must be >= 0 (0 uses the task's default)")
        return requested or (task.max_turns if task else 0) or self.config.default_max_turns

    async def _admit_session(self) -> None:
        """Max sessions: count open sessions in the store plus this process's creates in flight."""
        if not self.accepting:
            raise Unavailable(
                "the orchestrator is shutting down; retry on another replica", reason="SHUTTING_DOWN", retry_after_s=1.0
            )
        async with self._admit:
            limit = self.config.max_sessions
            if await self.store.count_open_sessions() + self._reserved >= limit:
                raise ResourceExhausted(
                    f"max sessions reached ({limit} open)",
                    subject="sessions",
                    reason="MAX_SESSIONS",
                    metadata={"limit": limit},
                    retry_after_s=5.0,
                )
            self._reserved += 1
            self._no_creations.clear()

    async def wait_creations(self) -> None:
        """Until every admitted new-session Reset of this process has finished (shutdown drains them
        before closing sessions, so none registers a session after the close sweep)."""
        await self._no_creations.wait()

    async def wait_endings(self) -> None:
        """Until every episode ending of this process is scored and recorded (shutdown: an ending whose
        caller went away still finishes here, so a retry anywhere replays it)."""
        while pending := {task for task in self._background if not task.done()}:
            await asyncio.wait(pending)

    async def abandon_endings(self) -> None:
        """Cancel the endings still being scored (shutdown, after the drain). Their request records stay
        PENDING: once this process is declared dead, a retry on another replica takes them over and
        answers with the episode's ending."""
        endings = set(self._background)
        for task in endings:
            task.cancel()
        if endings:
            log.warning("shutdown: %d episode ending(s) not scored yet; handed back to other replicas", len(endings))
            await asyncio.gather(*endings, return_exceptions=True)
        await self.ledger.drain(0)  # records the store would not take are handed back the same way

    # -- Reset ------------------------------------------------------------------------------------------
    async def reset(self, params: ResetParams, deadline: Deadline) -> orchestrator_pb2.ResetResponse:
        """Id lengths and labels are checked before this (`limits.check_request`, by the servicer)."""
        if params.max_turns < 0:
            raise InvalidArgument("max_turns", "must be >= 0 (0 uses the task's default)")
        if params.session_id and (params.task_key or params.env_key):
            raise InvalidArgument("session_id", "mutually exclusive with task_key and env_key")
        if not (params.session_id or params.task_key or params.env_key):
            raise InvalidArgument("task_key", "one of session_id, task_key or env_key is required")
        if params.task_key and not params.session_id:
            self.catalog.get(params.task_key)  # NOT_FOUND before any work

        def work(claim: Claim) -> Awaitable[orchestrator_pb2.ResetResponse]:
            if params.session_id:
                return self._next_episode(params, deadline, claim.prior)
            return self._new_session(params, deadline)

        return await self.ledger.run(
            scope("reset", params.caller),
            params.request_id,
            params.bound(),
            deadline,
            orchestrator_pb2.ResetResponse,
            work,
            redact=_without_token,
            replay=self._replay_reset,
        )

    async def _replay_reset(self, recorded: orchestrator_pb2.ResetResponse) -> orchestrator_pb2.ResetResponse:
        """A repeat of a finished Reset. Its record holds no token (tokens are stored only as hashes), so the
        episode gets a fresh one, which revokes the one handed out before: only the latest reply's holder
        acts. Once the episode is over or superseded: FAILED_PRECONDITION naming the session."""
        _, token = await self._rotate_token(recorded.session_id, recorded.episode)
        answer = orchestrator_pb2.ResetResponse()
        answer.CopyFrom(recorded)
        answer.agent_token = token
        return answer

    async def _rotate_token(self, session_id: str, episode: int) -> tuple[Session, str]:
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

        session, _ = await self._mutate(session_id, rotate)
        return session, token

    async def _acquire(
        self, env_key: str, task: TaskDef | None, deadline: Deadline
    ) -> tuple[InstanceHandle, Intent | None, bool]:
        """An instance for a new session: (handle, intent, reused)."""
        if not self.provider.manages_instances:
            try:
                endpoints = self.provider.endpoints_for(env_key, task)
            except EnvNotFound as exc:
                raise NotFound(str(exc), reason="ENV_NOT_FOUND", metadata={"env_key": env_key}) from exc
            return InstanceHandle(instance_id="", env_key=env_key, endpoints=endpoints), None, False
        entry = await self.pool.take(env_key)
        if entry is not None:
            return entry.handle, entry.intent, True
        env_vars = dict(task.env_variables) if task else {}
        handle, intent = await self.provisioner.create(env_key, deadline, env_variables=env_vars)
        return handle, intent, False

    @tracing.traced("rlgate.instance_reset", env_key="env_key")
    async def _reset_instance(
        self,
        handle: InstanceHandle,
        intent: Intent | None,
        reused: bool,
        env_key: str,
        task: TaskDef | None,
        deadline: Deadline,
    ) -> tuple[InstanceHandle, Intent | None]:
        """Restore seed state. Fresh instance: a failure is logged and the episode goes on. Reused instance:
        fatal — the instance is deleted and replaced by a fresh one, so no episode starts on dirty state."""
        if not self.provider.manages_instances:
            return handle, intent
        start = time.perf_counter()
        try:
            await self.provider.reset(handle, timeout_s=deadline.cap(self.config.reset_timeout_s) or 0.01)
            metrics.RESET_SECONDS.labels("ok").observe(time.perf_counter() - start)
            return handle, intent
        except ResetFailed as exc:
            metrics.RESET_SECONDS.labels("failed").observe(time.perf_counter() - start)
            if not reused:
                log.warning(
                    "reset failed on fresh instance %s (continuing, seed state is fresh): %s", handle.instance_id, exc
                )
                return handle, intent
            log.warning("reset failed on reused instance %s: replacing it: %s", handle.instance_id, exc)
        await asyncio.shield(self.provisioner.release(handle.instance_id, intent.intent_id if intent else ""))
        env_vars = dict(task.env_variables) if task else {}
        fresh, fresh_intent = await self.provisioner.create(env_key, deadline, env_variables=env_vars)
        return await self._reset_instance(fresh, fresh_intent, False, env_key, task, deadline)

    async def _new_session(self, params: ResetParams, deadline: Deadline) -> orchestrator_pb2.ResetResponse:
        task = self.catalog.get(params.task_key) if params.task_key else None
        env_key = task.env_key if task else params.env_key
        session_id = (
            session_id_for_request(params.caller, params.request_id)
            if params.request_id
            else f"s-{uuid.uuid4().hex[:24]}"
        )
        session_id_var.set(session_id)
        max_turns = self._effective_max_turns(params.max_turns, task)
        existing = await self.store.get_session(session_id)
        if existing is not None:  # a retried Reset whose first owner died after registering the session
            _check_registered(existing, params, env_key, max_turns)
            return await self._resume_registered(existing, task)
        tool_filter = self.provider.session_filter(env_key, task)  # modality, allow / deny
        modality = tool_filter["modality"]
        await self._admit_session()
        handle: InstanceHandle | None = None
        intent: Intent | None = None
        claimed = ""
        try:
            handle, intent, reused = await self._acquire(env_key, task, deadline)
            claimed = intent.intent_id if intent is not None and reused else ""
            handle, intent = await self._reset_instance(handle, intent, reused, env_key, task, deadline)
            tools = await self.tools.get(
                env_key, handle.endpoints, tool_filter, per_instance=self.provider.manages_instances
            )
            token = mint_agent_token(session_id)
            now = time.time()
            session = Session(
                session_id=session_id,
                env_key=env_key,
                task_key=task.key if task else "",
                status=SessionStatus.ACTIVE,
                run_id=params.run_id,
                orchestrator_run=self.config.run_id,
                modality=modality,
                episode=1,
                turn=0,
                max_turns=max_turns,
                labels=dict(params.labels),
                provider=self.provider.name,
                instance_id=handle.instance_id,
                intent_id=intent.intent_id if intent else "",
                instance=handle.to_record(),
                endpoints=list(handle.endpoints),
                tool_filter=tool_filter,
                token_hash=token_hash(token),
                created_at=now,
                updated_at=now,
                last_active_at=now,
                expires_at=now + self.config.session_ttl_s,
            )
            session = await self.store.create_session(session)
            if intent is not None:
                await self.provisioner.set_intent(intent.intent_id, IntentState.BOUND, session_id)
        except BaseException:
            if handle is not None:
                await asyncio.shield(self.provisioner.release(handle.instance_id, intent.intent_id if intent else ""))
            raise
        finally:
            self.pool.settled(claimed)
            self._reserved -= 1
            if self._reserved == 0:
                self._no_creations.set()
        log.info("session %s started on %s (%s)", session_id, handle.instance_id or env_key, env_key)
        return self._reset_response(session, task, tools, token)

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
        session, token = await self._rotate_token(session.session_id, session.episode)
        tools = await self.tools.get(
            session.env_key, session.endpoints, session.tool_filter, per_instance=self.provider.manages_instances
        )
        return self._reset_response(session, task, tools, token)

    async def _next_episode(
        self, params: ResetParams, deadline: Deadline, prior: RequestRecord | None = None
    ) -> orchestrator_pb2.ResetResponse:
        session = await self._get(params.session_id)
        task = self.task_of(session)
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

        session, _ = await self._mutate(params.session_id, begin)
        handle = (
            InstanceHandle.from_record(session.instance)
            if session.instance
            else InstanceHandle(instance_id=session.instance_id, env_key=session.env_key, endpoints=session.endpoints)
        )
        intent = (
            Intent(
                intent_id=session.intent_id,
                run_id=self.config.run_id,
                env_key=session.env_key,
                instance_id=session.instance_id,
            )
            if session.intent_id
            else None
        )
        try:
            new_handle, new_intent = await self._reset_instance(handle, intent, True, session.env_key, task, deadline)
        except BaseException as exc:
            await asyncio.shield(self.fail(session.session_id, f"reset failed: {exc}"))
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
            s.instance_id = new_handle.instance_id
            s.intent_id = new_intent.intent_id if new_intent else ""
            s.instance = new_handle.to_record()
            s.endpoints = list(new_handle.endpoints)
            s.token_hash = token_hash(token)
            s.last_active_at = time.time()
            return True

        try:
            session, _ = await self._mutate(session.session_id, start)
        except BaseException:
            if new_handle.instance_id != handle.instance_id:  # the replacement belongs to no one now
                await asyncio.shield(
                    self.provisioner.release(new_handle.instance_id, new_intent.intent_id if new_intent else "")
                )
            raise
        if new_intent is not None and new_handle.instance_id != handle.instance_id:
            # Only now: a BOUND intent is kept by reconciliation only while its session uses the instance.
            await self.provisioner.set_intent(new_intent.intent_id, IntentState.BOUND, session.session_id)
        tools = await self.tools.get(
            session.env_key, session.endpoints, session.tool_filter, per_instance=self.provider.manages_instances
        )
        log.info("session %s episode %d started", session.session_id, session.episode)
        return self._reset_response(session, task, tools, token)

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

    def _reset_response(
        self, session: Session, task: TaskDef | None, tools: list[common_pb2.ToolSpec], token: str
    ) -> orchestrator_pb2.ResetResponse:
        prompt = task.prompt if task else ""
        response = orchestrator_pb2.ResetResponse(
            session_id=session.session_id,
            episode=session.episode,
            prompt=prompt,
            messages=[common_pb2.ChatMessage(role="user", content=prompt)] if prompt else [],
            tools=tools,
            agent_token=token,
            gateway_address=self.config.gateway_address,
            task=task_info(task, session.env_key, session.max_turns),
            max_turns=session.max_turns,
            modality=session.modality,
            instance=instance_info(session),
        )
        return response

    # -- Step -------------------------------------------------------------------------------------------
    async def step(
        self, request: orchestrator_pb2.StepRequest, deadline: Deadline, caller: str = ""
    ) -> orchestrator_pb2.StepResponse:
        """One turn. With a request_id (the ledger, lazily claimed): an ordinary turn is one read and one
        write that counts the turn and records its response together, only if the request_id is new; a turn
        that ends the episode claims the request_id before its write, since it is scored after it (a repeat
        waits for the verifier's outcome instead of replaying a turn without it)."""
        if not request.session_id:
            raise InvalidArgument("session_id", "required")
        params = step_params(request)
        session_id_var.set(request.session_id)
        return await self.ledger.run(
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
        if claim.prior is not None:
            current = await self._get(request.session_id)
            if current.status == SessionStatus.DONE and current.updated_at >= claim.prior.created_at:
                # The dead attempt ended the episode (or was ending it): answer with that ending and
                # finish its verification if it never ran, instead of FAILED_PRECONDITION.
                log.warning(
                    "step %s taken over after its owner died: returning the episode's ending", clip(request.request_id)
                )
                if current.verification is None:
                    current = await self._score(current, final_answer)
                return step_response(current)

        def count(s: Session) -> bool:
            if s.status == SessionStatus.DONE:
                raise FailedPrecondition(
                    "the episode is already done; Reset with session_id starts the next", reason="EPISODE_DONE"
                )
            if s.status != SessionStatus.ACTIVE:
                raise FailedPrecondition(f"session {s.session_id} is {s.status}", reason="SESSION_NOT_ACTIVE")
            _count_turn(s, request)
            return True

        async def write(s: Session) -> Session | None:
            if s.status == SessionStatus.DONE:
                await claim.hold()  # scored after this write: repeats wait for the outcome
                written = asyncio.ensure_future(self.store.update_session(s))
                try:
                    return await asyncio.shield(written)
                except asyncio.CancelledError:
                    # The caller went away (or a drain cut the call) mid-write: the write lands or fails
                    # regardless, and the record follows it in the background (scored, or released).
                    claim.keep()
                    self._spawn_ending(self._end_after(written, final_answer, claim))
                    raise
            return await claim.commit(session=s, response=step_response(s))

        session, _ = await self._mutate(request.session_id, count, write=write)
        self._log_turn(session, request)
        if session.status != SessionStatus.DONE:
            return step_response(session)
        # The episode has ended: its verification and the request's record finish even if this caller goes
        # away now (a retry then gets the outcome instead of FAILED_PRECONDITION on an unscored episode).
        claim.keep()
        return await asyncio.shield(self._spawn_ending(self._end_episode(session, final_answer, claim)))

    def _spawn_ending(
        self, ending: Coroutine[Any, Any, orchestrator_pb2.StepResponse]
    ) -> asyncio.Task[orchestrator_pb2.StepResponse]:
        """Run an episode's ending in a task of its own (its caller may go away; shutdown waits for it)."""
        task = asyncio.create_task(ending)
        self._background.add(task)
        task.add_done_callback(self._ended)
        return task

    async def _end_after(
        self, written: asyncio.Future[Session], final_answer: str | None, claim: Claim
    ) -> orchestrator_pb2.StepResponse:
        """The ending of a turn whose caller left during its write: scored if the write landed."""
        try:
            session = await written
        except asyncio.CancelledError:
            raise  # shutdown: the record is handed back PENDING (see `_end_episode`)
        except BaseException:
            await asyncio.shield(self.store.release_request(claim.scope, claim.request_id))  # nothing written
            raise
        return await self._end_episode(session, final_answer, claim)

    def _ended(self, task: asyncio.Task[orchestrator_pb2.StepResponse]) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:  # retrieved here: its caller may be gone
            log.warning("scoring the episode failed: %s", task.exception())

    async def _end_episode(
        self, session: Session, final_answer: str | None, claim: Claim
    ) -> orchestrator_pb2.StepResponse:
        """Score the episode this turn ended and record the request's response (the claim is held)."""
        try:
            response = step_response(await self._score(session, final_answer))
        except asyncio.CancelledError:
            # Shutdown: the record stays PENDING, handed back with this process (`Orchestrator.stop`). A
            # released record would make a retry elsewhere find the episode done with no record of its
            # ending (FAILED_PRECONDITION); a PENDING one of a dead owner is taken over and scored there.
            raise
        except BaseException:
            if claim.request_id:  # not scored: a retry runs again rather than waiting on a live owner
                await asyncio.shield(self.store.release_request(claim.scope, claim.request_id))
            raise
        if claim.request_id:
            # A write the store refuses raises, and the ledger keeps the scored ending: repeats here get it
            # and it is written again in the background (never released: that would lose the ending).
            await claim.commit(response=response)
        return response

    @staticmethod
    def _log_turn(session: Session, request: orchestrator_pb2.StepRequest) -> None:
        if log.isEnabledFor(logging.INFO):
            log.info(
                "turn %d: %d tool call(s)%s%s",
                session.turn,
                len(request.tool_calls),
                ", final answer" if request.HasField("final_answer") else "",
                f", done ({session.done_reason})" if session.done_reason != DoneReason.NONE else "",
            )

    async def _score(self, session: Session, final_answer: str | None) -> Session:
        """Run the verifier for the episode that just ended and record its outcome."""
        task = self.task_of(session)
        handle = (
            InstanceHandle.from_record(session.instance)
            if session.instance
            else InstanceHandle(instance_id=session.instance_id, env_key=session.env_key)
        )
        calls = None
        if task is not None and self.provider.wants_tool_calls(task):
            calls = await self.store.list_tool_calls(session.session_id, session.episode)
        extra = {} if calls is None else {"tool_calls": calls}
        outcome = await self.verifier.run(task, handle, final_answer, **extra)
        episode = session.episode

        def record(s: Session) -> bool:
            if s.episode != episode or s.verification is not None:
                return False
            s.verification = outcome.verification()
            s.reward = outcome.score if outcome.status == VerificationStatus.OK else None
            return True

        updated, _ = await self._mutate(session.session_id, record, start=session)
        return updated

    # -- State ------------------------------------------------------------------------------------------
    async def state(self, session_id: str, include_tool_calls: bool) -> orchestrator_pb2.StateResponse:
        session = await self._get(session_id)
        entries = await self.store.list_tool_calls(session_id, session.episode)
        response = orchestrator_pb2.StateResponse(session=session_info(session, self.task_of(session), len(entries)))
        if include_tool_calls:
            response.tool_calls.extend(tool_call_entry(e) for e in entries)
        return response

    # -- Close ------------------------------------------------------------------------------------------
    async def close(self, session_id: str) -> orchestrator_pb2.CloseResponse:
        session, closed = await self._finish(session_id, SessionStatus.CLOSED, "closed by the caller")
        return orchestrator_pb2.CloseResponse(already_closed=not closed, status=SESSION_STATUS[session.status])

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
            s.status = status
            revoke_agent_token(s)
            s.closed_at = time.time()
            return True

        session, changed = await self._mutate(session_id, end)
        if changed:
            log.info("session %s %s (%s)", session_id, status, reason)
            await asyncio.shield(
                self._release_instance(
                    session,
                    pool_ok=status == SessionStatus.CLOSED and previous.get("status") != SessionStatus.PROVISIONING,
                )
            )
        return session, changed

    async def _release_instance(self, session: Session, *, pool_ok: bool) -> None:
        if not session.instance_id:
            return
        handle = InstanceHandle.from_record(session.instance)
        if pool_ok and self.config.pool_on_close and session.env_key in self.pool.targets:
            intent = Intent(
                intent_id=session.intent_id,
                run_id=self.config.run_id,
                env_key=session.env_key,
                instance_id=session.instance_id,
            )
            self.pool.claim(intent.intent_id)
            try:
                await self.provisioner.set_intent(intent.intent_id, IntentState.POOLED)
                await self.provider.reset(handle, timeout_s=self.config.reset_timeout_s)
                if await self.pool.put_back(PoolEntry(handle, intent)):
                    log.info("instance %s returned to the %s pool", handle.instance_id, session.env_key)
                    return
            except ResetFailed as exc:
                log.info("instance %s not pooled: %s", handle.instance_id, exc)
            finally:
                self.pool.settled(intent.intent_id)
        await self.provisioner.release(session.instance_id, session.intent_id)

    async def expire(self, session_id: str, reason: str, only_if: Callable[[Session], bool] | None = None) -> bool:
        try:
            _, changed = await self._finish(session_id, SessionStatus.EXPIRED, reason, only_if=only_if)
        except NotFound:
            return False
        return changed

    async def close_sessions(self, labels: Mapping[str, str], run_id: str) -> list[str]:
        if not labels and not run_id:
            raise InvalidArgument("labels", "at least one filter (labels or run_id) is required")
        targets = await self.open_sessions(labels=labels, run_id=run_id)
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

    async def open_sessions(
        self, *, labels: Mapping[str, str] | None = None, run_id: str = "", orchestrator_run: str = ""
    ) -> list[Session]:
        """Every open session matching the filters (all pages)."""
        out: list[Session] = []
        cursor = ""
        while True:
            page, cursor = await self.store.list_sessions(
                statuses=OPEN_STATUSES, labels=labels, run_id=run_id, limit=500, cursor=cursor
            )
            out.extend(s for s in page if not orchestrator_run or s.orchestrator_run == orchestrator_run)
            if not cursor:
                return out

    # -- ListSessions -----------------------------------------------------------------------------------
    async def list_sessions(
        self, request: orchestrator_pb2.ListSessionsRequest
    ) -> orchestrator_pb2.ListSessionsResponse:
        size = validate_page_size(request.page_size)
        status = status_filter(request.status)
        statuses = None if status is None else frozenset({status})
        scope = f"sessions:{request.status}:{sorted(request.labels.items())}:{request.run_id}"
        cursor = decode_token(request.page_token, scope=scope) if request.page_token else ""
        page, next_cursor = await self.store.list_sessions(
            statuses=statuses, labels=dict(request.labels), run_id=request.run_id, limit=size, cursor=cursor
        )
        return orchestrator_pb2.ListSessionsResponse(
            sessions=[session_info(s, self.task_of(s)) for s in page],
            next_page_token=encode_token(next_cursor, scope=scope) if next_cursor else "",
        )

    # -- ListTasks --------------------------------------------------------------------------------------
    def list_tasks(self, request: orchestrator_pb2.ListTasksRequest) -> orchestrator_pb2.ListTasksResponse:
        tasks, next_token, total = self.catalog.page(request.env_key, request.page_size, request.page_token)
        return orchestrator_pb2.ListTasksResponse(
            tasks=[
                task_info(
                    t,
                    default_max_turns=self.config.default_max_turns,
                    reference_solution=request.include_reference_solution,
                )
                for t in tasks
            ],
            next_page_token=next_token,
            total=total,
        )


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


__all__ = ["EpisodeManager", "ResetParams", "session_id_for_request"]
