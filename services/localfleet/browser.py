"""The one headless Chromium of a localfleet process, and one isolated page ("screen") per instance.

Chromium is started lazily, on the first screen asked for, through Playwright with the system's executable
(`executable_path`; Playwright's own browser downloads are never used). Each instance gets its own
`BrowserContext` (cookies, storage and cache apart from every other instance) holding one page, opened on
first use and closed when the instance stops (delete, TTL, heartbeat reaper) or localfleet shuts down. How
many are open at once is bounded (`--browser-max-contexts`); past it `TooManyScreens`, which the computer
tool reports as an error result. Every request a page makes is checked against its instance's app (`allow`)
and aborted otherwise, so a page cannot reach another instance, the control plane or anything off-host.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field

from playwright.async_api import Browser, BrowserContext, Page, Playwright, Request, Route, async_playwright
from playwright.async_api import Error as PlaywrightError

from rlgate.localfleet.config import LocalfleetConfig

log = logging.getLogger(__name__)

DEFAULT_EXECUTABLES = ("chromium", "chromium-headless-shell")
# Headless Chromium still builds a browser window per page, and with it the omnibox popup's WebUI page, which
# runs in a renderer process of its own: a second renderer per screen that nobody sees. Disabling it (and the
# spare renderer kept warm for the next tab) leaves one renderer per screen instead of two.
SCREEN_DISABLED_FEATURES = ("WebUIOmniboxPopup", "WebUIOmniboxAimPopup", "SpareRendererForSitePerProcess")
# Chromium keeps only the last `--disable-features` and Playwright passes its own before ours, so ours repeats
# Playwright's (its chromiumSwitches.ts); tests/localfleet/test_browser_flags.py fails when they drift apart.
PLAYWRIGHT_DISABLED_FEATURES = (
    "AvoidUnnecessaryBeforeUnloadCheckSync",
    "DestroyProfileOnBrowserClose",
    "HttpsUpgrades",
    "HttpsFirstBalancedModeAutoEnable",
    "LensOverlay",
    "MediaRouter",
    "PaintHolding",
    "ThirdPartyStoragePartitioning",
    "AvoidCorsURLLoaderRestartOnRedirect",
    "TcpPortRandomizationWin",
    "OptimizationHints",
    "NetworkTimeServiceQuerying",
    "AimEnabled",
    "PreconnectToSearch",
    "msForceBrowserSignIn",
    "msEdgeUpdateLaunchServicesPreferredVersion",
)
# What works here: no sandbox (containers without user namespaces), no GPU, and nothing that calls home.
LAUNCH_ARGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-features=" + ",".join((*PLAYWRIGHT_DISABLED_FEATURES, *SCREEN_DISABLED_FEATURES)),
)
BLOCKED_PAGE = (
    "<!doctype html><html><head><title>Blocked</title></head><body style='font-family:sans-serif;margin:2em'>"
    "<h1>Blocked</h1><p>That page is outside this app.</p></body></html>"
)
INSTALL_HINT = "install Debian's `chromium` package (apt-get install chromium) or set RLGATE_LOCALFLEET_BROWSER_PATH"


class BrowserUnavailable(RuntimeError):
    """No browser executable: instances with a screen cannot be served."""


class TooManyScreens(RuntimeError):
    """The bound on open browser contexts is reached."""


def find_executable(configured: str) -> str | None:
    """The browser to run: `configured` (a path, or a name looked up on PATH), else the default names."""
    for name in [configured] if configured else DEFAULT_EXECUTABLES:
        if os.sep in name:
            if os.path.isfile(name) and os.access(name, os.X_OK):
                return name
        elif found := shutil.which(name):
            return found
    return None


@dataclass
class Screen:
    """One instance's page. `lock` serializes its actions: one page, one action at a time."""

    instance_id: str
    context: BrowserContext
    page: Page
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    cursor: tuple[int, int] = (0, 0)
    # A main-frame navigation in flight (a click on a link, a form submit): set on its request, cleared
    # when the page loads or the navigation fails, so an action's screenshot waits for the page it caused.
    navigating: bool = False
    settled: asyncio.Event = field(default_factory=asyncio.Event)

    def watch_navigations(self) -> None:
        self.settled.set()

        def on_request(request: Request) -> None:
            if request.is_navigation_request() and request.frame == self.page.main_frame:
                self.navigating = True
                self.settled.clear()

        def on_done(*_: object) -> None:
            self.navigating = False
            self.settled.set()

        def on_failed(request: Request) -> None:
            if request.is_navigation_request() and request.frame == self.page.main_frame:
                on_done()

        self.page.on("request", on_request)
        self.page.on("load", on_done)
        self.page.on("requestfailed", on_failed)

    async def settle(self, timeout_s: float, grace_s: float = 0.1) -> None:
        """Give an action's effects `grace_s` to start, then wait (bounded) for a navigation it began."""
        await asyncio.sleep(grace_s)
        if self.navigating:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.settled.wait(), timeout_s)


