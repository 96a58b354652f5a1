"""The aggregator's `computer` tool: a model's mouse, keyboard and eyes on its instance's web app.

Served on `{root}api/v1/mcp` of instances created with `image_type="mcp"` (as Fleet serves it). Every action
runs on the instance's browser page (`browser.Screen`, one action at a time, each under the browser
timeout) and answers with a screenshot of the viewport: an `ImageContent` plus a short text, or, when the
instance's `env_variables` set `LOCALFLEET_COMPUTER_RESULT=base64_image` (per environment or per instance),
one JSON text `{"base64_image": "data:image/png;base64,...", "output": "..."}` as some Fleet images answer.
What a model got wrong (a coordinate off the screen, an unknown key, text past the bound, a URL outside its
app) is an error result saying so, never a crash.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import posixpath
from collections.abc import Awaitable, Callable
from typing import Annotated, Any, Literal
from urllib.parse import unquote, urljoin, urlsplit, urlunsplit

from mcp.server import MCPServer
from mcp.server.mcpserver import Context
from mcp.server.mcpserver.exceptions import ToolError
from mcp.types import CallToolResult, ImageContent, TextContent
from playwright.async_api import Error as PlaywrightError
from pydantic import Field

from rlgate.localfleet.browser import BrowserManager, BrowserUnavailable, Screen, TooManyScreens
from rlgate.localfleet.environments.base import current_instance
from rlgate.localfleet.webapps import app_root, in_app, same_origin

log = logging.getLogger(__name__)

RESULT_FORM_VARIABLE = "LOCALFLEET_COMPUTER_RESULT"  # "image" (default) or "base64_image"
MAX_TEXT = 2000  # characters one `type` may send
MAX_CHORDS = 16  # key combinations one `key` may press
MAX_SCROLL = 50  # wheel notches one `scroll` may turn
SCROLL_NOTCH_PX = 100
MAX_WAIT_S = 10.0
MAX_URL = 2048

Action = Literal[
    "screenshot",
    "left_click",
    "double_click",
    "right_click",
    "mouse_move",
    "left_click_drag",
    "type",
    "key",
    "scroll",
    "wait",
    "cursor_position",
    "navigate",
]

_MODIFIERS = {
    "ctrl": "Control",
    "control": "Control",
    "alt": "Alt",
    "option": "Alt",
    "shift": "Shift",
    "meta": "Meta",
    "cmd": "Meta",
    "command": "Meta",
    "super": "Meta",
    "win": "Meta",
}
# xdotool's names (what computer-use models are trained on) and Playwright's, lower-cased, to Playwright's.
_KEYS = {
    **{k: "Enter" for k in ("enter", "return", "kp_enter")},
    "tab": "Tab",
    **{k: "Escape" for k in ("escape", "esc")},
    "backspace": "Backspace",
    **{k: "Delete" for k in ("delete", "del")},
    "insert": "Insert",
    "space": "Space",
    "home": "Home",
    "end": "End",
    **{k: "PageUp" for k in ("pageup", "page_up", "prior")},
    **{k: "PageDown" for k in ("pagedown", "page_down", "next")},
    **{k: "ArrowUp" for k in ("up", "arrowup")},
    **{k: "ArrowDown" for k in ("down", "arrowdown")},
    **{k: "ArrowLeft" for k in ("left", "arrowleft")},
    **{k: "ArrowRight" for k in ("right", "arrowright")},
    **{f"f{n}": f"F{n}" for n in range(1, 13)},
}


def parse_keys(text: str) -> list[str]:
    """`ctrl+a`, `shift+Tab`, `Return`, `ctrl+a Delete` (a sequence) as Playwright key chords; ToolError if
    a key is unknown."""
    chords = text.split()
    if not chords:
        raise ToolError("key: `text` names no key (e.g. 'Enter', 'ctrl+a', 'shift+Tab')")
    if len(chords) > MAX_CHORDS:
        raise ToolError(f"key: at most {MAX_CHORDS} key combinations per action ({len(chords)} given)")
    out = []
    for chord in chords:
        if chord == "+":
            parts = ["+"]
        elif chord.endswith("++"):  # ctrl++: the plus key itself
            parts = [*chord[:-2].split("+"), "+"]
        else:
            parts = chord.split("+")
        *mods, key = parts
        names = []
        for mod in mods:
            name = _MODIFIERS.get(mod.lower())
            if name is None:
                raise ToolError(f"key: unknown modifier {mod!r} in {chord!r} (ctrl, alt, shift, meta)")
            names.append(name)
        if len(key) == 1 and key.isprintable():
            names.append(key)
        elif key.lower() in _KEYS:
            names.append(_KEYS[key.lower()])
        else:
            raise ToolError(f"key: unknown key {key!r} in {chord!r} (e.g. Enter, Tab, Escape, BackSpace, Up, F5, a)")
        out.append("+".join(names))
    return out


def _normalized_path(path: str) -> str:
    """`path` with dot segments (also percent-encoded ones) removed, as a browser would resolve it."""
    plain = unquote(path)
    normal = posixpath.normpath(plain) if plain else "/"
    if plain.endswith("/") and not normal.endswith("/"):
        normal += "/"
    return normal


class Computer:
    """The `computer` tool of the `screen` aggregators: resolves the instance's page and runs actions on it."""

    def __init__(
        self, browser: BrowserManager, public_url: str, listen_host: str, image_format: str, jpeg_quality: int
    ) -> None:
        self.browser = browser
        self.public_url = public_url
        # The browser runs in this process: it reaches the app on the address localfleet listens on.
        host = "127.0.0.1" if listen_host in ("", "0.0.0.0", "::") else listen_host
        self.host = f"[{host}]" if ":" in host else host
        self.image_format = image_format
        self.jpeg_quality = jpeg_quality

    def register(self, server: MCPServer) -> None:
        width, height = self.browser.width, self.browser.height

        @server.tool(
            description=(
                f"Use the app's screen ({width}x{height} pixels, origin top-left) with a mouse and a keyboard. "
                "Every action answers with a screenshot. Actions: screenshot; left_click, double_click, "
                "right_click, mouse_move (coordinate [x, y]); left_click_drag (start_coordinate -> coordinate); "
                f"type (text, at most {MAX_TEXT} characters); key (text: a key or combination such as 'Enter', "
                "'ctrl+a', 'shift+Tab', several separated by spaces); scroll (coordinate, scroll_direction "
                f"up/down/left/right, scroll_amount notches 1-{MAX_SCROLL}); wait (duration seconds, at most "
                f"{MAX_WAIT_S:g}); cursor_position; navigate (url: a page of this app)."
            )
        )
        async def computer(
            ctx: Context,
            action: Action,
            coordinate: Annotated[
                list[int] | None, Field(min_length=2, max_length=2, description="[x, y] in screen pixels")
            ] = None,
            start_coordinate: Annotated[
                list[int] | None, Field(min_length=2, max_length=2, description="[x, y] where a drag starts")
            ] = None,
            text: Annotated[str | None, Field(description="What to type (type), or the keys to press (key)")] = None,
            scroll_direction: Literal["up", "down", "left", "right"] | None = None,
            scroll_amount: Annotated[int, Field(ge=1, le=MAX_SCROLL, description="Wheel notches (scroll)")] = 3,
            duration: Annotated[float, Field(ge=0, le=MAX_WAIT_S, description="Seconds to wait (wait)")] = 1.0,
            url: Annotated[str | None, Field(description="A page of this app (navigate)")] = None,
        ) -> CallToolResult:
            inst = current_instance(ctx)
            request = ctx.request_context.request
            port = request.scope["server"][1] if request is not None and request.scope.get("server") else None
            if port is None:
                raise ToolError("computer: no HTTP request to find this instance's app from")
            origin = f"http://{self.host}:{port}"
            step = self._action(
                action,
                inst.instance_id,
                origin,
                coordinate=coordinate,
                start_coordinate=start_coordinate,
                text=text,
                scroll_direction=scroll_direction,
                scroll_amount=scroll_amount,
                duration=duration,
                url=url,
            )
            form = str((getattr(inst, "env_variables", None) or {}).get(RESULT_FORM_VARIABLE, "image"))

            def alive() -> bool:
                return getattr(inst, "status", "running") == "running"

            wait_s = duration if action == "wait" else 0.0
            looks_only = action in ("screenshot", "wait", "cursor_position")  # nothing to let settle
            return await self._run(inst.instance_id, origin, step, wait_s, not looks_only, form, alive)

    # -- validation: everything is checked before the page is touched --------------------------------------
    def _point(self, name: str, value: list[int] | None) -> tuple[int, int]:
        if value is None:
            raise ToolError(f"`{name}` [x, y] is required for this action")
        x, y = value
        if not (0 <= x < self.browser.width and 0 <= y < self.browser.height):
            raise ToolError(
                f"{name} [{x}, {y}] is outside the {self.browser.width}x{self.browser.height} screen "
                f"(0 <= x < {self.browser.width}, 0 <= y < {self.browser.height})"
            )
        return x, y

    def _action(
        self,
        action: str,
        instance_id: str,
        origin: str,
        *,
        coordinate: list[int] | None,
        start_coordinate: list[int] | None,
        text: str | None,
        scroll_direction: str | None,
        scroll_amount: int,
        duration: float,
        url: str | None,
    ) -> Callable[[Screen], Awaitable[str]]:
        """The action as a function of the page (returning its short text), or ToolError for bad input."""
        if action in ("screenshot", "wait"):

            async def look(screen: Screen) -> str:
                return f"waited {duration:g}s" if action == "wait" else "screenshot"

            return look
        if action == "cursor_position":

            async def where(screen: Screen) -> str:
                x, y = screen.cursor
                return json.dumps({"x": x, "y": y})

            return where
        if action in ("left_click", "double_click", "right_click", "mouse_move"):
            x, y = self._point("coordinate", coordinate)

            async def pointer(screen: Screen) -> str:
                mouse = screen.page.mouse
                if action == "mouse_move":
                    await mouse.move(x, y)
                else:
                    button: Literal["left", "right"] = "right" if action == "right_click" else "left"
                    await mouse.click(x, y, button=button, click_count=2 if action == "double_click" else 1)
                screen.cursor = (x, y)
                return f"{action} at ({x}, {y})"

            return pointer
        if action == "left_click_drag":
            x0, y0 = self._point("start_coordinate", start_coordinate)
            x1, y1 = self._point("coordinate", coordinate)

            async def drag(screen: Screen) -> str:
                mouse = screen.page.mouse
                await mouse.move(x0, y0)
                await mouse.down()
                await mouse.move(x1, y1, steps=10)
                await mouse.up()
                screen.cursor = (x1, y1)
                return f"dragged from ({x0}, {y0}) to ({x1}, {y1})"

            return drag
        if action == "type":
            if not text:
                raise ToolError("type: `text` is required")
            if len(text) > MAX_TEXT:
                raise ToolError(f"type: text is {len(text)} characters; at most {MAX_TEXT} per action")
            typed = text

            async def write(screen: Screen) -> str:
                await screen.page.keyboard.type(typed)
                return f"typed {len(typed)} characters"

            return write
        if action == "key":
            chords = parse_keys(text or "")

            async def press(screen: Screen) -> str:
                for chord in chords:
                    await screen.page.keyboard.press(chord)
                return "pressed " + " ".join(chords)

            return press
        if action == "scroll":
            x, y = self._point("coordinate", coordinate)
            if scroll_direction is None:
                raise ToolError("scroll: `scroll_direction` (up, down, left or right) is required")
            distance = scroll_amount * SCROLL_NOTCH_PX
            dx, dy = {"up": (0, -distance), "down": (0, distance), "left": (-distance, 0), "right": (distance, 0)}[
                scroll_direction
            ]

            async def wheel(screen: Screen) -> str:
                await screen.page.mouse.move(x, y)
                await screen.page.mouse.wheel(dx, dy)
                screen.cursor = (x, y)
                return f"scrolled {scroll_direction} {scroll_amount} at ({x}, {y})"

            return wheel
        if action == "navigate":
            return self._navigation(instance_id, origin, url)
        raise ToolError(f"unknown action {action!r}")

    def _navigation(self, instance_id: str, origin: str, url: str | None) -> Callable[[Screen], Awaitable[str]]:
        if not url:
            raise ToolError("navigate: `url` is required")
        if len(url) > MAX_URL:
            raise ToolError(f"navigate: url is longer than {MAX_URL} characters")
        app_url = f"{self.public_url}{app_root(instance_id)}"
        refused = ToolError(f"navigate: {url[:200]!r} is outside this instance's app ({app_url}); only its pages open")
        parts = urlsplit(url)
        if (parts.scheme or parts.netloc) and not (same_origin(url, self.public_url) or same_origin(url, origin)):
            raise refused

        async def go(screen: Screen) -> str:
            if parts.scheme or parts.netloc:  # the public form of an app URL: the same page, as the browser sees it
                target = origin + urlunsplit(("", "", parts.path or "/", parts.query, parts.fragment))
            else:
                here = screen.page.url
                target = urljoin(here if same_origin(here, origin) else origin + app_root(instance_id), url)
            if not (same_origin(target, origin) and in_app(instance_id, _normalized_path(urlsplit(target).path))):
                raise refused
            await screen.page.goto(target, wait_until="load")
            return f"navigated to {urlsplit(target).path}"

        return go

    # -- running -------------------------------------------------------------------------------------------
    async def _run(
        self,
        instance_id: str,
        origin: str,
        step: Callable[[Screen], Awaitable[str]],
        wait_s: float,
        settle: bool,
        form: str,
        alive: Callable[[], bool],
    ) -> CallToolResult:
        def allow(request_url: str) -> bool:
            return same_origin(request_url, origin) and in_app(instance_id, urlsplit(request_url).path)

        timeout = self.browser.timeout_s
        try:
            screen = await self.browser.screen(instance_id, origin + app_root(instance_id), allow, alive)
            async with screen.lock:
                if wait_s:
                    await asyncio.sleep(wait_s)
                output = await asyncio.wait_for(step(screen), timeout)
                if settle:
                    await screen.settle(timeout)
                shot = await asyncio.wait_for(self._screenshot(screen), timeout)
        except (BrowserUnavailable, TooManyScreens) as exc:
            raise ToolError(f"computer: {exc}") from exc
        except TimeoutError as exc:
            raise ToolError(f"computer: the browser did not answer within {timeout:g}s") from exc
        except PlaywrightError as exc:
            log.info("computer action on %s failed: %s", instance_id, exc)
            raise ToolError(f"computer: the browser failed: {str(exc).splitlines()[0][:300]}") from exc
        mime = f"image/{self.image_format}"
        data = base64.b64encode(shot).decode()
        if form == "base64_image":
            payload = {"base64_image": f"data:{mime};base64,{data}", "output": output}
            return CallToolResult(content=[TextContent(type="text", text=json.dumps(payload))])
        return CallToolResult(
            content=[TextContent(type="text", text=output), ImageContent(type="image", data=data, mime_type=mime)]
        )

    async def _screenshot(self, screen: Screen) -> bytes:
        """The viewport (never the full page: the size is bounded by the screen's)."""
        options: dict[str, Any] = {"type": self.image_format, "animations": "disabled"}
        if self.image_format == "jpeg":
            options["quality"] = self.jpeg_quality
        return await screen.page.screenshot(**options)
