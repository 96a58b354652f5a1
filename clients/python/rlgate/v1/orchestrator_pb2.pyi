import datetime

from google.protobuf import struct_pb2 as _struct_pb2
from google.protobuf import timestamp_pb2 as _timestamp_pb2
from rlgate.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DoneReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DONE_REASON_UNSPECIFIED: _ClassVar[DoneReason]
    DONE_REASON_FINAL_ANSWER: _ClassVar[DoneReason]
    DONE_REASON_AGENT_DONE: _ClassVar[DoneReason]
    DONE_REASON_MAX_TURNS: _ClassVar[DoneReason]

class ForkMechanism(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FORK_MECHANISM_UNSPECIFIED: _ClassVar[ForkMechanism]
    FORK_MECHANISM_SNAPSHOT: _ClassVar[ForkMechanism]
    FORK_MECHANISM_REPLAY: _ClassVar[ForkMechanism]
DONE_REASON_UNSPECIFIED: DoneReason
DONE_REASON_FINAL_ANSWER: DoneReason
DONE_REASON_AGENT_DONE: DoneReason
DONE_REASON_MAX_TURNS: DoneReason
FORK_MECHANISM_UNSPECIFIED: ForkMechanism
FORK_MECHANISM_SNAPSHOT: ForkMechanism
FORK_MECHANISM_REPLAY: ForkMechanism

class ResetRequest(_message.Message):
    __slots__ = ("request_id", "session_id", "task_key", "env_key", "max_turns", "labels", "run_id")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_KEY_FIELD_NUMBER: _ClassVar[int]
    ENV_KEY_FIELD_NUMBER: _ClassVar[int]
    MAX_TURNS_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    session_id: str
    task_key: str
    env_key: str
    max_turns: int
    labels: _containers.ScalarMap[str, str]
    run_id: str
    def __init__(self, request_id: _Optional[str] = ..., session_id: _Optional[str] = ..., task_key: _Optional[str] = ..., env_key: _Optional[str] = ..., max_turns: _Optional[int] = ..., labels: _Optional[_Mapping[str, str]] = ..., run_id: _Optional[str] = ...) -> None: ...

class ResetResponse(_message.Message):
    __slots__ = ("session_id", "episode", "prompt", "messages", "tools", "agent_token", "gateway_address", "task", "max_turns", "modality", "instance")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    EPISODE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    AGENT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    GATEWAY_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    MAX_TURNS_FIELD_NUMBER: _ClassVar[int]
    MODALITY_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    episode: int
    prompt: str
    messages: _containers.RepeatedCompositeFieldContainer[_common_pb2.ChatMessage]
    tools: _containers.RepeatedCompositeFieldContainer[_common_pb2.ToolSpec]
    agent_token: str
    gateway_address: str
    task: _common_pb2.TaskInfo
    max_turns: int
    modality: str
    instance: InstanceInfo
    def __init__(self, session_id: _Optional[str] = ..., episode: _Optional[int] = ..., prompt: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[_common_pb2.ChatMessage, _Mapping]]] = ..., tools: _Optional[_Iterable[_Union[_common_pb2.ToolSpec, _Mapping]]] = ..., agent_token: _Optional[str] = ..., gateway_address: _Optional[str] = ..., task: _Optional[_Union[_common_pb2.TaskInfo, _Mapping]] = ..., max_turns: _Optional[int] = ..., modality: _Optional[str] = ..., instance: _Optional[_Union[InstanceInfo, _Mapping]] = ...) -> None: ...

