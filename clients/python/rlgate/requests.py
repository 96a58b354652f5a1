"""Building requests and checking what goes into them, for both clients.

`build` makes a request message from a call's parameters; a value the message cannot hold is a TypeError
or ValueError naming the parameter and what it should be, never protobuf's "bad argument type". `Call` is
one logical RPC, fully built (where it goes, what it sends, how long it may take)."""

from __future__ import annotations

import os
import reprlib
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from rlgate.channels import Pool
from rlgate.settings import shown

if TYPE_CHECKING:
    from google._upb._message import FieldDescriptor as UpbFieldDescriptor

PAGE_SIZE = 1000

C = TypeVar("C")
R = TypeVar("R")
M = TypeVar("M", bound=Message)


def new_request_id() -> str:
    """A fresh request id (32 hex digits): every attempt of one call reuses it, so the server runs it once."""
    return os.urandom(16).hex()


@dataclass(frozen=True)
class Paging:
    """How a paged call's replies chain: the repeated field each page carries, the request's token field,
    and the reply's field naming the next page ("" on the last).

    Args:
        items: the reply's repeated field.
        request_token: the request's page-token field.
        next_token: the reply's next-page-token field.
    """

    items: str
    request_token: str = "page_token"
    next_token: str = "next_page_token"


@dataclass(frozen=True)
class Call(Generic[C, R]):
    """One logical RPC, fully built: where it goes, what it sends, how long it may take. `R` is its response
    message (for the type checker: `_run` returns an `R`).

    Args:
        pool: the channel pool the call goes out on.
        stub: the stub class of the service (`pool.next_stub` makes one per channel).
        method: the RPC's name on the stub.
        request: the request message.
        metadata: the call's metadata (credentials, trace).
        timeout: the whole call's deadline in seconds, retries included.
        trace_id: the call's `x-rlgate-trace-id` (the one in `metadata`), carried on the errors it raises.
        session_id: the session the call concerns ("" for none): its retries after UNAVAILABLE are reported
            on that session's next Step (`StepRequest.client_retries`).
        paging: for a call read page by page, how its pages chain (`next_page`).
    """

    pool: Pool[C]
    stub: Any
    method: str
    request: Any
    metadata: list[tuple[str, str]]
    timeout: float
    trace_id: str
    session_id: str = ""
    paging: Paging | None = None

    def next_page(self, reply: Any) -> Call[C, R] | None:
        """The same call for the page after `reply`, or None when `reply` was the last.

        Args:
            reply: a page this call (or the one it was made from) answered.
        """
        assert self.paging is not None, "next_page of a call that is not paged"
        token = getattr(reply, self.paging.next_token)
        if not token:
            return None
        request = type(self.request)()
        request.CopyFrom(self.request)
        setattr(request, self.paging.request_token, token)
        return replace(self, request=request)

    def items(self, reply: Any) -> Any:
        """The entries a page carries."""
        assert self.paging is not None, "items of a call that is not paged"
        return getattr(reply, self.paging.items)


_PYTHON_TYPES = {
    FieldDescriptor.CPPTYPE_STRING: "str",
    FieldDescriptor.CPPTYPE_BOOL: "bool",
    FieldDescriptor.CPPTYPE_INT32: "int",
    FieldDescriptor.CPPTYPE_INT64: "int",
    FieldDescriptor.CPPTYPE_UINT32: "int",
    FieldDescriptor.CPPTYPE_UINT64: "int",
    FieldDescriptor.CPPTYPE_DOUBLE: "float",
    FieldDescriptor.CPPTYPE_FLOAT: "float",
}


def _kind(field: FieldDescriptor | UpbFieldDescriptor) -> str:
    if field.message_type is not None:
        return field.message_type.full_name
    if field.enum_type is not None:
        names = ", ".join(value.name for value in field.enum_type.values)
        return f"{field.enum_type.full_name} ({names})"
    return _PYTHON_TYPES.get(field.cpp_type, "value")


def _expected(field: FieldDescriptor | UpbFieldDescriptor) -> str:
    """What a request field holds, in Python terms (the parameter of the same name takes it). Either kind of
    descriptor: a message's DESCRIPTOR is protobuf's C (upb) one or the pure-Python one."""
    entry = field.message_type
    if entry is not None and entry.GetOptions().map_entry:
        return f"a mapping of {_kind(entry.fields_by_name['key'])} to {_kind(entry.fields_by_name['value'])}"
    if field.is_repeated:
        return f"a sequence of {_kind(field)}"
    kind = _kind(field)
    return f"{'an' if kind[0] in 'aeiou' else 'a'} {kind}"


def build(cls: type[M], call: str, **fields: Any) -> M:
    """`cls(**fields)`, with errors that name the parameter a bad value came from (protobuf's own message,
    "bad argument type for built-in operation", names nothing).

    Args:
        cls: the request message class.
        call: the client method's name, for the error.
        **fields: the message's fields, each named as the method's parameter that gave it.

    Raises:
        TypeError: a value the field cannot hold, named with what it should be.
        ValueError: a string with a lone UTF-16 surrogate, which gRPC cannot send.
    """
    try:
        return cls(**fields)
    except (TypeError, ValueError) as exc:
        for name, value in fields.items():
            try:
                cls(**{name: value})
            except UnicodeEncodeError as field_exc:  # a str, but one UTF-8 (and so gRPC) cannot carry
                raise ValueError(
                    f"{call}(): {name} must be valid Unicode text: {reprlib.repr(value)} contains "
                    f"{field_exc.object[field_exc.start : field_exc.end]!r}, a lone UTF-16 surrogate"
                ) from exc
            except (TypeError, ValueError):
                expected = _expected(cls.DESCRIPTOR.fields_by_name[name])
                raise TypeError(f"{call}(): {name} must be {expected}, not {shown(value)}") from exc
        raise TypeError(f"{call}(): {exc}") from exc


def optional_text(call: str, name: str, value: object) -> None:
    """Check an optional text parameter.

    Args:
        call: the client method's name, for the error.
        name: the parameter's name.
        value: what the caller passed.

    Raises:
        TypeError: `value` is neither a str nor None.
    """
    if value is not None and not isinstance(value, str):
        raise TypeError(f"{call}(): {name} must be a str or None, not {shown(value)}")
