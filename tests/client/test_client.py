"""Client and AsyncClient against real grpc.aio servers with scripted answers: retries, request ids,
metadata, status mapping (with the services' google.rpc details), deadlines, round-robin and failover,
and exact JSON arguments."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2

import rlgate
from rlgate import AsyncClient, Client, ClientSettings, RetryPolicy
from rlgate.client import TRACE_HEADER
from rlgate.core import errors as service_errors  # the classes both services raise (the client's own)
from rlgate.core.convert import arguments_of
from rlgate.retry import NO_RETRY, RetryState
from tests.client.scripted import Rich, ScriptedServer, Sleep
from tests.support.ports import free_port

FAST = RetryPolicy(initial_backoff=0.01, max_backoff=0.05)
U = grpc.StatusCode.UNAVAILABLE


def test_reset_retries_unavailable_with_one_request_id(server: ScriptedServer) -> None:
    server.script.push("Reset", U, U)
    with Client(server.address, api_key="k1", retry=FAST) as client:
        response = client.reset(task_key="t1", max_turns=3, trace_id="trace-1")
    assert response.session_id == "s-1"
    seen = server.script.seen["Reset"]
    assert len(seen) == 3
    ids = {s.request.request_id for s in seen}
    assert len(ids) == 1 and ids.pop()
    assert all(s.metadata["authorization"] == "Bearer k1" for s in seen)
    assert all(s.metadata[TRACE_HEADER] == "trace-1" for s in seen)
    assert seen[0].request.task_key == "t1" and seen[0].request.max_turns == 3


async def test_async_step_retries_unavailable_with_one_request_id(server: ScriptedServer) -> None:
    server.script.push("Step", U)
    async with AsyncClient(server.address, retry=FAST) as client:
        response = await client.step("s-1", assistant_text="hi", final_answer="42")
    assert response.done and response.reward == 1.0
    seen = server.script.seen["Step"]
    assert len(seen) == 2 and seen[0].request.request_id == seen[1].request.request_id != ""
    assert seen[0].request.final_answer == "42"
    assert "authorization" not in seen[0].metadata  # no API key configured


def test_retries_after_unavailable_are_reported_on_the_sessions_next_step(server: ScriptedServer) -> None:
    """The client counts its retries after UNAVAILABLE per session (CallTool: the session its agent token names;
    Step and State: their session_id) and reports them once, on the next Step; a Step that fails hands its
    count on to the next one. Another session's count is its own."""
    token = "rlg1.s-1.secret"
    server.script.push("CallTool", U, U)
    server.script.push("State", U)
    server.script.push("Step", U, grpc.StatusCode.INTERNAL)
    with Client(server.address, retry=FAST, gateway_addresses=server.address) as client:
        client.call_tool(token, "echo", {"x": 1})  # 2 retries
        client.call_tool("rlg1.s-2.secret", "echo", {})  # answered at once: nothing for s-2
        client.state("s-1")  # 1 retry
        with pytest.raises(rlgate.Internal):
            client.step("s-1")  # carries 3, retried once (1 more), then fails: 4 go to the next Step
        client.step("s-1")
        client.step("s-1")
        client.step("s-2")
    reported = [(s.request.session_id, s.request.client_retries) for s in server.script.seen["Step"]]
    assert reported == [("s-1", 3), ("s-1", 3), ("s-1", 4), ("s-1", 0), ("s-2", 0)]


@pytest.mark.parametrize(
    ("code", "error"),
    [
        (grpc.StatusCode.UNAUTHENTICATED, rlgate.Unauthenticated),
        (grpc.StatusCode.PERMISSION_DENIED, rlgate.PermissionDenied),
        (grpc.StatusCode.NOT_FOUND, rlgate.NotFound),
        (grpc.StatusCode.FAILED_PRECONDITION, rlgate.FailedPrecondition),
        (grpc.StatusCode.INVALID_ARGUMENT, rlgate.InvalidArgument),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, rlgate.ResourceExhausted),
        (grpc.StatusCode.INTERNAL, rlgate.Internal),
    ],
)
def test_statuses_map_to_exceptions_without_retry(
    server: ScriptedServer, code: grpc.StatusCode, error: type[Exception]
) -> None:
    server.script.push("Step", code)
    with Client(server.address, retry=FAST) as client, pytest.raises(error) as info:
        client.step("s-1", assistant_text="x")
    assert server.script.count("Step") == 1
    assert isinstance(info.value, rlgate.RlgateError) and info.value.code == code
    assert "scripted" in str(info.value)


