"""Security: the plane-split matrix, token lifecycles, TLS, and a scan for secrets in everything the servers
wrote during the suite (logs of every stack, /metrics scrapes, every error detail the tests received).

Keep `test_no_forged_log_line_anywhere` and `test_no_secret_anywhere` last: they scan what the modules before
them (bad input, faults, hostile, load) left.
"""

from __future__ import annotations

import asyncio
import base64
import datetime
import ipaddress
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rlgate.devtools.stack import free_port
from rlgate.ledger import scope as ledger_scope
from rlgate.runtime.auth import token_hash
from rlgate.store import open_store
from rlgate.v1 import common_pb2, orchestrator_pb2, toolgateway_pb2
from tests.reliability.conftest import Figures
from tests.reliability.harness import (
    API_KEY,
    FLEET_API_KEY,
    REPO,
    Audit,
    AuditedStack,
    bearer,
    error_reason,
    gateway_stub,
    orchestrator_stub,
    start_stack,
)
from tests.support.hostile_mcp import FORGED_PREFIX
from tests.support.wait import wait_until_sync

SC = grpc.StatusCode
T = 30.0


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, audit: Audit) -> Iterator[AuditedStack]:
    s = start_stack(tmp_path_factory.mktemp("security"), audit)
    try:
        yield s
    finally:
        s.stop()


def new_session(stack: AuditedStack, env_key: str = "mailbox:v1", **kw: Any) -> orchestrator_pb2.ResetResponse:
    r: orchestrator_pb2.ResetResponse = orchestrator_stub(stack.orchestrator_address).Reset(
        orchestrator_pb2.ResetRequest(env_key=env_key, **kw), timeout=60.0, metadata=stack.metadata()
    )
    stack.audit.token(r.agent_token)
    return r


def status(stack: AuditedStack, where: str, call: Any) -> grpc.StatusCode:
    return status_and_reason(stack, where, call)[0]


def status_and_reason(stack: AuditedStack, where: str, call: Any) -> tuple[grpc.StatusCode, str]:
    """The call's status and its google.rpc.ErrorInfo reason ("" when none)."""
    try:
        call()
    except grpc.RpcError as err:
        stack.audit.error(where, err)
        return err.code(), error_reason(err)
    return SC.OK, ""


def orchestrator_calls(session_id: str) -> dict[str, tuple[str, Any]]:
    return {
        "Reset": ("Reset", orchestrator_pb2.ResetRequest(session_id=session_id)),
        "Step": ("Step", orchestrator_pb2.StepRequest(session_id=session_id, done=True)),
        "State": ("State", orchestrator_pb2.StateRequest(session_id=session_id, include_tool_calls=True)),
        "Close": ("Close", orchestrator_pb2.CloseRequest(session_id=session_id)),
        "CloseSessions": ("CloseSessions", orchestrator_pb2.CloseSessionsRequest(run_id="rel-any")),
        "ListTasks": ("ListTasks", orchestrator_pb2.ListTasksRequest()),
        "ListSessions": ("ListSessions", orchestrator_pb2.ListSessionsRequest()),
    }


def test_agent_token_rejected_by_every_orchestrator_rpc(stack: AuditedStack, figures: Figures) -> None:
    """An agent token (or no key, or a wrong one) opens no orchestrator RPC; the API key opens them."""
    session = new_session(stack)
    orch = orchestrator_stub(stack.orchestrator_address)
    matrix: dict[str, dict[str, str]] = {}
    for rpc, (method, request) in orchestrator_calls(session.session_id).items():
        row = {}
        for who, md in (
            ("agent token", bearer(session.agent_token)),
            ("no key", []),
            ("wrong key", bearer("wrong-" + API_KEY[::-1])),
            ("FLEET_API_KEY", bearer(FLEET_API_KEY)),
        ):
            row[who] = status(
                stack,
                f"orch {rpc} {who}",
                lambda m=method, r=request, md=md: getattr(orch, m)(r, timeout=T, metadata=md),
            ).name
        matrix[rpc] = row
    figures.record("security", "orchestrator_matrix", matrix)
    assert all(code == "UNAUTHENTICATED" for row in matrix.values() for code in row.values()), matrix
    # the same session is intact: nothing above reached it
    state = orch.State(
        orchestrator_pb2.StateRequest(session_id=session.session_id), timeout=T, metadata=stack.metadata()
    )
    assert state.session.status == common_pb2.SESSION_STATUS_ACTIVE and state.session.turn == 0


