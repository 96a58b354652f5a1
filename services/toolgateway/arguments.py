"""Tool arguments: JSON Schema validation at the gateway, with a message the model can act on.

The arguments arrive exact (`arguments_json` as written; a Struct's whole numbers as integers), so they are
validated as they are and sent upstream unchanged. Upstream servers often do not validate, or answer with
a message a model cannot use; the gateway names the JSON path and the expected shape instead.

The schema is the upstream's, so checking must survive a hostile one: a `$ref` cycle recurses without end,
a dangling or remote `$ref` cannot be resolved (remote ones are never fetched: no request leaves the gateway
because a schema names a URL), and a few hundred bytes of `anyOf` over `$ref`s can take hours. A schema
is compiled once, on a worker thread. Arguments are checked inline only when the work is provably small
(a short argument text against a small schema without references, patterns or nested alternatives: at
most a few thousand subschema visits); any other check runs on a worker thread, bounded by
CHECK_TIMEOUT_S and the call's deadline, and interrupted when its time is up. A check that cannot finish
is the tool's failure (TOOL_FAILED, the tool not called), never the RPC's; a schema found too slow is not
checked again while it is listed. Worker threads are daemons: nothing can hold the process at exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import itertools
import queue
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import jsonschema
import referencing
import referencing.exceptions
from jsonschema import exceptions as js_exceptions

from rlgate.core.errors import clip
from rlgate.v1 import common_pb2

Kind = common_pb2.ToolErrorKind
T = TypeVar("T")

MAX_ERRORS = 5  # violations named in a message
MAX_COLLECTED = 64  # violations read before choosing which to name (a value can have millions)
CHECK_TIMEOUT_S = 2.0  # a check on a worker thread, at most (and within the call's deadline)
WORKERS = 2  # worker threads (a check that never ends keeps one)
STOP_RETRY_S, STOP_RETRIES = 0.1, 50  # a stopped check still running is interrupted again this often, this long
INLINE_ARGUMENT_BYTES = 512  # arguments checked on the loop at most this long, as JSON text
INLINE_SCHEMA_VALUES = 512  # JSON values (objects, arrays, scalars) of a schema checked on the loop
DESCRIBE_DEPTH = 3  # nested unions described in "Expected {...}" (deeper: "any")
DESCRIBE_BRANCHES = 10  # alternatives of one union described
INLINE_BRANCHES = 4  # alternatives (anyOf/oneOf/allOf) along any path of a schema checked on the loop
# Keywords whose cost is not bounded by the schema's and the value's sizes: references (cycles, fan-out),
# regular expressions (backtracking), uniqueItems (quadratic), and keywords that re-check subschemas.
_COSTLY = frozenset({
    "$ref", "$dynamicRef", "$recursiveRef", "pattern", "patternProperties", "uniqueItems", "contains",
    "unevaluatedProperties", "unevaluatedItems", "dependentSchemas", "dependencies", "if", "propertyNames",
})  # fmt: skip
_BRANCHING = ("anyOf", "oneOf", "allOf")
_OFFLINE = referencing.Registry()  # the metaschemas only: a remote $ref is unresolvable, never fetched


@dataclass(frozen=True)
class Verdict:
    """Why a call must not go upstream: the result's kind and a message for the model."""

    kind: common_pb2.ToolErrorKind
    message: str


@dataclass
class _Compiled:
    schema: Mapping[str, Any]  # held: the cache is keyed by its id
    validator: Any  # None: an invalid schema (the upstream judges the arguments)
    inline: bool  # small enough to check on the event loop
    slow: str = ""  # set once a check of small arguments ran out of time


_compiled: dict[int, _Compiled] = {}


# -- compiling --------------------------------------------------------------------------------------------
def _compile(schema: Mapping[str, Any]) -> _Compiled:
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        # types-jsonschema's Validator protocol takes a dict here; the validators take any Mapping.
        cls.check_schema(schema)  # type: ignore[arg-type]
        validator = cls(schema, registry=_OFFLINE)
    except (js_exceptions.SchemaError, RecursionError):
        return _Compiled(schema, None, True)  # an upstream's broken schema: let the upstream judge
    return _Compiled(schema, validator, _cheap(schema))


def _cheap(schema: Mapping[str, Any]) -> bool:
    """Whether checking a short value against `schema` is provably small work (see the module docstring)."""
    values = 0
    stack: list[tuple[Any, int]] = [(schema, 1)]
    while stack:
        node, branches = stack.pop()
        values += 1
        if values > INLINE_SCHEMA_VALUES:
            return False
        if isinstance(node, Mapping):
            if _COSTLY.intersection(node):
                return False
            for key, value in node.items():
                width = len(value) if key in _BRANCHING and isinstance(value, list) else 1
                if branches * width > INLINE_BRANCHES:
                    return False
                stack.append((value, branches * width))
        elif isinstance(node, list):
            stack.extend((item, branches) for item in node)
    return True


