"""The gateway's statuses as toolgateway.proto states them: why a token is refused, request_id binding,
malformed requests, and RetryInfo on UNAVAILABLE."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2

from rlgate.core.convert import struct_from_dict
from rlgate.runtime.auth import MAX_REVOKED_TOKENS, mint_agent_token, revoke_agent_token, token_hash
from rlgate.store import Session, SessionStatus, SessionStore, call_scope
from rlgate.toolgateway.server import start_gateway
from rlgate.v1 import common_pb2, toolgateway_pb2
from rlgate.v1.toolgateway_pb2_grpc import ToolGatewayServiceStub as Stub
from tests.support.ports import free_port
from tests.support.statuses import M, rich_status
from tests.toolgateway.conftest import AgentSession, ExactUpstream, byo_session, gateway_config

Kind = common_pb2.ToolErrorKind
Metadata = tuple[tuple[str, str], ...]


def bearer(token: str) -> Metadata:
    return (("authorization", f"Bearer {token}"),)


def details(err: grpc.aio.AioRpcError) -> status_pb2.Status:
    status = rich_status(err)
    assert status is not None, err
    return status


def unpack(status: status_pb2.Status, kind: type[M]) -> M:
    for item in status.details:
        out = kind()
        if item.Unpack(out):  # False for a detail of another type
            return out
    raise AssertionError(f"no {kind.__name__} in {status}")


async def refused(stub: Stub, metadata: Metadata, *, call: bool = False) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        if call:
            await stub.CallTool(
                toolgateway_pb2.CallToolRequest(name="echo", request_id="r"), metadata=metadata, timeout=30
            )
        else:
            await stub.ListTools(toolgateway_pb2.ListToolsRequest(), metadata=metadata, timeout=30)
    return err.value


async def change(store: SessionStore, session_id: str, edit: Callable[[Session], None]) -> Session:
    current = await store.get_session(session_id)
    assert current is not None
    updated = current.copy()
    edit(updated)
    return await store.update_session(updated)


async def new_episode(store: SessionStore, session_id: str) -> str:
    """What the orchestrator's Reset of a session does to tokens: revoke the old one, mint the next."""
    token = mint_agent_token(session_id)

    def begin(s: Session) -> None:
        revoke_agent_token(s)
        s.episode += 1
        s.token_hash = token_hash(token)

    await change(store, session_id, begin)
    return token


def closing(status: SessionStatus) -> Callable[[Session], None]:
    def edit(s: Session) -> None:
        revoke_agent_token(s)
        s.status = status

    return edit


async def test_ended_tokens_are_failed_precondition_with_the_reason(stub: Stub, store: SessionStore) -> None:
    dead = [f"http://127.0.0.1:{free_port()}/mcp"]  # auth is decided before any upstream is reached
    cases: list[tuple[AgentSession, str, str]] = []

    closed = await byo_session(store, dead)
    await change(store, closed.session.session_id, closing(SessionStatus.CLOSED))
    cases.append((closed, "SESSION_CLOSED", f"session {closed.session.session_id} was closed"))

    expired = await byo_session(store, dead)
    await change(store, expired.session.session_id, closing(SessionStatus.EXPIRED))
    cases.append((expired, "SESSION_EXPIRED", f"session {expired.session.session_id} expired"))

    failed = await byo_session(store, dead)
    await change(store, failed.session.session_id, closing(SessionStatus.FAILED))
    cases.append((failed, "SESSION_FAILED", "failed"))

    done = await byo_session(store, dead)  # a finished episode keeps its token until the next Reset
    await change(store, done.session.session_id, lambda s: setattr(s, "status", SessionStatus.DONE))
    cases.append((done, "EPISODE_DONE", f"episode 1 of session {done.session.session_id} is done"))

    superseded = await byo_session(store, dead)
    second = await new_episode(store, superseded.session.session_id)
    cases.append(
        (
            superseded,
            "EPISODE_SUPERSEDED",
            f"episode 1 of session {superseded.session.session_id} ended: a later Reset started episode 2",
        )
    )

    replaced = await byo_session(store, dead)  # a repeated Reset hands out a new token for the same episode
    fresh = mint_agent_token(replaced.session.session_id)

    def rotate(s: Session) -> None:
        revoke_agent_token(s)
        s.token_hash = token_hash(fresh)

    await change(store, replaced.session.session_id, rotate)
    cases.append((replaced, "TOKEN_REPLACED", "was replaced"))

    resetting = await byo_session(store, dead)
    await change(store, resetting.session.session_id, closing(SessionStatus.PROVISIONING))
    cases.append((resetting, "EPISODE_SUPERSEDED", "a Reset is starting episode 2"))

    for s, reason, message in cases:
        for call in (False, True):
            err = await refused(stub, s.metadata, call=call)
            assert err.code() == grpc.StatusCode.FAILED_PRECONDITION, (reason, err.details())
            assert message in (err.details() or ""), (reason, err.details())
            info = unpack(details(err), error_details_pb2.ErrorInfo)
            assert info.reason == reason and info.metadata["session_id"] == s.session.session_id
            assert s.token not in (err.details() or "") + str(details(err))

    # A later episode's token is the one that works; a session keeps no token itself, only hashes.
    err = await refused(stub, bearer(second))
    assert err.code() == grpc.StatusCode.UNAVAILABLE  # authenticated; its endpoint is down
    stored = await store.get_session(superseded.session.session_id)
    assert stored is not None and superseded.token not in stored.to_json()
    assert not await store.list_tool_calls(closed.session.session_id)  # nothing was claimed or logged
    assert await store.get_request(call_scope(closed.session.session_id), "r") is None


