"""localfleet environments on their own: seeds, tool surface, errors and web apps, through the in-memory MCP client."""

from __future__ import annotations

import asyncio
import shutil
import sqlite3
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import pytest
from mcp import Client
from mcp.server import MCPServer
from starlette.applications import Starlette
from starlette.testclient import TestClient

from rlgate.localfleet.environments import all_environments, get_environment
from rlgate.localfleet.environments.base import EnvironmentSpec, _bound, bind_instance

ENVS = all_environments()
ENV_IDS = [spec.env_key for spec in ENVS]


class FileInstance:
    """A localfleet-like instance over one SQLite file (what tools see through `instance_db`)."""

    def __init__(self, instance_id: str, path: Path) -> None:
        self.instance_id = instance_id
        self.path = path
        self._conns: list[sqlite3.Connection] = []

    def current_db(self) -> sqlite3.Connection:
        # Like the platform: a connection per call (sync tools run in worker threads, possibly concurrently).
        conn = sqlite3.connect(self.path, check_same_thread=False, timeout=10)
        self._conns.append(conn)
        return conn

    def close(self) -> None:
        for conn in self._conns:
            conn.close()
        self._conns.clear()


def write_seed(spec: EnvironmentSpec, path: Path) -> Path:
    conn = sqlite3.connect(path)
    try:
        spec.seed(conn)
    finally:
        conn.close()
    return path


def dump(path: Path) -> list[str]:
    conn = sqlite3.connect(path)
    try:
        return list(conn.iterdump())
    finally:
        conn.close()


def build_server(spec: EnvironmentSpec) -> MCPServer:
    server = MCPServer(spec.env_id)
    spec.register_tools(server)
    return server


@contextmanager
def bound_copy(seed: Path, current: Path) -> Iterator[FileInstance]:
    """A fresh instance whose current DB is a copy of `seed`, bound for in-memory MCP calls."""
    shutil.copyfile(seed, current)
    inst = FileInstance("test-" + current.stem, current)
    token = bind_instance(inst)
    try:
        yield inst
    finally:
        _bound.reset(token)
        inst.close()


@asynccontextmanager
async def client_for(server: MCPServer) -> AsyncIterator[Client]:
    async with Client(server) as client:
        yield client


def error_text(result: Any) -> str:
    return " ".join(getattr(block, "text", "") for block in result.content)


