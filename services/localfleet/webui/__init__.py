"""localfleet's web UIs: one server-rendered app per environment, driven by the `computer` tool in a browser.

`APPS[env_id](connect)` gives the app's Starlette routes, with paths relative to the app root; `connect()`
returns a new connection to the instance's `current` database (each request closes the one it opened).
Mount them under any prefix (the routes read it from the ASGI `root_path`): every link and form is relative.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable

from starlette.routing import BaseRoute

from rlgate.localfleet.webui import booking, mailbox, tracker

APPS: dict[str, Callable[[Callable[[], sqlite3.Connection]], list[BaseRoute]]] = {
    "mailbox": mailbox.app_routes,
    "tracker": tracker.app_routes,
    "booking": booking.app_routes,
}

__all__ = ["APPS"]
