"""State pages the tool-call log, through the real orchestrator, gateway and localfleet: seventeen calls of
1 MiB arguments (past the 16 MiB reply limit together) answer in pages under 4 MiB each, in order, none
twice, none missing; a computer-use episode's screenshots add a bounded note each, never their bytes; a
page token of another session, a forged token and a bad page size are INVALID_ARGUMENT naming the field."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

import rlgate
from rlgate.orchestrator.endings import LogTooLarge, verifier_log
from rlgate.orchestrator.logpages import PAGE_BYTES, LogPages
from rlgate.store import SessionStore, ToolCallEntry, open_store
from rlgate.toolgateway.server import GatewayHandle
from rlgate.v1 import orchestrator_pb2
from tests.orchestrator.conftest import Running, bundled_tasks, call_tool, fast_config
from tests.orchestrator.test_limits import field_of, refused
from tests.support.localfleet import LocalfleetProcess

TASK = "mailbox-count-unread-from-kenji"
REPLY_LIMIT = 16 * 1024 * 1024


@pytest.fixture(params=["memory", "sqlite", pytest.param("redis", marks=pytest.mark.redis)])
async def log_store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[SessionStore]:
    """Each backend's paged read under the State pages and the verifier's log (positions differ per backend)."""
    url = {"memory": f"memory://{uuid.uuid4().hex}", "sqlite": f"sqlite:///{tmp_path / 'store.db'}"}.get(
        request.param, ""
    )
    if request.param == "redis":
        url = request.getfixturevalue("redis_server").url
    store = await open_store(url)
    try:
        yield store
    finally:
        await store.close()


async def all_pages(
    orch: Running, session_id: str, page_size: int = 0
) -> tuple[list[orchestrator_pb2.ToolCallLogEntry], list[orchestrator_pb2.StateResponse]]:
    entries: list[orchestrator_pb2.ToolCallLogEntry] = []
    replies: list[orchestrator_pb2.StateResponse] = []
    token = ""
    while True:
        reply = await orch.stub.State(
            orchestrator_pb2.StateRequest(
                session_id=session_id,
                include_tool_calls=True,
                tool_calls_page_size=page_size,
                tool_calls_page_token=token,
            ),
            timeout=60,
        )
        replies.append(reply)
        entries.extend(reply.tool_calls)
        token = reply.next_tool_calls_page_token
        if not token:
            return entries, replies
        assert len(replies) < 1000, "pages never end"


async def test_seventeen_one_mib_calls_answer_through_pages(
    lf: LocalfleetProcess, gateway: GatewayHandle, orchestrator_factory: Callable[..., Any]
) -> None:
    orch: Running = await orchestrator_factory(fast_config(lf, gateway_address=gateway.address))
    reset = await orch.stub.Reset(orchestrator_pb2.ResetRequest(task_key=TASK), timeout=60)
    big = "x" * ((1 << 20) - 64)  # the gateway's default max_arguments_bytes, just under
    for _ in range(17):
        await call_tool(gateway.address, reset.agent_token, "list_folders", {"pad": big})

    entries, replies = await all_pages(orch, reset.session_id)
    assert len(entries) == 17 and len({e.request_id for e in entries}) == 17
    assert all(json.loads(e.arguments_json)["pad"] == big and not e.arguments_elided for e in entries)
    assert [e.finished_at.ToNanoseconds() for e in entries] == sorted(e.finished_at.ToNanoseconds() for e in entries)
    assert len(replies) >= 5  # 17 MiB in pages of at most 4 MiB
    for reply in replies:
        assert sum(e.ByteSize() for e in reply.tool_calls) <= PAGE_BYTES
        assert reply.ByteSize() < REPLY_LIMIT and reply.session.tool_call_count == 17
    # Small pages walk the same log: the same entries in the same order.
    walked, pages = await all_pages(orch, reset.session_id, page_size=2)
    assert [e.request_id for e in walked] == [e.request_id for e in entries] and len(pages) == 9
    # Without include_tool_calls the count comes without the entries.
    bare = await orch.stub.State(orchestrator_pb2.StateRequest(session_id=reset.session_id), timeout=30)
    assert bare.session.tool_call_count == 17 and not bare.tool_calls and not bare.next_tool_calls_page_token


async def test_hundred_screens_keep_state_small(
    tmp_path: Path, lf: LocalfleetProcess, gateway: GatewayHandle, orchestrator_factory: Callable[..., Any]
) -> None:
    task = next(t for t in bundled_tasks() if t["key"] == TASK)
    screen_task = {**task, "key": "screen-task", "task_modality": "computer_use", "max_turns": 200}
    tasks_file = tmp_path / "tasks.json"
    tasks_file.write_text(json.dumps([screen_task]))
    orch: Running = await orchestrator_factory(
        fast_config(lf, gateway_address=gateway.address, tasks_file=str(tasks_file))
    )
    reset = await orch.stub.Reset(orchestrator_pb2.ResetRequest(task_key="screen-task"), timeout=60)
    assert [t.name for t in reset.tools] == ["computer"]
    image_bytes = 0
    for _ in range(100):
        result = await call_tool(gateway.address, reset.agent_token, "computer", {"action": "screenshot"})
        images = [c.image for c in result.content if c.WhichOneof("kind") == "image"]
        assert not result.is_error and len(images) == 1, result
        image_bytes += len(images[0].data)

    state = await orch.stub.State(
        orchestrator_pb2.StateRequest(session_id=reset.session_id, include_tool_calls=True), timeout=30
    )
    assert len(state.tool_calls) == 100 and not state.next_tool_calls_page_token
    for entry in state.tool_calls:
        assert "[image: image/" in entry.result_summary and "sha256:" in entry.result_summary, entry.result_summary
        assert entry.ByteSize() < 1024  # a note per screen, not the screen
    assert state.ByteSize() < 128 * 1024 < image_bytes
    # The clients read the same log page by page.
    logged = [e.request_id for e in state.tool_calls]
    async with rlgate.AsyncClient(orch.handle.address) as client:
        assert [e.request_id for e in await client.tool_calls(reset.session_id, page_size=7)] == logged
        page = await client.state(reset.session_id, include_tool_calls=True, tool_calls_page_size=30)
        assert [e.request_id for e in page.tool_calls] == logged[:30] and page.next_tool_calls_page_token

    def blocking() -> list[str]:
        with rlgate.Client(orch.handle.address) as client:
            return [e.request_id for e in client.tool_calls(reset.session_id, page_size=33)]

    assert await asyncio.to_thread(blocking) == logged


async def test_bad_tokens_and_sizes_are_invalid_argument(orch: Running) -> None:
    mine = await orch.stub.Reset(orchestrator_pb2.ResetRequest(task_key=TASK), timeout=60)
    other = await orch.stub.Reset(orchestrator_pb2.ResetRequest(task_key=TASK), timeout=60)
    # A token of another session (made here, as State makes them, with a position inside its log).
    from rlgate.orchestrator.logpages import _Cursor, _encode

    foreign = _encode(other.session_id, _Cursor(1, 1))
    for token in (foreign, "not-a-token", _encode(mine.session_id, _Cursor(7, 0)), "e30"):
        for include in (True, False):
            request = orchestrator_pb2.StateRequest(
                session_id=mine.session_id, include_tool_calls=include, tool_calls_page_token=token
            )
            err = await refused(orch.stub.State(request, timeout=30))
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (token, err)
            assert field_of(err) == "tool_calls_page_token", err
    for size in (-1, 1001):
        request = orchestrator_pb2.StateRequest(
            session_id=mine.session_id, include_tool_calls=True, tool_calls_page_size=size
        )
        err = await refused(orch.stub.State(request, timeout=30))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and field_of(err) == "tool_calls_page_size", err


@pytest.mark.parametrize("page_bytes", [1, 300])
async def test_an_entry_above_the_bound_comes_alone_with_its_arguments_elided(
    page_bytes: int, log_store: SessionStore
) -> None:
    """With a bound below one entry (the gateway accepting arguments larger than a page), every page holds one
    entry, elided, and the pages still cover the log in order."""
    for i in range(5):
        await log_store.append_tool_call(
            ToolCallEntry(session_id="s", episode=1, request_id=f"r{i}", tool="t", arguments={"a": "x" * 400})
        )
    pages = LogPages(log_store, page_bytes=page_bytes)
    token, seen = "", []
    while True:
        page = await pages.page("s", 1, 0, token)
        assert len(page.entries) == 1 and page.entries[0].arguments_elided and not page.entries[0].arguments_json
        seen.append(page.entries[0].request_id)
        token = page.next_token
        if not token:
            break
    assert seen == [f"r{i}" for i in range(5)]


async def test_pages_end_on_their_byte_bound_without_gaps(log_store: SessionStore) -> None:
    """Entries of mixed sizes, two episodes interleaved: every page within its bound, the episode's entries
    once each in order, whatever batch the bound fell in."""
    sizes = [10, 900, 20, 2500, 30, 30, 1800, 5, 700, 700, 700, 40] * 3
    for i, n in enumerate(sizes):
        await log_store.append_tool_call(
            ToolCallEntry(session_id="s", episode=1, request_id=f"r{i}", tool="t", arguments={"a": "x" * n})
        )
        await log_store.append_tool_call(ToolCallEntry(session_id="s", episode=2, request_id=f"o{i}", tool="t"))
    pages = LogPages(log_store, page_bytes=3000)
    for size in (0, 1, 5):
        token, seen = "", list[str]()
        while True:
            page = await pages.page("s", 1, size, token)
            assert sum(e.ByteSize() + 6 for e in page.entries) <= 3000 and 1 <= len(page.entries) <= (size or 100)
            seen.extend(e.request_id for e in page.entries)
            token = page.next_token
            if not token:
                break
        assert seen == [f"r{i}" for i in range(len(sizes))], size


async def test_the_verifier_gets_the_whole_log_within_its_bound(log_store: SessionStore) -> None:
    """The verifier's copy of the log is read page by page, in order; past its byte bound the ending is an
    honest LogTooLarge (verification ERROR), never a score on part of the log."""
    for i in range(40):
        await log_store.append_tool_call(
            ToolCallEntry(session_id="s", episode=1, request_id=f"r{i}", tool="t", arguments={"a": "x" * 1000})
        )
    await log_store.append_tool_call(ToolCallEntry(session_id="s", episode=2, request_id="later", tool="t"))
    got = await verifier_log(log_store, "s", 1)
    assert [e.request_id for e in got] == [f"r{i}" for i in range(40)]
    with pytest.raises(LogTooLarge, match="20000 bytes"):
        await verifier_log(log_store, "s", 1, limit_bytes=20_000)
