"""The README's grpcurl session, run verbatim with the real grpcurl (1.8.6) against a local stack, twice; and
what grpcurl sees of the two servers through reflection alone: each plane's services, the gateway's exact
two methods, `describe` of methods, the agent plane's token check.

The README's lines address `rlgate up`'s defaults (127.0.0.1:50051 and :50052); the stack here runs on free
ports, and those two addresses are the only thing substituted. They run as a reader's fresh terminal would
after `make up`: in the checkout, with no virtualenv activated and no grpcurl on PATH, so a line that
leaned on an activated venv fails here."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rlgate.devtools.stack import LocalStack
from tests.support.grpcurl import require_grpcurl, run_grpcurl
from tests.support.ports import IN_CI

CHECKOUT = Path(__file__).resolve().parents[2]
README = CHECKOUT / "README.md"
MAKE_UP_GRPCURL = CHECKOUT / ".venv" / "bin" / "grpcurl"  # where `make up` puts it (the local extra)
SECTION = "## Talking to it with grpcurl"
ORCHESTRATOR = "127.0.0.1:50051"  # as the README writes them
GATEWAY = "127.0.0.1:50052"
GRPC_STATUS_EXIT = 64  # grpcurl exits 64 + the gRPC status code when an RPC fails


def readme_block() -> tuple[int, list[str]]:
    """The first line number (1-based) of the section's bash block and its lines."""
    lines = README.read_text().splitlines()
    start = lines.index(SECTION)
    opening = next(i for i in range(start, len(lines)) if lines[i].strip() == "```bash")
    closing = next(i for i in range(opening + 1, len(lines)) if lines[i].strip() == "```")
    return opening + 2, lines[opening + 1 : closing]


def readme_commands() -> list[str]:
    """The block's commands: continuation lines (a trailing backslash) kept together, exactly as written;
    comments and blank lines left out."""
    commands: list[str] = []
    pending: list[str] = []
    for line in readme_block()[1]:
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        pending.append(line)
        if not line.endswith("\\"):
            commands.append("\n".join(pending))
            pending = []
    assert not pending, "the block ends inside a continued line"
    return commands


def grpcurl_lines(text: str) -> list[int]:
    """Line numbers (1-based) of the lines in `text` that start a grpcurl command."""
    return [n for n, line in enumerate(text.splitlines(), 1) if re.match(r"\s*(\w+=\$\()?\S*grpcurl\s", line)]


def fresh_terminal_env() -> dict[str, str]:
    """This process's environment as a fresh terminal's: no virtualenv active, and PATH without any
    virtualenv's bin folder or any folder holding a grpcurl."""
    venv_bins = {Path(sys.prefix) / "bin", CHECKOUT / ".venv" / "bin"}
    kept = [
        entry
        for entry in os.environ.get("PATH", "").split(os.pathsep)
        if entry
        and Path(entry) not in venv_bins
        and not (Path(entry).parent / "pyvenv.cfg").exists()  # any other virtualenv's bin
        and not (Path(entry) / "grpcurl").exists()
    ]
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    env["PATH"] = os.pathsep.join(kept)
    assert shutil.which("grpcurl", path=env["PATH"]) is None
    return env


def session_script(commands: list[str], stack: LocalStack) -> str:
    """A bash script that runs each command and prints `<<rc INDEX STATUS>>` after it, stopping at the first
    failure; then the session id the lines worked with."""
    parts = ["set -o pipefail"]
    for index, command in enumerate(commands):
        command = command.replace(ORCHESTRATOR, stack.orchestrator_address).replace(GATEWAY, stack.gateway_address)
        parts.append(f'{command}\nrc=$?; echo "<<rc {index} $rc>>"; [ "$rc" -eq 0 ] || exit "$rc"')
    parts.append('echo "<<session $SESSION_ID>>"')
    return "\n".join(parts) + "\n"


@pytest.fixture(scope="module")
def grpcurl() -> Path:
    return require_grpcurl()


@pytest.fixture(scope="module")
def make_up_grpcurl() -> Path:
    """The checkout's `.venv/bin/grpcurl`, the one the README's lines call."""
    if not os.access(MAKE_UP_GRPCURL, os.X_OK):
        message = f"{MAKE_UP_GRPCURL} is missing: the suite runs from a `make up`/`make test` checkout's .venv"
        if IN_CI:
            pytest.fail(message)
        pytest.skip(message)
    return MAKE_UP_GRPCURL


