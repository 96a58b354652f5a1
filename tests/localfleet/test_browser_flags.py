"""The browser's launch flags do what browser.py says: one renderer process per screen (no omnibox popup WebUI,
no spare renderer), and our `--disable-features` keeps every feature Playwright itself disables (Chromium
honours only the last such switch, and ours comes after Playwright's).

Real parts: Debian's `chromium` started by `BrowserManager` as localfleet starts it, screens opened on pages
served by a loopback HTTP server, the processes read with psutil. Without `chromium` these tests skip (fail
under CI=true).
"""

from __future__ import annotations

import asyncio
import http.server
import threading
from collections.abc import AsyncIterator, Iterator

import psutil
import pytest

from rlgate.localfleet.browser import SCREEN_DISABLED_FEATURES, BrowserManager
from rlgate.localfleet.config import LocalfleetConfig
from tests.support.ports import require_binary

SCREENS = 3


class _Page(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = b"<!doctype html><title>page</title><p>a page</p>"
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def page_url() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Page)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


@pytest.fixture
async def browser() -> AsyncIterator[BrowserManager]:
    require_binary("chromium")
    manager = BrowserManager(LocalfleetConfig())
    try:
        yield manager
    finally:
        await manager.aclose()


def chromium_processes() -> list[list[str]]:
    """The command lines of this test process's Chromium processes (below Playwright's driver)."""
    out = []
    for proc in psutil.Process().children(recursive=True):
        try:
            if "chrom" in proc.name().lower():
                out.append(proc.cmdline())
        except psutil.Error:
            continue
    return out


def features(argv: list[str]) -> list[set[str]]:
    """Each `--disable-features` switch of a command line, in order, as a set of names."""
    prefix = "--disable-features="
    return [set(a.removeprefix(prefix).split(",")) for a in argv if a.startswith(prefix)]


async def test_one_renderer_per_screen_and_playwrights_features_kept(browser: BrowserManager, page_url: str) -> None:
    for i in range(SCREENS):
        await browser.screen(f"inst-{i}", page_url, allow=lambda url: True, alive=lambda: True)
    await asyncio.sleep(1.0)  # anything started with a page (a popup's WebUI, a spare renderer) has started
    procs = chromium_processes()
    main = [argv for argv in procs if not any(a.startswith("--type=") for a in argv)]
    renderers = [argv for argv in procs if "--type=renderer" in argv]
    assert len(main) == 1
    assert len(renderers) == SCREENS, [" ".join(a for a in argv if a.startswith("--")) for argv in renderers]
    switches = features(main[0])
    assert len(switches) >= 2, "Playwright's own --disable-features and ours"
    playwrights, ours = switches[0], switches[-1]
    assert playwrights <= ours, f"Playwright disables features ours drops: {sorted(playwrights - ours)}"
    assert set(SCREEN_DISABLED_FEATURES) <= ours