async def test_never_issued_tokens_are_unauthenticated(stub: Stub, store: SessionStore) -> None:
    s = await byo_session(store, [f"http://127.0.0.1:{free_port()}/mcp"])
    for metadata in [
        (),
        (("authorization", "Basic abc"),),
        bearer("not-a-token"),
        bearer(mint_agent_token(s.session.session_id)),  # names the session, never issued
        bearer(mint_agent_token("no-such-session")),
        bearer("rlg1..x"),
        bearer("rlg1." + "a" * 300 + ".b"),
    ]:
        for call in (False, True):
            err = await refused(stub, metadata, call=call)
            assert err.code() == grpc.StatusCode.UNAUTHENTICATED, (metadata, err.details())
    # A bad request without a valid token is UNAUTHENTICATED too: the token is checked first.
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.CallTool(toolgateway_pb2.CallToolRequest(name="bad name"), metadata=bearer("x"), timeout=10)
    assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED


async def test_revoked_tokens_are_remembered_up_to_the_bound(stub: Stub, store: SessionStore) -> None:
    s = await byo_session(store, [f"http://127.0.0.1:{free_port()}/mcp"])
    tokens = [s.token]
    for _ in range(MAX_REVOKED_TOKENS):
        tokens.append(await new_episode(store, s.session.session_id))
    # The current token is the last; the MAX_REVOKED_TOKENS before it are explained, older ones are not.
    stored = await store.get_session(s.session.session_id)
    assert stored is not None and len(stored.revoked_tokens) == MAX_REVOKED_TOKENS
    err = await refused(stub, bearer(tokens[0]))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "episode 1 " in (err.details() or "")
    await new_episode(store, s.session.session_id)  # the oldest revoked hash (episode 1's) is dropped
    err = await refused(stub, bearer(tokens[0]))
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED
    err = await refused(stub, bearer(tokens[1]))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "episode 2 " in (err.details() or "")


