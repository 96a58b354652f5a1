"""The contract: generated code matches the protos, buf lint is clean and enforces comments, each service
has exactly the unary RPCs its proto names (the agent plane two), and JSON passed on travels as text."""

from __future__ import annotations

import filecmp
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from rlgate.devtools import protogen
from tests.support.ports import IN_CI

ROOT = Path(__file__).resolve().parents[2]
GENERATED = ROOT / "clients" / "python" / "rlgate" / "v1"


def _buf() -> str:
    # buf-bin (the dev extra) puts buf beside this interpreter.
    candidate = os.environ.get("RLGATE_BUF") or str(Path(sys.executable).parent / "buf")
    if Path(candidate).exists():
        return str(Path(candidate).resolve())  # tests run buf from other directories
    found = shutil.which("buf")
    if found:
        return found
    if IN_CI:
        pytest.fail("buf is not installed (make test installs it: buf-bin in the dev extra)")
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


def _rpcs_named_in(proto: str) -> list[str]:
    """The RPCs a .proto file declares, read from its text (the contract as written, not as generated)."""
    return re.findall(r"^\s*rpc\s+(\w+)\s*\(", (ROOT / "proto" / "rlgate" / "v1" / proto).read_text(), re.M)


@pytest.mark.parametrize(
    ("proto", "service", "methods"),
    [
        ("toolgateway.proto", "ToolGatewayService", ["ListTools", "CallTool"]),
        (
            "orchestrator.proto",
            "OrchestratorService",
            ["Reset", "Step", "State", "Close", "CloseSessions", "ListTasks", "ListSessions", "Fork"],
        ),
    ],
)
def test_each_service_has_exactly_the_rpcs_the_proto_names_all_unary(
    proto: str, service: str, methods: list[str]
) -> None:
    """The agent plane (RFC 001) lists and calls tools and nothing else; neither service has a streaming
    twin of an RPC. The generated descriptors agree with the .proto text."""
    from rlgate.v1 import orchestrator_pb2, toolgateway_pb2

    module = toolgateway_pb2 if proto == "toolgateway.proto" else orchestrator_pb2
    descriptor = module.DESCRIPTOR.services_by_name[service]
    assert [m.name for m in descriptor.methods] == _rpcs_named_in(proto) == methods
    for method in descriptor.methods:
        assert not method.client_streaming and not method.server_streaming, method.full_name


def test_no_stream_messages_remain() -> None:
    from rlgate.v1 import common_pb2, orchestrator_pb2, toolgateway_pb2

    names = [n for m in (common_pb2, orchestrator_pb2, toolgateway_pb2) for n in m.DESCRIPTOR.message_types_by_name]
    assert not [n for n in names if "Stream" in n or n == "CallStatus"], names


def test_json_the_services_pass_on_travels_as_text() -> None:
    """Struct carries every number as a double; what rlgate passes on is JSON text, kept exactly."""
    from rlgate.v1 import common_pb2, orchestrator_pb2, toolgateway_pb2

    def fields(message: Any) -> dict[str, Any]:
        return {f.name: f for f in message.DESCRIPTOR.fields}

    reset = fields(orchestrator_pb2.ResetResponse)
    assert "info" not in reset and reset["instance"].message_type.full_name == "rlgate.v1.InstanceInfo"
    task = fields(common_pb2.TaskInfo)
    assert "metadata" not in task
    assert {"metadata_json", "reference_solution_json"} <= set(task)
    log = fields(orchestrator_pb2.ToolCallLogEntry)
    assert "arguments" not in log and log["arguments_json"].type == log["arguments_json"].TYPE_STRING
    for message in (toolgateway_pb2.CallToolRequest, orchestrator_pb2.ToolCallSummary):
        args = message.DESCRIPTOR.oneofs_by_name["args"]
        assert sorted(f.name for f in args.fields) == ["arguments", "arguments_json"], message
    assert "include_reference_solution" in fields(orchestrator_pb2.ListTasksRequest)


def test_reward_has_presence() -> None:
    """reward is `optional`: an unscored episode is distinguishable from a score of 0."""
    from rlgate.v1 import orchestrator_pb2

    reply = orchestrator_pb2.StepResponse()
    assert not reply.HasField("reward")
    reply.reward = 0.0
    assert reply.HasField("reward")
