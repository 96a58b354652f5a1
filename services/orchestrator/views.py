"""Store records -> wire messages (SessionInfo, TaskInfo, Verification, ...)."""

from __future__ import annotations

from google.protobuf import timestamp_pb2

from rlgate.core.convert import json_text
from rlgate.core.errors import InvalidArgument
from rlgate.orchestrator.providers.base import TaskDef
from rlgate.store import (
    INFRA_FAULT_KINDS,
    DoneReason,
    Session,
    SessionStatus,
    ToolCallEntry,
    Verification,
    VerificationStatus,
)
from rlgate.v1 import common_pb2, orchestrator_pb2

# The domain's enums on the wire: one explicit table per enum (a member missing from one is a KeyError in the
# tests, not a label that happens to build).
SESSION_STATUS: dict[SessionStatus, common_pb2.SessionStatus] = {
    SessionStatus.PROVISIONING: common_pb2.SESSION_STATUS_PROVISIONING,
    SessionStatus.ACTIVE: common_pb2.SESSION_STATUS_ACTIVE,
    SessionStatus.DONE: common_pb2.SESSION_STATUS_DONE,
    SessionStatus.CLOSED: common_pb2.SESSION_STATUS_CLOSED,
    SessionStatus.EXPIRED: common_pb2.SESSION_STATUS_EXPIRED,
    SessionStatus.FAILED: common_pb2.SESSION_STATUS_FAILED,
}
SESSION_STATUS_OF_WIRE: dict[int, SessionStatus] = {wire: status for status, wire in SESSION_STATUS.items()}
DONE_REASON: dict[DoneReason, orchestrator_pb2.DoneReason] = {
    DoneReason.NONE: orchestrator_pb2.DONE_REASON_UNSPECIFIED,
    DoneReason.FINAL_ANSWER: orchestrator_pb2.DONE_REASON_FINAL_ANSWER,
    DoneReason.AGENT_DONE: orchestrator_pb2.DONE_REASON_AGENT_DONE,
    DoneReason.MAX_TURNS: orchestrator_pb2.DONE_REASON_MAX_TURNS,
}
VERIFICATION_STATUS: dict[VerificationStatus, common_pb2.VerificationStatus] = {
    VerificationStatus.OK: common_pb2.VERIFICATION_STATUS_OK,
    VerificationStatus.ERROR: common_pb2.VERIFICATION_STATUS_ERROR,
    VerificationStatus.TIMEOUT: common_pb2.VERIFICATION_STATUS_TIMEOUT,
    VerificationStatus.SKIPPED: common_pb2.VERIFICATION_STATUS_SKIPPED,
}


def status_filter(value: int, field: str = "status") -> SessionStatus | None:
    """A request's SessionStatus filter; None for SESSION_STATUS_UNSPECIFIED (no filter). proto3 enums are
    open (any int32 arrives), so a number this build does not know is the caller's mistake: INVALID_ARGUMENT
    naming the field."""
    if value == common_pb2.SESSION_STATUS_UNSPECIFIED:
        return None
    status = SESSION_STATUS_OF_WIRE.get(value)
    if status is None:
        raise InvalidArgument(field, f"unknown SessionStatus value {value}")
    return status


def verification(outcome: Verification | None) -> common_pb2.Verification:
    """An episode's scoring on the wire: the empty message (VERIFICATION_STATUS_UNSPECIFIED) until it is
    scored."""
    if outcome is None:
        return common_pb2.Verification()
    return common_pb2.Verification(
        status=VERIFICATION_STATUS[outcome.status],
        message=outcome.message,
        stdout=outcome.stdout,
        attempts=outcome.attempts,
        elapsed_ms=outcome.elapsed_ms,
    )


def timestamp(seconds: float) -> timestamp_pb2.Timestamp:
    ts = timestamp_pb2.Timestamp()
    if seconds:
        ts.FromNanoseconds(int(seconds * 1e9))
    return ts


REFERENCE_SOLUTION = "reference_solution"  # the metadata key of a task's answer key (Fleet's task JSON)


