"""The Redis store's Lua scripts, one file each under lua/, read when this module is imported.

A script file may start with a line `-- uses: LIB ...`, naming library files (lua/LIB.lua: local functions
several scripts share) that are put before it, in that order, to make the script Redis runs. Every write of
the store is one script, so each record and its secondary indexes change atomically.
"""

from __future__ import annotations

from importlib import resources

_LUA = resources.files(__package__) / "lua"
_USES = "-- uses:"

# The scripts the store runs (lua/<name>.lua); the *_lib.lua files are their libraries.
NAMES = (
    "create_session",
    "update_session",
    "touch_session",
    "delete_session",
    "append_tool_call",
    "claim_request",
    "authorize_call",
    "complete_request",
    "release_request",
    "pending_requests",
    "take_over_request",
    "commit",
    "put_intent",
    "delete_intent",
    "acquire_lease",
    "release_lease",
    "admit_create",
    "release_create",
    "throttle_creates",
    "prune_sessions",
    "prune_requests",
)


def _read(name: str) -> str:
    return (_LUA / f"{name}.lua").read_text(encoding="utf-8")


def source(name: str) -> str:
    """The text Redis runs for script `name`: its libraries, then the script."""
    text = _read(name)
    first, _, _ = text.partition("\n")
    libraries = first[len(_USES) :].split() if first.startswith(_USES) else []
    return "".join(_read(library) for library in libraries) + text


SOURCES = {name: source(name) for name in NAMES}