class ToolCallSummary(_message.Message):
    __slots__ = ("name", "arguments", "arguments_json", "request_id", "is_error", "error_kind")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_JSON_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    IS_ERROR_FIELD_NUMBER: _ClassVar[int]
    ERROR_KIND_FIELD_NUMBER: _ClassVar[int]
    name: str
    arguments: _struct_pb2.Struct
    arguments_json: str
    request_id: str
    is_error: bool
    error_kind: _common_pb2.ToolErrorKind
    def __init__(self, name: _Optional[str] = ..., arguments: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., arguments_json: _Optional[str] = ..., request_id: _Optional[str] = ..., is_error: _Optional[bool] = ..., error_kind: _Optional[_Union[_common_pb2.ToolErrorKind, str]] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("request_id", "session_id", "assistant_text", "tool_calls", "final_answer", "done", "client_retries", "close_when_done")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ASSISTANT_TEXT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    FINAL_ANSWER_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    CLIENT_RETRIES_FIELD_NUMBER: _ClassVar[int]
    CLOSE_WHEN_DONE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    session_id: str
    assistant_text: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCallSummary]
    final_answer: str
    done: bool
    client_retries: int
    close_when_done: bool
    def __init__(self, request_id: _Optional[str] = ..., session_id: _Optional[str] = ..., assistant_text: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCallSummary, _Mapping]]] = ..., final_answer: _Optional[str] = ..., done: _Optional[bool] = ..., client_retries: _Optional[int] = ..., close_when_done: _Optional[bool] = ...) -> None: ...

class StepResponse(_message.Message):
    __slots__ = ("turn", "done", "truncated", "done_reason", "reward", "verification", "status", "infra_faults")
    TURN_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    DONE_REASON_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    VERIFICATION_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    INFRA_FAULTS_FIELD_NUMBER: _ClassVar[int]
    turn: int
    done: bool
    truncated: bool
    done_reason: DoneReason
    reward: float
    verification: _common_pb2.Verification
    status: _common_pb2.SessionStatus
    infra_faults: _common_pb2.InfraFaults
    def __init__(self, turn: _Optional[int] = ..., done: _Optional[bool] = ..., truncated: _Optional[bool] = ..., done_reason: _Optional[_Union[DoneReason, str]] = ..., reward: _Optional[float] = ..., verification: _Optional[_Union[_common_pb2.Verification, _Mapping]] = ..., status: _Optional[_Union[_common_pb2.SessionStatus, str]] = ..., infra_faults: _Optional[_Union[_common_pb2.InfraFaults, _Mapping]] = ...) -> None: ...

class StateRequest(_message.Message):
    __slots__ = ("session_id", "include_tool_calls", "tool_calls_page_size", "tool_calls_page_token")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    include_tool_calls: bool
    tool_calls_page_size: int
    tool_calls_page_token: str
    def __init__(self, session_id: _Optional[str] = ..., include_tool_calls: _Optional[bool] = ..., tool_calls_page_size: _Optional[int] = ..., tool_calls_page_token: _Optional[str] = ...) -> None: ...

class InstanceInfo(_message.Message):
    __slots__ = ("provider", "instance_id", "env_key", "root_url", "mcp_endpoints")
    PROVIDER_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    ENV_KEY_FIELD_NUMBER: _ClassVar[int]
    ROOT_URL_FIELD_NUMBER: _ClassVar[int]
    MCP_ENDPOINTS_FIELD_NUMBER: _ClassVar[int]
    provider: str
    instance_id: str
    env_key: str
    root_url: str
    mcp_endpoints: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, provider: _Optional[str] = ..., instance_id: _Optional[str] = ..., env_key: _Optional[str] = ..., root_url: _Optional[str] = ..., mcp_endpoints: _Optional[_Iterable[str]] = ...) -> None: ...