async def test_async_statuses_map_too(server: ScriptedServer) -> None:
    server.script.push("State", grpc.StatusCode.NOT_FOUND)
    async with AsyncClient(server.address, retry=FAST) as client:
        with pytest.raises(rlgate.NotFound):
            await client.state("nope")


def test_retries_are_bounded_by_the_deadline(server: ScriptedServer) -> None:
    server.script.push("Reset", *([U] * 1000))
    policy = RetryPolicy(max_attempts=1000, initial_backoff=0.05, max_backoff=0.2)
    started = time.monotonic()
    with Client(server.address, retry=policy) as client, pytest.raises((rlgate.Unavailable, rlgate.DeadlineExceeded)):
        client.reset(task_key="t", timeout=1.0)
    assert time.monotonic() - started < 3.0
    assert 2 < server.script.count("Reset") < 100


def test_max_attempts_bounds_retries(server: ScriptedServer) -> None:
    server.script.push("Close", *([U] * 10))
    policy = RetryPolicy(max_attempts=3, initial_backoff=0.01)
    with Client(server.address, retry=policy) as client, pytest.raises(rlgate.Unavailable, match="after 3 attempts"):
        client.close_session("s-1")
    assert server.script.count("Close") == 3


def test_attempt_timeout_retries_a_hung_step_with_the_same_request_id(server: ScriptedServer) -> None:
    server.script.push("Step", Sleep(3.0))
    policy = RetryPolicy(initial_backoff=0.01, attempt_timeout=0.5)
    with Client(server.address, retry=policy) as client:
        response = client.step("s-1", assistant_text="x", timeout=10.0)
    assert response.turn == 1
    seen = server.script.seen["Step"]
    assert len(seen) == 2 and seen[0].request.request_id == seen[1].request.request_id


def test_deadline_without_attempt_timeout_is_not_retried(server: ScriptedServer) -> None:
    server.script.push("Step", Sleep(3.0))
    with Client(server.address, retry=FAST) as client, pytest.raises(rlgate.DeadlineExceeded):
        client.step("s-1", timeout=0.5)
    assert server.script.count("Step") == 1


def test_call_tool_retries_unavailable_with_the_same_request_id_and_agent_token(server: ScriptedServer) -> None:
    server.script.push("CallTool", U)
    with Client(server.address, api_key="orchestrator-key", retry=FAST) as client:
        response = client.call_tool("agent-token", "echo", {"x": 1}, gateway=server.address)
    assert response.result.content[0].text.text == "echo ok"
    seen = server.script.seen["CallTool"]
    assert len(seen) == 2 and seen[0].request.request_id == seen[1].request.request_id != ""
    assert all(s.metadata["authorization"] == "Bearer agent-token" for s in seen)
    assert seen[0].request.WhichOneof("args") == "arguments_json" and arguments_of(seen[0].request) == {"x": 1}


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
async def test_call_tool_sends_arguments_json_that_keeps_integers_exact(
    server: ScriptedServer, asynchronous: bool
) -> None:
    """2^60 is past a double's 53 bits: a Struct would deliver 1152921504606846976.0 (or another integer)."""
    arguments = {"n": 2**60, "limit": 3, "ids": [2**60 + 1, -(2**60)], "ratio": 0.5, "name": "Jürgen"}
    if asynchronous:
        async with AsyncClient(server.address, retry=FAST) as aclient:
            await aclient.call_tool("tok", "echo", arguments, gateway=server.address)
    else:
        with Client(server.address, retry=FAST) as client:
            await asyncio.to_thread(client.call_tool, "tok", "echo", arguments, gateway=server.address)
    (seen,) = server.script.seen["CallTool"]
    assert seen.request.WhichOneof("args") == "arguments_json"
    sent = json.loads(seen.request.arguments_json)
    assert sent == arguments and type(sent["n"]) is int and type(sent["limit"]) is int
    assert '"n":1152921504606846976' in seen.request.arguments_json


