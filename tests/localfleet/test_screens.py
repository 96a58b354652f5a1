"""localfleet's screens: each instance's web app at its `{root}`, the headless Chromium behind the aggregator's
`computer` tool on `image_type="mcp"` instances, and that browser's lifecycle.

Real parts only: a `python -m rlgate.localfleet` process with the tiny notes environment (whose stub app,
`tests/support/localfleet.py::_notes_app`, puts its elements at fixed places), Debian's `chromium` driven by
Playwright inside it, and the mcp SDK's client. Without `chromium` these tests skip, and fail under CI=true.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import httpx
import psutil
import pytest
from mcp import Client
from PIL import Image, ImageChops

from rlgate.localfleet.computer import parse_keys
from rlgate.localfleet.config import LocalfleetConfig
from rlgate.localfleet.webapps import in_app
from rlgate.runtime.config import SettingError
from tests.support.localfleet import AUTH, LocalfleetProcess, create, delete, text_of
from tests.support.ports import require_binary

TINY = "tests.support.localfleet:tiny_environments"
WIDTH, HEIGHT = 1024, 768
INPUT = [100, 95]  # the stub app's title input
TITLE_BOX = (20, 80, 330, 115)  # ... and where it is drawn
COUNT_BOX = (0, 0, 400, 60)  # "N notes"


@pytest.fixture(scope="module")
def lf() -> Iterator[LocalfleetProcess]:
    require_binary("chromium")
    # PNG: these tests compare screenshots pixel by pixel, which JPEG's (default) artifacts would blur.
    args = ["--browser-viewport", f"{WIDTH}x{HEIGHT}", "--screenshot-format", "png"]
    with LocalfleetProcess(environments=TINY, extra_args=args) as proc:
        yield proc


def image_of(result: Any) -> Image.Image:
    assert not result.is_error, text_of(result)
    images = [c for c in result.content if c.type == "image"]
    assert len(images) == 1
    image = Image.open(io.BytesIO(base64.b64decode(images[0].data)))
    assert image.format is not None and images[0].mime_type == Image.MIME[image.format]  # says what it is
    return image.convert("RGB")


def changed(a: Image.Image, b: Image.Image, box: tuple[int, int, int, int] | None = None) -> bool:
    if box is not None:
        a, b = a.crop(box), b.crop(box)
    return ImageChops.difference(a, b).getbbox() is not None


async def wait_for(pred: Any, within: float = 10.0) -> None:
    deadline = time.monotonic() + within
    while not pred():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.05)


async def act(client: Client, action: str, **args: Any) -> Any:
    return await client.call_tool("computer", {"action": action, **args})


def test_app_is_served_at_the_instance_root(lf: LocalfleetProcess) -> None:
    inst = create(lf)
    try:
        root = inst["urls"]["root"]
        assert inst["urls"]["app"] == [root]
        page = httpx.get(root)
        assert page.status_code == 200 and "50 notes" in page.text
        assert f'href="{root}notes/50"' in page.text  # url_for builds links under the instance's root
        bare = httpx.get(root.rstrip("/") + "?x=1", follow_redirects=False)
        assert bare.status_code == 307 and bare.headers["location"] == f"/instances/{inst['instance_id']}/?x=1"
        assert "body of note 7" in httpx.get(f"{root}notes/7").text
        added = httpx.post(f"{root}add", data={"title": "from a form"}, follow_redirects=False)
        assert added.status_code == 303
        assert "51 notes" in httpx.get(root).text and "from a form" in httpx.get(root).text
        assert httpx.get(f"{root}api/v1/env/health").json()["status"]  # the manager keeps its paths
        assert httpx.get(f"{root}nowhere").status_code == 404
    finally:
        delete(lf, inst["instance_id"])
    assert httpx.get(inst["urls"]["root"]).status_code == 404  # a stopped instance's app is gone


async def test_tool_use_instances_have_no_computer(lf: LocalfleetProcess) -> None:
    for image_type in (None, "standard"):
        inst = create(lf, **({"image_type": image_type} if image_type else {}))
        try:
            async with Client(inst["urls"]["mcp"]["aggregator"], read_timeout_seconds=30) as client:
                names = {t.name for t in (await client.list_tools()).tools}
                assert "computer" not in names and {"count_notes", "add_note"} <= names
                assert (await client.call_tool("computer", {"action": "screenshot"})).is_error
        finally:
            delete(lf, inst["instance_id"])


@pytest.mark.parametrize("env_key", ["notes", "notes-legacy"])
async def test_every_action_acts_on_the_page(lf: LocalfleetProcess, env_key: str) -> None:
    inst = create(lf, env_key, image_type="mcp")
    root = inst["urls"]["root"]
    try:
        async with Client(inst["urls"]["mcp"]["aggregator"], read_timeout_seconds=60) as client:
            tools = {t.name: t for t in (await client.list_tools()).tools}
            assert {"computer", "count_notes"} <= set(tools)  # the app's tools and the computer
            assert "left_click_drag" in json.dumps(tools["computer"].input_schema)

            first = await act(client, "screenshot")
            assert text_of(first) == "screenshot"
            seed = image_of(first)
            assert seed.size == (WIDTH, HEIGHT)

            assert json.loads(text_of(await act(client, "cursor_position"))) == {"x": 0, "y": 0}
            moved = await act(client, "mouse_move", coordinate=[300, 400])
            assert not moved.is_error and json.loads(text_of(await act(client, "cursor_position"))) == {
                "x": 300,
                "y": 400,
            }

            # Click into the input and type: the text shows in the input, nowhere in the count.
            clicked = image_of(await act(client, "left_click", coordinate=INPUT))
            typed = image_of(await act(client, "type", text="hello screen"))
            assert changed(clicked, typed, TITLE_BOX) and not changed(clicked, typed, COUNT_BOX)
            # Select it all and replace it with a key chord and more typing.
            await act(client, "key", text="ctrl+a")
            retyped = image_of(await act(client, "type", text="from the screen"))
            assert changed(typed, retyped, TITLE_BOX)
            # Enter submits the form: the app adds a note, redirects, and the next screenshot shows it.
            submitted = await act(client, "key", text="Return")
            assert text_of(submitted) == "pressed Enter"
            after = image_of(submitted)
            assert changed(retyped, after, COUNT_BOX)
            assert text_of(await client.call_tool("count_notes", {})) == "51"
            async with httpx.AsyncClient() as http:
                query = {"query": "SELECT title FROM notes WHERE id = 51"}
                current = (await http.post(f"{root}api/v1/env/resources/sqlite/current/query", json=query)).json()
            assert current["rows"] == [["from the screen"]]

            # Scrolling moves the list and back; the header is fixed in the document, so it moves too.
            down = image_of(
                await act(client, "scroll", coordinate=[200, 400], scroll_direction="down", scroll_amount=5)
            )
            assert changed(after, down)
            up = image_of(await act(client, "scroll", coordinate=[200, 400], scroll_direction="up", scroll_amount=5))
            assert not changed(after, up)
            assert not (await act(client, "scroll", coordinate=[200, 400], scroll_direction="right")).is_error

            # Double and right clicks on text, a drag across it: they run, and the pointer ends where they did.
            for action in ("double_click", "right_click"):
                done = await act(client, action, coordinate=[40, 25])
                assert not done.is_error and text_of(done) == f"{action} at (40, 25)"
            dragged = await act(client, "left_click_drag", start_coordinate=[20, 25], coordinate=[140, 25])
            assert text_of(dragged) == "dragged from (20, 25) to (140, 25)"
            assert json.loads(text_of(await act(client, "cursor_position"))) == {"x": 140, "y": 25}

            started = time.monotonic()
            waited = await act(client, "wait", duration=0.5)
            assert time.monotonic() - started >= 0.5 and text_of(waited) == "waited 0.5s"
            image_of(waited)

            # Clicking a link navigates within the app; so does `navigate` (relative, or the app's own URL).
            note_page = image_of(await act(client, "left_click", coordinate=[40, 190]))  # the first note link
            assert changed(after, note_page, COUNT_BOX)
            back = image_of(await act(client, "navigate", url=root))
            assert not changed(up, back, COUNT_BOX)
            relative = await act(client, "navigate", url="notes/7")
            assert text_of(relative) == f"navigated to /instances/{inst['instance_id']}/notes/7"
            assert changed(back, image_of(relative), COUNT_BOX)
    finally:
        delete(lf, inst["instance_id"])


async def test_actions_on_one_instance_run_one_at_a_time(lf: LocalfleetProcess) -> None:
    inst = create(lf, image_type="mcp")
    url = inst["urls"]["mcp"]["aggregator"]
    finished: list[str] = []
    try:
        async with Client(url, read_timeout_seconds=60) as a, Client(url, read_timeout_seconds=60) as b:
            await act(a, "screenshot")  # the page is open

            async def run(client: Client, name: str, delay: float, **args: Any) -> None:
                await asyncio.sleep(delay)
                image_of(await act(client, **args))
                finished.append(name)

            started = time.monotonic()
            await asyncio.gather(
                run(a, "wait", 0.0, action="wait", duration=1.5),
                run(b, "screenshot", 0.3, action="screenshot"),
            )
            # The screenshot asked for during the wait was taken after it: one page, one action at a time.
            assert finished == ["wait", "screenshot"] and time.monotonic() - started >= 1.5
    finally:
        delete(lf, inst["instance_id"])


async def test_what_a_model_gets_wrong_is_an_error_result(lf: LocalfleetProcess) -> None:
    inst = create(lf, image_type="mcp")
    root = inst["urls"]["root"]
    other = create(lf)
    bad: list[tuple[dict[str, Any], str]] = [
        ({"action": "left_click", "coordinate": [WIDTH, 10]}, f"outside the {WIDTH}x{HEIGHT} screen"),
        ({"action": "mouse_move", "coordinate": [-1, 10]}, "outside"),
        ({"action": "left_click_drag", "start_coordinate": [0, HEIGHT], "coordinate": [1, 1]}, "start_coordinate"),
        ({"action": "left_click"}, "`coordinate` [x, y] is required"),
        ({"action": "left_click", "coordinate": [1, 2, 3]}, "coordinate"),
        ({"action": "key", "text": "ctrl+Bogus"}, "unknown key 'Bogus'"),
        ({"action": "key", "text": "hyper+a"}, "unknown modifier 'hyper'"),
        ({"action": "key", "text": " ".join(["a"] * 17)}, "at most 16"),
        ({"action": "type", "text": "x" * 2001}, "at most 2000"),
        ({"action": "type"}, "`text` is required"),
        ({"action": "scroll", "coordinate": [5, 5]}, "scroll_direction"),
        ({"action": "scroll", "coordinate": [5, 5], "scroll_direction": "down", "scroll_amount": 51}, "50"),
        ({"action": "wait", "duration": 11}, "10"),
        ({"action": "click", "coordinate": [1, 1]}, "left_click"),  # unknown action: the valid ones listed
        ({"action": "navigate", "url": "http://example.com/"}, "outside this instance's app"),
        ({"action": "navigate", "url": other["urls"]["root"]}, "outside this instance's app"),
        ({"action": "navigate", "url": f"{root}api/v1/env/health"}, "outside this instance's app"),
        ({"action": "navigate", "url": f"{root}mcp"}, "outside this instance's app"),
        ({"action": "navigate", "url": f"{root}%2e%2e/%2e%2e/v1/account"}, "outside this instance's app"),
        ({"action": "navigate", "url": "../../v1/account"}, "outside this instance's app"),
        ({"action": "navigate", "url": "file:///etc/passwd"}, "outside this instance's app"),
    ]
    try:
        async with Client(inst["urls"]["mcp"]["aggregator"], read_timeout_seconds=60) as client:
            before = image_of(await act(client, "screenshot"))
            for args, message in bad:
                result = await client.call_tool("computer", args)
                assert result.is_error and message in text_of(result), (args, text_of(result))
            # Nothing of it reached the page.
            assert not changed(before, image_of(await act(client, "screenshot")))
    finally:
        delete(lf, inst["instance_id"])
        delete(lf, other["instance_id"])


async def test_a_page_cannot_reach_outside_its_app(lf: LocalfleetProcess) -> None:
    inst = create(lf, image_type="mcp")
    try:
        async with Client(inst["urls"]["mcp"]["aggregator"], read_timeout_seconds=60) as client:
            await client.list_tools()
            app = image_of(await act(client, "screenshot"))
            lf.reset_counters()
            # The stub app links to /v1/regions (outside it): the browser aborts that request, so the only
            # requests localfleet sees are the MCP ones (and this counters read).
            left = image_of(await act(client, "left_click", coordinate=[520, 25]))
            counters = lf.counters()
            assert counters["http_requests"] == sum(counters["mcp_methods"].values()) + 1, counters
            assert changed(app, left)  # the browser's error page, not the app
            # The app is still one navigation away.
            assert not changed(app, image_of(await act(client, "navigate", url=inst["urls"]["root"])))
    finally:
        delete(lf, inst["instance_id"])


async def test_base64_image_form(lf: LocalfleetProcess) -> None:
    inst = create(lf, image_type="mcp", env_variables={"LOCALFLEET_COMPUTER_RESULT": "base64_image"})
    try:
        async with Client(inst["urls"]["mcp"]["aggregator"], read_timeout_seconds=60) as client:
            for args in ({"action": "screenshot"}, {"action": "cursor_position"}):
                result = await client.call_tool("computer", args)
                assert not result.is_error and [c.type for c in result.content] == ["text"]
                doc = json.loads(text_of(result))
                prefix = "data:image/png;base64,"
                assert doc["base64_image"].startswith(prefix)
                png = Image.open(io.BytesIO(base64.b64decode(doc["base64_image"][len(prefix) :])))
                assert png.size == (WIDTH, HEIGHT)
            assert json.loads(doc["output"]) == {"x": 0, "y": 0}
    finally:
        delete(lf, inst["instance_id"])


def _chromium_of(pid: int) -> list[psutil.Process]:
    return [p for p in psutil.Process(pid).children(recursive=True) if "chrom" in p.name()]


def _alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    return [p for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


async def _screenshot(inst: dict[str, Any]) -> Any:
    async with Client(inst["urls"]["mcp"]["aggregator"], read_timeout_seconds=60) as client:
        return await act(client, "screenshot")


async def test_contexts_are_bounded_and_close_with_their_instance_and_the_browser_at_shutdown() -> None:
    require_binary("chromium")
    with LocalfleetProcess(
        environments=TINY, extra_args=["--browser-max-contexts", "2", "--reaper-interval-s", "0.2"]
    ) as proc:
        assert proc.pid is not None
        a, b, c = (create(proc, image_type="mcp") for _ in range(3))
        assert not proc.counters()["browser_running"] and not _chromium_of(proc.pid)  # started lazily
        image_of(await _screenshot(a))
        image_of(await _screenshot(b))
        counters = proc.counters()
        assert counters["browser_running"] and counters["open_screens"] == 2
        refused = await _screenshot(c)
        assert refused.is_error and "too many open screens" in text_of(refused)
        assert "--browser-max-contexts=2" in text_of(refused)

        delete(proc, a["instance_id"])  # a deleted instance's context closes, and frees its place
        assert proc.counters()["open_screens"] == 1
        image_of(await _screenshot(c))
        assert proc.counters()["open_screens"] == 2

        short = create(proc, image_type="mcp", ttl_seconds=1)  # an expired one's too
        delete(proc, c["instance_id"])
        image_of(await _screenshot(short))
        await wait_for(lambda: proc.counters()["open_screens"] == 1)
        assert proc.counters()["instances_expired"] == 1

        browser = _chromium_of(proc.pid)
        driver = [p for p in psutil.Process(proc.pid).children() if p not in browser]
        assert browser and driver
        proc.terminate()
        await wait_for(lambda: not _alive(browser + driver))  # no browser process outlives localfleet


async def test_a_crashed_browser_is_started_again() -> None:
    require_binary("chromium")
    with LocalfleetProcess(environments=TINY) as proc:
        assert proc.pid is not None
        inst = create(proc, image_type="mcp")
        image_of(await _screenshot(inst))
        driver = psutil.Process(proc.pid).children()[0]
        (browser,) = [p for p in driver.children() if "chrom" in p.name()]  # the browser's main process
        browser.kill()
        await wait_for(lambda: not proc.counters()["browser_running"])
        assert proc.counters()["open_screens"] == 0
        image_of(await _screenshot(inst))  # a new browser, a new page for the instance
        assert proc.counters()["browser_running"] and proc.counters()["open_screens"] == 1


async def test_no_browser_process_outlives_a_killed_localfleet() -> None:
    require_binary("chromium")
    with LocalfleetProcess(environments=TINY) as proc:
        assert proc.pid is not None and proc.proc is not None
        image_of(await _screenshot(create(proc, image_type="mcp")))
        spawned = psutil.Process(proc.pid).children(recursive=True)
        assert _chromium_of(proc.pid)
        os.kill(proc.pid, signal.SIGKILL)  # localfleet alone (the browser runs in a process group of its own)
        proc.proc.wait(timeout=10)
        await wait_for(lambda: not _alive(spawned))


async def test_without_a_browser_screen_instances_are_refused_at_create() -> None:
    with LocalfleetProcess(environments=TINY, extra_args=["--browser-path", "/nonexistent/chromium"]) as proc:
        async with httpx.AsyncClient() as http:
            body = {"env_key": "notes", "image_type": "mcp"}
            r = await http.post(f"{proc.base_url}/v1/env/instances", json=body, headers=AUTH)
        assert r.status_code == 412
        detail = r.json()["detail"]
        assert detail["error_type"] == "browser_unavailable"
        assert "/nonexistent/chromium" in detail["message"] and "install Debian's `chromium`" in detail["message"]
        assert proc.counters()["running_instances"] == 0
        inst = create(proc)  # tool_use instances do not need one
        async with Client(inst["urls"]["mcp"]["aggregator"], read_timeout_seconds=30) as client:
            assert "computer" not in {t.name for t in (await client.list_tools()).tools}


# ---- the rules, without a browser --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "chords"),
    [
        ("Return", ["Enter"]),
        ("ctrl+a", ["Control+a"]),
        ("shift+Tab", ["Shift+Tab"]),
        ("ctrl+a BackSpace", ["Control+a", "Backspace"]),
        ("Page_Down", ["PageDown"]),
        ("cmd+shift+Up", ["Meta+Shift+ArrowUp"]),
        ("ctrl++", ["Control++"]),
        ("+", ["+"]),
        ("F12 space", ["F12", "Space"]),
    ],
)
def test_key_names(text: str, chords: list[str]) -> None:
    assert parse_keys(text) == chords


@pytest.mark.parametrize(
    ("path", "inside"),
    [
        ("/instances/abc/", True),
        ("/instances/abc", True),
        ("/instances/abc/messages/7", True),
        ("/instances/abc/mcpx", True),
        ("/instances/abc/mcp", False),
        ("/instances/abc/mcp/", False),
        ("/instances/abc/api/v1/env/health", False),
        ("/instances/abcd/", False),
        ("/v1/account", False),
    ],
)
def test_app_paths(path: str, inside: bool) -> None:
    assert in_app("abc", path) is inside


def test_viewport_setting_is_checked() -> None:
    assert LocalfleetConfig(browser_viewport="800x600").viewport() == (800, 600)
    for bad in ("800", "800x", "axb", "100x100", "5000x800"):
        with pytest.raises(SettingError):
            LocalfleetConfig(browser_viewport=bad)
    with pytest.raises(SettingError):
        LocalfleetConfig(screenshot_format="gif")