class SessionInfo(_message.Message):
    __slots__ = ("session_id", "status", "task", "episode", "turn", "max_turns", "done_reason", "reward", "verification", "labels", "run_id", "instance", "created_at", "updated_at", "expires_at", "tool_call_count", "parent_session_id", "branch_index", "infra_faults")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    EPISODE_FIELD_NUMBER: _ClassVar[int]
    TURN_FIELD_NUMBER: _ClassVar[int]
    MAX_TURNS_FIELD_NUMBER: _ClassVar[int]
    DONE_REASON_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    VERIFICATION_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    UPDATED_AT_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_COUNT_FIELD_NUMBER: _ClassVar[int]
    PARENT_SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    BRANCH_INDEX_FIELD_NUMBER: _ClassVar[int]
    INFRA_FAULTS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    status: _common_pb2.SessionStatus
    task: _common_pb2.TaskInfo
    episode: int
    turn: int
    max_turns: int
    done_reason: DoneReason
    reward: float
    verification: _common_pb2.Verification
    labels: _containers.ScalarMap[str, str]
    run_id: str
    instance: InstanceInfo
    created_at: _timestamp_pb2.Timestamp
    updated_at: _timestamp_pb2.Timestamp
    expires_at: _timestamp_pb2.Timestamp
    tool_call_count: int
    parent_session_id: str
    branch_index: int
    infra_faults: _common_pb2.InfraFaults
    def __init__(self, session_id: _Optional[str] = ..., status: _Optional[_Union[_common_pb2.SessionStatus, str]] = ..., task: _Optional[_Union[_common_pb2.TaskInfo, _Mapping]] = ..., episode: _Optional[int] = ..., turn: _Optional[int] = ..., max_turns: _Optional[int] = ..., done_reason: _Optional[_Union[DoneReason, str]] = ..., reward: _Optional[float] = ..., verification: _Optional[_Union[_common_pb2.Verification, _Mapping]] = ..., labels: _Optional[_Mapping[str, str]] = ..., run_id: _Optional[str] = ..., instance: _Optional[_Union[InstanceInfo, _Mapping]] = ..., created_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., updated_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., expires_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., tool_call_count: _Optional[int] = ..., parent_session_id: _Optional[str] = ..., branch_index: _Optional[int] = ..., infra_faults: _Optional[_Union[_common_pb2.InfraFaults, _Mapping]] = ...) -> None: ...

class ToolCallLogEntry(_message.Message):
    __slots__ = ("episode", "request_id", "tool", "arguments_json", "is_error", "error_kind", "result_summary", "endpoint", "duration_ms", "finished_at", "arguments_elided", "infra_fault")
    EPISODE_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOOL_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_JSON_FIELD_NUMBER: _ClassVar[int]
    IS_ERROR_FIELD_NUMBER: _ClassVar[int]
    ERROR_KIND_FIELD_NUMBER: _ClassVar[int]
    RESULT_SUMMARY_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    DURATION_MS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_AT_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_ELIDED_FIELD_NUMBER: _ClassVar[int]
    INFRA_FAULT_FIELD_NUMBER: _ClassVar[int]
    episode: int
    request_id: str
    tool: str
    arguments_json: str
    is_error: bool
    error_kind: _common_pb2.ToolErrorKind
    result_summary: str
    endpoint: str
    duration_ms: float
    finished_at: _timestamp_pb2.Timestamp
    arguments_elided: bool
    infra_fault: str
    def __init__(self, episode: _Optional[int] = ..., request_id: _Optional[str] = ..., tool: _Optional[str] = ..., arguments_json: _Optional[str] = ..., is_error: _Optional[bool] = ..., error_kind: _Optional[_Union[_common_pb2.ToolErrorKind, str]] = ..., result_summary: _Optional[str] = ..., endpoint: _Optional[str] = ..., duration_ms: _Optional[float] = ..., finished_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., arguments_elided: _Optional[bool] = ..., infra_fault: _Optional[str] = ...) -> None: ...

class StateResponse(_message.Message):
    __slots__ = ("session", "tool_calls", "next_tool_calls_page_token")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOOL_CALLS_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    session: SessionInfo
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCallLogEntry]
    next_tool_calls_page_token: str
    def __init__(self, session: _Optional[_Union[SessionInfo, _Mapping]] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCallLogEntry, _Mapping]]] = ..., next_tool_calls_page_token: _Optional[str] = ...) -> None: ...

class CloseRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class CloseResponse(_message.Message):
    __slots__ = ("already_closed", "status")
    ALREADY_CLOSED_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    already_closed: bool
    status: _common_pb2.SessionStatus
    def __init__(self, already_closed: _Optional[bool] = ..., status: _Optional[_Union[_common_pb2.SessionStatus, str]] = ...) -> None: ...

class CloseSessionsRequest(_message.Message):
    __slots__ = ("labels", "run_id")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    LABELS_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    labels: _containers.ScalarMap[str, str]
    run_id: str
    def __init__(self, labels: _Optional[_Mapping[str, str]] = ..., run_id: _Optional[str] = ...) -> None: ...

