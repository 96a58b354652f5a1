"""Several toolgateway processes on one host (`rlgate up` with gateway_workers, one per core): the orchestrator
hands each session one of them, always the same, sessions spread over all, and any of them serves any
session (the gateway keeps no state outside the store)."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

import rlgate
from rlgate.devtools.stack import LocalStack, StackSettings
from rlgate.orchestrator.resets import gateway_for

UPSTREAM = Path(__file__).resolve().parents[2] / "bench" / "scale_upstream.py"  # one `wait` tool


def test_a_session_is_handed_one_gateway_of_several_always_the_same() -> None:
    both = "127.0.0.1:1, 127.0.0.1:2"
    picks = Counter(gateway_for(both, f"s-{i}") for i in range(400))
    assert set(picks) == {"127.0.0.1:1", "127.0.0.1:2"} and min(picks.values()) > 150
    assert all(gateway_for(both, f"s-{i}") == gateway_for(both, f"s-{i}") for i in range(50))
    assert gateway_for("127.0.0.1:9", "s-1") == "127.0.0.1:9"


@pytest.fixture(scope="module")
def upstream() -> Iterator[str]:
    proc = subprocess.Popen([sys.executable, str(UPSTREAM)], stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        yield f"http://127.0.0.1:{port}/mcp"
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.mark.slow
def test_sessions_spread_over_the_gateway_workers_and_any_serves_any(upstream: str, tmp_path: Path) -> None:
    settings = StackSettings(data_dir=tmp_path, mcp_envs=[f"wait={upstream}"], gateway_workers=2)
    with LocalStack(settings) as stack, rlgate.Client(stack.orchestrator_address) as client:
        assert len(set(stack.gateway_addresses)) == 2
        assert [stack.procs[name].poll() for name in stack.gateways] == [None, None]
        handed: Counter[str] = Counter()
        for _ in range(12):
            reset = client.reset(env_key="wait")
            assert reset.gateway_address in stack.gateway_addresses
            handed[reset.gateway_address] += 1
            for gateway in stack.gateway_addresses:  # its own and the other
                reply = client.call_tool(reset.agent_token, "wait", {"seconds": 0}, gateway=gateway)
                assert not reply.result.is_error, reply.result.error_message
            client.close_session(reset.session_id)
        assert set(handed) == set(stack.gateway_addresses)