@pytest.mark.parametrize(
    ("arguments", "problem"),
    [({"x": float("nan")}, r"\$\.x is nan"), ({"x": [float("inf")]}, r"\$\.x\[0\] is inf"), (["x"], "mapping")],
)
def test_call_tool_refuses_arguments_json_cannot_carry(server: ScriptedServer, arguments: object, problem: str) -> None:
    with Client(server.address, retry=FAST) as client, pytest.raises(rlgate.InvalidArgument, match=problem):
        client.call_tool("tok", "echo", arguments, gateway=server.address)  # type: ignore[arg-type]
    assert server.script.count("CallTool") == 0


def test_call_tool_is_not_retried_after_its_deadline(server: ScriptedServer) -> None:
    server.script.push("CallTool", Sleep(3.0))
    policy = RetryPolicy(initial_backoff=0.01, attempt_timeout=0.3)  # even with per-attempt timeouts
    with Client(server.address, retry=policy) as client, pytest.raises(rlgate.DeadlineExceeded):
        client.call_tool("agent-token", "echo", gateway=server.address, timeout=5.0)
    assert server.script.count("CallTool") == 1


def test_call_tool_is_not_retried_on_other_errors(server: ScriptedServer) -> None:
    server.script.push("CallTool", grpc.StatusCode.FAILED_PRECONDITION)
    with Client(server.address, retry=FAST) as client, pytest.raises(rlgate.FailedPrecondition):
        client.call_tool("agent-token", "echo", gateway=server.address)
    assert server.script.count("CallTool") == 1


def test_round_robin_over_addresses(server: ScriptedServer, server2: ScriptedServer) -> None:
    with Client([server.address, server2.address], retry=FAST) as client:
        for _ in range(6):
            client.state("s-1")
    assert server.script.count("State") == 3 and server2.script.count("State") == 3


async def test_failover_to_a_live_address(server: ScriptedServer) -> None:
    dead = f"127.0.0.1:{free_port()}"
    async with AsyncClient(f"{dead},{server.address}", retry=FAST) as client:
        for _ in range(4):
            assert (await client.reset(task_key="t")).session_id == "s-1"
    assert server.script.count("Reset") == 4


async def test_a_new_client_reaches_a_server_restarted_on_its_port() -> None:
    """A client made after a server restarted on the same address connects at once. gRPC's default shares a
    connection, and its reconnect backoff, between all channels of a process to one address: the new client
    used to inherit the old one's "connection refused" for 0.8-1.2 s (and so failed CI once, when a test's
    server got a port a stopped server of an earlier test had used)."""
    first = ScriptedServer().start()
    port = first.port
    try:
        async with AsyncClient(first.address, settings=ClientSettings(retry=NO_RETRY)) as old:
            await old.step("s-1", assistant_text="hi", timeout=5)
            await asyncio.to_thread(first.stop)
            with pytest.raises(rlgate.Unavailable):  # the old connection is refused, and backs off
                await old.step("s-1", assistant_text="hi", timeout=0.3)
            second = ScriptedServer(port=port).start()
            try:
                async with AsyncClient(
                    second.address,
                    settings=ClientSettings(retry=NO_RETRY, gateway_addresses=(second.address,)),
                ) as new:
                    await new.step("s-1", assistant_text="hi", timeout=0.5)
                    await new.call_tool("tok", "echo", timeout=0.5)
            finally:
                second.stop()
    finally:
        first.stop()


def test_gateway_addresses_override(server: ScriptedServer, server2: ScriptedServer) -> None:
    with Client(server.address, gateway_addresses=server2.address, retry=FAST) as client:
        client.call_tool("tok", "echo", gateway=f"127.0.0.1:{free_port()}")  # never dialed
    assert server2.script.count("CallTool") == 1 and server.script.count("CallTool") == 0


def test_call_tool_without_a_gateway_says_what_to_pass(server: ScriptedServer) -> None:
    with Client(server.address, retry=FAST) as client, pytest.raises(ValueError) as info:
        client.call_tool("tok", "echo")
    message = str(info.value)
    assert message.startswith("no toolgateway address: pass gateway='host:port'") and "RLGATE_GATEWAY" in message
    assert "Reset returned none" not in message  # no Reset was involved
    assert server.script.count("CallTool") == 0