@pytest.fixture(scope="module")
def seeds(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("seeds")
    return {spec.env_key: write_seed(spec, root / f"{spec.env_id}.db") for spec in ENVS}


def test_lookup_and_eras() -> None:
    assert len(ENVS) >= 3
    assert {spec.env_key for spec in ENVS} == {"mailbox:v1", "tracker:v1", "booking:v1"}
    assert get_environment("tracker") is get_environment("tracker:v1")
    with pytest.raises(KeyError, match="unknown environment 'nope'"):
        get_environment("nope")
    assert {spec.mcp_era for spec in ENVS} == {"modern", "legacy"}
    for spec in ENVS:
        assert spec.env_variables.get("LOGGED_IN_USER")
        assert spec.name and spec.description


@pytest.mark.parametrize("spec", ENVS, ids=ENV_IDS)
def test_seed_is_deterministic_and_realistic(spec: EnvironmentSpec, tmp_path: Path) -> None:
    a = write_seed(spec, tmp_path / "a.db")
    b = write_seed(spec, tmp_path / "b.db")
    assert dump(a) == dump(b)
    conn = sqlite3.connect(a)
    try:
        tables = [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
        counts = {t: conn.execute(f'SELECT COUNT(*) FROM "{t}"').fetchone()[0] for t in tables}
    finally:
        conn.close()
    assert max(counts.values()) >= 300, counts
    assert sum(counts.values()) >= 500, counts
    # schema_sql applied first (as the platform may do) and then seed gives the same database.
    c = tmp_path / "c.db"
    conn = sqlite3.connect(c)
    try:
        conn.executescript(spec.schema_sql)
        spec.seed(conn)
    finally:
        conn.close()
    assert dump(c) == dump(a)


@pytest.mark.parametrize("spec", ENVS, ids=ENV_IDS)
async def test_tool_surface(spec: EnvironmentSpec) -> None:
    async with client_for(build_server(spec)) as client:
        tools = (await client.list_tools()).tools
    assert 8 <= len(tools) <= 15
    names = [t.name for t in tools]
    assert len(set(names)) == len(names)
    for tool in tools:
        assert tool.description and len(tool.description) > 20, tool.name
        assert tool.input_schema.get("type") == "object", tool.name
        assert "ctx" not in tool.input_schema.get("properties", {}), tool.name
        assert tool.output_schema is not None, f"{tool.name} has no structured output"
        for prop, schema in tool.input_schema.get("properties", {}).items():
            assert schema.get("description"), f"{tool.name}.{prop} has no description"


# (tool, arguments, fragment of the model-visible error)
INVALID: dict[str, list[tuple[str, dict[str, Any], str]]] = {
    "mailbox:v1": [
        ("read_message", {"message_id": 999999}, "no message with id 999999"),
        ("list_messages", {"folder": "Nowhere"}, "no folder named 'Nowhere'; folders are: Inbox"),
        ("move_message", {"message_ids": [1], "folder": "Sent"}, "cannot be moved into Sent"),
        ("mark_read", {"message_ids": [1, 999999]}, "no message with id 999999; nothing was changed"),
        ("search_messages", {}, "give a query or a sender"),
        ("create_folder", {"name": "inbox"}, "already exists"),
        ("send_message", {"to": ["not-an-address"], "subject": "x", "body": "y"}, "String should match pattern"),
        ("list_messages", {"limit": 0}, "greater than or equal to 1"),
    ],
    "tracker:v1": [
        ("get_issue", {"repo": "northwind/atlas-api", "number": 9999}, "northwind/atlas-api has no issue #9999"),
        ("list_issues", {"repo": "nope/nope"}, "no repository 'nope/nope'; repositories are:"),
        ("add_labels", {"repo": "northwind/docs", "number": 1, "labels": ["urgent!!"]}, "has no label 'urgent!!'"),
        ("assign_issue", {"repo": "northwind/docs", "number": 1, "assignee": "ghost"}, "no user with login 'ghost'"),
        ("close_issue", {"repo": "northwind/docs", "number": 1, "reason": "done"}, "validation error"),
        ("reopen_issue", {"repo": "northwind/docs", "number": 2}, "is already open"),
    ],
    "booking:v1": [
        ("get_offer", {"offer_id": "XX-1"}, "is not an offer id"),
        ("search_flights", {"origin": "SFO", "destination": "ZZZ", "date": "2026-03-10"}, "unknown airport 'ZZZ'"),
        ("search_flights", {"origin": "SFO", "destination": "JFK", "date": "2026-01-01"}, "must be after today"),
        (
            "search_hotels",
            {"city": "Atlantis", "check_in": "2026-03-10", "check_out": "2026-03-12"},
            "no hotels in 'Atlantis'",
        ),
        ("search_hotels", {"city": "Paris", "check_in": "2026-03-12", "check_out": "2026-03-10"}, "1 to 30 nights"),
        ("book_hold", {"hold_id": 42, "traveller_id": 1, "payment_method_id": 1}, "no hold 42"),
        ("cancel_booking", {"confirmation": "NOPE123"}, "no booking with confirmation NOPE123"),
        ("hold_offer", {"offer_id": "FL-1", "passengers": 9}, "less than or equal to 6"),
    ],
}


@pytest.mark.parametrize("spec", ENVS, ids=ENV_IDS)
async def test_invalid_operations_are_tool_errors(
    spec: EnvironmentSpec, seeds: dict[str, Path], tmp_path: Path
) -> None:
    cases = INVALID[spec.env_key]
    with bound_copy(seeds[spec.env_key], tmp_path / "current.db"):
        async with client_for(build_server(spec)) as client:
            for name, args, fragment in cases:
                result = await client.call_tool(name, args)
                assert result.is_error, (name, args)
                assert fragment in error_text(result), (name, error_text(result))
            unknown = await client.call_tool("no_such_tool", {})
            assert unknown.is_error
    # Failed operations left the database as seeded.
    assert dump(tmp_path / "current.db") == dump(seeds[spec.env_key])


async def test_state_rules_hold_across_calls(seeds: dict[str, Path], tmp_path: Path) -> None:
    """Errors that depend on state: a second delete, a second close, an expired card, too many points."""
    mailbox, tracker, booking = (get_environment(k) for k in ("mailbox", "tracker", "booking"))
    with bound_copy(seeds["mailbox:v1"], tmp_path / "m.db"):
        async with client_for(build_server(mailbox)) as client:
            assert not (await client.call_tool("delete_message", {"message_ids": [3]})).is_error
            again = await client.call_tool("delete_message", {"message_ids": [3]})
            assert again.is_error and "already in Trash" in error_text(again)
    with bound_copy(seeds["tracker:v1"], tmp_path / "t.db"):
        async with client_for(build_server(tracker)) as client:
            args = {"repo": "northwind/atlas-api", "number": 53}
            assert not (await client.call_tool("close_issue", args)).is_error
            again = await client.call_tool("close_issue", args)
            assert again.is_error and "already closed" in error_text(again)
            assert not (await client.call_tool("reopen_issue", args)).is_error
    with bound_copy(seeds["booking:v1"], tmp_path / "b.db"):
        async with client_for(build_server(booking)) as client:
            hold = await client.call_tool("hold_offer", {"offer_id": "HT-40-20260310-20260312"})
            assert not hold.is_error and hold.structured_content is not None
            hold_id = hold.structured_content["hold_id"]
            expired = await client.call_tool(
                "book_hold", {"hold_id": hold_id, "traveller_id": 1, "payment_method_id": 3}
            )
            assert expired.is_error and "expired in 2025-12" in error_text(expired)
            greedy = await client.call_tool(
                "book_hold",
                {"hold_id": hold_id, "traveller_id": 1, "payment_method_id": 1, "points_to_redeem": 10_000_000},
            )
            assert greedy.is_error and "points available" in error_text(greedy)
            ok = await client.call_tool("book_hold", {"hold_id": hold_id, "traveller_id": 1, "payment_method_id": 1})
            assert not ok.is_error and ok.structured_content is not None
            assert ok.structured_content["status"] == "confirmed"
            twice = await client.call_tool("book_hold", {"hold_id": hold_id, "traveller_id": 1, "payment_method_id": 1})
            assert twice.is_error and "is booked" in error_text(twice)
            conf = ok.structured_content["confirmation"]
            assert not (await client.call_tool("cancel_booking", {"confirmation": conf})).is_error
            again = await client.call_tool("cancel_booking", {"confirmation": conf})
            assert again.is_error and "already cancelled" in error_text(again)


@pytest.mark.parametrize("spec", ENVS, ids=ENV_IDS)
async def test_web_app_tracks_state(spec: EnvironmentSpec, seeds: dict[str, Path], tmp_path: Path) -> None:
    """The app's page (what the computer tool's browser shows) is drawn from `current`: a tool's change shows."""
    changes: dict[str, tuple[str, str, dict[str, Any], str]] = {
        "mailbox:v1": (
            "/",
            "mark_read",
            {"message_ids": [429], "read": False},
            '<tr class="unread"><td><input type="checkbox" form="bulk" name="ids" value="429"',
        ),
        "tracker:v1": (
            "/r/northwind/docs/issues/1",
            "add_comment",
            {"repo": "northwind/docs", "number": 1, "body": "bump"},
            "bump",
        ),
        "booking:v1": ("/trips/PK799999", "cancel_booking", {"confirmation": "PK799999"}, "cancelled"),
    }
    path, tool, args, shows = changes[spec.env_key]
    assert spec.app is not None
    with bound_copy(seeds[spec.env_key], tmp_path / "current.db") as inst:
        app = Starlette(routes=spec.app(lambda: sqlite3.connect(inst.path, check_same_thread=False)))
        with TestClient(app) as web:
            before = web.get(path)
            assert before.status_code == 200 and before.headers["content-type"].startswith("text/html")
            assert web.get(path).text == before.text
            async with client_for(build_server(spec)) as client:
                result = await client.call_tool(tool, args)
                assert not result.is_error, error_text(result)
            after = web.get(path).text
        assert after != before.text and shows in after


async def test_concurrent_bookings_of_one_hold_book_once(
    seeds: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Checks and writes share one transaction: racing book_hold calls on the same hold book it exactly once."""
    from rlgate.localfleet.environments import booking as booking_module

    slow_now = booking_module._now

    def now_after_a_pause(conn: sqlite3.Connection) -> str:
        time.sleep(0.05)  # widen the window between "hold is active" and the write
        return slow_now(conn)

    monkeypatch.setattr(booking_module, "_now", now_after_a_pause)
    booking = get_environment("booking")
    with bound_copy(seeds["booking:v1"], tmp_path / "b.db") as inst:
        async with client_for(build_server(booking)) as client:
            hold = await client.call_tool("hold_offer", {"offer_id": "FL-260", "passengers": 2})
            assert hold.structured_content is not None
            args = {"hold_id": hold.structured_content["hold_id"], "traveller_id": 1, "payment_method_id": 1}
            results = await asyncio.gather(*(client.call_tool("book_hold", args) for _ in range(4)))
        assert sorted(r.is_error for r in results) == [False, True, True, True]
        assert all("is booked" in error_text(r) for r in results if r.is_error)
        conn = inst.current_db()
        assert conn.execute("SELECT COUNT(*) FROM bookings WHERE hold_id = 1").fetchone() == (1,)
        seats = conn.execute("SELECT seats_left FROM flights WHERE id = 260").fetchone()[0]
    seed = sqlite3.connect(seeds["booking:v1"])
    try:
        assert seats == seed.execute("SELECT seats_left FROM flights WHERE id = 260").fetchone()[0] - 2
    finally:
        seed.close()
