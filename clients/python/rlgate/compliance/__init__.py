"""Compliance tests for implementations of rlgate's two services, after dm_env_rpc's `compliance` package.

`OrchestratorServiceCompliance` and `ToolGatewayServiceCompliance` are base classes whose `test_*` methods
check, over the wire, what the proto comments in proto/rlgate/v1/*.proto promise: the status of each RPC,
request-id retries, the lifecycle of sessions and agent tokens, exact JSON, and the split between the
orchestration and the agent plane. They import only the generated stubs, grpc, grpcio-status and
rlgate.core.convert, so they test any server, rlgate's own included.

Subclass them in a test module and say how to reach the server under test. Class names starting with
`Test` make pytest collect them (the bases are not collected themselves); mixing in `unittest.TestCase`
works as well. A test whose option is missing skips with the reason::

    import grpc
    from rlgate.compliance import ExactJsonCall, OrchestratorServiceCompliance, ToolCall, ToolGatewayServiceCompliance

    class MyServer:
        task_key = "tracker-who-is-assigned"                    # a task ListTasks lists
        tool_call = ToolCall("get_issue", {"repo": "northwind/beacon-sdk", "number": 25})  # succeeds on it
        exact_json_call = ExactJsonCall(                        # optional: echoes an integer back
            "get_issue", {"repo": "northwind/beacon-sdk", "number": 25}, expect={"/number": 25})
        api_key = "k1"                                          # optional: the server requires API keys

        def orchestrator_channel(self) -> grpc.Channel:        # a new channel per test; the harness closes it
            return grpc.insecure_channel("127.0.0.1:50051")

    class TestMyOrchestrator(MyServer, OrchestratorServiceCompliance): ...
    class TestMyGateway(MyServer, ToolGatewayServiceCompliance): ...

The gateway is reached at the address Reset returns (override `gateway_channel(address)` for TLS), with
the agent tokens Reset mints. `expiring_orchestrator_channel()` (an orchestrator whose sessions expire
within `expiry_timeout_s`) enables the expiry test; `other_api_key` the test of request ids scoped to the
caller. See docs/compliance.md.
"""

from rlgate.compliance.harness import ComplianceHarness, ExactJsonCall, ToolCall
from rlgate.compliance.orchestrator import OrchestratorServiceCompliance
from rlgate.compliance.toolgateway import ToolGatewayServiceCompliance

__all__ = [
    "ComplianceHarness",
    "ExactJsonCall",
    "OrchestratorServiceCompliance",
    "ToolCall",
    "ToolGatewayServiceCompliance",
]