# -- the services' statuses: google.rpc.Status details from rlgate.core.errors, on both planes


def _one_call(method: str) -> Callable[[Any, str], Any]:
    """A sync or async client call of `method` (Step to the orchestrator, CallTool to the gateway)."""

    def call(client: Any, address: str) -> Any:
        if method == "Step":
            return client.step("s-1", assistant_text="hi", timeout=10)
        return client.call_tool("tok", "echo", {"x": 1}, gateway=address, timeout=10)

    return call


# Refusals the client retries after their RetryInfo: UNAVAILABLE from either service
# (rlgate.core.errors.Unavailable), and a connection over its reply budget, refused before any work
# (RESOURCE_EXHAUSTED with reason REPLY_BUDGET), which CallTool retries too.
RETRIED_REFUSALS = {
    "unavailable": service_errors.Unavailable("upstream busy", retry_after_s=0.4),
    "reply-budget": service_errors.ResourceExhausted(
        "this connection has 400 bytes of replies unread",
        subject="connection 127.0.0.1:1",
        reason="REPLY_BUDGET",
        retry_after_s=0.4,
    ),
}


@pytest.mark.parametrize("refusal", list(RETRIED_REFUSALS))
@pytest.mark.parametrize("method", ["Step", "CallTool"])
@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
async def test_retry_info_paces_the_retry_with_the_same_request_id(
    server: ScriptedServer, method: str, asynchronous: bool, refusal: str
) -> None:
    """The client waits at least the RetryInfo's delay before its retry, whichever plane refused, and the
    retry carries the same request_id."""
    server.script.push(method, Rich(RETRIED_REFUSALS[refusal].to_status()))
    call = _one_call(method)
    started = time.monotonic()
    if asynchronous:
        async with AsyncClient(server.address, retry=FAST) as aclient:
            await call(aclient, server.address)
    else:
        with Client(server.address, retry=FAST) as client:
            await asyncio.to_thread(call, client, server.address)
    assert time.monotonic() - started >= 0.4  # FAST alone would retry after ~0.01 s
    seen = server.script.seen[method]
    assert len(seen) == 2 and seen[0].request.request_id == seen[1].request.request_id


@pytest.mark.parametrize(
    ("method", "error", "expected"),
    [
        ("Step", service_errors.FailedPrecondition("episode 1 of session s-1 is done"), rlgate.FailedPrecondition),
        ("CallTool", service_errors.InvalidArgument("arguments_json", "not a JSON object"), rlgate.InvalidArgument),
        ("CallTool", service_errors.FailedPrecondition("the episode of this token is over"), rlgate.FailedPrecondition),
    ],
)
async def test_status_details_from_either_service_reach_the_error(
    server: ScriptedServer, method: str, error: service_errors.RlgateError, expected: type[Exception]
) -> None:
    server.script.push(method, Rich(error.to_status()))
    async with AsyncClient(server.address, retry=FAST) as client:
        with pytest.raises(expected) as info:
            await _one_call(method)(client, server.address)
    err = info.value
    assert isinstance(err, rlgate.RlgateError) and err.message == f"{method}: {error.message}"
    assert err.rich_status is not None and err.rich_status.message == error.message
    reason = error_details_pb2.ErrorInfo()
    assert err.rich_status.details[0].Unpack(reason) and reason.reason == error.reason
    if isinstance(error, service_errors.InvalidArgument):
        bad = error_details_pb2.BadRequest()
        assert err.rich_status.details[1].Unpack(bad) and bad.field_violations[0].field == "arguments_json"
    # One hierarchy: the class the service raised, with what it said in its details.
    assert type(err) is type(error) and err.reason == error.reason and err.metadata == error.metadata
    assert getattr(err, "field", "") == getattr(error, "field", "")
    assert server.script.count(method) == 1  # caller errors are not retried