def test_api_key_grants_nothing_on_the_gateway(stack: AuditedStack, figures: Figures) -> None:
    """The gateway answers only agent tokens, and has no orchestration RPCs at all."""
    gw = gateway_stub(stack.gateway_address)
    rows = {
        "ListTools": status(
            stack,
            "gw ListTools api key",
            lambda: gw.ListTools(toolgateway_pb2.ListToolsRequest(), timeout=T, metadata=bearer(API_KEY)),
        ).name,
        "CallTool": status(
            stack,
            "gw CallTool api key",
            lambda: gw.CallTool(
                toolgateway_pb2.CallToolRequest(name="list_folders"), timeout=T, metadata=bearer(API_KEY)
            ),
        ).name,
    }
    with grpc.insecure_channel(stack.gateway_address) as channel:
        for rpc in ("Reset", "Step", "Close"):
            method: grpc.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary(
                f"/rlgate.v1.OrchestratorService/{rpc}"
            )
            try:
                method(b"", timeout=T, metadata=tuple(bearer(API_KEY)))
                rows[f"OrchestratorService/{rpc} on the gateway"] = "OK"
            except grpc.RpcError as err:
                rows[f"OrchestratorService/{rpc} on the gateway"] = err.code().name
    figures.record("security", "gateway_with_api_key", rows)
    assert rows["ListTools"] == rows["CallTool"] == "UNAUTHENTICATED", rows
    assert all(v == "UNIMPLEMENTED" for k, v in rows.items() if k.startswith("Orchestrator")), rows


def test_token_reaches_only_its_own_session(stack: AuditedStack, figures: Figures) -> None:
    """A's token changes A's instance and A's log only; B sees nothing of it."""
    a, b = new_session(stack), new_session(stack)
    gw = gateway_stub(stack.gateway_address)
    folder = f"rel-only-in-a-{os.getpid()}"
    created = gw.CallTool(
        toolgateway_pb2.CallToolRequest(
            request_id="sec-a-1", name="create_folder", arguments=_struct({"name": folder})
        ),
        timeout=T,
        metadata=bearer(a.agent_token),
    )
    assert not created.result.is_error, created.result.error_message

    def folders(token: str) -> str:
        reply = gw.CallTool(toolgateway_pb2.CallToolRequest(name="list_folders"), timeout=T, metadata=bearer(token))
        return " ".join(c.text.text for c in reply.result.content) + str(reply.result.structured_content_json)

    orch = orchestrator_stub(stack.orchestrator_address)
    log_a = orch.State(
        orchestrator_pb2.StateRequest(session_id=a.session_id, include_tool_calls=True),
        timeout=T,
        metadata=stack.metadata(),
    ).tool_calls
    log_b = orch.State(
        orchestrator_pb2.StateRequest(session_id=b.session_id, include_tool_calls=True),
        timeout=T,
        metadata=stack.metadata(),
    ).tool_calls
    seen_by_b = folders(b.agent_token)
    # the same request_id under B's token is B's own call, not a replay of A's
    replay = gw.CallTool(
        toolgateway_pb2.CallToolRequest(request_id="sec-a-1", name="list_folders"),
        timeout=T,
        metadata=bearer(b.agent_token),
    )
    figures.record(
        "security",
        "cross_session",
        {
            "a_log": len(log_a),
            "b_log_before": len(log_b),
            "b_sees_a_folder": folder in seen_by_b,
            "same_request_id_replayed_across_sessions": replay.replayed,
        },
    )
    assert folder in folders(a.agent_token)
    assert folder not in seen_by_b
    assert [e.request_id for e in log_a] == ["sec-a-1"] and list(log_b) == []
    assert not replay.replayed


