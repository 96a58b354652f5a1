"""Store records -> wire messages (SessionInfo, TaskInfo, Verification, ...)."""

from __future__ import annotations

from typing import Any

from google.protobuf import timestamp_pb2
from google.protobuf.internal.enum_type_wrapper import EnumTypeWrapper

from rlgate.convert import json_text
from rlgate.orchestrator.providers.base import TaskDef
from rlgate.runtime.errors import InvalidArgument
from rlgate.store import Session, ToolCallEntry
from rlgate.v1 import common_pb2, orchestrator_pb2


def session_status(status: str) -> int:
    return int(common_pb2.SessionStatus.Value(f"SESSION_STATUS_{status.upper()}"))


def request_enum(enum: EnumTypeWrapper, value: int, field: str) -> str:
    """A request's enum number -> its name. proto3 enums are open (any int32 arrives), so a number this
    build does not know is the caller's mistake: INVALID_ARGUMENT naming the field, never a ValueError."""
    if value not in enum.values():
        raise InvalidArgument(field, f"unknown {enum.DESCRIPTOR.name} value {value}")
    return enum.Name(value)


def status_name(value: int, field: str = "status") -> str:
    """SESSION_STATUS_ACTIVE -> 'active' (a request's SessionStatus; see `request_enum`)."""
    return request_enum(common_pb2.SessionStatus, value, field).removeprefix("SESSION_STATUS_").lower()


def done_reason(reason: str) -> int:
    if not reason:
        return orchestrator_pb2.DONE_REASON_UNSPECIFIED
    return int(orchestrator_pb2.DoneReason.Value(f"DONE_REASON_{reason.upper()}"))


def verification(record: dict[str, Any]) -> common_pb2.Verification:
    status = str(record.get("status") or "")
    return common_pb2.Verification(
        status=common_pb2.VerificationStatus.Value(f"VERIFICATION_STATUS_{status.upper()}") if status else 0,
        message=str(record.get("message") or ""),
        stdout=str(record.get("stdout") or ""),
        attempts=int(record.get("attempts") or 0),
        elapsed_ms=float(record.get("elapsed_ms") or 0.0),
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


def session_info(session: Session, task: TaskDef | None, tool_calls: int = 0) -> orchestrator_pb2.SessionInfo:
    info = orchestrator_pb2.SessionInfo(
        session_id=session.session_id,
        status=session_status(session.status),
        task=task_info(task, session.env_key),
        episode=session.episode,
        turn=session.turn,
        max_turns=session.max_turns,
        done_reason=done_reason(session.done_reason),
        verification=verification(session.verification),
        labels=session.labels,
        run_id=session.run_id,
        instance=instance_info(session),
        created_at=timestamp(session.created_at),
        updated_at=timestamp(session.updated_at),
        expires_at=timestamp(session.expires_at),
        tool_call_count=tool_calls,
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
        error_kind=common_pb2.ToolErrorKind.Value(kind) if kind in common_pb2.ToolErrorKind.keys() else 0,  # noqa: SIM118
        result_summary=entry.result_summary,
        endpoint=entry.endpoint,
        duration_ms=entry.duration_ms,
        finished_at=timestamp(entry.finished_at),
        arguments_json=json_text(entry.arguments),
    )
