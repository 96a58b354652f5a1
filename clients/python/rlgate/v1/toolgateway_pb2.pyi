import datetime

from google.protobuf import duration_pb2 as _duration_pb2
from google.protobuf import struct_pb2 as _struct_pb2
from rlgate.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ListToolsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListToolsResponse(_message.Message):
    __slots__ = ("tools",)
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    tools: _containers.RepeatedCompositeFieldContainer[_common_pb2.ToolSpec]
    def __init__(self, tools: _Optional[_Iterable[_Union[_common_pb2.ToolSpec, _Mapping]]] = ...) -> None: ...

class CallToolRequest(_message.Message):
    __slots__ = ("request_id", "name", "arguments")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    name: str
    arguments: _struct_pb2.Struct
    def __init__(self, request_id: _Optional[str] = ..., name: _Optional[str] = ..., arguments: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ...) -> None: ...

class CallToolResponse(_message.Message):
    __slots__ = ("result", "replayed")
    RESULT_FIELD_NUMBER: _ClassVar[int]
    REPLAYED_FIELD_NUMBER: _ClassVar[int]
    result: _common_pb2.ToolResult
    replayed: bool
    def __init__(self, result: _Optional[_Union[_common_pb2.ToolResult, _Mapping]] = ..., replayed: _Optional[bool] = ...) -> None: ...

class CallToolStreamRequest(_message.Message):
    __slots__ = ("call_id", "token", "call", "timeout", "cancel", "trace_id")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    CALL_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    TRACE_ID_FIELD_NUMBER: _ClassVar[int]
    call_id: int
    token: str
    call: CallToolRequest
    timeout: _duration_pb2.Duration
    cancel: bool
    trace_id: str
    def __init__(self, call_id: _Optional[int] = ..., token: _Optional[str] = ..., call: _Optional[_Union[CallToolRequest, _Mapping]] = ..., timeout: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., cancel: _Optional[bool] = ..., trace_id: _Optional[str] = ...) -> None: ...

class CallToolStreamResponse(_message.Message):
    __slots__ = ("call_id", "reply", "error")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    REPLY_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    call_id: int
    reply: CallToolResponse
    error: _common_pb2.CallStatus
    def __init__(self, call_id: _Optional[int] = ..., reply: _Optional[_Union[CallToolResponse, _Mapping]] = ..., error: _Optional[_Union[_common_pb2.CallStatus, _Mapping]] = ...) -> None: ...
