"""`rlgate up --mcp` end to end against a real third-party MCP server: the reference time server
(`mcp-server-time`, from PyPI, in the dev extra) served over streamable HTTP by
examples/own_mcp_server/serve_time_http.py on a free loopback port, and the stack as `rlgate up --mcp` runs
it (orchestrator with the mcp provider and toolgateway, no localfleet), with the example's task file.

Episodes by env key and by task, ListTools and CallTool through the gateway, rewards from the task file's
scoring (an expected answer, verifier code reading the tool-call log), allow / deny filters per environment
and per task, an unreachable endpoint answered FAILED_PRECONDITION at once, and mistyped endpoints refused at
start. Without the server installed the module skips, except under CI=true, where it fails."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from click.testing import CliRunner

from rlgate.cli import cli
from rlgate.core.convert import parse_json_object
from rlgate.devtools.stack import LocalStack, StackSettings
from rlgate.v1 import (
    common_pb2,
    orchestrator_pb2,
    orchestrator_pb2_grpc,
    toolgateway_pb2,
    toolgateway_pb2_grpc,
)
from tests.support.ports import IN_CI, free_port, wait_for_port

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "own_mcp_server"
TOKYO = {"source_timezone": "UTC", "time": "12:00", "target_timezone": "Asia/Tokyo"}

if importlib.util.find_spec("mcp_server_time") is None:
    if IN_CI:
        pytest.fail("mcp-server-time is not installed (the dev extra pins it)", pytrace=False)
    pytest.skip("mcp-server-time is not installed (pip install -e '.[dev]')", allow_module_level=True)


@pytest.fixture(scope="module")
def time_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The third-party server on a free loopback port; yields its MCP URL."""
    port = free_port()
    log = (tmp_path_factory.mktemp("time-server") / "server.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, str(EXAMPLE / "serve_time_http.py"), "--port", str(port)], stdout=log, stderr=log
    )
    try:
        wait_for_port(port, timeout=30)
        yield f"http://127.0.0.1:{port}/mcp"
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()


@pytest.fixture(scope="module")
def closed_url() -> str:
    return f"http://127.0.0.1:{free_port()}/mcp"  # nothing listens there