async def test_metadata_per_call(server: ScriptedServer) -> None:
    """The API key goes to the orchestrator only; each gateway call carries its own agent token; trace ids
    are the caller's or generated per call."""
    async with AsyncClient(server.address, api_key="key-1", gateway_addresses=server.address) as client:
        await client.step("s-1", assistant_text="hi", trace_id="trace-step")
        await client.call_tool("token-a", "echo", trace_id="trace-a")
        await client.call_tool("token-b", "echo", trace_id="trace-b")
        await client.call_tool("token-c", "echo")
    (step,) = server.script.seen["Step"]
    assert step.metadata["authorization"] == "Bearer key-1" and step.metadata[TRACE_HEADER] == "trace-step"
    tools = server.script.seen["CallTool"]
    assert [s.metadata["authorization"] for s in tools] == ["Bearer token-a", "Bearer token-b", "Bearer token-c"]
    assert [s.metadata[TRACE_HEADER] for s in tools[:2]] == ["trace-a", "trace-b"]
    assert len(tools[2].metadata[TRACE_HEADER]) == 32  # generated per call (a W3C-sized trace id)


def test_tls_with_root_certificates() -> None:
    cert, key = _self_signed()
    srv = ScriptedServer().start(grpc.ssl_server_credentials([(key, cert)]))
    try:
        with Client(f"localhost:{srv.port}", tls=True, root_certificates=cert, retry=FAST) as client:
            assert client.state("s-1").session.session_id == "s-1"
        plain = Client(f"localhost:{srv.port}", retry=RetryPolicy(max_attempts=1))
        with plain, pytest.raises(rlgate.Unavailable):
            plain.state("s-1", timeout=2.0)
    finally:
        srv.stop()


def test_retry_state_jitter_and_backoff_bounds() -> None:
    policy = RetryPolicy(initial_backoff=0.1, max_backoff=1.0, multiplier=2.0, jitter=0.5)
    assert policy.backoff(0, rng=lambda: 0.0) == pytest.approx(0.05)
    assert policy.backoff(0, rng=lambda: 1.0) == pytest.approx(0.15)
    assert policy.backoff(10, rng=lambda: 0.5) == pytest.approx(1.0)
    state = RetryState("Reset", policy, timeout=0.0)
    with pytest.raises(rlgate.DeadlineExceeded):
        state.attempt_timeout()


def test_errors_pickle() -> None:
    import pickle

    err = rlgate.VerifierError("boom", status="TIMEOUT", session_id="s", task_key="t")
    back = pickle.loads(pickle.dumps(err))
    assert isinstance(back, rlgate.VerifierError) and back.status == "TIMEOUT" and back.task_key == "t"
    nf = pickle.loads(pickle.dumps(rlgate.NotFound("x", trace_id="tr")))
    assert isinstance(nf, rlgate.NotFound) and nf.trace_id == "tr" and nf.code == grpc.StatusCode.NOT_FOUND
    # A server's error as a client reads it back: its details survive a pickle too.
    sent = service_errors.ResourceExhausted("full", subject="sessions", reason="MAX_SESSIONS", retry_after_s=2.5)
    received = rlgate.ResourceExhausted.from_status(
        "Reset: full", code=grpc.StatusCode.RESOURCE_EXHAUSTED, trace_id="tr", rich_status=sent.to_status()
    )
    back_ = pickle.loads(pickle.dumps(received))
    assert (back_.subject, back_.reason, back_.retry_after_s) == ("sessions", "MAX_SESSIONS", 2.5)
    assert back_.rich_status == sent.to_status() and str(back_) == "RESOURCE_EXHAUSTED: Reset: full (trace id tr)"


def _self_signed() -> tuple[bytes, bytes]:
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    return (
        cert.public_bytes(serialization.Encoding.PEM),
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()),
    )


def test_list_tasks_walks_every_page(server: ScriptedServer) -> None:
    from rlgate.v1 import common_pb2, orchestrator_pb2

    server.script.push(
        "ListTasks",
        orchestrator_pb2.ListTasksResponse(tasks=[common_pb2.TaskInfo(key="a")], next_page_token="p2"),
        orchestrator_pb2.ListTasksResponse(tasks=[common_pb2.TaskInfo(key="b")]),
    )
    with Client(server.address, retry=FAST) as client:
        assert [t.key for t in client.list_tasks("mailbox")] == ["a", "b"]
        client.list_tasks(include_reference_solution=True)
    seen = server.script.seen["ListTasks"]
    assert [s.request.page_token for s in seen] == ["", "p2", ""] and seen[1].request.env_key == "mailbox"
    # Answer keys only on request, on every page.
    assert [s.request.include_reference_solution for s in seen] == [False, False, True]
