"""Screenshots of the bundled apps' busiest pages reach the agent whole through the gateway at its default
output limit: localfleet's default screenshot encoding (JPEG) at the default viewport, in both result forms
(an image block, whose bytes count raw, and `base64_image` JSON text, whose base64 counts a third more).

Real parts: a localfleet process with the bundled environments and Debian's `chromium`, the orchestrator
provisioning computer_use tasks, and the toolgateway with its default `max_output_bytes`. The pages are the
apps' longest lists (the largest screenshots measured over every app page); the test fails when one of them
comes back truncated, or uses more than 3/4 of the limit (no room left for a busier seed).
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from rlgate.toolgateway.config import GatewayConfig
from rlgate.v1 import orchestrator_pb2
from tests.orchestrator.conftest import Running, call_tool, fast_config
from tests.support.localfleet import LocalfleetProcess
from tests.support.ports import require_binary

LIMIT = GatewayConfig().max_output_bytes  # the gateway fixture runs with the default
HEADROOM = 0.75
BUSIEST_PAGES = {
    "mailbox": ["", "?page=2", "search?q=a", "contacts"],
    "tracker": ["r/northwind/atlas-api", "r/northwind/atlas-api?state=closed", "search?q=a"],
    "booking": ["trips?tab=past", "profile"],
}
FORMS = ("image", "base64_image")


@pytest.fixture(scope="module")
def apps_lf() -> Iterator[LocalfleetProcess]:
    require_binary("chromium")
    with LocalfleetProcess() as lf:  # the bundled environments, every screen setting at its default
        yield lf


@pytest.fixture
def tasks_file(tmp_path: Path) -> str:
    tasks = [
        {
            "key": f"{env}-{form}",
            "prompt": "Look around.",
            "env_id": env,
            "version": "v1",
            "task_modality": "computer_use",
            **({"env_variables": {"LOCALFLEET_COMPUTER_RESULT": "base64_image"}} if form == "base64_image" else {}),
        }
        for env in BUSIEST_PAGES
        for form in FORMS
    ]
    path = tmp_path / "tasks.json"
    path.write_text(json.dumps({"tasks": tasks}))
    return str(path)


def output_bytes(result: Any) -> int:
    """What the gateway counts against its limit: text as UTF-8, binary blocks as their bytes."""
    return sum(len(b.text.text.encode()) if b.HasField("text") else len(b.image.data) for b in result.content)


def screenshot_of(result: Any, form: str) -> bytes:
    if form == "image":
        (image,) = [b.image for b in result.content if b.HasField("image")]
        assert image.mime_type == "image/jpeg"
        return bytes(image.data)
    (text,) = [b.text.text for b in result.content if b.HasField("text")]
    url = json.loads(text)["base64_image"]
    prefix = "data:image/jpeg;base64,"
    assert url.startswith(prefix)
    return base64.b64decode(url[len(prefix) :])


async def test_the_busiest_app_pages_fit_the_gateways_default_output_limit(
    apps_lf: LocalfleetProcess, orchestrator_factory: Callable[..., Any], gateway: Any, tasks_file: str
) -> None:
    config = fast_config(apps_lf, tasks_file=tasks_file, instance_ttl_s=0, gateway_address=gateway.address)
    orch: Running = await orchestrator_factory(config)
    sizes: dict[str, int] = {}
    for env, pages in BUSIEST_PAGES.items():
        for form in FORMS:
            reset = await orch.stub.Reset(orchestrator_pb2.ResetRequest(task_key=f"{env}-{form}"), timeout=60)
            root = reset.instance.root_url  # the app's root too (localfleet's `urls.app == [root]`)
            assert root.endswith("/")
            for page in pages:
                arguments = {"action": "navigate", "url": root + page}
                result = await call_tool(gateway.address, reset.agent_token, "computer", arguments)
                label = f"{env} {page!r} ({form})"
                assert not result.is_error and not result.error_message, f"{label}: {result.error_message}"
                shot = screenshot_of(result, form)
                assert shot[:2] == b"\xff\xd8", label  # a JPEG, whole
                sizes[label] = output_bytes(result)
            await orch.stub.Close(orchestrator_pb2.CloseRequest(session_id=reset.session_id), timeout=60)
    largest = max(sizes, key=lambda k: sizes[k])
    assert sizes[largest] <= LIMIT * HEADROOM, f"{largest}: {sizes[largest]} bytes of {LIMIT}"
