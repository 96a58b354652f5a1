"""Screen tasks through the orchestrator and a real localfleet: a computer_use Reset gets an
`image_type="mcp"` instance (Fleet's screen images) living 1800 s, a tool_use one a standard instance living
900 s, and without a browser a computer_use Reset fails at once with FAILED_PRECONDITION naming `chromium`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2

from rlgate.v1 import orchestrator_pb2
from tests.orchestrator.conftest import Running, call_tool, fast_config, instances_of
from tests.support.localfleet import LocalfleetProcess
from tests.support.ports import require_binary
from tests.support.statuses import detail

TINY = "tests.support.localfleet:tiny_environments"
TASKS = [
    {"key": "notes-look", "prompt": "Look at the notes.", "env_id": "notes", "version": "v1"},
    {
        "key": "notes-screen",
        "prompt": "Add a note on the screen.",
        "env_id": "notes",
        "version": "v1",
        "task_modality": "computer_use",
    },
]


@pytest.fixture
def tasks_file(tmp_path: Path) -> str:
    path = tmp_path / "tasks.json"
    path.write_text(json.dumps({"tasks": TASKS}))
    return str(path)


@pytest.fixture(scope="module")
def screen_lf() -> Iterator[LocalfleetProcess]:
    require_binary("chromium")
    with LocalfleetProcess(environments=TINY) as lf:
        yield lf


@pytest.fixture(scope="module")
def blind_lf() -> Iterator[LocalfleetProcess]:
    with LocalfleetProcess(environments=TINY, extra_args=["--browser-path", "/nonexistent/chromium"]) as lf:
        yield lf


async def test_modality_decides_the_image_and_its_lifetime(
    screen_lf: LocalfleetProcess, orchestrator_factory: Callable[..., Any], gateway: Any, tasks_file: str
) -> None:
    config = fast_config(screen_lf, tasks_file=tasks_file, instance_ttl_s=0, gateway_address=gateway.address)
    orch: Running = await orchestrator_factory(config)
    screen = await orch.stub.Reset(orchestrator_pb2.ResetRequest(task_key="notes-screen"), timeout=60)
    tool_use = await orch.stub.Reset(orchestrator_pb2.ResetRequest(task_key="notes-look"), timeout=60)
    assert [t.name for t in screen.tools] == ["computer"]
    assert "computer" not in {t.name for t in tool_use.tools} and "count_notes" in {t.name for t in tool_use.tools}
    live = {i["instance_id"]: i for i in instances_of(screen_lf, config.run_id)}
    assert (live[screen.instance.instance_id]["image_type"], live[screen.instance.instance_id]["ttl_seconds"]) == (
        "mcp",
        1800,
    )
    assert (live[tool_use.instance.instance_id]["image_type"], live[tool_use.instance.instance_id]["ttl_seconds"]) == (
        None,
        900,
    )
    # The agent sees its screen through the gateway.
    shot = await call_tool(gateway.address, screen.agent_token, "computer", {"action": "screenshot"})
    assert not shot.is_error and any(block.HasField("image") for block in shot.content)


async def test_a_configured_ttl_wins(
    screen_lf: LocalfleetProcess, orchestrator_factory: Callable[..., Any], tasks_file: str
) -> None:
    config = fast_config(screen_lf, tasks_file=tasks_file, instance_ttl_s=120)
    orch: Running = await orchestrator_factory(config)
    screen = await orch.stub.Reset(orchestrator_pb2.ResetRequest(task_key="notes-screen"), timeout=60)
    (inst,) = [i for i in instances_of(screen_lf, config.run_id) if i["instance_id"] == screen.instance.instance_id]
    assert (inst["image_type"], inst["ttl_seconds"]) == ("mcp", 120)


async def test_a_screen_task_without_a_browser_is_a_failed_precondition(
    blind_lf: LocalfleetProcess, orchestrator_factory: Callable[..., Any], tasks_file: str
) -> None:
    config = fast_config(blind_lf, tasks_file=tasks_file)
    orch: Running = await orchestrator_factory(config)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await orch.stub.Reset(orchestrator_pb2.ResetRequest(task_key="notes-screen"), timeout=60)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "chromium" in (err.value.details() or "")
    assert detail(err.value, error_details_pb2.ErrorInfo).reason == "PROVIDER_UNSUPPORTED"
    assert instances_of(blind_lf, config.run_id) == []  # nothing created, nothing leaked
    # tool_use tasks do not need a browser.
    ok = await orch.stub.Reset(orchestrator_pb2.ResetRequest(task_key="notes-look"), timeout=60)
    assert "count_notes" in {t.name for t in ok.tools}
