from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ToolErrorKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TOOL_ERROR_KIND_UNSPECIFIED: _ClassVar[ToolErrorKind]
    TOOL_ERROR_KIND_UNKNOWN_TOOL: _ClassVar[ToolErrorKind]
    TOOL_ERROR_KIND_INVALID_ARGUMENTS: _ClassVar[ToolErrorKind]
    TOOL_ERROR_KIND_TOOL_FAILED: _ClassVar[ToolErrorKind]
    TOOL_ERROR_KIND_OUTCOME_UNKNOWN: _ClassVar[ToolErrorKind]
    TOOL_ERROR_KIND_OUTPUT_TRUNCATED: _ClassVar[ToolErrorKind]
    TOOL_ERROR_KIND_BUDGET_EXHAUSTED: _ClassVar[ToolErrorKind]

class SessionStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SESSION_STATUS_UNSPECIFIED: _ClassVar[SessionStatus]
    SESSION_STATUS_PROVISIONING: _ClassVar[SessionStatus]
    SESSION_STATUS_ACTIVE: _ClassVar[SessionStatus]
    SESSION_STATUS_DONE: _ClassVar[SessionStatus]
    SESSION_STATUS_CLOSED: _ClassVar[SessionStatus]
    SESSION_STATUS_EXPIRED: _ClassVar[SessionStatus]
    SESSION_STATUS_FAILED: _ClassVar[SessionStatus]

class VerificationStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    VERIFICATION_STATUS_UNSPECIFIED: _ClassVar[VerificationStatus]
    VERIFICATION_STATUS_OK: _ClassVar[VerificationStatus]
    VERIFICATION_STATUS_ERROR: _ClassVar[VerificationStatus]
    VERIFICATION_STATUS_TIMEOUT: _ClassVar[VerificationStatus]
    VERIFICATION_STATUS_SKIPPED: _ClassVar[VerificationStatus]
TOOL_ERROR_KIND_UNSPECIFIED: ToolErrorKind
TOOL_ERROR_KIND_UNKNOWN_TOOL: ToolErrorKind
TOOL_ERROR_KIND_INVALID_ARGUMENTS: ToolErrorKind
TOOL_ERROR_KIND_TOOL_FAILED: ToolErrorKind
TOOL_ERROR_KIND_OUTCOME_UNKNOWN: ToolErrorKind
TOOL_ERROR_KIND_OUTPUT_TRUNCATED: ToolErrorKind
TOOL_ERROR_KIND_BUDGET_EXHAUSTED: ToolErrorKind
SESSION_STATUS_UNSPECIFIED: SessionStatus
SESSION_STATUS_PROVISIONING: SessionStatus
SESSION_STATUS_ACTIVE: SessionStatus
SESSION_STATUS_DONE: SessionStatus
SESSION_STATUS_CLOSED: SessionStatus
SESSION_STATUS_EXPIRED: SessionStatus
SESSION_STATUS_FAILED: SessionStatus
VERIFICATION_STATUS_UNSPECIFIED: VerificationStatus
VERIFICATION_STATUS_OK: VerificationStatus
VERIFICATION_STATUS_ERROR: VerificationStatus
VERIFICATION_STATUS_TIMEOUT: VerificationStatus
VERIFICATION_STATUS_SKIPPED: VerificationStatus

class ToolSpec(_message.Message):
    __slots__ = ("name", "title", "description", "input_schema_json", "output_schema_json", "annotations_json", "endpoint")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TITLE_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    INPUT_SCHEMA_JSON_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_SCHEMA_JSON_FIELD_NUMBER: _ClassVar[int]
    ANNOTATIONS_JSON_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    name: str
    title: str
    description: str
    input_schema_json: str
    output_schema_json: str
    annotations_json: str
    endpoint: str
    def __init__(self, name: _Optional[str] = ..., title: _Optional[str] = ..., description: _Optional[str] = ..., input_schema_json: _Optional[str] = ..., output_schema_json: _Optional[str] = ..., annotations_json: _Optional[str] = ..., endpoint: _Optional[str] = ...) -> None: ...

class ContentBlock(_message.Message):
    __slots__ = ("text", "image", "audio", "resource_link", "resource")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    AUDIO_FIELD_NUMBER: _ClassVar[int]
    RESOURCE_LINK_FIELD_NUMBER: _ClassVar[int]
    RESOURCE_FIELD_NUMBER: _ClassVar[int]
    text: TextContent
    image: ImageContent
    audio: AudioContent
    resource_link: ResourceLink
    resource: EmbeddedResource
    def __init__(self, text: _Optional[_Union[TextContent, _Mapping]] = ..., image: _Optional[_Union[ImageContent, _Mapping]] = ..., audio: _Optional[_Union[AudioContent, _Mapping]] = ..., resource_link: _Optional[_Union[ResourceLink, _Mapping]] = ..., resource: _Optional[_Union[EmbeddedResource, _Mapping]] = ...) -> None: ...

class TextContent(_message.Message):
    __slots__ = ("text",)
    TEXT_FIELD_NUMBER: _ClassVar[int]
    text: str
    def __init__(self, text: _Optional[str] = ...) -> None: ...