# -- checking ---------------------------------------------------------------------------------------------
def _path(error: js_exceptions.ValidationError) -> str:
    out = "$"
    for part in error.absolute_path:
        out += f"[{part}]" if isinstance(part, int) else f".{clip(part)}"
    return out


def validation_errors(arguments: Mapping[str, Any], validator: Any) -> list[str]:
    """Readable schema violations (at most MAX_ERRORS, each cut to a few hundred characters: a message
    repeats the value, which the model may have made megabytes long), empty when the arguments are valid."""
    errors = list(itertools.islice(validator.iter_errors(arguments), MAX_COLLECTED))
    errors.sort(key=lambda e: (list(map(str, e.absolute_path)), e.message))
    return [f"{_path(e)}: {clip(e.message, 300)}" for e in errors[:MAX_ERRORS]]


def _problem(tool: str, arguments: Mapping[str, Any], compiled: _Compiled) -> Verdict | None:
    """The verdict of checking `arguments` (run inline or on a worker thread)."""
    not_called = f"Tool '{tool}' was not called: its input schema"
    try:
        problems = validation_errors(arguments, compiled.validator)
    except RecursionError:
        return Verdict(Kind.TOOL_ERROR_KIND_TOOL_FAILED, f"{not_called} refers to itself without end ($ref cycle) "
                       "or nests too deeply to check the arguments against.")  # fmt: skip
    # _WrappedReferencingError: jsonschema's private wrapper, which its stubs leave out.
    except (referencing.exceptions.Unresolvable, js_exceptions._WrappedReferencingError) as exc:  # type: ignore[attr-defined]
        return Verdict(Kind.TOOL_ERROR_KIND_TOOL_FAILED, f"{not_called} has a $ref that cannot be resolved "
                       f"({clip(exc, 200)}); remote schemas are not fetched.")  # fmt: skip
    except Exception as exc:  # jsonschema on a schema nobody tested: the tool's failure, not the RPC's
        return Verdict(Kind.TOOL_ERROR_KIND_TOOL_FAILED, f"{not_called} could not be checked: "
                       f"{type(exc).__name__}: {clip(exc, 200)}")  # fmt: skip
    if not problems:
        return None
    schema = compiled.schema
    props: Mapping[str, Any] = schema["properties"] if isinstance(schema.get("properties"), Mapping) else {}
    required = schema.get("required")
    if not isinstance(required, list):
        required = []
    expected = ", ".join(
        f"{clip(name)}{'' if name in required else '?'}: {_describe(props[name])}"
        for name in itertools.islice(props, 50)
    )
    if len(props) > 50:
        expected += ", …"
    return Verdict(
        Kind.TOOL_ERROR_KIND_INVALID_ARGUMENTS,
        f"Invalid arguments for tool '{tool}': "
        + "; ".join(problems)
        + f". Expected {{{expected or 'no arguments'}}}. Fix the arguments and call the tool again.",
    )


def _describe(schema: Any, depth: int = 0) -> str:
    """A property's schema as the model reads it in "Expected {...}": its type or types, its values, or the
    union of its alternatives (`anyOf`/`oneOf`, as pydantic writes an Optional), "any" when it says none."""
    if not isinstance(schema, Mapping):
        return "any"
    if "enum" in schema and isinstance(schema["enum"], list):
        return clip("one of " + "|".join(map(repr, schema["enum"])), 200)
    if "const" in schema:
        return clip(repr(schema["const"]), 200)
    t = schema.get("type")
    types = [t] if isinstance(t, str) else [x for x in t if isinstance(x, str)] if isinstance(t, list) else []
    if types:
        return "|".join(dict.fromkeys(types))
    for key in ("anyOf", "oneOf"):
        branches = schema.get(key)
        if isinstance(branches, list) and branches and depth < DESCRIBE_DEPTH:
            parts = dict.fromkeys(_describe(b, depth + 1) for b in branches[:DESCRIBE_BRANCHES])
            if "any" not in parts:
                return clip("|".join(parts), 200)
    return "any"


def arguments_problem(tool: str, arguments: Mapping[str, Any], schema: Mapping[str, Any]) -> str:
    """A message naming what is wrong with `arguments` (or why they cannot be checked), "" when they satisfy
    the tool's input schema. Runs the check here, unbounded: the gateway uses `check_arguments`."""
    compiled = _compile(schema)
    if compiled.validator is None:
        return ""
    verdict = _problem(tool, arguments, compiled)
    return verdict.message if verdict else ""