def test_revoked_closed_and_finished_tokens(stack: AuditedStack, figures: Figures) -> None:
    """Tokens of a past episode, a closed session and a finished episode open nothing, and say why
    (FAILED_PRECONDITION with the reason); a token that was never issued is UNAUTHENTICATED."""
    orch = orchestrator_stub(stack.orchestrator_address)
    md = stack.metadata()
    revoked = new_session(stack)
    current = new_session(stack, env_key="", session_id=revoked.session_id)  # next episode: new token
    closed = new_session(stack, env_key="tracker:v1")
    orch.Close(orchestrator_pb2.CloseRequest(session_id=closed.session_id), timeout=T, metadata=md)
    finished = new_session(stack, env_key="tracker:v1")
    orch.Step(orchestrator_pb2.StepRequest(session_id=finished.session_id, done=True), timeout=T, metadata=md)
    # well-formed and naming a live session, but never issued: nothing to explain, so UNAUTHENTICATED
    forged = f"rlg1.{current.session_id}.{'A' * 43}"
    gw = gateway_stub(stack.gateway_address)
    rows: dict[str, dict[str, str]] = {}
    for who, token in (
        ("revoked (previous episode)", revoked.agent_token),
        ("closed session", closed.agent_token),
        ("finished episode", finished.agent_token),
        ("never issued (forged)", forged),
        ("garbage", "garbage"),
        ("missing", ""),
    ):
        md_ = bearer(token) if token else []
        cells = {
            "ListTools": status_and_reason(
                stack,
                f"gw {who}",
                lambda md_=md_: gw.ListTools(toolgateway_pb2.ListToolsRequest(), timeout=T, metadata=md_),
            ),
            "CallTool": status_and_reason(
                stack,
                f"gw {who}",
                lambda md_=md_: gw.CallTool(
                    toolgateway_pb2.CallToolRequest(name="list_folders"), timeout=T, metadata=md_
                ),
            ),
        }
        rows[who] = {rpc: f"{code.name} {reason}".strip() for rpc, (code, reason) in cells.items()}
    rows["current episode"] = {
        "ListTools": status(
            stack,
            "gw current",
            lambda: gw.ListTools(toolgateway_pb2.ListToolsRequest(), timeout=T, metadata=bearer(current.agent_token)),
        ).name
    }
    figures.record("security", "token_lifecycle", rows)
    assert set(rows["revoked (previous episode)"].values()) == {"FAILED_PRECONDITION EPISODE_SUPERSEDED"}, rows
    assert set(rows["closed session"].values()) == {"FAILED_PRECONDITION SESSION_CLOSED"}, rows
    assert set(rows["finished episode"].values()) == {"FAILED_PRECONDITION EPISODE_DONE"}, rows
    for who in ("never issued (forged)", "garbage", "missing"):
        assert {v.split()[0] for v in rows[who].values()} == {"UNAUTHENTICATED"}, rows
    assert rows["current episode"]["ListTools"] == "OK"