class BrowserManager:
    """The browser process and the per-instance screens, owned by the platform (closed on shutdown)."""

    def __init__(self, config: LocalfleetConfig) -> None:
        self.configured_path = config.browser_path
        self.width, self.height = config.viewport()
        self.max_contexts = config.browser_max_contexts
        self.timeout_s = config.browser_timeout_s
        self._playwright: Playwright | None = None
        self._browser: Browser | None = None
        self._screens: dict[str, Screen] = {}
        self._lock = asyncio.Lock()  # launching and opening contexts, one at a time
        self._closed = False

    def executable(self) -> str:
        """The browser executable, or `BrowserUnavailable` naming what to install."""
        path = find_executable(self.configured_path)
        if path is None:
            looked = self.configured_path or " or ".join(DEFAULT_EXECUTABLES) + " on PATH"
            raise BrowserUnavailable(f"no browser executable found (looked for {looked}): {INSTALL_HINT}")
        return path

    @property
    def open_screens(self) -> int:
        return len(self._screens)

    @property
    def running(self) -> bool:
        return self._browser is not None and self._browser.is_connected()

    async def screen(
        self, instance_id: str, start_url: str, allow: Callable[[str], bool], alive: Callable[[], bool]
    ) -> Screen:
        """The instance's screen, opened on `start_url` on first use (requests outside `allow` aborted).
        `alive`: whether the instance still runs (one stopped while its screen opened gets none)."""
        existing = self._screens.get(instance_id)
        if existing is not None and not existing.page.is_closed():
            return existing
        async with self._lock:
            existing = self._screens.get(instance_id)
            if existing is not None:
                if not existing.page.is_closed():
                    return existing
                await self.close_screen(instance_id)  # the page closed itself (window.close()): a new one
            if self._closed:
                raise BrowserUnavailable("localfleet is shutting down")
            if len(self._screens) >= self.max_contexts:
                raise TooManyScreens(
                    f"too many open screens: {len(self._screens)} instances already have one "
                    f"(--browser-max-contexts={self.max_contexts}); delete instances or raise the limit"
                )
            browser = await self._ensure_browser()
            screen = await asyncio.wait_for(self._open(browser, instance_id, start_url, allow), self.timeout_s)
            self._screens[instance_id] = screen
        if not alive():  # its stop hook ran while the page opened, and found nothing to close
            await self.close_screen(instance_id)
            raise BrowserUnavailable(f"instance {instance_id} stopped")
        return screen

    async def _ensure_browser(self) -> Browser:
        if self._browser is not None and self._browser.is_connected():
            return self._browser
        await self._stop_browser()  # a crashed browser: drop what is left of it first
        executable = self.executable()
        playwright = await asyncio.wait_for(async_playwright().start(), self.timeout_s)  # the driver process
        try:
            browser = await playwright.chromium.launch(
                executable_path=executable, headless=True, args=list(LAUNCH_ARGS), timeout=self.timeout_s * 1000
            )
        except BaseException:
            await playwright.stop()
            raise
        self._playwright, self._browser = playwright, browser
        browser.on("disconnected", self._on_disconnected)
        log.info("browser started: %s %s (viewport %dx%d)", executable, browser.version, self.width, self.height)
        return browser

    def _on_disconnected(self, browser: Browser) -> None:
        if browser is self._browser:
            log.warning("the browser went away with %d screens (the next use starts a new one)", len(self._screens))
            self._screens.clear()

    async def _open(self, browser: Browser, instance_id: str, start_url: str, allow: Callable[[str], bool]) -> Screen:
        context = await browser.new_context(
            viewport={"width": self.width, "height": self.height},
            device_scale_factor=1,
            accept_downloads=False,
            service_workers="block",
        )
        try:
            context.set_default_timeout(self.timeout_s * 1000)
            context.set_default_navigation_timeout(self.timeout_s * 1000)

            async def gate(route: Route) -> None:
                request = route.request
                if allow(request.url):
                    await route.continue_()
                    return
                log.info("screen of %s: blocked a request outside its app: %.200s", instance_id, request.url)
                if request.is_navigation_request():  # the page says so (a browser error page cannot be captured)
                    await route.fulfill(status=403, content_type="text/html; charset=utf-8", body=BLOCKED_PAGE)
                else:
                    await route.abort("blockedbyclient")

            await context.route("**/*", gate)
            page = await context.new_page()
            screen = Screen(instance_id, context, page)
            screen.watch_navigations()
            await page.goto(start_url, wait_until="load")
            return screen
        except BaseException:
            with contextlib.suppress(PlaywrightError, TimeoutError):
                await asyncio.wait_for(context.close(), self.timeout_s)
            raise

    async def close_screen(self, instance_id: str) -> None:
        """Close an instance's context (its stop hook); a no-op when it has none."""
        screen = self._screens.pop(instance_id, None)
        if screen is None:
            return
        try:
            await asyncio.wait_for(screen.context.close(), self.timeout_s)
        except (PlaywrightError, TimeoutError) as exc:
            log.warning("closing the screen of %s: %s", instance_id, exc)

    async def aclose(self) -> None:
        """Close every screen, then the browser and Playwright's driver (no process is left behind)."""
        self._closed = True
        async with self._lock:
            for instance_id in list(self._screens):
                await self.close_screen(instance_id)
            await self._stop_browser()

    async def _stop_browser(self) -> None:
        browser, playwright = self._browser, self._playwright
        self._browser = self._playwright = None
        self._screens.clear()
        if browser is not None:
            try:
                await asyncio.wait_for(browser.close(), self.timeout_s)
            except (PlaywrightError, TimeoutError) as exc:
                log.warning("closing the browser: %s", exc)
        if playwright is not None:
            # Stopping the driver also ends a browser that did not close in time.
            with contextlib.suppress(PlaywrightError, TimeoutError):
                await asyncio.wait_for(playwright.stop(), self.timeout_s)
