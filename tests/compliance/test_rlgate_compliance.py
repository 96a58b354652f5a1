"""rlgate's own servers against rlgate.compliance: the orchestration and agent planes, without and with API
keys (tests/compliance/conftest.py starts them). A case rlgate fails because it breaks its own contract is
kept here as xfail(strict=True), naming where the fix belongs."""

from __future__ import annotations

import subprocess
import sys

import grpc
import pytest

from rlgate.compliance import ExactJsonCall, OrchestratorServiceCompliance, ToolCall, ToolGatewayServiceCompliance
from tests.compliance.conftest import API_KEY, OTHER_API_KEY
from tests.compliance.servers import Servers

# tracker's get_issue answers the issue as structured content, its number (an integer argument) included
ISSUE = {"repo": "northwind/beacon-sdk", "number": 25}


class RlgateServers:
    # Typed as ComplianceHarness declares them: the test classes inherit both.
    task_key = "tracker-who-is-assigned"
    tool_call: ToolCall | None = ToolCall("get_issue", ISSUE)
    exact_json_call: ExactJsonCall | None = ExactJsonCall(
        "get_issue", ISSUE, expect={"/number": 25, "/repo": "northwind/beacon-sdk"}
    )
    rpc_timeout_s = 30.0
    expiry_timeout_s = 30.0
    servers_fixture = "open_servers"

    @pytest.fixture(autouse=True)
    def _servers(self, request: pytest.FixtureRequest) -> None:
        self._request = request
        self.servers: Servers = request.getfixturevalue(self.servers_fixture)

    def orchestrator_channel(self) -> grpc.Channel:
        return grpc.insecure_channel(self.servers.orchestrator_address)

    def expiring_orchestrator_channel(self) -> grpc.Channel | None:
        expiring: Servers = self._request.getfixturevalue("expiring_servers")
        return grpc.insecure_channel(expiring.orchestrator_address)


class RlgateServersWithApiKeys(RlgateServers):
    api_key: str | None = API_KEY
    other_api_key: str | None = OTHER_API_KEY
    servers_fixture = "keyed_servers"


class TestOrchestrator(RlgateServers, OrchestratorServiceCompliance):
    pass


class TestToolGateway(RlgateServers, ToolGatewayServiceCompliance):
    pass


class TestOrchestratorWithApiKeys(RlgateServersWithApiKeys, OrchestratorServiceCompliance):
    pass


class TestToolGatewayWithApiKeys(RlgateServersWithApiKeys, ToolGatewayServiceCompliance):
    pass


def test_compliance_imports_no_service_code() -> None:
    """rlgate.compliance tests any implementation: it needs the stubs, grpc and rlgate.core.convert, not rlgate's
    servers."""
    code = (
        "import sys, rlgate.compliance;"
        "bad = sorted(m for m in sys.modules if m.split('.')[:2] in (['rlgate', 'orchestrator'],"
        " ['rlgate', 'toolgateway'], ['rlgate', 'runtime'], ['rlgate', 'store'], ['rlgate', 'mcpclient'],"
        " ['rlgate', 'localfleet']));"
        "print(bad); sys.exit(1 if bad else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