async def test_request_id_is_bound_to_its_name_and_arguments(
    stub: Stub, store: SessionStore, exact_upstream: ExactUpstream
) -> None:
    s = await byo_session(store, [exact_upstream.url])

    async def call(name: str, **args: Any) -> toolgateway_pb2.CallToolResponse:
        req = toolgateway_pb2.CallToolRequest(name=name, request_id="r1", **args)
        response: toolgateway_pb2.CallToolResponse = await stub.CallTool(req, metadata=s.metadata, timeout=20)
        return response

    first = await call("echo", arguments_json='{"items": [1], "n": 5}')
    assert not first.replayed and not first.result.is_error
    for name, args, field in [
        ("reject", {"arguments_json": "{}"}, "name"),
        ("echo", {"arguments_json": '{"items": [2], "n": 5}'}, "arguments"),
        ("echo", {"arguments_json": '{"items": [1]}'}, "arguments"),
    ]:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call(name, **args)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
        assert "differs from the first request with request_id 'r1'" in (err.value.details() or "")
        violation = unpack(details(err.value), error_details_pb2.BadRequest).field_violations[0]
        assert violation.field == field, err.value.details()
    # The same call still gets the original result, in either form (JSON numbers compare by value).
    forms: list[dict[str, Any]] = [
        {"arguments_json": '{"n": 5, "items": [1]}'},
        {"arguments_json": '{"items": [1], "n": 5.0}'},
        {"arguments": struct_from_dict({"items": [1], "n": 5})},
    ]
    for args in forms:
        again = await call("echo", **args)
        assert again.replayed and again.result == first.result, args
    assert dict(exact_upstream.calls) == {"echo": 1}

    # A request_id belongs to its session: another session's r1 is its own call.
    other = await byo_session(store, [exact_upstream.url])
    req = toolgateway_pb2.CallToolRequest(name="reject", request_id="r1")
    own = await stub.CallTool(req, metadata=other.metadata, timeout=20)
    assert not own.replayed and own.result.error_kind == Kind.TOOL_ERROR_KIND_TOOL_FAILED
    assert [e.tool for e in await store.list_tool_calls(s.session.session_id)] == ["echo"]


async def test_malformed_requests_are_invalid_argument(store: SessionStore, exact_upstream: ExactUpstream) -> None:
    handle = await start_gateway(gateway_config(max_arguments_bytes=64), store)
    s = await byo_session(store, [exact_upstream.url])
    try:
        async with grpc.aio.insecure_channel(handle.address) as channel:
            stub = Stub(channel)

            async def invalid(field: str, **fields: Any) -> str:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.CallTool(toolgateway_pb2.CallToolRequest(**fields), metadata=s.metadata, timeout=10)
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (fields, err.value.details())
                violation = unpack(details(err.value), error_details_pb2.BadRequest).field_violations[0]
                assert violation.field == field, fields
                return err.value.details() or ""

            for name in ["", "bad name", "a/b", "ünï", "x" * 129, "tab\t", "semi;colon"]:
                assert "[A-Za-z0-9._-]" in await invalid("name", name=name)
            assert "129 characters" in await invalid("request_id", name="echo", request_id="r" * 129)
            assert "must be a JSON object" in await invalid("arguments_json", name="echo", arguments_json="[1]")
            assert "not valid JSON" in await invalid("arguments_json", name="echo", arguments_json="{")
            big = json.dumps({"items": [1], "pad": "x" * 64})
            assert "at most 64" in await invalid("arguments_json", name="echo", arguments_json=big)
            assert "at most 64" in await invalid(
                "arguments", name="echo", arguments=struct_from_dict({"pad": "x" * 64})
            )
            # Well-formed: a 128-character name nobody owns is the model's mistake, a result.
            unknown = await stub.CallTool(
                toolgateway_pb2.CallToolRequest(name="x" * 128), metadata=s.metadata, timeout=10
            )
            assert unknown.result.error_kind == Kind.TOOL_ERROR_KIND_UNKNOWN_TOOL
            ok = await stub.CallTool(
                toolgateway_pb2.CallToolRequest(name="echo", arguments_json='{"items": [1]}'),
                metadata=s.metadata,
                timeout=10,
            )
            assert not ok.result.is_error
        assert dict(exact_upstream.calls) == {"echo": 1}
    finally:
        await handle.stop(grace=0)


async def test_unavailable_carries_retry_info(stub: Stub, store: SessionStore) -> None:
    s = await byo_session(store, [f"http://127.0.0.1:{free_port()}/mcp"])
    for call in (False, True):
        err = await refused(stub, s.metadata, call=call)
        assert err.code() == grpc.StatusCode.UNAVAILABLE, err.details()
        status = details(err)
        retry = unpack(status, error_details_pb2.RetryInfo)
        assert retry is not None and retry.retry_delay.ToTimedelta().total_seconds() > 0
        assert unpack(status, error_details_pb2.ErrorInfo).reason == "UPSTREAM_UNAVAILABLE"
    # Nothing ran, so the request record was released: a retry may run the tool.
    assert await store.get_request(call_scope(s.session.session_id), "r") is None