def test_agent_tokens_are_stored_only_as_hashes(stack: AuditedStack) -> None:
    """DESIGN: agent tokens are stored only as hashes. The Reset idempotency record must not keep the
    token it returned (a store reader would otherwise hold every live token)."""
    rid = f"sec-store-{os.getpid()}"
    session = new_session(stack, request_id=rid)

    async def recorded() -> str:
        store = await open_store(stack.store_url)
        try:
            # the ledger's scope: Reset records of the caller, named by its API key's hash
            record = await store.get_request(ledger_scope("reset", token_hash(API_KEY)), rid)
            return record.result if record is not None else ""
        finally:
            await store.close()

    raw = asyncio.run(recorded())
    assert raw, "no Reset request record found under the caller's scope"
    response = json.loads(raw)["response"]  # {"params": {field: digest}, "response": base64}
    stored = orchestrator_pb2.ResetResponse.FromString(base64.b64decode(response))
    secret = session.agent_token.rpartition(".")[2]
    db = Path(stack.store_url.removeprefix("sqlite:///"))
    on_disk = b"".join(p.read_bytes() for p in db.parent.glob(db.name + "*"))
    assert secret.encode() not in on_disk
    assert secret not in stored.agent_token, "the Reset request record keeps the plaintext agent token"


# ---------------------------------------------------------------------------------------------------------
# TLS


@dataclass
class Cert:
    cert: Path
    key: Path
    pem: bytes


def make_cert(directory: Path, name: str = "rlgate-test") -> Cert:
    """A self-signed certificate for 127.0.0.1 and localhost (it is its own CA)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    directory.mkdir(parents=True, exist_ok=True)
    pem = cert.public_bytes(serialization.Encoding.PEM)
    (directory / f"{name}.crt").write_bytes(pem)
    (directory / f"{name}.key").write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return Cert(directory / f"{name}.crt", directory / f"{name}.key", pem)


class TlsServices:
    """An orchestrator and a gateway started with --tls-cert/--tls-key (LocalStack probes readiness in
    plaintext, so these two are launched here), on the security stack's localfleet, with their own store."""

    def __init__(self, stack: AuditedStack, directory: Path, cert: Cert) -> None:
        self.ports = {"orchestrator": free_port(), "toolgateway": free_port()}
        self.cert = cert
        store = f"sqlite:///{directory / 'tls-store.db'}"
        self.logs = {name: directory / f"tls-{name}.log" for name in self.ports}
        tls = ["--tls-cert", str(cert.cert), "--tls-key", str(cert.key)]
        self.commands = {
            "toolgateway": ["toolgateway", "--listen", self.address("toolgateway"), "--store-url", store, *tls],
            "orchestrator": [
                "orchestrator",
                "--listen",
                self.address("orchestrator"),
                "--store-url",
                store,
                "--fleet-base-url",
                stack.localfleet_url,
                "--gateway-address",
                self.address("toolgateway"),
                "--api-keys",
                API_KEY,
                "--run-id",
                "rel-tls",
                *tls,
            ],
        }
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("RLGATE_", "FLEET_"))}
        self.env.update(FLEET_API_KEY=FLEET_API_KEY, PYTHONUNBUFFERED="1")
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        stack.audit.log_files.extend(self.logs.values())

    def address(self, name: str) -> str:
        return f"127.0.0.1:{self.ports[name]}"

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=self.cert.pem)

    def start(self) -> TlsServices:
        for name in ("toolgateway", "orchestrator"):
            with self.logs[name].open("ab") as log:
                self.procs[name] = subprocess.Popen(
                    [sys.executable, "-m", "rlgate.cli", *self.commands[name]],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=self.env,
                    cwd=str(REPO),
                    start_new_session=True,
                )
            self._wait(name)
        return self

    def _wait(self, name: str, timeout: float = 60.0) -> None:
        def serving() -> bool:
            if self.procs[name].poll() is not None:
                raise RuntimeError(f"TLS {name} exited: {self.logs[name].read_text()[-2000:]}")
            try:
                with grpc.secure_channel(self.address(name), self.credentials()) as channel:
                    # types-grpcio-health-checking gives HealthStub no methods.
                    reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2.0)  # type: ignore[attr-defined]
                    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)
            except grpc.RpcError:
                return False

        wait_until_sync(
            serving, timeout, f"TLS {name} serving", interval=0.2, explain=lambda: self.logs[name].read_text()[-2000:]
        )

    def stop(self) -> None:
        for name in ("orchestrator", "toolgateway"):
            proc = self.procs.get(name)
            if proc is not None and proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(10)


