"""`ToolCallLog`: appends (once per request_id), counts, the whole log and its pages, against every backend (see
conftest.py)."""

from __future__ import annotations

from rlgate.store import Session, SessionStore, ToolCallEntry


async def test_tool_call_log(store: SessionStore) -> None:
    await store.create_session(Session(session_id="s1", env_key="mail:v1"))
    for i in range(3):
        n = await store.append_tool_call(
            ToolCallEntry(session_id="s1", episode=1, request_id=f"r{i}", tool="search", arguments={"q": i})
        )
        assert n == i + 1
    assert await store.append_tool_call(ToolCallEntry("s1", 2, "r0", "send", is_error=True)) == 1
    # a retried append of the same request is logged once
    assert await store.append_tool_call(ToolCallEntry("s1", 1, "r2", "search", arguments={"q": 2})) == 3
    assert await store.count_tool_calls("s1", 1) == 3
    assert await store.count_tool_calls("s1", 2) == 1
    assert await store.count_tool_calls("s1", 3) == 0
    episode1 = await store.list_tool_calls("s1", 1)
    assert [e.request_id for e in episode1] == ["r0", "r1", "r2"]
    assert episode1[1].arguments == {"q": 1}
    everything = await store.list_tool_calls("s1")
    assert [(e.episode, e.tool) for e in everything] == [(1, "search")] * 3 + [(2, "send")]
    assert everything[-1].is_error
    assert await store.list_tool_calls("other") == []

    await store.delete_session("s1")
    assert await store.list_tool_calls("s1") == []
    assert await store.count_tool_calls("s1", 1) == 0


def entry(episode: int, request_id: str) -> ToolCallEntry:
    return ToolCallEntry(session_id="s1", episode=episode, request_id=request_id, tool="t")


async def all_pages(
    store: SessionStore, limit: int, episode: int | None = None
) -> tuple[list[list[str]], list[int | None]]:
    """Every page of s1's log in turn: the request ids of each page, and the position each page returned."""
    pages: list[list[str]] = []
    positions: list[int | None] = []
    after = 0
    for _ in range(100):  # bounded: a log of a few entries has a few pages
        entries, after_next = await store.tool_calls("s1", episode=episode, after=after, limit=limit)
        pages.append([e.request_id for e in entries])
        positions.append(after_next)
        if after_next is None:
            return pages, positions
        after = after_next
    raise AssertionError("the pages never ended")


async def test_the_log_is_read_in_pages_oldest_first(store: SessionStore) -> None:
    for i in range(5):
        await store.append_tool_call(entry(1, f"a{i}"))
    pages, positions = await all_pages(store, 2)
    assert pages == [["a0", "a1"], ["a2", "a3"], ["a4"]]
    assert positions[-1] is None and positions[0] is not None and positions[1] is not None
    assert positions[0] < positions[1]  # positions only grow
    # A page exactly as long as what is left is the last one: no empty page after it.
    pages, positions = await all_pages(store, 5)
    assert pages == [["a0", "a1", "a2", "a3", "a4"]] and positions == [None]
    # Entries appended after a page was read come on the next page, after the ones already read.
    first, after = await store.tool_calls("s1", limit=4)
    assert [e.request_id for e in first] == ["a0", "a1", "a2", "a3"] and after is not None
    await store.append_tool_call(entry(1, "a5"))
    rest, last = await store.tool_calls("s1", after=after, limit=4)
    assert [e.request_id for e in rest] == ["a4", "a5"] and last is None
    assert rest[0] == (await store.list_tool_calls("s1"))[4]  # the entries themselves, whole


async def test_pages_of_one_episode(store: SessionStore) -> None:
    for request_id, episode in [("a0", 1), ("b0", 2), ("a1", 1), ("b1", 2), ("b2", 2), ("a2", 1)]:
        await store.append_tool_call(entry(episode, request_id))
    assert (await all_pages(store, 2, episode=1))[0] == [["a0", "a1"], ["a2"]]
    assert (await all_pages(store, 2, episode=2))[0] == [["b0", "b1"], ["b2"]]
    assert (await all_pages(store, 4))[0] == [["a0", "b0", "a1", "b1"], ["b2", "a2"]]
    assert await store.tool_calls("s1", episode=3, limit=10) == ([], None)


async def test_an_empty_or_unknown_log_is_one_empty_page(store: SessionStore) -> None:
    assert await store.tool_calls("s1", limit=10) == ([], None)
    assert await store.tool_calls("nobody", limit=10) == ([], None)
    await store.append_tool_call(entry(1, "a0"))
    _, after = await store.tool_calls("s1", limit=1)
    assert after is None
    assert await store.tool_calls("s1", after=10**9, limit=10) == ([], None)  # past the end


async def test_the_page_size_is_bounded(store: SessionStore) -> None:
    for i in range(1001):
        await store.commit(tool_call=entry(1, f"r{i}"))
    for limit, size in [(0, 100), (-5, 100), (1, 1), (5000, 1000)]:  # 0 or less: the default; at most 1000
        entries, after = await store.tool_calls("s1", limit=limit)
        assert len(entries) == size and after is not None, limit
