"""`rlgate` commands end with one line and an exit status, never a traceback: `rollout` against an
unreachable orchestrator, without an API key, with an output path in a missing folder (checked before any
episode runs) or failing in an unexpected way; `healthcheck` in a client-only install (no server extra)."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from click.testing import CliRunner, Result
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from rlgate import rollout
from rlgate.cli import cli
from tests.client.scripted import ScriptedServer

# What `pip install rlgate` lacks: the server extra's modules, and the rollout extra's (healthcheck needs none).
SERVER_ONLY = (
    "grpc_health", "grpc_reflection", "mcp", "fleet", "cloudpickle", "uvicorn", "starlette", "redis",
    "prometheus_client", "jsonschema", "PIL", "orjson", "apsw", "httpx", "rich", "matplotlib",
)  # fmt: skip


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RLGATE_API_KEY", "RLGATE_ORCHESTRATOR", "RLGATE_DEBUG", "RLGATE_TOOL_TIMEOUT_S"):
        monkeypatch.delenv(name, raising=False)


def _one_line_error(result: Result, exit_code: int = 1) -> str:
    """The command's last line, after checking it ended with that line and `exit_code`, not a traceback."""
    assert isinstance(result.exception, SystemExit), result.exception  # not an exception CliRunner caught
    assert result.exit_code == exit_code, result.output
    assert "Traceback" not in result.output
    last = result.output.strip().splitlines()[-1]
    assert last.startswith("Error: "), result.output
    return last


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_rollout_against_an_unreachable_orchestrator(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rollout, "LIST_TASKS_TIMEOUT_S", 0.5)
    address = f"127.0.0.1:{_closed_port()}"
    result = CliRunner().invoke(cli, ["rollout", "--orchestrator", address, "--no-progress"])
    assert _one_line_error(result).startswith(f"Error: cannot reach the orchestrator at {address} (")


@pytest.mark.parametrize(
    ("given", "said"),
    [
        ("http://127.0.0.1:8765", "'http://127.0.0.1:8765' is a URL; the orchestrator is a gRPC address host:port"),
        ("127.0.0.1", "'127.0.0.1' is not host:port (for example 127.0.0.1:50051)"),
        (" , ", "no address in"),
    ],
)
def test_rollout_refuses_a_malformed_orchestrator_address_at_once(given: str, said: str) -> None:
    result = CliRunner().invoke(cli, ["rollout", "--orchestrator", given, "--no-progress"])
    assert _one_line_error(result, exit_code=2).startswith("Error: Invalid value for '--orchestrator': ")
    assert said in result.output, result.output


def test_rollout_defaults_to_the_local_stack_and_says_what_episodes_counts() -> None:
    helped = CliRunner().invoke(cli, ["rollout", "--help"])
    assert "[default: 127.0.0.1:50051]" in helped.output
    assert "Episodes of EACH task" in helped.output
    # Not run against it: another stack may be up on this machine's 50051.
    defaults = {p.name: p.default for p in rollout.rollout_command.params}
    assert defaults["orchestrator"] == "127.0.0.1:50051"


@pytest.mark.parametrize("key", [None, "wrong"])
def test_rollout_without_an_accepted_api_key(server: ScriptedServer, key: str | None) -> None:
    server.script.push("ListTasks", grpc.StatusCode.UNAUTHENTICATED)
    args = ["rollout", "--orchestrator", server.address, "--no-progress", *(["--api-key", key] if key else [])]
    last = _one_line_error(CliRunner().invoke(cli, args))
    if key is None:
        assert "needs an API key: pass --api-key or set RLGATE_API_KEY" in last
    else:
        assert "refused the API key" in last
    assert server.script.count("Reset") == 0


@pytest.mark.parametrize("option", ["--out", "--summary-json", "--plot"])
def test_rollout_checks_output_paths_before_running_anything(
    server: ScriptedServer, tmp_path: Path, option: str
) -> None:
    missing = tmp_path / "no-such-folder" / "file.png"
    result = CliRunner().invoke(cli, ["rollout", "--orchestrator", server.address, option, str(missing)])
    last = _one_line_error(result, exit_code=2)
    assert last == f"Error: Invalid value for '{option}': folder {str(missing.parent)!r} does not exist"
    assert server.script.count("ListTasks") == 0  # nothing ran


def test_an_unexpected_failure_is_one_line(monkeypatch: pytest.MonkeyPatch, server: ScriptedServer) -> None:
    async def broken(config: rollout.RolloutConfig) -> None:
        raise RuntimeError("the policy blew up\nwith a second line")

    monkeypatch.setattr(rollout, "run_rollout", broken)
    result = CliRunner().invoke(cli, ["rollout", "--orchestrator", server.address, "--no-progress"])
    assert _one_line_error(result) == "Error: RuntimeError: the policy blew up with a second line"
    monkeypatch.setenv("RLGATE_DEBUG", "1")  # for debugging, the traceback is kept
    debug = CliRunner().invoke(cli, ["rollout", "--orchestrator", server.address, "--no-progress"])
    assert isinstance(debug.exception, RuntimeError)


# ------------------------------------------------------------------------------------------- healthcheck


@pytest.fixture
def health_server() -> Iterator[tuple[str, health.HealthServicer]]:
    servicer = health.HealthServicer()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}", servicer
    finally:
        server.stop(0)


def _client_only(*args: str) -> subprocess.CompletedProcess[str]:
    """`rlgate ARGS` in a fresh interpreter where the server extra's modules cannot be imported."""
    code = (
        f"import sys\nfor name in {SERVER_ONLY!r}:\n    sys.modules[name] = None\n"
        f"from rlgate.cli import main\nsys.argv = ['rlgate', *{list(args)!r}]\nmain()\n"
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)


def test_healthcheck_works_in_a_client_only_install(health_server: tuple[str, health.HealthServicer]) -> None:
    address, servicer = health_server
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    servicer.set("rlgate.v1.OrchestratorService", health_pb2.HealthCheckResponse.NOT_SERVING)
    serving = _client_only("healthcheck", address)
    assert (serving.returncode, serving.stdout, serving.stderr) == (0, f"{address}: SERVING\n", "")
    not_serving = _client_only("healthcheck", address, "--service", "rlgate.v1.OrchestratorService")
    assert (not_serving.returncode, not_serving.stderr) == (1, f"{address}: NOT_SERVING\n")
    unknown = _client_only("healthcheck", address, "--service", "nope", "-q")
    assert (unknown.returncode, unknown.stdout, unknown.stderr) == (1, "", "")
    unreachable = _client_only("healthcheck", f"127.0.0.1:{_closed_port()}", "--timeout", "1")
    assert unreachable.returncode == 2 and len(unreachable.stderr.splitlines()) == 1
    assert "UNAVAILABLE" in unreachable.stderr and "Traceback" not in unreachable.stderr


def test_rollout_runs_only_the_modalities_asked_for() -> None:
    from rlgate.v1 import common_pb2

    tasks = [
        common_pb2.TaskInfo(key="a", modality="tool_use"),
        common_pb2.TaskInfo(key="b", modality="computer_use"),
        common_pb2.TaskInfo(key="c"),  # no modality: tool_use, as the contract says
    ]
    assert [t.key for t in tasks if rollout._of_modality(t, "all")] == ["a", "b", "c"]
    assert [t.key for t in tasks if rollout._of_modality(t, "tool_use")] == ["a", "c"]
    assert [t.key for t in tasks if rollout._of_modality(t, " computer_use , browser_use")] == ["b"]
