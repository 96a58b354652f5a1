"""Pure pieces of the orchestrator, without servers: task parsing and paging, page tokens, error details,
score extraction, config parsing, Fleet error mapping, the verifier's retry/timeout policy."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import grpc
import pytest
from fleet._async.exceptions import (
    FleetAPIError,
    FleetEnvironmentNotFoundError,
    FleetInstanceLimitError,
    FleetRateLimitError,
    FleetTimeoutError,
)
from google.rpc import error_details_pb2

from rlgate.core.errors import (
    MAX_ECHO,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    RlgateError,
    Unavailable,
    clip,
)
from rlgate.orchestrator.limits import MAX_KEY, MAX_PAGE_TOKEN, check_request
from rlgate.orchestrator.pool import parse_pool_targets
from rlgate.orchestrator.providers.base import (
    INTENT_ENV_VAR,
    EnvNotFound,
    InstanceGone,
    InstanceHandle,
    InstanceLimit,
    Provider,
    RateLimited,
    Retryable,
    TaskDef,
    VerifierRun,
)
from rlgate.orchestrator.providers.fleet import map_fleet_error, score_of
from rlgate.orchestrator.providers.mcp import McpProvider, parse_mcp_envs
from rlgate.orchestrator.tasks import TaskCatalog, decode_token, encode_token, task_from_json
from rlgate.orchestrator.verifier import Verifier
from rlgate.orchestrator.views import DONE_REASON, SESSION_STATUS, VERIFICATION_STATUS, status_filter
from rlgate.store import DoneReason, SessionStatus, VerificationStatus
from rlgate.v1 import common_pb2, orchestrator_pb2


def _task(key: str, env: str = "mailbox", version: str = "v1") -> TaskDef:
    return TaskDef(key=key, env_id=env, version=version, prompt=f"do {key}")


def test_task_from_fleet_json_variants() -> None:
    t = task_from_json(
        {
            "key": "k",
            "prompt": "p",
            "env_key": "mailbox:v2",
            "task_modality": "computer_use",
            "verifier": {"code": "def verify(env): return 1"},
            "metadata": {"max_turns": 7},
        }
    )
    assert (t.env_id, t.version, t.modality, t.max_turns) == ("mailbox", "v2", "computer_use", 7)
    assert t.verifier_code.startswith("def verify") and t.env_key == "mailbox:v2"
    t = task_from_json({"id": "k2", "prompt": "p", "environment_id": "tracker", "version": "v1"})
    assert (t.key, t.env_key, t.modality) == ("k2", "tracker:v1", "tool_use")
    with pytest.raises(ValueError):
        task_from_json({"prompt": "no key", "env_id": "x"})
    with pytest.raises(ValueError):
        task_from_json({"key": "no env", "prompt": "p"})
    with pytest.raises(ValueError):  # a Reset could never name it
        task_from_json({"key": "k" * (MAX_KEY + 1), "prompt": "p", "env_id": "x"})


def test_catalog_pages_and_filters() -> None:
    catalog = TaskCatalog([_task(f"t{i:02d}", "mailbox" if i % 2 else "tracker") for i in range(25)])
    seen: list[str] = []
    token = ""
    while True:
        page, token, total = catalog.page("", 10, token)
        seen += [t.key for t in page]
        if not token:
            break
    assert seen == sorted(seen) and len(seen) == total == 25
    page, token, total = catalog.page("tracker:v1", 0, "")
    assert total == 13 and not token and all(t.env_id == "tracker" for t in page)
    assert catalog.page("tracker:v9", 0, "")[2] == 0
    with pytest.raises(NotFound):
        catalog.get("missing")


@pytest.mark.parametrize("token", ["garbage", "!!!", encode_token("t05", scope="tasks:other"), "e30"])
def test_bad_page_tokens_are_invalid_argument(token: str) -> None:
    with pytest.raises(InvalidArgument) as err:
        decode_token(token, scope="tasks:")
    assert err.value.field == "page_token"
    assert err.value.to_grpc_status().code == grpc.StatusCode.INVALID_ARGUMENT


def test_page_size_bounds() -> None:
    catalog = TaskCatalog([_task("a")])
    for bad in (-1, 1001):
        with pytest.raises(InvalidArgument):
            catalog.page("", bad, "")


def test_error_details_travel_in_google_rpc_status() -> None:
    status = ResourceExhausted(
        "limit",
        subject="instances:mailbox:v1",
        reason="INSTANCE_LIMIT",
        metadata={"running": 5, "limit": 5, "none": None},
        retry_after_s=2.5,
    ).to_status()
    kinds = {d.TypeName() for d in status.details}
    assert kinds == {"google.rpc.ErrorInfo", "google.rpc.QuotaFailure", "google.rpc.RetryInfo"}
    info = error_details_pb2.ErrorInfo()
    assert any(d.Unpack(info) for d in status.details)  # Unpack is False for a detail of another type
    assert info.reason == "INSTANCE_LIMIT" and dict(info.metadata) == {"running": "5", "limit": "5"}
    retry = error_details_pb2.RetryInfo()
    assert any(d.Unpack(retry) for d in status.details)
    assert retry.retry_delay.seconds == 2 and retry.retry_delay.nanos == 500_000_000
    assert Unavailable("down").to_grpc_status().code == grpc.StatusCode.UNAVAILABLE
    bad = InvalidArgument("labels", "too long").to_status()
    assert any(d.Unpack(error_details_pb2.BadRequest()) for d in bad.details)


def test_errors_never_grow_with_the_request() -> None:
    huge = "x" * 50_000
    assert clip("short") == "short" and clip(huge) == "x" * MAX_ECHO + "…"
    errors: list[RlgateError] = [
        NotFound(f"unknown session {huge!r}", reason="SESSION_NOT_FOUND", metadata={"session_id": huge}),
        FailedPrecondition(huge, metadata={huge[:10]: huge}),
        InvalidArgument(huge, huge),
        ResourceExhausted(huge, subject=huge, reason="MAX_SESSIONS", metadata={"limit": huge}),
    ]
    for error in errors:
        assert error.to_status().ByteSize() < 3 * 1024, type(error).__name__


@pytest.mark.parametrize(
    ("request_", "code", "field"),
    [
        (orchestrator_pb2.StateRequest(session_id="s-" + "x" * 20_000), grpc.StatusCode.NOT_FOUND, "session_id"),
        (orchestrator_pb2.CloseRequest(session_id="s" * 129), grpc.StatusCode.NOT_FOUND, "session_id"),
        (orchestrator_pb2.StepRequest(session_id="s" * 129), grpc.StatusCode.NOT_FOUND, "session_id"),
        (orchestrator_pb2.ResetRequest(task_key="t" * (MAX_KEY + 1)), grpc.StatusCode.NOT_FOUND, "task_key"),
        (orchestrator_pb2.ResetRequest(request_id="r" * 129), grpc.StatusCode.INVALID_ARGUMENT, "request_id"),
        (
            orchestrator_pb2.StepRequest(session_id="s-1", request_id="r" * 129),
            grpc.StatusCode.INVALID_ARGUMENT,
            "request_id",
        ),
        (orchestrator_pb2.ResetRequest(env_key="e" * (MAX_KEY + 1)), grpc.StatusCode.INVALID_ARGUMENT, "env_key"),
        (orchestrator_pb2.ResetRequest(run_id="r" * 129), grpc.StatusCode.INVALID_ARGUMENT, "run_id"),
        (orchestrator_pb2.ResetRequest(labels={"k" * 64: "v"}), grpc.StatusCode.INVALID_ARGUMENT, "labels"),
        (orchestrator_pb2.CloseSessionsRequest(run_id="r" * 10_000), grpc.StatusCode.INVALID_ARGUMENT, "run_id"),
        (orchestrator_pb2.ListSessionsRequest(labels={"k": "v" * 64}), grpc.StatusCode.INVALID_ARGUMENT, "labels"),
        (
            orchestrator_pb2.ListSessionsRequest(page_token="p" * (MAX_PAGE_TOKEN + 1)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "page_token",
        ),
        (orchestrator_pb2.ListTasksRequest(env_key="e" * 5000), grpc.StatusCode.INVALID_ARGUMENT, "env_key"),
    ],
)
def test_request_ids_are_bounded_before_any_work(request_: Any, code: grpc.StatusCode, field: str) -> None:
    with pytest.raises(RlgateError) as err:
        check_request(request_)
    status = err.value.to_status()
    assert err.value.code == code and status.ByteSize() < 1024
    assert field in err.value.message if code == grpc.StatusCode.INVALID_ARGUMENT else err.value.metadata[field]


def test_requests_within_the_limits_pass() -> None:
    check_request(
        orchestrator_pb2.ResetRequest(
            request_id="r" * 128,
            task_key="t" * MAX_KEY,
            run_id="u" * 128,
            env_key="e" * MAX_KEY,
            labels={"k" * 63: "v" * 63},
        )
    )
    check_request(
        orchestrator_pb2.StepRequest(session_id="s" * 128, assistant_text="a" * 100_000, final_answer="f" * 100_000)
    )
    # A page token positioned at the longest possible task key fits the page_token limit.
    token = encode_token("\U0001f600" * MAX_KEY, scope="tasks:")
    check_request(orchestrator_pb2.ListTasksRequest(page_token=token))
    assert decode_token(token, scope="tasks:") == "\U0001f600" * MAX_KEY


def test_unknown_enum_numbers_are_invalid_argument() -> None:
    assert status_filter(common_pb2.SESSION_STATUS_ACTIVE) is SessionStatus.ACTIVE
    assert status_filter(common_pb2.SESSION_STATUS_UNSPECIFIED) is None  # no filter
    for bad in (99, -1, 2**31 - 1):
        with pytest.raises(InvalidArgument) as err:
            status_filter(bad)
        assert err.value.field == "status"


@pytest.mark.parametrize(
    ("table", "domain", "wire", "unset"),
    [
        (SESSION_STATUS, SessionStatus, common_pb2.SessionStatus, []),
        (DONE_REASON, DoneReason, orchestrator_pb2.DoneReason, [DoneReason.NONE]),
        (VERIFICATION_STATUS, VerificationStatus, common_pb2.VerificationStatus, []),
    ],
    ids=["SessionStatus", "DoneReason", "VerificationStatus"],
)
def test_every_domain_enum_member_has_its_own_wire_value(table: Any, domain: Any, wire: Any, unset: list[Any]) -> None:
    """The tables are the one mapping: every member is in them, one to one, and the wire's only value without a
    member is UNSPECIFIED (which stands for the domain's 'not set' member, if it has one)."""
    assert set(table) == set(domain)
    assert len(set(table.values())) == len(table)
    unspecified = {name: value for name, value in wire.items() if name.endswith("_UNSPECIFIED")}
    assert set(wire.values()) - set(table.values()) <= set(unspecified.values())
    assert [m for m in domain if table[m] in unspecified.values()] == unset


@pytest.mark.parametrize(
    ("result", "score"),
    [
        (1, 1.0),
        (0.25, 0.25),
        (True, 1.0),
        (False, 0.0),
        ({"score": 0.5}, 0.5),
        ("0.75", 0.75),
        (None, None),
        ("yes", None),
        ([1], None),
        ({"value": 1}, None),
    ],
)
def test_score_of_never_invents_a_zero(result: Any, score: float | None) -> None:
    assert score_of(result) == score


def test_fleet_errors_map_to_provider_errors() -> None:
    assert isinstance(map_fleet_error(FleetInstanceLimitError("x", 5, 5), "c"), InstanceLimit)
    assert isinstance(map_fleet_error(FleetRateLimitError("slow down"), "c"), RateLimited)
    assert isinstance(map_fleet_error(FleetEnvironmentNotFoundError("Environment 'x' not found"), "c"), EnvNotFound)
    assert isinstance(map_fleet_error(FleetTimeoutError("t"), "c"), Retryable)
    assert isinstance(map_fleet_error(TimeoutError(), "c"), Retryable)
    assert isinstance(map_fleet_error(FleetAPIError("gone", status_code=404), "c"), InstanceGone)
    assert isinstance(map_fleet_error(FleetAPIError("boom", status_code=503), "c"), Retryable)
    placement = FleetAPIError('{"error":"seed_placement_failed","retryable":true}', status_code=409)
    assert isinstance(map_fleet_error(placement, "c"), Retryable)
    burst = FleetAPIError("Too many in-flight instance creations for this team", status_code=400)
    assert isinstance(map_fleet_error(burst, "c"), Retryable)
    assert not map_fleet_error(FleetAPIError("nope", status_code=401), "c").retryable


def test_config_parsers() -> None:
    assert parse_pool_targets("mailbox:v1=4, tracker:v1=2") == {"mailbox:v1": 4, "tracker:v1": 2}
    assert parse_pool_targets("") == {}
    with pytest.raises(ValueError):
        parse_pool_targets("mailbox:v1")
    assert parse_mcp_envs("calc:v1=http://127.0.0.1:1/mcp|http://127.0.0.1:2/mcp") == {
        "calc:v1": ["http://127.0.0.1:1/mcp", "http://127.0.0.1:2/mcp"]
    }
    with pytest.raises(ValueError):
        parse_mcp_envs("calc:v1")


class _ScriptedProvider(McpProvider):
    """The mcp provider (no instances to manage) whose verify() follows a script: the verifier's policy is
    what is under test."""

    name = "scripted"

    def __init__(self, script: list[Any]) -> None:
        super().__init__({})
        self.script = script
        self.calls = 0

    can_verify = Provider.can_verify  # scored when the task has verifier code (McpProvider wants an answer)

    async def verify(
        self,
        task: TaskDef,
        handle: InstanceHandle,
        final_answer: str | None,
        *,
        timeout_s: float,
        tool_calls: Sequence[Any] | None = None,
    ) -> VerifierRun:
        step = self.script[min(self.calls, len(self.script) - 1)]
        self.calls += 1
        if step == "hang":
            await asyncio.sleep(3600)
        if isinstance(step, BaseException):
            raise step
        assert isinstance(step, VerifierRun)
        return step


async def _verify(script: list[Any], *, retries: int = 2, limit_s: float = 2.0) -> tuple[Any, int]:
    provider = _ScriptedProvider(script)
    task = TaskDef(key="k", env_id="e", version="v1", prompt="p", verifier_code="def verify(env): return 1")
    outcome = await Verifier(provider, timeout_s=limit_s, retries=retries, backoff_s=0.01).run(
        task, InstanceHandle(instance_id="i", env_key="e:v1"), "answer"
    )
    return outcome, provider.calls


async def test_verifier_retries_infrastructure_failures_only() -> None:
    outcome, calls = await _verify([Retryable("502"), VerifierRun(success=True, score=1.0)])
    assert (outcome.status, outcome.score, outcome.attempts, calls) == ("ok", 1.0, 2, 2)
    outcome, calls = await _verify([Retryable("502")], retries=2)
    assert (outcome.status, outcome.score, calls) == ("error", None, 3) and "502" in outcome.message
    outcome, calls = await _verify([VerifierRun(success=False, message="AssertionError: boom")])
    assert (outcome.status, calls) == ("error", 1) and "boom" in outcome.message  # a verifier bug: no retry
    outcome, _ = await _verify([VerifierRun(success=True, score=None)])
    assert outcome.status == "error" and outcome.score is None


async def test_verifier_timeout_is_rlgates_own() -> None:
    loop = asyncio.get_running_loop()
    start = loop.time()
    outcome, _ = await _verify(["hang"], limit_s=0.5)
    assert outcome.status == "timeout" and outcome.score is None
    assert loop.time() - start < 0.5 + 9.5  # its 0.5 s, not the hang's forever; room for a loaded machine


async def test_verifier_skips_tasks_without_scoring() -> None:
    provider = _ScriptedProvider([VerifierRun(success=True, score=1.0)])
    outcome = await Verifier(provider, timeout_s=1, retries=0).run(
        TaskDef(key="k", env_id="e", version="v1", prompt="p"), InstanceHandle(instance_id="i", env_key="e"), None
    )
    assert outcome.status == "skipped" and provider.calls == 0
    outcome = await Verifier(provider, timeout_s=1, retries=0).run(None, InstanceHandle("i", "e"), None)
    assert outcome.status == "skipped"


class _RejectingProvider(_ScriptedProvider):
    """create() fails with a scripted error each time (the provisioner's policy is under test)."""

    def __init__(self, error: Exception) -> None:
        super().__init__([])
        self.error = error
        self.creates = 0
        self.keys: list[str] = []  # each attempt's idempotency key (its intent id)

    async def create(
        self,
        env_key: str,
        *,
        env_variables: dict[str, Any],
        run_id: str,
        ttl_s: int,
        heartbeat_interval_s: int,
        timeout_s: float,
        modality: str = "tool_use",
    ) -> InstanceHandle:
        self.creates += 1
        self.keys.append(env_variables[INTENT_ENV_VAR])
        raise self.error


@pytest.mark.parametrize(
    ("error", "code", "reason"),
    [
        (RateLimited("429"), grpc.StatusCode.UNAVAILABLE, "RATE_LIMITED"),
        (Retryable("503 placement"), grpc.StatusCode.UNAVAILABLE, "PROVIDER_UNAVAILABLE"),
        (InstanceLimit("limit", 10, 10), grpc.StatusCode.RESOURCE_EXHAUSTED, "INSTANCE_LIMIT"),
    ],
)
async def test_provisioner_retries_until_the_deadline_then_maps(
    error: Exception, code: grpc.StatusCode, reason: str, tmp_path: Any
) -> None:
    from rlgate.core.errors import RlgateError
    from rlgate.orchestrator.config import OrchestratorConfig
    from rlgate.orchestrator.provisioning import Provisioner
    from rlgate.runtime.deadline import Deadline
    from rlgate.store.sqlite import SqliteStore

    store = await SqliteStore.open(str(tmp_path / "s.db"))
    try:
        provider = _RejectingProvider(error)
        provisioner = Provisioner(OrchestratorConfig(run_id="unit"), store, provider, "owner-1")
        loop = asyncio.get_running_loop()
        start = loop.time()
        with pytest.raises(RlgateError) as err:
            await provisioner.create("mailbox:v1", Deadline(1.5))
        assert 1.4 <= loop.time() - start < 1.5 + 3.0  # used the whole deadline, not more (room for load)
        assert provider.creates >= 2  # retried with backoff
        assert err.value.code == code and err.value.reason == reason
        intents = await store.list_intents("unit")
        if isinstance(error, RateLimited | InstanceLimit):
            assert intents == []  # a definite rejection created nothing: no intent left behind
        else:  # the outcome is unknown: the create's one intent says "delete whatever turns up"
            assert len(intents) == 1 and intents[0].state == "deleting"
            # Every attempt was the same create to the provider: one idempotency key, the intent's.
            assert set(provider.keys) == {intents[0].intent_id}
    finally:
        await store.close()


async def test_provisioner_marks_unknown_outcomes_for_deletion(tmp_path: Any) -> None:
    from rlgate.core.errors import RlgateError
    from rlgate.orchestrator.config import OrchestratorConfig
    from rlgate.orchestrator.provisioning import Provisioner
    from rlgate.runtime.deadline import Deadline
    from rlgate.store import IntentState
    from rlgate.store.sqlite import SqliteStore

    store = await SqliteStore.open(str(tmp_path / "s.db"))
    try:
        provisioner = Provisioner(
            OrchestratorConfig(run_id="unit"), store, _RejectingProvider(Retryable("timed out")), "owner-1"
        )
        with pytest.raises(RlgateError):
            await provisioner.create("mailbox:v1", Deadline(0.5))
        intents = await store.list_intents("unit")
        # A timed-out create may still produce an instance: its intent says "delete what turns up".
        assert intents and all(i.state == IntentState.DELETING for i in intents)
        assert all(i.intent_id.startswith("owner-1~") for i in intents)
    finally:
        await store.close()
