"""Bad input: property-based requests to every RPC of both services.

Hypothesis builds requests from unknown and malformed ids, empty and huge strings, nested and non-JSON-able
Struct values (NaN and Infinity set directly on the wire), out-of-range numbers and enums, schema-violating
tool arguments, and wrong, missing or misplaced credentials. Each request's answer is worked out from the
contract before it is sent (the `expect_*` oracles below): a malformed request must get exactly the status
its first malformed field calls for, in the order the contract checks them (credentials first, then each
field's limit, then what the RPC itself requires); only a well-formed one may be answered OK, or with what the
state the other examples left calls for (a victim session closed, a request_id bound to another request).
Never INTERNAL, UNKNOWN or a hang (every call has a deadline); the servers must stay healthy and the store
must pass its invariant check afterwards. Byte-level abuse (oversized messages, corrupt and
too-deeply nested protobuf, another RPC's message) is checked once per RPC outside hypothesis.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import grpc
import pytest
from google.protobuf import struct_pb2
from google.protobuf.internal.encoder import _VarintBytes  # type: ignore[attr-defined]
from google.protobuf.message import DecodeError
from hypothesis import given, settings
from hypothesis import strategies as st

from rlgate.core.convert import MAX_JSON_TEXT_DEPTH
from rlgate.store import open_store
from rlgate.v1 import common_pb2, orchestrator_pb2, toolgateway_pb2
from tests.reliability.conftest import FULL, PROFILE, Figures
from tests.reliability.harness import (
    API_KEY,
    Audit,
    AuditedStack,
    bearer,
    gateway_stub,
    orchestrator_stub,
    start_stack,
)

SC = grpc.StatusCode
pytestmark = pytest.mark.timeout(1800 if FULL else 300)  # 5,000 examples per RPC in the full set
CALL_TIMEOUT = 30.0
RESET_TIMEOUT = 60.0
MAX_RECEIVE = 16 * 1024 * 1024  # rlgate.runtime.grpc_server DEFAULT_OPTIONS

# The contract's limits (orchestrator.proto, toolgateway.proto, docs/orchestrator.md "Errors"). A field that
# names something that must exist (session_id, task_key) and is longer than any name is NOT_FOUND; any other
# field past its limit is INVALID_ARGUMENT.
MAX_ID = 128  # request_id, run_id, session_id; CallTool's request_id
MAX_KEY = 256  # task_key, env_key
MAX_PAGE_TOKEN = 2048
MAX_LABEL = 63  # label keys (1..63) and values (0..63)
MAX_ARGUMENTS_BYTES = 1 << 20  # CallTool's arguments, in either form (the gateway's default)
TOOL_NAME = re.compile(r"[A-Za-z0-9._-]{1,128}")
PAGE_SIZES = range(0, 1001)  # 0 means 100
KNOWN_TASKS = {"mailbox-count-unread-from-kenji"}
KNOWN_ENVS = {"mailbox:v1", "tracker"}  # env_keys the stack's localfleet serves ("tracker": its latest version)
SESSION_STATUSES = set(common_pb2.SessionStatus.values())
NEVER = {SC.INTERNAL, SC.UNKNOWN, SC.DEADLINE_EXCEEDED, SC.UNAVAILABLE}


@dataclass
class Fixture:
    stack: AuditedStack
    victims: list[str]  # sessions the orchestrator fuzzing may step, reset and close
    gateway_tokens: dict[str, str]  # era -> live agent token (never touched by the orchestrator fuzzing)
    dead_tokens: dict[str, str]  # revoked / closed / done -> token
    tools: dict[str, list[common_pb2.ToolSpec]]
    seen: dict[str, dict[str, int]] = field(default_factory=dict)  # rpc -> status name -> count

    def count(self, rpc: str, code: grpc.StatusCode) -> None:
        bucket = self.seen.setdefault(rpc, {})
        bucket[code.name] = bucket.get(code.name, 0) + 1


@pytest.fixture(scope="module")
def fx(tmp_path_factory: pytest.TempPathFactory, audit: Audit, figures: Figures) -> Iterator[Fixture]:
    stack = start_stack(tmp_path_factory.mktemp("bad-input"), audit, orchestrator_args=["--verify-timeout-s", "10"])
    try:
        orch = orchestrator_stub(stack.orchestrator_address)
        md = stack.metadata()
        served = orch.ListTasks(orchestrator_pb2.ListTasksRequest(page_size=1000), timeout=CALL_TIMEOUT, metadata=md)
        missing = KNOWN_TASKS - {t.key for t in served.tasks}
        assert not missing, f"the oracles' known tasks {sorted(missing)} are not served (renamed?)"

        def reset(**kw: Any) -> orchestrator_pb2.ResetResponse:
            r: orchestrator_pb2.ResetResponse = orch.Reset(
                orchestrator_pb2.ResetRequest(**kw), timeout=RESET_TIMEOUT, metadata=md
            )
            audit.token(r.agent_token)
            return r

        victims = [
            reset(env_key=e, run_id="rel-victim", labels={"suite": "victim"}).session_id
            for e in ("mailbox:v1", "tracker:v1", "booking:v1")
        ]
        gw: dict[str, orchestrator_pb2.ResetResponse] = {
            era: reset(env_key=f"{env}:v1", run_id="rel-gateway-only-x9")
            for era, env in (("modern", "mailbox"), ("legacy", "tracker"))
        }
        revoked = reset(env_key="mailbox:v1", run_id="rel-gateway-only-x9")
        reset(session_id=revoked.session_id)  # a new episode revokes the first token
        closed = reset(env_key="tracker:v1", run_id="rel-gateway-only-x9")
        orch.Close(orchestrator_pb2.CloseRequest(session_id=closed.session_id), timeout=CALL_TIMEOUT, metadata=md)
        done = reset(env_key="mailbox:v1", run_id="rel-gateway-only-x9")
        orch.Step(
            orchestrator_pb2.StepRequest(session_id=done.session_id, done=True), timeout=CALL_TIMEOUT, metadata=md
        )
        fixture = Fixture(
            stack=stack,
            victims=victims,
            gateway_tokens={era: r.agent_token for era, r in gw.items()},
            dead_tokens={"revoked": revoked.agent_token, "closed": closed.agent_token, "done": done.agent_token},
            tools={era: list(r.tools) for era, r in gw.items()},
        )
        yield fixture
        figures.record("bad_input", "statuses_by_rpc", fixture.seen)
    finally:
        stack.stop()


# ---------------------------------------------------------------------------------------------------------
# Strategies


def huge_text(min_size: int, max_size: int) -> st.SearchStrategy[str]:
    return st.integers(min_size, max_size).map(lambda n: "x" * n)


# Ids and keys stay below 1 kB (test_huge_unknown_ids_are_not_echoed covers bigger ones); free text goes
# up to 300 kB.
ID = st.one_of(
    st.just(""),
    st.text(max_size=40),
    st.text(alphabet=st.characters(codec="utf-8"), max_size=200),
    huge_text(129, 1000),
    st.sampled_from(["\x00", "../../etc/passwd", "' OR 1=1 --", "s-" + "0" * 24, "%s%n", "\u202e\ufeff"]),
)
TEXT = st.one_of(ID, huge_text(10_000, 300_000))
INT32 = st.one_of(st.integers(-(2**31), 2**31 - 1), st.sampled_from([0, -1, 1, 1000, 1001, 2**31 - 1]))
FLOATS = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([math.nan, math.inf, -math.inf]))
JSON_LEAF = st.one_of(st.none(), st.booleans(), FLOATS, st.integers(-(2**60), 2**60).map(float), TEXT)
JSON = st.recursive(
    JSON_LEAF,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=12), inner, max_size=4)),
    max_leaves=20,
)
LABELS = st.dictionaries(
    st.one_of(st.just(""), st.text(max_size=70), huge_text(64, 100)),
    st.one_of(st.text(max_size=70), huge_text(64, 100)),
    max_size=4,
)


def to_value(obj: Any) -> struct_pb2.Value:
    """Build a Value directly (no finiteness check), so NaN and Infinity reach the wire."""
    v = struct_pb2.Value()
    if obj is None:
        v.null_value = struct_pb2.NULL_VALUE
    elif isinstance(obj, bool):
        v.bool_value = obj
    elif isinstance(obj, float):
        v.number_value = obj
    elif isinstance(obj, str):
        v.string_value = obj
    elif isinstance(obj, list):
        v.list_value.values.extend(to_value(x) for x in obj)
    else:
        v.struct_value.CopyFrom(to_struct(obj))
    return v


def to_struct(obj: dict[str, Any]) -> struct_pb2.Struct:
    s = struct_pb2.Struct()
    for k, item in obj.items():
        s.fields[k].CopyFrom(to_value(item))
    return s


def has_non_finite(obj: Any) -> bool:
    if isinstance(obj, float):
        return not math.isfinite(obj)
    if isinstance(obj, dict):
        return any(has_non_finite(v) for v in obj.values())
    if isinstance(obj, list):
        return any(has_non_finite(v) for v in obj)
    return False


def nested(depth: int) -> dict[str, Any]:
    obj: dict[str, Any] = {"leaf": 1.0}
    for _ in range(depth):
        obj = {"a": obj}
    return obj


ARGS = st.one_of(
    st.dictionaries(st.text(max_size=20), JSON, max_size=6), st.integers(1, 25).map(nested)
)  # within protobuf's parse depth (see the byte-level tests)


@dataclass(frozen=True)
class JsonText:
    """Arguments sent as `arguments_json` text (CallToolRequest's and ToolCallSummary's other `args` form)."""

    text: str


def _strict_object(text: str) -> bool:
    """Whether `text` is a JSON object under RFC 8259 (no NaN/Infinity literals) within rlgate's nesting
    bound; "" counts as {}."""
    if not text:
        return True

    def refuse(constant: str) -> None:
        raise ValueError(constant)

    try:
        value = json.loads(text, parse_constant=refuse)
    except (ValueError, RecursionError):
        return False
    return isinstance(value, dict) and _depth(value) <= MAX_JSON_TEXT_DEPTH


def _depth(value: Any) -> int:
    """Objects/arrays inside each other (iteratively: the fuzzers nest past Python's recursion limit)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


# Text that is not a JSON object, or barely is: syntax errors, NaN literals, other top-level types, nesting
# far past any parser's depth, a 500-digit integer, duplicate keys. JSON rlgate cannot write back (an escaped
# lone surrogate, a number past a double) is left to test_unrepresentable_json_* (refused where it is parsed)
# until it stops answering INTERNAL.
JSON_TEXTS = st.one_of(
    ARGS.map(lambda a: json.dumps(a, allow_nan=True)),
    st.text(max_size=50),
    st.integers(1, 20_000).map(lambda d: '{"a": ' + "[" * d + "]" * d + "}"),
    st.sampled_from(
        [
            "",
            "{}",
            "[]",
            "null",
            '"x"',
            '{"a": 1, "a": 2}',
            '{"a": ' + "9" * 500 + "}",
            '{"a" 1}',
            "\ufeff{}",
            "{" * 5000,
        ]
    ),
).map(JsonText)
EITHER_ARGS = st.one_of(ARGS, JSON_TEXTS)


def invalid_arguments(args: dict[str, Any] | JsonText) -> bool:
    """Arguments every RPC must refuse with INVALID_ARGUMENT."""
    return not _strict_object(args.text) if isinstance(args, JsonText) else has_non_finite(args)


def summary(*, args: dict[str, Any] | JsonText, **fields: Any) -> orchestrator_pb2.ToolCallSummary:
    if isinstance(args, JsonText):
        return orchestrator_pb2.ToolCallSummary(arguments_json=args.text, **fields)
    return orchestrator_pb2.ToolCallSummary(arguments=to_struct(args), **fields)


# Orchestrator credentials: (metadata, valid?)
ORCH_MD = st.one_of(
    st.just(("key", True)),
    st.just(("key", True)),
    st.just(("key", True)),
    st.sampled_from([("none", False), ("wrong", False), ("agent", False), ("scheme", False), ("empty", False)]),
)


def orch_metadata(fx: Fixture, kind: str) -> list[tuple[str, str]]:
    return {
        "key": bearer(API_KEY),
        "none": [],
        "wrong": bearer("not-the-key"),
        "agent": bearer(fx.gateway_tokens["modern"]),
        "scheme": [("authorization", f"Basic {API_KEY}")],
        "empty": [("authorization", "Bearer ")],
    }[kind]


def run(fx: Fixture, rpc: str, call: Callable[[], Any], expected: set[grpc.StatusCode]) -> tuple[grpc.StatusCode, Any]:
    """Make the call; assert it answered one of the statuses its oracle expects (one, for a malformed request)."""
    audit_ = fx.stack.audit
    try:
        reply = call()
        code = SC.OK
    except grpc.RpcError as err:
        reply = err
        code = err.code()
        audit_.error(f"bad_input {rpc}", err)
    fx.count(rpc, code)
    detail = reply.details() if isinstance(reply, grpc.RpcError) else ""
    assert code not in NEVER, f"{rpc} answered {code.name}: {detail}"
    assert code in expected, f"{rpc} answered {code.name} ({detail}); expected {sorted(c.name for c in expected)}"
    return code, reply


# ---------------------------------------------------------------------------------------------------------
# Oracles: the statuses a request calls for under the contract, worked out before it is sent.


def first_failure(*checks: tuple[bool, grpc.StatusCode]) -> grpc.StatusCode | None:
    """The status of the first check that fails, in the order the contract makes them; None when all pass."""
    return next((code for failed, code in checks if failed), None)


def bad_labels(labels: Mapping[str, str]) -> bool:
    return any(not k or len(k) > MAX_LABEL or len(v) > MAX_LABEL for k, v in labels.items())


def reused(request_id: str) -> set[grpc.StatusCode]:
    """The strategies draw request_ids again (hypothesis also replays its examples), and one first used with
    another request is INVALID_ARGUMENT however well-formed this one is; a new one never is."""
    return {SC.INVALID_ARGUMENT} if request_id else set()


def from_value(value: struct_pb2.Value) -> Any:
    """A Struct value as Python, NaN and Infinity kept (json_format would refuse them)."""
    kind = value.WhichOneof("kind")
    if kind == "struct_value":
        return {k: from_value(v) for k, v in value.struct_value.fields.items()}
    if kind == "list_value":
        return [from_value(v) for v in value.list_value.values]
    return None if kind in (None, "null_value") else getattr(value, kind)


def arguments_of(message: Any) -> dict[str, Any] | JsonText:
    """A CallToolRequest's or ToolCallSummary's arguments as the strategies draw them."""
    if message.WhichOneof("args") == "arguments_json":
        return JsonText(message.arguments_json)
    return {k: from_value(v) for k, v in message.arguments.fields.items()}


def orchestrator_auth(authorized: bool, expected: Callable[[], set[grpc.StatusCode]]) -> set[grpc.StatusCode]:
    """Credentials are checked before anything else."""
    return expected() if authorized else {SC.UNAUTHENTICATED}


def expect_reset(fx: Fixture, req: orchestrator_pb2.ResetRequest) -> set[grpc.StatusCode]:
    refused = first_failure(
        (len(req.request_id) > MAX_ID, SC.INVALID_ARGUMENT),
        (len(req.session_id) > MAX_ID, SC.NOT_FOUND),
        (len(req.task_key) > MAX_KEY, SC.NOT_FOUND),
        (len(req.env_key) > MAX_KEY, SC.INVALID_ARGUMENT),
        (bad_labels(req.labels), SC.INVALID_ARGUMENT),
        (len(req.run_id) > MAX_ID, SC.INVALID_ARGUMENT),
        (req.max_turns < 0, SC.INVALID_ARGUMENT),
        (bool(req.session_id) and bool(req.task_key or req.env_key), SC.INVALID_ARGUMENT),
        (not (req.session_id or req.task_key or req.env_key), SC.INVALID_ARGUMENT),
        (bool(req.task_key) and req.task_key not in KNOWN_TASKS, SC.NOT_FOUND),
    )
    if refused is not None:
        return {refused}
    if req.session_id:  # the next episode of a victim, unless an example closed it
        found = {SC.OK, SC.FAILED_PRECONDITION} if req.session_id in fx.victims else {SC.NOT_FOUND}
    elif req.task_key or req.env_key in KNOWN_ENVS:  # a new session, within the session limit or not
        found = {SC.OK, SC.RESOURCE_EXHAUSTED}
    else:
        found = {SC.NOT_FOUND}  # an environment localfleet does not serve
    return found | reused(req.request_id)


def expect_step(fx: Fixture, req: orchestrator_pb2.StepRequest) -> set[grpc.StatusCode]:
    refused = first_failure(
        (len(req.request_id) > MAX_ID, SC.INVALID_ARGUMENT),
        (len(req.session_id) > MAX_ID, SC.NOT_FOUND),
        *((len(c.request_id) > MAX_ID, SC.INVALID_ARGUMENT) for c in req.tool_calls),
        (not req.session_id, SC.INVALID_ARGUMENT),
        *((not c.name or invalid_arguments(arguments_of(c)), SC.INVALID_ARGUMENT) for c in req.tool_calls),
    )
    if refused is not None:
        return {refused}
    # A victim's turn, unless an example ended its episode or closed it.
    found = {SC.OK, SC.FAILED_PRECONDITION} if req.session_id in fx.victims else {SC.NOT_FOUND}
    return found | reused(req.request_id)


def expect_session_lookup(fx: Fixture, session_id: str) -> set[grpc.StatusCode]:
    """State and Close: a victim is found whatever its status (Close is idempotent)."""
    refused = first_failure((len(session_id) > MAX_ID, SC.NOT_FOUND), (not session_id, SC.INVALID_ARGUMENT))
    if refused is not None:
        return {refused}
    return {SC.OK} if session_id in fx.victims else {SC.NOT_FOUND}


def expect_close_sessions(req: orchestrator_pb2.CloseSessionsRequest) -> set[grpc.StatusCode]:
    refused = first_failure(
        (bad_labels(req.labels), SC.INVALID_ARGUMENT),
        (len(req.run_id) > MAX_ID, SC.INVALID_ARGUMENT),
        (not req.labels and not req.run_id, SC.INVALID_ARGUMENT),  # at least one filter
    )
    return {SC.OK} if refused is None else {refused}


def expect_list_tasks(req: orchestrator_pb2.ListTasksRequest) -> set[grpc.StatusCode]:
    refused = first_failure(
        (len(req.env_key) > MAX_KEY, SC.INVALID_ARGUMENT),
        (len(req.page_token) > MAX_PAGE_TOKEN, SC.INVALID_ARGUMENT),
        (req.page_size not in PAGE_SIZES, SC.INVALID_ARGUMENT),
        (bool(req.page_token), SC.INVALID_ARGUMENT),  # every token drawn is forged: none came from this RPC
    )
    return {SC.OK} if refused is None else {refused}  # an unknown env_key lists no task


def expect_list_sessions(req: orchestrator_pb2.ListSessionsRequest) -> set[grpc.StatusCode]:
    refused = first_failure(
        (bad_labels(req.labels), SC.INVALID_ARGUMENT),
        (len(req.run_id) > MAX_ID, SC.INVALID_ARGUMENT),
        (len(req.page_token) > MAX_PAGE_TOKEN, SC.INVALID_ARGUMENT),
        (req.page_size not in PAGE_SIZES, SC.INVALID_ARGUMENT),
        (req.status not in SESSION_STATUSES, SC.INVALID_ARGUMENT),  # proto3 enums are open: any int32 arrives
        (bool(req.page_token), SC.INVALID_ARGUMENT),  # forged, as in ListTasks
    )
    return {SC.OK} if refused is None else {refused}


# ---------------------------------------------------------------------------------------------------------
# Orchestrator RPCs


def session_ids(fx: Fixture) -> st.SearchStrategy[str]:
    return st.one_of(st.sampled_from(fx.victims), ID, st.just("s-ffffffffffffffffffffffff"))


REQUEST_IDS = st.one_of(st.sampled_from(["rel-r1", "rel-r2", "rel-r3"]), huge_text(129, 400))


@settings(parent=PROFILE)
@given(data=st.data())
def test_reset(fx: Fixture, data: st.DataObject) -> None:
    # request_id is drawn from three fixed ids (or an invalid one), so at most three Resets do real work.
    req = orchestrator_pb2.ResetRequest(
        request_id=data.draw(REQUEST_IDS),
        session_id=data.draw(st.one_of(st.just(""), session_ids(fx))),
        task_key=data.draw(
            st.one_of(st.just(""), st.sampled_from(["mailbox-count-unread-from-kenji", "no-such-task"]), ID)
        ),
        env_key=data.draw(st.one_of(st.just(""), st.sampled_from(["mailbox:v1", "tracker", "nope:v9", ":"]), ID)),
        max_turns=data.draw(INT32),
        labels=data.draw(LABELS),
        run_id=data.draw(st.one_of(ID, huge_text(129, 200))),
    )
    kind, ok = data.draw(ORCH_MD)
    orch = orchestrator_stub(fx.stack.orchestrator_address)
    code, reply = run(
        fx,
        "Reset",
        lambda: orch.Reset(req, timeout=RESET_TIMEOUT, metadata=orch_metadata(fx, kind)),
        orchestrator_auth(ok, lambda: expect_reset(fx, req)),
    )
    if code == SC.OK:
        fx.stack.audit.token(reply.agent_token)


@settings(parent=PROFILE)
@given(data=st.data())
def test_step(fx: Fixture, data: st.DataObject) -> None:
    calls = data.draw(
        st.lists(st.tuples(st.one_of(st.just(""), ID), EITHER_ARGS, TEXT, st.booleans(), INT32), max_size=3)
    )
    req = orchestrator_pb2.StepRequest(
        request_id=data.draw(st.one_of(st.just(""), ID)),
        session_id=data.draw(session_ids(fx)),
        assistant_text=data.draw(TEXT),
        done=data.draw(st.booleans()),
        tool_calls=[summary(name=n, args=a, request_id=r, is_error=e, error_kind=k) for n, a, r, e, k in calls],
    )
    if data.draw(st.booleans()):
        req.final_answer = data.draw(TEXT)
    kind, ok = data.draw(ORCH_MD)
    orch = orchestrator_stub(fx.stack.orchestrator_address)
    run(
        fx,
        "Step",
        lambda: orch.Step(req, timeout=CALL_TIMEOUT, metadata=orch_metadata(fx, kind)),
        orchestrator_auth(ok, lambda: expect_step(fx, req)),
    )


@settings(parent=PROFILE)
@given(data=st.data())
def test_state(fx: Fixture, data: st.DataObject) -> None:
    import base64
    import hashlib
    import json

    session_id = data.draw(session_ids(fx))
    # Tokens forged for this very session (the scope matches), with any position in them: one that reads as
    # "<episode>:<position>" with episode >= 1 and position >= 0 may be one State would issue (answered, or
    # refused when the victim has not reached that episode); any other is refused.
    scope = hashlib.sha256(f"state:{session_id}".encode("utf-8", "surrogatepass")).hexdigest()[:16]
    position = data.draw(st.one_of(st.builds(lambda e, a: f"{e}:{a}", INT32, INT32), st.text(max_size=20)))
    scoped = base64.urlsafe_b64encode(json.dumps({"p": position, "s": scope}).encode()).decode()
    token = data.draw(st.one_of(_page_tokens(), st.just(scoped)))
    req = orchestrator_pb2.StateRequest(
        session_id=session_id,
        include_tool_calls=data.draw(st.booleans()),
        tool_calls_page_size=data.draw(INT32),
        tool_calls_page_token=token,
    )
    kind, ok = data.draw(ORCH_MD)
    orch = orchestrator_stub(fx.stack.orchestrator_address)
    code, reply = run(
        fx,
        "State",
        lambda: orch.State(req, timeout=CALL_TIMEOUT, metadata=orch_metadata(fx, kind)),
        orchestrator_auth(ok, lambda: expect_state(fx, req, issuable=token == scoped and _issuable(position))),
    )
    if code == SC.OK:
        assert len(reply.tool_calls) <= (req.tool_calls_page_size or 100)


def _issuable(position: str) -> bool:
    episode, sep, after = position.partition(":")
    try:
        return bool(sep) and int(episode) >= 1 and int(after) >= 0
    except ValueError:
        return False


def expect_state(fx: Fixture, req: orchestrator_pb2.StateRequest, *, issuable: bool) -> set[grpc.StatusCode]:
    """State: the token's length is a field limit (checked first); then the session is looked up; then the page
    size and the token are checked, with or without include_tool_calls."""
    if len(req.tool_calls_page_token) > MAX_PAGE_TOKEN:
        return {SC.INVALID_ARGUMENT}
    found = expect_session_lookup(fx, req.session_id)
    if found != {SC.OK}:
        return found
    refused = first_failure(
        (req.tool_calls_page_size not in PAGE_SIZES, SC.INVALID_ARGUMENT),
        (bool(req.tool_calls_page_token) and not issuable, SC.INVALID_ARGUMENT),
    )
    if refused is not None:
        return {refused}
    return {SC.OK, SC.INVALID_ARGUMENT} if req.tool_calls_page_token else {SC.OK}


@settings(parent=PROFILE)
@given(data=st.data())
def test_close(fx: Fixture, data: st.DataObject) -> None:
    req = orchestrator_pb2.CloseRequest(session_id=data.draw(session_ids(fx)))
    kind, ok = data.draw(ORCH_MD)
    orch = orchestrator_stub(fx.stack.orchestrator_address)
    run(
        fx,
        "Close",
        lambda: orch.Close(req, timeout=CALL_TIMEOUT, metadata=orch_metadata(fx, kind)),
        orchestrator_auth(ok, lambda: expect_session_lookup(fx, req.session_id)),
    )


@settings(parent=PROFILE)
@given(data=st.data())
def test_close_sessions(fx: Fixture, data: st.DataObject) -> None:
    req = orchestrator_pb2.CloseSessionsRequest(
        labels=data.draw(st.one_of(LABELS, st.just({"suite": "victim"}))),
        run_id=data.draw(st.one_of(st.just(""), st.just("rel-victim"), ID)),
    )
    kind, ok = data.draw(ORCH_MD)
    orch = orchestrator_stub(fx.stack.orchestrator_address)
    run(
        fx,
        "CloseSessions",
        lambda: orch.CloseSessions(req, timeout=CALL_TIMEOUT, metadata=orch_metadata(fx, kind)),
        orchestrator_auth(ok, lambda: expect_close_sessions(req)),
    )


def _page_tokens() -> st.SearchStrategy[str]:
    import base64
    import json

    forged = st.builds(
        lambda p, s: base64.urlsafe_b64encode(json.dumps({"p": p, "s": s}).encode()).decode(),
        st.text(max_size=20),
        st.text(max_size=20),
    )
    return st.one_of(st.just(""), ID, forged, st.binary(max_size=40).map(lambda b: base64.b64encode(b).decode()))


@settings(parent=PROFILE)
@given(data=st.data())
def test_list_tasks(fx: Fixture, data: st.DataObject) -> None:
    req = orchestrator_pb2.ListTasksRequest(
        env_key=data.draw(st.one_of(st.sampled_from(["", "mailbox", "tracker:v1", "x:y:z"]), ID)),
        page_size=data.draw(INT32),
        page_token=data.draw(_page_tokens()),
    )
    kind, ok = data.draw(ORCH_MD)
    orch = orchestrator_stub(fx.stack.orchestrator_address)
    code, reply = run(
        fx,
        "ListTasks",
        lambda: orch.ListTasks(req, timeout=CALL_TIMEOUT, metadata=orch_metadata(fx, kind)),
        orchestrator_auth(ok, lambda: expect_list_tasks(req)),
    )
    if code == SC.OK:
        assert len(reply.tasks) <= (req.page_size or 100)


@settings(parent=PROFILE)
@given(data=st.data())
def test_list_sessions(fx: Fixture, data: st.DataObject) -> None:
    req = orchestrator_pb2.ListSessionsRequest(
        status=cast(common_pb2.SessionStatus, data.draw(st.one_of(st.integers(0, 6), INT32))),  # any number
        labels=data.draw(LABELS),
        run_id=data.draw(st.one_of(st.just(""), ID)),
        page_size=data.draw(INT32),
        page_token=data.draw(_page_tokens()),
    )
    kind, ok = data.draw(ORCH_MD)
    orch = orchestrator_stub(fx.stack.orchestrator_address)
    code, reply = run(
        fx,
        "ListSessions",
        lambda: orch.ListSessions(req, timeout=CALL_TIMEOUT, metadata=orch_metadata(fx, kind)),
        orchestrator_auth(ok, lambda: expect_list_sessions(req)),
    )
    if code == SC.OK:
        assert len(reply.sessions) <= (req.page_size or 100)


# ---------------------------------------------------------------------------------------------------------
# Gateway RPCs

GW_MD = st.one_of(
    st.sampled_from(["modern", "legacy"]).map(lambda e: ("live", e)),
    st.sampled_from(["modern", "legacy"]).map(lambda e: ("live", e)),
    st.sampled_from(["revoked", "closed", "done", "api-key", "none", "garbage", "empty", "scheme", "huge"]).map(
        lambda k: (k, "")
    ),
)


def gateway_metadata(fx: Fixture, kind: str, era: str) -> list[tuple[str, str]]:
    if kind == "live":
        return bearer(fx.gateway_tokens[era])
    if kind in fx.dead_tokens:
        return bearer(fx.dead_tokens[kind])
    return {
        "api-key": bearer(API_KEY),
        "none": [],
        "garbage": bearer("garbage-token"),
        "empty": [("authorization", "Bearer")],
        "scheme": [("authorization", f"Token {fx.gateway_tokens['modern']}")],
        "huge": bearer("t" * 4000),
    }[kind]


def gateway_auth(kind: str, expected: Callable[[], set[grpc.StatusCode]]) -> set[grpc.StatusCode]:
    """Credentials are checked first: an ended token says why (FAILED_PRECONDITION with its reason);
    UNAUTHENTICATED is for tokens never issued; a live token's request is judged on its fields."""
    if kind == "live":
        return expected()
    return {SC.FAILED_PRECONDITION} if kind in ("revoked", "closed", "done") else {SC.UNAUTHENTICATED}


def expect_call_tool(req: toolgateway_pb2.CallToolRequest) -> set[grpc.StatusCode]:
    """A live token's CallTool: a malformed request is INVALID_ARGUMENT; a well-formed one is answered OK
    (an unknown tool, or arguments failing its schema, are is_error results: the model's mistakes)."""
    form = req.WhichOneof("args")
    size = len(req.arguments_json.encode()) if form == "arguments_json" else req.arguments.ByteSize()
    refused = first_failure(
        (not TOOL_NAME.fullmatch(req.name), SC.INVALID_ARGUMENT),
        (len(req.request_id) > MAX_ID, SC.INVALID_ARGUMENT),
        (size > MAX_ARGUMENTS_BYTES, SC.INVALID_ARGUMENT),
        (invalid_arguments(arguments_of(req)), SC.INVALID_ARGUMENT),
    )
    return {SC.OK} | reused(req.request_id) if refused is None else {refused}


@settings(parent=PROFILE)
@given(data=st.data())
def test_list_tools(fx: Fixture, data: st.DataObject) -> None:
    kind, era = data.draw(GW_MD)
    gw = gateway_stub(fx.stack.gateway_address)
    code, reply = run(
        fx,
        "ListTools",
        lambda: gw.ListTools(
            toolgateway_pb2.ListToolsRequest(), timeout=CALL_TIMEOUT, metadata=gateway_metadata(fx, kind, era)
        ),
        gateway_auth(kind, lambda: {SC.OK}),
    )
    if code == SC.OK:
        assert [t.name for t in reply.tools] == [t.name for t in fx.tools[era]]


@settings(parent=PROFILE)
@given(data=st.data())
def test_call_tool(fx: Fixture, data: st.DataObject) -> None:
    kind, era = data.draw(GW_MD)
    era = era or "modern"
    tools = fx.tools[era]
    known = st.sampled_from([t.name for t in tools])
    name = data.draw(st.one_of(known, known, known, st.just(""), ID))  # mostly real tools: reach the upstream
    spec = next((t for t in tools if t.name == name), None)
    props = list(json.loads(spec.input_schema_json).get("properties") or {}) if spec else []
    keys = st.one_of(st.sampled_from(props), st.text(max_size=12)) if props else st.text(max_size=12)
    args = data.draw(st.one_of(st.dictionaries(keys, JSON, max_size=5), ARGS, JSON_TEXTS))
    # fresh ids run; short texts repeat across examples with other arguments (bound: INVALID_ARGUMENT)
    request_id = data.draw(st.one_of(st.just(""), st.uuids().map(str), st.text(max_size=20), huge_text(129, 300)))
    req = toolgateway_pb2.CallToolRequest(request_id=request_id, name=name)
    if isinstance(args, JsonText):
        req.arguments_json = args.text
    else:
        req.arguments.CopyFrom(to_struct(args))
    gw = gateway_stub(fx.stack.gateway_address)
    code, reply = run(
        fx,
        "CallTool",
        lambda: gw.CallTool(req, timeout=CALL_TIMEOUT, metadata=gateway_metadata(fx, kind, era)),
        gateway_auth(kind, lambda: expect_call_tool(req)),
    )
    if code == SC.OK and spec is None and not reply.replayed:
        assert reply.result.is_error
        assert reply.result.error_kind == common_pb2.TOOL_ERROR_KIND_UNKNOWN_TOOL


# ---------------------------------------------------------------------------------------------------------
# Byte-level abuse, once per RPC

ORCH_RPCS = ["Reset", "Step", "State", "Close", "CloseSessions", "ListTasks", "ListSessions"]
GW_RPCS = ["ListTools", "CallTool"]
ALL_RPCS = [("OrchestratorService", r) for r in ORCH_RPCS] + [("ToolGatewayService", r) for r in GW_RPCS]


def raw_call(fx: Fixture, service: str, rpc: str, payload: bytes) -> grpc.StatusCode:
    address = fx.stack.orchestrator_address if service == "OrchestratorService" else fx.stack.gateway_address
    md = bearer(API_KEY) if service == "OrchestratorService" else bearer(fx.gateway_tokens["modern"])
    with grpc.insecure_channel(address, options=[("grpc.max_send_message_length", -1)]) as channel:
        method: grpc.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary(f"/rlgate.v1.{service}/{rpc}")
        try:
            method(payload, timeout=CALL_TIMEOUT, metadata=tuple(md))
        except grpc.RpcError as err:
            fx.stack.audit.error(f"raw {rpc}", err)
            return err.code()
    return SC.OK


REQUEST_TYPES: dict[str, Any] = {
    "Reset": orchestrator_pb2.ResetRequest,
    "Step": orchestrator_pb2.StepRequest,
    "State": orchestrator_pb2.StateRequest,
    "Close": orchestrator_pb2.CloseRequest,
    "CloseSessions": orchestrator_pb2.CloseSessionsRequest,
    "ListTasks": orchestrator_pb2.ListTasksRequest,
    "ListSessions": orchestrator_pb2.ListSessionsRequest,
    "ListTools": toolgateway_pb2.ListToolsRequest,
    "CallTool": toolgateway_pb2.CallToolRequest,
}


def expect_raw(fx: Fixture, rpc: str, payload: bytes) -> set[grpc.StatusCode]:
    """What `payload` calls for as `rpc`'s request (with `raw_call`'s valid credentials): INVALID_ARGUMENT
    when it does not parse as one, else what the RPC's oracle says about the message it parses as (a valid
    message whose unknown fields protobuf skips, for forward compatibility)."""
    try:
        req = REQUEST_TYPES[rpc].FromString(payload)
    except DecodeError:
        return {SC.INVALID_ARGUMENT}
    oracles: dict[str, Callable[[], set[grpc.StatusCode]]] = {
        "Reset": lambda: expect_reset(fx, req),
        "Step": lambda: expect_step(fx, req),
        "State": lambda: expect_session_lookup(fx, req.session_id),
        "Close": lambda: expect_session_lookup(fx, req.session_id),
        "CloseSessions": lambda: expect_close_sessions(req),
        "ListTasks": lambda: expect_list_tasks(req),
        "ListSessions": lambda: expect_list_sessions(req),
        "ListTools": lambda: {SC.OK},
        "CallTool": lambda: expect_call_tool(req),
    }
    return oracles[rpc]()


def deep_step_bytes(depth: int) -> bytes:
    req = orchestrator_pb2.StepRequest(session_id="s-nope", tool_calls=[orchestrator_pb2.ToolCallSummary(name="a")])
    req.tool_calls[0].arguments.CopyFrom(to_struct(nested(depth)))
    return req.SerializeToString()


@pytest.mark.parametrize(("service", "rpc"), ALL_RPCS)
def test_oversized_message_is_resource_exhausted(fx: Fixture, service: str, rpc: str) -> None:
    size = MAX_RECEIVE + 1024
    payload = b"\x0a" + _VarintBytes(size) + b"a" * size  # field 1, length-delimited
    assert raw_call(fx, service, rpc, payload) == SC.RESOURCE_EXHAUSTED


@pytest.mark.parametrize(("service", "rpc"), ALL_RPCS)
def test_another_rpcs_message_gets_what_it_parses_as(fx: Fixture, service: str, rpc: str) -> None:
    """Another RPC's message is judged as what it parses as in this RPC's request type (protobuf does not
    tell one message from another): exactly the status that request calls for."""
    wrong = orchestrator_pb2.StepRequest(
        session_id="x", assistant_text="y", done=True, tool_calls=[orchestrator_pb2.ToolCallSummary(name="z")]
    ).SerializeToString()
    expected = expect_raw(fx, rpc, wrong)
    code = raw_call(fx, service, rpc, wrong)
    assert code in expected, f"{code.name}; expected {sorted(c.name for c in expected)}"


@pytest.mark.parametrize(("service", "rpc"), ALL_RPCS)
def test_corrupt_protobuf_is_invalid_argument(fx: Fixture, service: str, rpc: str) -> None:
    """Bytes that do not parse (a truncated varint) are the caller's mistake. Bytes that parse only as
    unknown fields are a valid message (protobuf skips unknown fields for forward compatibility): they
    get the RPC's documented answer, never UNKNOWN or INTERNAL."""
    assert raw_call(fx, service, rpc, b"\x08\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff") == SC.INVALID_ARGUMENT
    deep = deep_step_bytes(60)  # 60 nested objects: past protobuf's parse depth of 100 messages
    expected = expect_raw(fx, rpc, deep)
    code = raw_call(fx, service, rpc, deep)
    assert code in expected, f"{code.name}; expected {sorted(c.name for c in expected)}"


@pytest.mark.parametrize(
    ("service", "rpc", "payload"),
    [
        ("OrchestratorService", "Step", lambda: deep_step_bytes(60)),
        ("ToolGatewayService", "CallTool", lambda: deep_call_bytes(60)),
    ],
)
def test_struct_past_parse_depth_is_invalid_argument(
    fx: Fixture, service: str, rpc: str, payload: Callable[[], bytes]
) -> None:
    """A Struct nested past protobuf's parse depth, in a field the RPC knows, is INVALID_ARGUMENT."""
    assert raw_call(fx, service, rpc, payload()) == SC.INVALID_ARGUMENT


def deep_call_bytes(depth: int) -> bytes:
    req = toolgateway_pb2.CallToolRequest(name="list_folders", request_id="deep")
    req.arguments.CopyFrom(to_struct(nested(depth)))
    return req.SerializeToString()


def test_client_survives_deeply_nested_model_arguments(fx: Fixture) -> None:
    """A model that writes arguments nested past the JSON text bound (MAX_JSON_TEXT_DEPTH) made an agent
    mistake: the client must turn it into an INVALID_ARGUMENT error (or the gateway into an is_error result),
    never a parser's exception. Arguments 40 deep (once past what a Struct could carry) arrive exactly."""
    from rlgate import Client, InvalidArgument

    with Client(fx.stack.orchestrator_address, api_key=API_KEY) as client:
        within = client.call_tool(
            fx.gateway_tokens["modern"], "list_folders", nested(40), gateway=fx.stack.gateway_address,
            timeout=CALL_TIMEOUT,
        )  # fmt: skip
        assert not within.result.is_error, within.result.error_message
        try:
            reply = client.call_tool(
                fx.gateway_tokens["modern"],
                "list_folders",
                nested(MAX_JSON_TEXT_DEPTH + 16),
                gateway=fx.stack.gateway_address,
                timeout=CALL_TIMEOUT,
            )
        except InvalidArgument:
            return
        except Exception as exc:  # the point is which exception escapes
            pytest.fail(f"{type(exc).__module__}.{type(exc).__name__}: {exc}")
    assert reply.result.is_error and reply.result.error_kind == common_pb2.TOOL_ERROR_KIND_INVALID_ARGUMENTS


# valid JSON syntax, no JSON value rlgate can carry: INVALID_ARGUMENT where it is parsed (convert.parse_json_text)
UNREPRESENTABLE = {"lone-surrogate": '{"a": "\\ud800"}', "overflow": '{"a": 1e999}'}
unrepresentable = pytest.mark.parametrize("text", list(UNREPRESENTABLE.values()), ids=list(UNREPRESENTABLE))


@unrepresentable
def test_unrepresentable_json_in_step_arguments(fx: Fixture, text: str) -> None:
    """A ToolCallSummary whose arguments_json cannot be written back is refused: Step parses a turn's
    arguments (its request_id is bound to them as JSON), so INVALID_ARGUMENT naming the field; the session
    goes on: State and the next Step answer. Found by test_step's fuzzing."""
    orch = orchestrator_stub(fx.stack.orchestrator_address)
    md = bearer(API_KEY)
    session = orch.Reset(orchestrator_pb2.ResetRequest(env_key="mailbox:v1"), timeout=RESET_TIMEOUT, metadata=md)
    fx.stack.audit.token(session.agent_token)
    bad = orchestrator_pb2.ToolCallSummary(name="a", arguments_json=text)
    sid = session.session_id
    calls: list[tuple[str, Callable[[], Any]]] = [
        ("Step", lambda: orch.Step(orchestrator_pb2.StepRequest(session_id=sid, tool_calls=[bad], request_id="un"),
                                   timeout=CALL_TIMEOUT, metadata=md)),
        ("State", lambda: orch.State(orchestrator_pb2.StateRequest(session_id=sid, include_tool_calls=True),
                                     timeout=CALL_TIMEOUT, metadata=md)),
        ("Step", lambda: orch.Step(orchestrator_pb2.StepRequest(session_id=sid, done=True), timeout=CALL_TIMEOUT,
                                   metadata=md)),
    ]  # fmt: skip
    for (rpc, call), expected in zip(calls, [{SC.INVALID_ARGUMENT}, {SC.OK}, {SC.OK}], strict=True):
        run(fx, rpc, call, expected)


@unrepresentable
def test_unrepresentable_json_in_call_arguments(fx: Fixture, text: str) -> None:
    """The same arguments to CallTool: INVALID_ARGUMENT (the gateway parses arguments before the call)."""
    gw = gateway_stub(fx.stack.gateway_address)
    req = toolgateway_pb2.CallToolRequest(name="list_folders", request_id=f"un-{len(text)}", arguments_json=text)
    run(
        fx, "CallTool", lambda: gw.CallTool(req, timeout=CALL_TIMEOUT, metadata=bearer(fx.gateway_tokens["modern"])),
        {SC.INVALID_ARGUMENT},
    )  # fmt: skip


HUGE_ID = "s-" + "x" * 20_000


@pytest.mark.parametrize(
    ("rpc", "message"),
    [
        ("State", orchestrator_pb2.StateRequest(session_id=HUGE_ID)),
        ("Close", orchestrator_pb2.CloseRequest(session_id=HUGE_ID)),
        ("Step", orchestrator_pb2.StepRequest(session_id=HUGE_ID)),
        ("Reset", orchestrator_pb2.ResetRequest(session_id=HUGE_ID)),
        ("Reset", orchestrator_pb2.ResetRequest(task_key=HUGE_ID)),
    ],
    ids=["State", "Close", "Step", "Reset-session", "Reset-task"],
)
def test_huge_unknown_ids_are_not_echoed(fx: Fixture, rpc: str, message: Any) -> None:
    """A 20 kB unknown id is NOT_FOUND, and the error does not echo it whole: an echo overflows the
    caller's metadata limit (16 kB), which then sees RESOURCE_EXHAUSTED 'Stream removed' instead."""
    orch = orchestrator_stub(fx.stack.orchestrator_address)
    try:
        getattr(orch, rpc)(message, timeout=CALL_TIMEOUT, metadata=bearer(API_KEY))
        code, detail = SC.OK, ""
    except grpc.RpcError as err:
        fx.stack.audit.error(f"huge id {rpc}", err)
        code, detail = err.code(), err.details() or ""
    assert (code.name, len(detail) <= 2048) == ("NOT_FOUND", True), f"{code.name}: {detail[:200]}"


def test_servers_healthy_and_store_consistent(fx: Fixture, figures: Figures) -> None:
    """After everything above: every service SERVING and the store's invariants hold."""
    import asyncio

    assert fx.stack.healthy() == {"orchestrator": True, "toolgateway": True, "localfleet": True}

    async def problems() -> list[str]:
        store = await open_store(fx.stack.store_url)
        try:
            return await store.check_invariants()
        finally:
            await store.close()

    found = asyncio.run(problems())
    figures.record("bad_input", "store_invariant_problems", len(found))
    assert found == []
    started = time.perf_counter()
    assert (
        orchestrator_stub(fx.stack.orchestrator_address)
        .ListTasks(orchestrator_pb2.ListTasksRequest(), timeout=CALL_TIMEOUT, metadata=bearer(API_KEY))
        .total
        > 0
    )
    figures.record("bad_input", "list_tasks_after_ms", round((time.perf_counter() - started) * 1000, 1))