class CloseSessionsResponse(_message.Message):
    __slots__ = ("session_ids",)
    SESSION_IDS_FIELD_NUMBER: _ClassVar[int]
    session_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, session_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class ListTasksRequest(_message.Message):
    __slots__ = ("env_key", "page_size", "page_token", "include_reference_solution")
    ENV_KEY_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_REFERENCE_SOLUTION_FIELD_NUMBER: _ClassVar[int]
    env_key: str
    page_size: int
    page_token: str
    include_reference_solution: bool
    def __init__(self, env_key: _Optional[str] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ..., include_reference_solution: _Optional[bool] = ...) -> None: ...

class ListTasksResponse(_message.Message):
    __slots__ = ("tasks", "next_page_token", "total")
    TASKS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    tasks: _containers.RepeatedCompositeFieldContainer[_common_pb2.TaskInfo]
    next_page_token: str
    total: int
    def __init__(self, tasks: _Optional[_Iterable[_Union[_common_pb2.TaskInfo, _Mapping]]] = ..., next_page_token: _Optional[str] = ..., total: _Optional[int] = ...) -> None: ...

class ListSessionsRequest(_message.Message):
    __slots__ = ("status", "labels", "run_id", "page_size", "page_token")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    STATUS_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    status: _common_pb2.SessionStatus
    labels: _containers.ScalarMap[str, str]
    run_id: str
    page_size: int
    page_token: str
    def __init__(self, status: _Optional[_Union[_common_pb2.SessionStatus, str]] = ..., labels: _Optional[_Mapping[str, str]] = ..., run_id: _Optional[str] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListSessionsResponse(_message.Message):
    __slots__ = ("sessions", "next_page_token")
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    sessions: _containers.RepeatedCompositeFieldContainer[SessionInfo]
    next_page_token: str
    def __init__(self, sessions: _Optional[_Iterable[_Union[SessionInfo, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class ForkRequest(_message.Message):
    __slots__ = ("request_id", "session_id", "count", "mechanism")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    MECHANISM_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    session_id: str
    count: int
    mechanism: ForkMechanism
    def __init__(self, request_id: _Optional[str] = ..., session_id: _Optional[str] = ..., count: _Optional[int] = ..., mechanism: _Optional[_Union[ForkMechanism, str]] = ...) -> None: ...

class ForkBranch(_message.Message):
    __slots__ = ("branch_index", "session_id", "episode", "turn", "max_turns", "tools", "agent_token", "gateway_address", "instance")
    BRANCH_INDEX_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    EPISODE_FIELD_NUMBER: _ClassVar[int]
    TURN_FIELD_NUMBER: _ClassVar[int]
    MAX_TURNS_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    AGENT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    GATEWAY_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    branch_index: int
    session_id: str
    episode: int
    turn: int
    max_turns: int
    tools: _containers.RepeatedCompositeFieldContainer[_common_pb2.ToolSpec]
    agent_token: str
    gateway_address: str
    instance: InstanceInfo
    def __init__(self, branch_index: _Optional[int] = ..., session_id: _Optional[str] = ..., episode: _Optional[int] = ..., turn: _Optional[int] = ..., max_turns: _Optional[int] = ..., tools: _Optional[_Iterable[_Union[_common_pb2.ToolSpec, _Mapping]]] = ..., agent_token: _Optional[str] = ..., gateway_address: _Optional[str] = ..., instance: _Optional[_Union[InstanceInfo, _Mapping]] = ...) -> None: ...

class ForkResponse(_message.Message):
    __slots__ = ("parent_session_id", "turn", "mechanism", "branches")
    PARENT_SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TURN_FIELD_NUMBER: _ClassVar[int]
    MECHANISM_FIELD_NUMBER: _ClassVar[int]
    BRANCHES_FIELD_NUMBER: _ClassVar[int]
    parent_session_id: str
    turn: int
    mechanism: ForkMechanism
    branches: _containers.RepeatedCompositeFieldContainer[ForkBranch]
    def __init__(self, parent_session_id: _Optional[str] = ..., turn: _Optional[int] = ..., mechanism: _Optional[_Union[ForkMechanism, str]] = ..., branches: _Optional[_Iterable[_Union[ForkBranch, _Mapping]]] = ...) -> None: ...