def task_info(
    task: TaskDef | None, env_key: str = "", default_max_turns: int = 0, *, reference_solution: bool = False
) -> common_pb2.TaskInfo:
    """A task on the wire: its metadata as JSON text without the reference solution, which only
    `reference_solution=True` (ListTasks asked for it) puts in `reference_solution_json`."""
    if task is None:
        env_id, _, version = env_key.partition(":")
        return common_pb2.TaskInfo(env_id=env_id, version=version, max_turns=default_max_turns)
    metadata = {k: v for k, v in task.metadata.items() if k != REFERENCE_SOLUTION}
    info = common_pb2.TaskInfo(
        key=task.key,
        env_id=task.env_id,
        version=task.version,
        prompt=task.prompt,
        modality=task.modality,
        max_turns=task.max_turns or default_max_turns,
        metadata_json=json_text(metadata),
    )
    if reference_solution and REFERENCE_SOLUTION in task.metadata:
        info.reference_solution_json = json_text(task.metadata[REFERENCE_SOLUTION])
    return info


def instance_info(session: Session) -> orchestrator_pb2.InstanceInfo:
    return orchestrator_pb2.InstanceInfo(
        provider=session.provider,
        instance_id=session.instance_id,
        env_key=session.env_key,
        root_url=str(session.instance.get("root_url", "")),
        mcp_endpoints=list(session.endpoints),
    )


def infra_faults(session: Session) -> common_pb2.InfraFaults:
    """The episode's infrastructure faults on the wire, with their total."""
    counts = {kind: session.infra_faults.get(kind, 0) for kind in INFRA_FAULT_KINDS}
    return common_pb2.InfraFaults(total=sum(counts.values()), **counts)


def session_info(session: Session, task: TaskDef | None, tool_calls: int = 0) -> orchestrator_pb2.SessionInfo:
    info = orchestrator_pb2.SessionInfo(
        session_id=session.session_id,
        status=SESSION_STATUS[session.status],
        task=task_info(task, session.env_key),
        episode=session.episode,
        turn=session.turn,
        max_turns=session.max_turns,
        done_reason=DONE_REASON[session.done_reason],
        verification=verification(session.verification),
        labels=session.labels,
        run_id=session.run_id,
        instance=instance_info(session),
        created_at=timestamp(session.created_at),
        updated_at=timestamp(session.updated_at),
        expires_at=timestamp(session.expires_at),
        tool_call_count=tool_calls,
        parent_session_id=session.parent_session_id,
        branch_index=session.branch_index,
        infra_faults=infra_faults(session),
    )
    if session.reward is not None:
        info.reward = session.reward
    return info


def tool_call_entry(entry: ToolCallEntry) -> orchestrator_pb2.ToolCallLogEntry:
    kind = f"TOOL_ERROR_KIND_{entry.error_kind}" if entry.error_kind else "TOOL_ERROR_KIND_UNSPECIFIED"
    return orchestrator_pb2.ToolCallLogEntry(
        episode=entry.episode,
        request_id=entry.request_id,
        tool=entry.tool,
        is_error=entry.is_error,
        error_kind=kind if kind in common_pb2.ToolErrorKind.keys() else "TOOL_ERROR_KIND_UNSPECIFIED",  # noqa: SIM118
        result_summary=entry.result_summary,
        endpoint=entry.endpoint,
        duration_ms=entry.duration_ms,
        finished_at=timestamp(entry.finished_at),
        arguments_json=json_text(entry.arguments),
        infra_fault=entry.infra_fault,
    )


def step_response(session: Session) -> orchestrator_pb2.StepResponse:
    response = orchestrator_pb2.StepResponse(
        turn=session.turn,
        done=session.done_reason != DoneReason.NONE,  # CLOSED with it too, by close_when_done
        truncated=session.done_reason == DoneReason.MAX_TURNS,
        done_reason=DONE_REASON[session.done_reason],
        verification=verification(session.verification),
        status=SESSION_STATUS[session.status],
        infra_faults=infra_faults(session),
    )
    if session.reward is not None:
        response.reward = session.reward
    return response