@pytest.fixture(scope="module")
def stack(time_server: str, closed_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    """The example's task file plus one environment ("clock") and task of this test's own."""
    data = json.loads((EXAMPLE / "tasks.json").read_text())
    data["tasks"].append(
        {"key": "clock-now", "env": "clock", "prompt": "What time is it?", "tool_filter": {"allow": ["get_*"]}}
    )
    tasks = tmp_path_factory.mktemp("tasks") / "tasks.json"
    tasks.write_text(json.dumps(data))
    settings = StackSettings(
        data_dir=tmp_path_factory.mktemp("own-mcp"),
        mcp_envs=[f"time={time_server}", f"clock={time_server}", f"down={closed_url}"],
        tasks_file=str(tasks),
    )
    with LocalStack(settings) as running:
        assert running.services == ("toolgateway", "orchestrator")  # no localfleet
        yield running


@pytest.fixture(scope="module")
def orchestrator(stack: LocalStack) -> Iterator[orchestrator_pb2_grpc.OrchestratorServiceStub]:
    with grpc.insecure_channel(stack.orchestrator_address) as channel:
        yield orchestrator_pb2_grpc.OrchestratorServiceStub(channel)


@pytest.fixture(scope="module")
def gateway(stack: LocalStack) -> Iterator[toolgateway_pb2_grpc.ToolGatewayServiceStub]:
    with grpc.insecure_channel(stack.gateway_address) as channel:
        yield toolgateway_pb2_grpc.ToolGatewayServiceStub(channel)


def agent(reset: orchestrator_pb2.ResetResponse) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {reset.agent_token}")]


def test_the_example_scores_both_tasks(stack: LocalStack) -> None:
    run = subprocess.run(
        [sys.executable, str(EXAMPLE / "episode.py"), "--orchestrator", stack.orchestrator_address],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == [
        "env time: tools ['convert_time']",
        "time-tokyo-noon: tools ['convert_time'], answer 21:00, reward 1.0 (OK)",
        "time-kathmandu-checked: tools ['convert_time'], answer 15:15, reward 1.0 (OK)",
    ]


def test_episode_by_env_key_then_by_task(
    orchestrator: orchestrator_pb2_grpc.OrchestratorServiceStub, gateway: toolgateway_pb2_grpc.ToolGatewayServiceStub
) -> None:
    reset = orchestrator.Reset(orchestrator_pb2.ResetRequest(env_key="time"), timeout=30)
    assert reset.instance.provider == "mcp" and [t.name for t in reset.tools] == ["convert_time"]
    listed = gateway.ListTools(toolgateway_pb2.ListToolsRequest(), metadata=agent(reset), timeout=30)
    assert [t.name for t in listed.tools] == ["convert_time"]  # the environment's deny of get_current_time
    called = gateway.CallTool(
        toolgateway_pb2.CallToolRequest(name="convert_time", arguments_json=json.dumps(TOKYO)),
        metadata=agent(reset),
        timeout=30,
    )
    assert not called.result.is_error, called.result
    converted = parse_json_object(called.result.structured_content_json, "convert_time result")
    assert converted["target"]["timezone"] == "Asia/Tokyo" and converted["target"]["datetime"][11:16] == "21:00"
    step = orchestrator.Step(
        orchestrator_pb2.StepRequest(session_id=reset.session_id, final_answer="21:00"), timeout=60
    )
    assert step.done and step.verification.status == common_pb2.VERIFICATION_STATUS_SKIPPED  # no task, no scoring

    for answer, reward in [("21:00", 1.0), ("20:00", 0.0)]:
        scored = orchestrator.Reset(orchestrator_pb2.ResetRequest(task_key="time-tokyo-noon"), timeout=30)
        assert "expected_answer" not in parse_json_object(scored.task.metadata_json, "metadata")
        step = orchestrator.Step(
            orchestrator_pb2.StepRequest(session_id=scored.session_id, final_answer=answer), timeout=60
        )
        assert (step.verification.status, step.reward) == (common_pb2.VERIFICATION_STATUS_OK, reward)
        orchestrator.Close(orchestrator_pb2.CloseRequest(session_id=scored.session_id), timeout=30)


def test_verifier_code_needs_the_tool_call(orchestrator: orchestrator_pb2_grpc.OrchestratorServiceStub) -> None:
    """The right answer without the conversion in the tool-call log scores 0 (the task's verifier code)."""
    reset = orchestrator.Reset(orchestrator_pb2.ResetRequest(task_key="time-kathmandu-checked"), timeout=30)
    step = orchestrator.Step(
        orchestrator_pb2.StepRequest(session_id=reset.session_id, final_answer="15:15"), timeout=60
    )
    assert (step.verification.status, step.reward) == (common_pb2.VERIFICATION_STATUS_OK, 0.0)
    assert "no successful convert_time call" in step.verification.stdout


def test_filters_per_environment_and_per_task(
    orchestrator: orchestrator_pb2_grpc.OrchestratorServiceStub, gateway: toolgateway_pb2_grpc.ToolGatewayServiceStub
) -> None:
    for fields, names in [
        ({"env_key": "clock"}, ["get_current_time", "convert_time"]),  # same server, no environment filter
        ({"task_key": "clock-now"}, ["get_current_time"]),  # the task's allow
        ({"env_key": "time"}, ["convert_time"]),
    ]:
        reset = orchestrator.Reset(orchestrator_pb2.ResetRequest(**fields), timeout=30)  # type: ignore[arg-type]
        assert [t.name for t in reset.tools] == names, fields
        listed = gateway.ListTools(toolgateway_pb2.ListToolsRequest(), metadata=agent(reset), timeout=30)
        assert [t.name for t in listed.tools] == names, fields


def test_an_unreachable_endpoint_fails_reset_at_once(
    orchestrator: orchestrator_pb2_grpc.OrchestratorServiceStub, closed_url: str
) -> None:
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as err:
        orchestrator.Reset(orchestrator_pb2.ResetRequest(env_key="down"), timeout=30)
    assert time.monotonic() - started < 8.0  # at once: not the 20 s discovery timeout nor the call's 30 s
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert closed_url in (err.value.details() or "")


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--mcp", "time=localhost:8931/mcp"], "'localhost:8931/mcp' is not an http(s) URL"),
        (["--mcp", "time=http://127.0.0.1:8931"], "'http://127.0.0.1:8931' has no path"),
        (["--mcp", "time=http://127.0.0.1:89x1/mcp"], "is not a URL"),
        (["--mcp", "time=http://127.0.0.1:8931/mcp", "--mcp", "time=http://127.0.0.1:8932/mcp"], "defined twice"),
    ],
)
def test_a_mistyped_endpoint_is_an_error_at_start(args: list[str], says: str, tmp_path: Path) -> None:
    result = CliRunner().invoke(cli, ["up", "--data-dir", str(tmp_path), *args])
    assert result.exit_code == 2, result.output
    last = result.output.strip().splitlines()[-1]
    assert last.startswith("Error: Invalid value for '--mcp' / RLGATE_MCP_ENVS: ") and says in last, last
    assert not (tmp_path / "logs").exists()  # nothing started


def test_the_orchestrator_refuses_a_mistyped_endpoint_from_the_environment(tmp_path: Path) -> None:
    """As compose runs it: RLGATE_MCP_ENVS in the environment, one line on stderr, exit 2, nothing served."""
    run = subprocess.run(
        [sys.executable, "-m", "rlgate.cli", "orchestrator", "--listen", "127.0.0.1:0", "--data-dir", str(tmp_path)],
        env={"PATH": "/usr/bin:/bin", "RLGATE_PROVIDER": "mcp", "RLGATE_MCP_ENVS": "time=http//127.0.0.1:8931/mcp"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 2
    assert run.stderr.strip().splitlines()[-1] == (
        "Error: Invalid value for '--mcp-envs' / RLGATE_MCP_ENVS: MCP environment 'time': "
        "'http//127.0.0.1:8931/mcp' is not an http(s) URL (want http://HOST:PORT/PATH, e.g. .../mcp)"
    )


def test_a_task_of_an_undefined_environment_is_an_error_at_start(tmp_path: Path) -> None:
    tasks = tmp_path / "tasks.json"
    tasks.write_text(json.dumps([{"key": "k", "env": "tyme", "prompt": "p", "expected_answer": "x"}]))
    result = CliRunner().invoke(
        cli, ["up", "--data-dir", str(tmp_path), "--mcp", "time=http://127.0.0.1:8931/mcp", "--tasks", str(tasks)]
    )
    assert result.exit_code == 2, result.output
    assert "no MCP endpoints defined for 'tyme' (defined: time" in result.output.strip().splitlines()[-1]
