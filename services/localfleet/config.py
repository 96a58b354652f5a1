"""localfleet configuration: every flag of `rlgate localfleet` and its environment variable."""

from __future__ import annotations

from dataclasses import dataclass

from rlgate.runtime.config import SettingError, setting


@dataclass
class LocalfleetConfig:
    listen: str = setting("127.0.0.1:8765", "RLGATE_LOCALFLEET_LISTEN", "HTTP listen address HOST:PORT")
    data_dir: str = setting(".rlgate/localfleet", "RLGATE_LOCALFLEET_DATA_DIR", "Directory for instance databases")
    faults: str = setting("", "RLGATE_LOCALFLEET_FAULTS", "Fault-injection file (JSON), off when empty")
    instance_limit: int = setting(1000, "RLGATE_LOCALFLEET_INSTANCE_LIMIT", "Running instances allowed")
    public_url: str = setting("", "RLGATE_LOCALFLEET_PUBLIC_URL", "Base URL instances advertise (empty: http://LISTEN)")
    verifier_timeout_s: float = setting(
        30.0,
        "RLGATE_LOCALFLEET_VERIFIER_TIMEOUT_S",
        "Verifier subprocess timeout (upper bound; a request may ask for less)",
    )
    verifier_memory_mb: int = setting(
        1024, "RLGATE_LOCALFLEET_VERIFIER_MEMORY_MB", "Address-space limit of a verifier subprocess (MiB)"
    )
    reaper_interval_s: float = setting(
        1.0, "RLGATE_LOCALFLEET_REAPER_INTERVAL_S", "How often expired instances (ttl, missed heartbeats) are stopped"
    )
    environments: str = setting(
        "",
        "RLGATE_LOCALFLEET_ENVIRONMENTS",
        "MODULE:FUNCTION returning the EnvironmentSpecs to host (empty: the bundled ones)",
    )
    tasks_dir: str = setting(
        "",
        "RLGATE_LOCALFLEET_TASKS_DIR",
        "Directory of task JSON files (empty: the bundled tasks); task files are trusted code",
    )
    browser_path: str = setting(
        "",
        "RLGATE_LOCALFLEET_BROWSER_PATH",
        "Chromium executable for instance screens (empty: chromium or chromium-headless-shell on PATH)",
    )
    browser_viewport: str = setting(
        "1280x800", "RLGATE_LOCALFLEET_BROWSER_VIEWPORT", "Screen size WIDTHxHEIGHT of every instance's page"
    )
    browser_max_contexts: int = setting(
        16,
        "RLGATE_LOCALFLEET_BROWSER_MAX_CONTEXTS",
        "Instance screens (browser contexts) open at once; past it the computer tool answers an error",
    )
    browser_timeout_s: float = setting(
        10.0, "RLGATE_LOCALFLEET_BROWSER_TIMEOUT_S", "Timeout of one browser call (an action, a page load)"
    )
    # JPEG by default: a busy app page's PNG at the default viewport, carried as base64 text (the base64_image
    # result form), would not fit the toolgateway's default output limit (tests/orchestrator/test_screen_sizes.py).
    screenshot_format: str = setting("jpeg", "RLGATE_LOCALFLEET_SCREENSHOT_FORMAT", "Screenshot encoding: jpeg or png")
    screenshot_quality: int = setting(
        70, "RLGATE_LOCALFLEET_SCREENSHOT_QUALITY", "JPEG quality of screenshots (1-100; jpeg only)"
    )
    log_level: str = setting("INFO", "RLGATE_LOG_LEVEL", "Log level")

    def __post_init__(self) -> None:
        self.viewport()  # a malformed size fails the start, not the first screenshot
        if not 1 <= self.browser_max_contexts <= 1000:
            raise SettingError("browser_max_contexts", "must be between 1 and 1000")
        if not 0.5 <= self.browser_timeout_s <= 300:
            raise SettingError("browser_timeout_s", "must be between 0.5 and 300 seconds")
        if self.screenshot_format not in ("png", "jpeg"):
            raise SettingError("screenshot_format", "must be png or jpeg")
        if not 1 <= self.screenshot_quality <= 100:
            raise SettingError("screenshot_quality", "must be between 1 and 100")

    def viewport(self) -> tuple[int, int]:
        """`browser_viewport` as (width, height)."""
        width, sep, height = self.browser_viewport.lower().partition("x")
        try:
            w, h = int(width), int(height)
        except ValueError:
            w = h = 0
        if not sep or not (320 <= w <= 3840 and 240 <= h <= 2160):
            raise SettingError("browser_viewport", "must be WIDTHxHEIGHT within 320x240 .. 3840x2160, e.g. 1280x800")
        return w, h