class ImageContent(_message.Message):
    __slots__ = ("data", "mime_type")
    DATA_FIELD_NUMBER: _ClassVar[int]
    MIME_TYPE_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    mime_type: str
    def __init__(self, data: _Optional[bytes] = ..., mime_type: _Optional[str] = ...) -> None: ...

class AudioContent(_message.Message):
    __slots__ = ("data", "mime_type")
    DATA_FIELD_NUMBER: _ClassVar[int]
    MIME_TYPE_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    mime_type: str
    def __init__(self, data: _Optional[bytes] = ..., mime_type: _Optional[str] = ...) -> None: ...

class ResourceLink(_message.Message):
    __slots__ = ("uri", "name", "title", "description", "mime_type", "size")
    URI_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    TITLE_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    MIME_TYPE_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    uri: str
    name: str
    title: str
    description: str
    mime_type: str
    size: int
    def __init__(self, uri: _Optional[str] = ..., name: _Optional[str] = ..., title: _Optional[str] = ..., description: _Optional[str] = ..., mime_type: _Optional[str] = ..., size: _Optional[int] = ...) -> None: ...

class EmbeddedResource(_message.Message):
    __slots__ = ("uri", "mime_type", "text", "blob")
    URI_FIELD_NUMBER: _ClassVar[int]
    MIME_TYPE_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    BLOB_FIELD_NUMBER: _ClassVar[int]
    uri: str
    mime_type: str
    text: str
    blob: bytes
    def __init__(self, uri: _Optional[str] = ..., mime_type: _Optional[str] = ..., text: _Optional[str] = ..., blob: _Optional[bytes] = ...) -> None: ...

class ToolResult(_message.Message):
    __slots__ = ("content", "structured_content_json", "is_error", "error_kind", "error_message")
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_CONTENT_JSON_FIELD_NUMBER: _ClassVar[int]
    IS_ERROR_FIELD_NUMBER: _ClassVar[int]
    ERROR_KIND_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    content: _containers.RepeatedCompositeFieldContainer[ContentBlock]
    structured_content_json: str
    is_error: bool
    error_kind: ToolErrorKind
    error_message: str
    def __init__(self, content: _Optional[_Iterable[_Union[ContentBlock, _Mapping]]] = ..., structured_content_json: _Optional[str] = ..., is_error: _Optional[bool] = ..., error_kind: _Optional[_Union[ToolErrorKind, str]] = ..., error_message: _Optional[str] = ...) -> None: ...

class Verification(_message.Message):
    __slots__ = ("status", "message", "stdout", "attempts", "elapsed_ms")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    STDOUT_FIELD_NUMBER: _ClassVar[int]
    ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    ELAPSED_MS_FIELD_NUMBER: _ClassVar[int]
    status: VerificationStatus
    message: str
    stdout: str
    attempts: int
    elapsed_ms: float
    def __init__(self, status: _Optional[_Union[VerificationStatus, str]] = ..., message: _Optional[str] = ..., stdout: _Optional[str] = ..., attempts: _Optional[int] = ..., elapsed_ms: _Optional[float] = ...) -> None: ...

class InfraFaults(_message.Message):
    __slots__ = ("total", "outcome_unknown", "tool_reruns", "client_retries", "verifier_errors", "orchestrator_restarts")
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_UNKNOWN_FIELD_NUMBER: _ClassVar[int]
    TOOL_RERUNS_FIELD_NUMBER: _ClassVar[int]
    CLIENT_RETRIES_FIELD_NUMBER: _ClassVar[int]
    VERIFIER_ERRORS_FIELD_NUMBER: _ClassVar[int]
    ORCHESTRATOR_RESTARTS_FIELD_NUMBER: _ClassVar[int]
    total: int
    outcome_unknown: int
    tool_reruns: int
    client_retries: int
    verifier_errors: int
    orchestrator_restarts: int
    def __init__(self, total: _Optional[int] = ..., outcome_unknown: _Optional[int] = ..., tool_reruns: _Optional[int] = ..., client_retries: _Optional[int] = ..., verifier_errors: _Optional[int] = ..., orchestrator_restarts: _Optional[int] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class TaskInfo(_message.Message):
    __slots__ = ("key", "env_id", "version", "prompt", "modality", "max_turns", "metadata_json", "reference_solution_json")
    KEY_FIELD_NUMBER: _ClassVar[int]
    ENV_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    MODALITY_FIELD_NUMBER: _ClassVar[int]
    MAX_TURNS_FIELD_NUMBER: _ClassVar[int]
    METADATA_JSON_FIELD_NUMBER: _ClassVar[int]
    REFERENCE_SOLUTION_JSON_FIELD_NUMBER: _ClassVar[int]
    key: str
    env_id: str
    version: str
    prompt: str
    modality: str
    max_turns: int
    metadata_json: str
    reference_solution_json: str
    def __init__(self, key: _Optional[str] = ..., env_id: _Optional[str] = ..., version: _Optional[str] = ..., prompt: _Optional[str] = ..., modality: _Optional[str] = ..., max_turns: _Optional[int] = ..., metadata_json: _Optional[str] = ..., reference_solution_json: _Optional[str] = ...) -> None: ...
