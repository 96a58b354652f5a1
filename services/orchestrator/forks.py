"""Fork: branch a live episode into `count` new sessions whose instances hold the source's state.

Two mechanisms, chosen per instance: SNAPSHOT where the provider can snapshot the source's instance (one
snapshot, then every branch's instance created from it), else REPLAY (fresh instances, warm pools used, reset
and the source's logged calls re-run: `replay`). Either way the branches are then registered as sessions
copying the source's task, episode, turn, turn limit, labels, run and tool-call log, each with a fresh agent
token and its parent and branch index.

Nothing leaks: every instance is created through the provisioner (its intent written first, so a process
killed mid-fork leaves intents that reconciliation resolves by deleting their instances), and a Fork that
fails part-way discards the instances it made and closes the branches it registered. Branches are registered
PROVISIONING and made ACTIVE together once all are registered, so a process killed meanwhile leaves branches
that reconciliation fails (releasing their instances) rather than part of a group in use. The request ledger
makes a retried Fork return the same branches (fresh tokens), as for Reset.

Tool calls in flight are not waited for: a call of the source in flight when Fork starts, or when the
branches are ready, or one that finished meanwhile (the log grew), or a turn taken meanwhile, makes the Fork
refuse (FAILED_PRECONDITION), undoing everything it made. "In flight" is a PENDING ledger record in the
session's call scope, which every CallTool holds from its claim until its result is recorded.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any, TypeVar

from rlgate.core.errors import FailedPrecondition, InvalidArgument, RlgateError, Unavailable, clip
from rlgate.ledger import Claim, RequestLedger, scope
from rlgate.orchestrator.admission import Admission
from rlgate.orchestrator.closing import Closing
from rlgate.orchestrator.config import OrchestratorConfig
from rlgate.orchestrator.creates import create_client
from rlgate.orchestrator.instances import Instances
from rlgate.orchestrator.providers.base import InstanceHandle, Provider, SnapshotUnsupported, TaskDef
from rlgate.orchestrator.replay import ReplayMismatch, replay_calls
from rlgate.orchestrator.resets import Resets, gateway_for
from rlgate.orchestrator.sessions import Sessions
from rlgate.orchestrator.tools import ToolCache
from rlgate.orchestrator.views import instance_info
from rlgate.runtime.auth import mint_agent_token, token_hash
from rlgate.runtime.deadline import Deadline
from rlgate.store import Intent, Session, SessionStatus, ToolCallEntry, call_scope
from rlgate.v1 import orchestrator_pb2

log = logging.getLogger(__name__)
T = TypeVar("T")

PARENT_LABEL = "rlgate.parent_session"
BRANCH_LABEL = "rlgate.branch"

SNAPSHOT = orchestrator_pb2.FORK_MECHANISM_SNAPSHOT
REPLAY = orchestrator_pb2.FORK_MECHANISM_REPLAY
_MECHANISMS = {orchestrator_pb2.FORK_MECHANISM_UNSPECIFIED, SNAPSHOT, REPLAY}


@dataclass
class ForkParams:
    request_id: str = ""
    session_id: str = ""
    count: int = 0
    mechanism: int = orchestrator_pb2.FORK_MECHANISM_UNSPECIFIED
    caller: str = ""  # the API key's hash ("" without keys): request ids are the caller's own

    def bound(self) -> dict[str, Any]:
        """What the request_id is bound to (the ledger's parameters)."""
        return {"session_id": self.session_id, "count": self.count, "mechanism": self.mechanism}


@dataclass
class _Made:
    """One branch's instance, before and after its session is registered."""

    index: int
    handle: InstanceHandle
    intent: Intent | None
    claimed: str = ""  # a warm-pool intent held until settled
    session_id: str = ""  # set once registered


class Forks:
    def __init__(
        self,
        config: OrchestratorConfig,
        sessions: Sessions,
        admission: Admission,
        instances: Instances,
        closing: Closing,
        provider: Provider,
        tools: ToolCache,
        ledger: RequestLedger,
        resets: Resets,
    ) -> None:
        self._config = config
        self._sessions = sessions
        self._admission = admission
        self._instances = instances
        self._closing = closing
        self._provider = provider
        self._tools = tools
        self._ledger = ledger
        self._resets = resets

    async def fork(self, params: ForkParams, deadline: Deadline) -> orchestrator_pb2.ForkResponse:
        if not params.session_id:
            raise InvalidArgument("session_id", "required")
        limit = self._config.max_fork_branches
        if not 1 <= params.count <= limit:
            raise InvalidArgument("count", f"must be 1..{limit} (got {params.count})")
        if params.mechanism not in _MECHANISMS:
            raise InvalidArgument("mechanism", f"unknown ForkMechanism value {params.mechanism}")
        if not self._provider.manages_instances:
            raise FailedPrecondition(
                f"the {self._provider.name} provider cannot fork: its sessions share their environment's endpoints, "
                "so there is no instance of the episode's own to copy",
                reason="FORK_UNSUPPORTED",
            )

        def work(claim: Claim) -> Awaitable[orchestrator_pb2.ForkResponse]:
            return self._fork(params, deadline)

        return await self._ledger.run(
            scope("fork", params.caller),
            params.request_id,
            params.bound(),
            deadline,
            orchestrator_pb2.ForkResponse,
            work,
            redact=_without_tokens,
            replay=self._replay,
        )

    async def _replay(self, recorded: orchestrator_pb2.ForkResponse) -> orchestrator_pb2.ForkResponse:
        """A repeat of a finished Fork: the same branches, each with a fresh token (the earlier revoked)."""
        answer = orchestrator_pb2.ForkResponse()
        answer.CopyFrom(recorded)
        for branch in answer.branches:
            _, branch.agent_token = await self._resets.rotate_token(branch.session_id, branch.episode)
        return answer

    # -- the fork -----------------------------------------------------------------------------------------
    async def _fork(self, params: ForkParams, deadline: Deadline) -> orchestrator_pb2.ForkResponse:
        source = await self._sessions.get(params.session_id)
        _check_forkable(source)
        task = self._sessions.task_of(source)
        handle = InstanceHandle.from_record(source.instance)
        await self._check_idle(source)
        calls = await self._sessions.store.list_tool_calls(source.session_id, source.episode)
        made: list[_Made] = []
        async with contextlib.AsyncExitStack() as places:
            for _ in range(params.count):
                await places.enter_async_context(self._admission.new_session())
            try:
                mechanism = await self._make(params, source, task, handle, calls, deadline, made)
                await self._check_unchanged(source, len(calls))
                made.sort(key=lambda m: m.index)
                # Registered PROVISIONING, then all made ACTIVE: a process killed in between leaves branches
                # that reconciliation fails (and whose instances it releases), never a half-made group in use.
                branches = await _all([self._register(source, m, calls) for m in made])
                await _all([self._activate(m.session_id) for m in made])
            except BaseException:
                await asyncio.shield(self._undo(made))
                raise
            finally:
                for m in made:
                    self._instances.settled(m.claimed)
        log.info(
            "session %s forked at turn %d into %d branch(es) by %s",
            source.session_id,
            source.turn,
            len(branches),
            orchestrator_pb2.ForkMechanism.Name(mechanism),
        )
        return orchestrator_pb2.ForkResponse(
            parent_session_id=source.session_id, turn=source.turn, mechanism=mechanism, branches=branches
        )

    async def _make(
        self,
        params: ForkParams,
        source: Session,
        task: TaskDef | None,
        handle: InstanceHandle,
        calls: list[ToolCallEntry],
        deadline: Deadline,
        made: list[_Made],
    ) -> orchestrator_pb2.ForkMechanism:
        """Every branch's instance, appended to `made` as soon as it exists; returns the mechanism used."""
        why = self._provider.snapshot_unsupported(handle)
        if params.mechanism == SNAPSHOT and why:
            raise FailedPrecondition(f"cannot fork by snapshot: {why}", reason="FORK_UNSUPPORTED")
        env_vars = dict(task.env_variables) if task else {}
        client = create_client(params.caller, source.run_id)
        if params.mechanism != REPLAY and not why:
            try:
                snapshot_id = await self._provider.snapshot(
                    handle, timeout_s=deadline.cap(self._config.provider_timeout_s) or 0.01
                )
            except SnapshotUnsupported as exc:
                if params.mechanism == SNAPSHOT:
                    raise FailedPrecondition(f"cannot fork by snapshot: {exc}", reason="FORK_UNSUPPORTED") from exc
                log.info("no snapshot of %s (replaying instead): %s", handle.instance_id, exc)
            except RlgateError:
                raise
            except Exception as exc:
                raise Unavailable(
                    f"snapshot of instance {handle.instance_id} failed: {clip(str(exc))}",
                    reason="SNAPSHOT_FAILED",
                    retry_after_s=2.0,
                ) from exc
            else:

                async def from_snapshot(index: int) -> None:
                    fresh, intent = await self._instances.provisioner.create(
                        source.env_key,
                        deadline,
                        env_variables=env_vars,
                        snapshot_id=snapshot_id,
                        modality=source.modality,
                        client=client,
                    )
                    made.append(_Made(index, fresh, intent))

                await _all([from_snapshot(i) for i in range(params.count)])
                return SNAPSHOT

        async def replayed(index: int) -> None:
            fresh, intent, reused = await self._instances.acquire(source.env_key, task, deadline, client=client)
            entry = _Made(index, fresh, intent, claimed=intent.intent_id if intent is not None and reused else "")
            made.append(entry)
            entry.handle, entry.intent = await self._instances.reset(
                fresh, intent, reused, source.env_key, task, deadline, client=client
            )
            try:
                async with asyncio.timeout(deadline.remaining()):
                    await replay_calls(
                        calls,
                        source.endpoints,
                        entry.handle.endpoints,
                        timeout_s=deadline.cap(self._config.tools_timeout_s) or 0.01,
                    )
            except ReplayMismatch as exc:
                raise FailedPrecondition(
                    f"branch {index}: {exc}",
                    reason="REPLAY_MISMATCH",
                    metadata={"position": exc.position, "request_id": exc.entry.request_id, "tool": exc.entry.tool},
                ) from exc

        await _all([replayed(i) for i in range(params.count)])
        return REPLAY

    async def _check_idle(self, source: Session) -> None:
        """No tool call of the source is in flight: none holds a PENDING ledger record (every CallTool has one,
        the gateway minting a request_id for a call sent without). A call whose gateway died mid-call holds
        its record until a retry settles it; it counts as in flight too, since its effect on the instance is
        unknown and REPLAY could not reproduce it."""
        pending = await self._sessions.store.pending_requests(call_scope(source.session_id), 1)
        if pending:
            raise FailedPrecondition(
                f"tool call {clip(pending[0].request_id)!r} of session {source.session_id} is in flight (or its "
                "gateway died mid-call and no retry has settled it); fork between turns, when none is in flight",
                reason="TOOL_CALL_IN_FLIGHT",
                metadata={"request_id": pending[0].request_id},
            )

    async def _check_unchanged(self, source: Session, logged: int) -> None:
        """The fork point still holds: no call of the source started or finished and no turn was taken
        meanwhile."""
        now = await self._sessions.get(source.session_id)
        if (now.episode, now.turn, now.status) != (source.episode, source.turn, source.status):
            raise FailedPrecondition(
                f"session {source.session_id} moved on during the fork (episode {now.episode}, turn {now.turn}, "
                f"{now.status}); fork between turns",
                reason="SESSION_NOT_FORKABLE",
            )
        if await self._sessions.store.count_tool_calls(source.session_id, source.episode) != logged:
            raise FailedPrecondition(
                f"a tool call of session {source.session_id} finished during the fork; fork between turns, "
                "when none is in flight",
                reason="TOOL_CALL_IN_FLIGHT",
            )
        await self._check_idle(source)

    async def _register(self, source: Session, m: _Made, calls: list[ToolCallEntry]) -> orchestrator_pb2.ForkBranch:
        """The branch's session (PROVISIONING until `_activate`): the source's episode on the branch's
        instance, with a fresh token."""
        session_id = f"s-{uuid.uuid4().hex[:24]}"
        token = mint_agent_token(session_id)
        now = time.time()
        branch = source.copy(
            session_id=session_id,
            status=SessionStatus.PROVISIONING,
            labels={**source.labels, PARENT_LABEL: source.session_id, BRANCH_LABEL: str(m.index)},
            orchestrator_run=self._config.run_id,
            instance_id=m.handle.instance_id,
            intent_id=m.intent.intent_id if m.intent else "",
            instance=m.handle.to_record(),
            endpoints=list(m.handle.endpoints),
            token_hash=token_hash(token),
            revoked_tokens={},
            created_at=now,
            updated_at=now,
            last_active_at=now,
            expires_at=now + self._config.session_ttl_s,
            closed_at=0.0,
            parent_session_id=source.session_id,
            branch_index=m.index,
            version=0,
        )
        branch = await self._sessions.store.create_session(branch)
        m.session_id = session_id
        for call in calls:
            await self._sessions.store.append_tool_call(call.copy(session_id=session_id))
        if m.intent is not None:
            await self._instances.bind(m.intent, session_id)
        tools = await self._tools.get(
            branch.env_key, branch.endpoints, branch.tool_filter, per_instance=self._provider.manages_instances
        )
        return orchestrator_pb2.ForkBranch(
            branch_index=m.index,
            session_id=session_id,
            episode=branch.episode,
            turn=branch.turn,
            max_turns=branch.max_turns,
            tools=tools,
            agent_token=token,
            gateway_address=gateway_for(self._config.gateway_address, session_id),
            instance=instance_info(branch),
        )

    async def _activate(self, session_id: str) -> None:
        def start(s: Session) -> bool:
            if s.status != SessionStatus.PROVISIONING:  # closed or failed while the fork ran
                raise FailedPrecondition(f"branch {s.session_id} was {s.status} during the fork", reason="BRANCH_LOST")
            s.status = SessionStatus.ACTIVE
            return True

        await self._sessions.mutate(session_id, start)

    async def _undo(self, made: list[_Made]) -> None:
        """A failed Fork: close the branches it registered, delete the instances it made."""
        for m in made:
            try:
                if m.session_id:
                    await self._closing.close(m.session_id)
                else:
                    await self._instances.discard(m.handle, m.intent)
            except Exception:
                log.exception("undoing branch %d of a failed fork (reconciliation will retry)", m.index)


def _check_forkable(source: Session) -> None:
    if source.status != SessionStatus.ACTIVE:
        what = "done" if source.status == SessionStatus.DONE else str(source.status)
        raise FailedPrecondition(
            f"session {source.session_id} is {what}: only a running episode can be forked",
            reason="SESSION_NOT_FORKABLE",
            metadata={"session_id": source.session_id, "status": str(source.status)},
        )
    if not source.instance_id:
        raise FailedPrecondition(
            f"session {source.session_id} has no instance of its own to fork", reason="FORK_UNSUPPORTED"
        )


async def _all(steps: list[Awaitable[T]]) -> list[T]:
    """Run every step; once all have ended, raise the first failure (each step records what it made, so the
    caller can undo it; none is left running), else their results in order."""
    results = await asyncio.gather(*steps, return_exceptions=True)
    out: list[T] = []
    for result in results:
        if isinstance(result, BaseException):
            raise result
        out.append(result)
    return out


def _without_tokens(response: orchestrator_pb2.ForkResponse) -> orchestrator_pb2.ForkResponse:
    """What the Fork's request record keeps: the branches minus their agent tokens (stored only as hashes)."""
    kept = orchestrator_pb2.ForkResponse()
    kept.CopyFrom(response)
    for branch in kept.branches:
        branch.ClearField("agent_token")
    return kept


__all__ = ["BRANCH_LABEL", "PARENT_LABEL", "ForkParams", "Forks"]