def test_every_grpcurl_line_of_the_readme_is_in_the_tested_block() -> None:
    first, block = readme_block()
    in_block = {first + n - 1 for n in grpcurl_lines("\n".join(block))}
    assert grpcurl_lines(README.read_text()) == sorted(in_block)
    commands = readme_commands()
    grpcurl_commands = [c for c in commands if "grpcurl " in c]
    assert len(grpcurl_commands) >= 8
    for command in grpcurl_commands:  # the substitution reaches every call
        assert (ORCHESTRATOR in command) != (GATEWAY in command), command
    assert "OrchestratorService/Close" in commands[-1]


def test_readme_session_runs_twice_on_one_stack(
    grpcurl: Path, make_up_grpcurl: Path, stack: LocalStack, tmp_path: Path
) -> None:
    commands = readme_commands()
    script = tmp_path / "readme.sh"
    script.write_text(session_script(commands, stack))
    sessions = []
    for run in (1, 2):
        done = subprocess.run(
            ["bash", "--noprofile", "--norc", str(script)],
            capture_output=True,
            text=True,
            timeout=240,
            env=fresh_terminal_env(),
            cwd=CHECKOUT,
        )
        output = done.stdout + done.stderr
        statuses = [int(s) for s in re.findall(r"<<rc \d+ (\d+)>>", done.stdout)]
        assert done.returncode == 0 and statuses == [0] * len(commands), f"run {run}:\n{output}"
        assert '"is_error": true' not in done.stdout, f"run {run}:\n{output}"
        sessions.append(re.findall(r"<<session (\S*)>>", done.stdout)[0])
    assert all(sessions) and sessions[0] != sessions[1]  # a fresh request_id each run: a new session
    for session_id in sessions:  # and Close closed each
        state = run_grpcurl(
            grpcurl,
            "-d",
            json.dumps({"session_id": session_id}),
            stack.orchestrator_address,
            "rlgate.v1.OrchestratorService/State",
        )
        assert state.returncode == 0, state.stderr
        assert "SESSION_STATUS_CLOSED" in state.stdout


def test_each_plane_lists_its_own_service_only(grpcurl: Path, stack: LocalStack) -> None:
    common = ["grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"]
    for address, own in (
        (stack.orchestrator_address, "rlgate.v1.OrchestratorService"),
        (stack.gateway_address, "rlgate.v1.ToolGatewayService"),
    ):
        listed = run_grpcurl(grpcurl, address, "list")
        assert listed.returncode == 0, listed.stderr
        assert sorted(listed.stdout.split()) == sorted([*common, own])


def test_gateway_has_exactly_list_tools_and_call_tool(grpcurl: Path, stack: LocalStack) -> None:
    listed = run_grpcurl(grpcurl, stack.gateway_address, "list", "rlgate.v1.ToolGatewayService")
    assert listed.returncode == 0, listed.stderr
    assert sorted(listed.stdout.split()) == [
        "rlgate.v1.ToolGatewayService.CallTool",
        "rlgate.v1.ToolGatewayService.ListTools",
    ]


@pytest.mark.parametrize(
    ("plane", "method"),
    [
        ("orchestrator", "rlgate.v1.OrchestratorService.Reset"),
        ("orchestrator", "rlgate.v1.OrchestratorService.Close"),
        ("gateway", "rlgate.v1.ToolGatewayService.ListTools"),
        ("gateway", "rlgate.v1.ToolGatewayService.CallTool"),
        ("orchestrator", "grpc.health.v1.Health.Check"),
        ("gateway", "grpc.health.v1.Health.Check"),
    ],
)
def test_describe_a_method(grpcurl: Path, stack: LocalStack, plane: str, method: str) -> None:
    address = stack.orchestrator_address if plane == "orchestrator" else stack.gateway_address
    described = run_grpcurl(grpcurl, address, "describe", method)
    assert described.returncode == 0, described.stderr
    name = method.rpartition(".")[2]
    assert described.stdout.startswith(f"{method} is a method:\nrpc {name} ("), described.stdout


def test_describe_an_unknown_method_is_not_found(grpcurl: Path, stack: LocalStack) -> None:
    described = run_grpcurl(grpcurl, stack.orchestrator_address, "describe", "rlgate.v1.OrchestratorService.Nope")
    assert described.returncode != 0
    assert "Symbol not found" in described.stderr


def test_agent_plane_needs_the_agent_token(grpcurl: Path, stack: LocalStack) -> None:
    for headers in ([], ["-H", "authorization: Bearer not-a-token"]):
        denied = run_grpcurl(grpcurl, *headers, stack.gateway_address, "rlgate.v1.ToolGatewayService/ListTools")
        assert denied.returncode == GRPC_STATUS_EXIT + 16, denied.stderr  # UNAUTHENTICATED
        assert "Code: Unauthenticated" in denied.stderr
