"""The contract: generated code matches the protos, buf lint is clean and enforces comments, and the
agent plane has exactly two RPCs."""

from __future__ import annotations

import filecmp
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from rlgate.runtime import protogen
from tests.support.ports import IN_CI

ROOT = Path(__file__).resolve().parents[2]
GENERATED = ROOT / "clients" / "python" / "rlgate" / "v1"


def _buf() -> str:
    candidate = os.environ.get("RLGATE_BUF") or str(ROOT / ".tools" / "node_modules" / ".bin" / "buf")
    if Path(candidate).exists():
        return str(Path(candidate).resolve())  # tests run buf from other directories
    found = shutil.which("buf")
    if found:
        return found
    if IN_CI:
        pytest.fail("buf is not installed (make test installs it from npm)")
    pytest.skip("buf not installed; run `make test`")


def test_generated_code_has_no_drift(tmp_path: Path) -> None:
    fresh = protogen.generate(tmp_path)
    assert fresh, "protoc generated nothing"
    names = sorted(p.name for p in fresh)
    committed = sorted(p.name for p in GENERATED.glob("*_pb2*.py*"))
    assert names == committed, f"generated files differ: {names} vs {committed}"
    for path in fresh:
        assert filecmp.cmp(path, GENERATED / path.name, shallow=False), (
            f"{path.name} is stale: run `make proto` and commit the result"
        )


def test_buf_lint_is_clean() -> None:
    result = subprocess.run([_buf(), "lint"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_buf_lint_rejects_an_uncommented_field(tmp_path: Path) -> None:
    shutil.copy(ROOT / "buf.yaml", tmp_path / "buf.yaml")
    shutil.copytree(ROOT / "proto", tmp_path / "proto")
    proto = tmp_path / "proto" / "rlgate" / "v1" / "toolgateway.proto"
    text = proto.read_text()
    text = text.replace("message ListToolsRequest {}", "message ListToolsRequest {\n  string cursor = 1;\n}")
    proto.write_text(text)
    result = subprocess.run([_buf(), "lint"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "COMMENT_FIELD" in result.stdout + result.stderr or "comment" in (result.stdout + result.stderr).lower()


def test_gateway_service_can_only_list_and_call_tools() -> None:
    """The agent plane (RFC 001): listing tools and calling them, nothing else. CallToolStream is CallTool
    over a stream: its requests carry one CallToolRequest (or a cancel of one) and nothing that could reach
    another operation."""
    from rlgate.v1 import toolgateway_pb2

    service = toolgateway_pb2.DESCRIPTOR.services_by_name["ToolGatewayService"]
    assert sorted(m.name for m in service.methods) == ["CallTool", "CallToolStream", "ListTools"]
    stream = service.methods_by_name["CallToolStream"]
    assert stream.client_streaming and stream.server_streaming
    fields = {f.name: f for f in stream.input_type.fields}
    assert sorted(fields) == ["call", "call_id", "cancel", "timeout", "token", "trace_id"]
    assert fields["call"].message_type.full_name == "rlgate.v1.CallToolRequest"
    answer = {f.name: f for f in stream.output_type.fields}
    assert answer["reply"].message_type.full_name == "rlgate.v1.CallToolResponse"


def test_orchestrator_service_methods() -> None:
    from rlgate.v1 import orchestrator_pb2

    service = orchestrator_pb2.DESCRIPTOR.services_by_name["OrchestratorService"]
    assert sorted(m.name for m in service.methods) == sorted(
        ["Reset", "Step", "StepStream", "State", "Close", "CloseSessions", "ListTasks", "ListSessions"]
    )


def test_reward_has_presence() -> None:
    """reward is `optional`: an unscored episode is distinguishable from a score of 0."""
    from rlgate.v1 import orchestrator_pb2

    reply = orchestrator_pb2.StepResponse()
    assert not reply.HasField("reward")
    reply.reward = 0.0
    assert reply.HasField("reward")