def test_tls(stack: AuditedStack, tmp_path: Path, figures: Figures) -> None:
    """With a certificate made here: plaintext clients and clients trusting another CA fail; a client with
    the CA runs an episode through both services."""
    services = TlsServices(stack, tmp_path, make_cert(tmp_path / "ca")).start()
    try:
        other = make_cert(tmp_path / "other", "other-ca")
        rows: dict[str, str] = {}
        for name, rpc in (("orchestrator", "ListTasks"), ("toolgateway", "ListTools")):
            for client, creds in (("plaintext", None), ("TLS, wrong CA", grpc.ssl_channel_credentials(other.pem))):
                stub = (orchestrator_stub if name == "orchestrator" else gateway_stub)(services.address(name), creds)
                request = (
                    orchestrator_pb2.ListTasksRequest()
                    if name == "orchestrator"
                    else toolgateway_pb2.ListToolsRequest()
                )
                rows[f"{name} {client}"] = status(
                    stack,
                    f"tls {name} {client}",
                    lambda s=stub, r=request, m=rpc: getattr(s, m)(r, timeout=5.0, metadata=bearer(API_KEY)),
                ).name
        orch = orchestrator_stub(services.address("orchestrator"), services.credentials())
        reset = orch.Reset(orchestrator_pb2.ResetRequest(env_key="mailbox:v1"), timeout=60.0, metadata=bearer(API_KEY))
        stack.audit.token(reset.agent_token)
        gw = gateway_stub(reset.gateway_address, services.credentials())
        reply = gw.CallTool(
            toolgateway_pb2.CallToolRequest(name="list_folders", request_id="tls-1"),
            timeout=T,
            metadata=bearer(reset.agent_token),
        )
        closed = orch.Close(
            orchestrator_pb2.CloseRequest(session_id=reset.session_id), timeout=T, metadata=bearer(API_KEY)
        )
        rows["TLS with the CA: Reset, CallTool, Close"] = (
            "OK" if not reply.result.is_error and closed.status == common_pb2.SESSION_STATUS_CLOSED else "FAILED"
        )
        figures.record("security", "tls", rows)
        assert all(v == "UNAVAILABLE" for k, v in rows.items() if "plaintext" in k or "wrong CA" in k), rows
        assert rows["TLS with the CA: Reset, CallTool, Close"] == "OK"
    finally:
        services.stop()


# ---------------------------------------------------------------------------------------------------------


def test_no_forged_log_line_anywhere(audit: Audit, figures: Figures) -> None:
    """No line of any log of the whole reliability session starts like the log lines test_hostile's tool names
    and upstream errors tried to forge after a line break."""
    forged = audit.forged_lines(FORGED_PREFIX)
    figures.record("security", "forged_log_lines", {"log_files": len(audit.log_files), "forged": forged[:20]})
    assert forged == []


def test_no_secret_anywhere(stack: AuditedStack, audit: Audit, figures: Figures) -> None:
    """No API key, agent token or FLEET_API_KEY in any log line, /metrics scrape or error detail of the
    whole reliability session (every stack's logs, including the stopped ones)."""
    stack.scrape_metrics()
    leaks = audit.leaks()
    figures.record(
        "security",
        "secret_scan",
        {
            "secrets": len(audit.secrets),
            "log_files": len(audit.log_files),
            "log_bytes": sum(p.stat().st_size for p in audit.log_files if p.exists()),
            "texts": len(audit.texts),
            "leaks": leaks[:20],
        },
    )
    assert audit.secrets and audit.log_files and audit.texts
    assert leaks == []


def _struct(obj: dict[str, Any]) -> Any:
    from rlgate.core.convert import struct_from_dict

    return struct_from_dict(obj)