async def check_arguments(
    tool: str, arguments: Mapping[str, Any], schema: Mapping[str, Any], arguments_bytes: int, timeout_s: float
) -> Verdict | None:
    """Check `arguments` (`arguments_bytes` long as JSON) against the tool's input schema within CHECK_TIMEOUT_S:
    None when they may go upstream. Raises TimeoutError when `timeout_s` (the call's deadline) ends first."""
    deadline_first = timeout_s < CHECK_TIMEOUT_S
    timeout_s = max(min(timeout_s, CHECK_TIMEOUT_S), 0.0)
    compiled = _compiled.get(id(schema))
    if compiled is None or compiled.schema is not schema:
        try:
            compiled = await _workers.run(_compile, schema, timeout=timeout_s)
        except TimeoutError:
            if deadline_first:
                raise
            return _too_slow(tool, timeout_s)
        if len(_compiled) >= 4096:
            _compiled.clear()
        _compiled[id(schema)] = compiled
    if compiled.validator is None:
        return None
    if compiled.slow:
        return Verdict(Kind.TOOL_ERROR_KIND_TOOL_FAILED, compiled.slow)
    if compiled.inline and arguments_bytes <= INLINE_ARGUMENT_BYTES:
        return _problem(tool, arguments, compiled)
    try:
        return await _workers.run(_problem, tool, arguments, compiled, timeout=timeout_s)
    except TimeoutError:
        if deadline_first:
            raise
        verdict = _too_slow(tool, timeout_s)
        if arguments_bytes <= INLINE_ARGUMENT_BYTES:  # short arguments: the schema is to blame
            compiled.slow = verdict.message
        return verdict


def _too_slow(tool: str, timeout_s: float) -> Verdict:
    return Verdict(
        Kind.TOOL_ERROR_KIND_TOOL_FAILED,
        f"Tool '{tool}' was not called: checking the arguments against its input schema took longer than "
        f"{timeout_s:.1f}s (the schema is too costly to check).",
    )


class _Abandoned(BaseException):
    """Raised inside a worker whose check nobody waits for any more (its caller's time ran out)."""


class _Job:
    """One check on a worker. `stop` interrupts it if it still runs, and withdraws it if it has not started
    (its caller's time ran out while every worker was busy): a check nobody waits for would otherwise keep a
    worker and a core busy, and its memory growing, for as long as the schema makes it (hours)."""

    def __init__(self, fn: Callable[[], None]) -> None:
        self.fn = fn
        self.thread = 0  # the worker's id while the check runs
        self.stopped = False
        self.lock = threading.Lock()

    def run(self) -> None:
        with self.lock:
            if self.stopped:
                return
            self.thread = threading.get_ident()
        try:
            self.fn()
        finally:
            with self.lock:
                thread, self.thread = self.thread, 0
            _raise_in(thread, None)  # withdraw an interruption that came too late to land in the check

    def stop(self) -> bool:
        """Interrupt or withdraw the check; True while it still runs (the interruption not landed yet)."""
        with self.lock:
            self.stopped = True
            if self.thread:
                _raise_in(self.thread, _Abandoned)
            return bool(self.thread)


def _raise_in(thread: int, exc: type[BaseException] | None) -> None:
    """Raise `exc` in `thread` at its next bytecode (None: withdraw a pending one). Pure-Python work such as
    jsonschema's stops within microseconds; a single long C call (one regex match) only when it returns."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread), ctypes.py_object(exc) if exc else None)


class _Workers:
    """A few daemon threads running checks (a `ThreadPoolExecutor`'s threads are joined at exit, so one
    stuck in a check would hang the process's shutdown)."""

    def __init__(self, count: int) -> None:
        self._count = count
        self._jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def _start(self) -> None:
        with self._lock:
            while len(self._threads) < self._count:
                thread = threading.Thread(target=self._work, name=f"rlgate-schema-{len(self._threads)}", daemon=True)
                thread.start()
                self._threads.append(thread)

    def _work(self) -> None:
        while True:
            with contextlib.suppress(_Abandoned):  # an interruption that landed after its check ended
                self._jobs.get().run()

    async def run(self, fn: Callable[..., T], *args: Any, timeout: float) -> T:  # noqa: ASYNC109
        """`fn(*args)` on a worker; TimeoutError after `timeout` seconds, the check then interrupted."""
        if not self._threads:
            self._start()
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()

        def settle(outcome: Callable[[], None]) -> None:
            if not future.done():
                outcome()

        def check() -> None:
            try:
                value = fn(*args)
                outcome = functools.partial(future.set_result, value)
            except _Abandoned:
                return  # nobody waits
            except BaseException as exc:  # handed to the waiting call
                outcome = functools.partial(future.set_exception, exc)
            with contextlib.suppress(RuntimeError):  # the loop closed while the check ran: nobody waits
                loop.call_soon_threadsafe(settle, outcome)

        job = _Job(check)
        self._jobs.put(job)
        try:
            async with asyncio.timeout(timeout):
                return await future
        except BaseException:  # timed out or cancelled: the check's result is not wanted
            if job.stop():
                loop.call_later(STOP_RETRY_S, _keep_stopping, loop, job, STOP_RETRIES)
            raise


def _keep_stopping(loop: asyncio.AbstractEventLoop, job: _Job, left: int) -> None:
    """Interrupt a stopped check again while it still runs: code inside it (a library's broad `except`) may
    have swallowed an interruption. Bounded: a check stuck in one C call outlives every retry."""
    if job.stop() and left > 1:
        loop.call_later(STOP_RETRY_S, _keep_stopping, loop, job, left - 1)


_workers = _Workers(WORKERS)
