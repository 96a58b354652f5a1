"""Redis outages: a server restart (even SIGKILL) loses no acknowledged record, operations issued while it
is down succeed once it is back, a lost reply does not make a retried write count twice, and an outage
longer than the retry budget surfaces as StoreError rather than a hang."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from typing import Any

import pytest

from rlgate.store import (
    ConflictError,
    Intent,
    RequestState,
    Session,
    SessionStatus,
    SessionStore,
    StoreError,
    ToolCallEntry,
    open_store,
)
from rlgate.store.redis import RedisStore
from tests.support.ports import free_port
from tests.support.redis import RedisServer

pytestmark = pytest.mark.redis


@pytest.fixture
async def redis_store(redis_server: RedisServer) -> AsyncIterator[RedisStore]:
    store = await RedisStore.open(redis_server.url)
    yield store
    await store.close()


async def test_restart_keeps_every_record(redis_server: RedisServer, redis_store: RedisStore) -> None:
    for i in range(40):
        await redis_store.create_session(
            Session(
                session_id=f"s{i}",
                env_key="e",
                status=SessionStatus.ACTIVE,
                token_hash=f"t{i}",
                run_id="r",
                labels={"k": "v"},
            )
        )
        await redis_store.append_tool_call(ToolCallEntry(f"s{i}", 1, "req", "tool"))
    await redis_store.claim_request("reset", "q1", "owner")
    await redis_store.complete_request("reset", "q1", "answer")
    await redis_store.put_intent(Intent("i1", "run", "e"))
    await redis_store.acquire_lease("leader", "me", 60)

    await redis_server.restart_async(kill=True)  # a crash: only the append-only file survives

    page, _ = await redis_store.list_sessions(run_id="r", labels={"k": "v"}, limit=1000)
    assert sorted(s.session_id for s in page) == sorted(f"s{i}" for i in range(40))
    found = await redis_store.session_by_token("t7")
    assert found is not None and found.session_id == "s7"
    assert await redis_store.count_tool_calls("s39", 1) == 1
    record = await redis_store.get_request("reset", "q1")
    assert record is not None and record.state == RequestState.DONE and record.result == "answer"
    assert await redis_store.get_intent("i1") is not None
    assert not await redis_store.acquire_lease("leader", "other", 60)
    assert await redis_store.check_invariants() == []


async def test_operations_ride_out_a_restart(redis_server: RedisServer, redis_store: RedisStore) -> None:
    """Writers keep going while the server is killed and comes back a second later: every operation
    either completes (after retries) or raises StoreError, and every completed one is stored."""
    await redis_store.create_session(Session(session_id="counter", env_key="e"))
    created: list[str] = []
    failed: list[BaseException] = []
    increments = 0
    spans: list[tuple[float, float]] = []
    stop = asyncio.Event()

    async def creator(n: int) -> None:
        i = 0
        while not stop.is_set():
            sid = f"w{n}-{i}"
            started = time.monotonic()
            try:
                await redis_store.create_session(Session(session_id=sid, env_key="e", run_id="w"))
                await redis_store.append_tool_call(ToolCallEntry(sid, 1, "r", "t"))
                created.append(sid)
            except StoreError as exc:
                failed.append(exc)
            spans.append((started, time.monotonic()))
            i += 1
            await asyncio.sleep(0.01)

    async def incrementer() -> None:
        nonlocal increments
        while not stop.is_set():
            counter = await redis_store.get_session("counter")
            assert counter is not None
            try:
                await redis_store.update_session(replace(counter, turn=counter.turn + 1))
                increments += 1
            except ConflictError:
                pass
            await asyncio.sleep(0.01)

    tasks = [asyncio.create_task(creator(n)) for n in range(4)] + [asyncio.create_task(incrementer())]
    await until(lambda: len(created) >= 4 and increments > 0)  # every writer is going
    down_at = time.monotonic()
    await redis_server.restart_async(kill=True, down_for=1.0)
    up_at = time.monotonic()
    await until(lambda: sum(start > up_at for start, _ in spans) >= 4)  # writes go on after the outage
    stop.set()
    await asyncio.gather(*tasks)

    assert failed == []  # a one-second outage is well inside the retry budget
    assert any(down_at - 0.1 < start < up_at < end for start, end in spans), (
        "no operation was in flight across the outage"
    )
    page, _ = await redis_store.list_sessions(run_id="w", limit=1000)
    assert {s.session_id for s in page} == set(created)
    for sid in created:
        assert await redis_store.count_tool_calls(sid, 1) == 1
    counter = await redis_store.get_session("counter")
    assert counter is not None and counter.turn == increments and increments > 0
    assert await redis_store.check_invariants() == []


async def test_outage_beyond_budget_is_store_error(redis_server: RedisServer) -> None:
    store = await RedisStore.open(redis_server.url, retry_s=0.5)
    try:
        await redis_server.stop_async()
        started = time.monotonic()
        with pytest.raises(StoreError):
            await store.create_session(Session(session_id="s", env_key="e"))
        with pytest.raises(StoreError):
            await store.ping()
        assert time.monotonic() - started < 10
        await redis_server.start_async()
        await store.create_session(Session(session_id="s", env_key="e"))  # the same object recovers
        assert await store.get_session("s") is not None
    finally:
        await store.close()


async def test_open_unreachable_is_store_error() -> None:
    started = time.monotonic()
    with pytest.raises(StoreError):
        await RedisStore.open(f"redis://127.0.0.1:{free_port()}/0", retry_s=0.3)
    assert time.monotonic() - started < 10


async def until(condition: Callable[[], bool], limit_s: float = 10.0) -> None:
    """Until `condition()` holds (polled; AssertionError after `limit_s`)."""
    give_up = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < give_up, "condition not met in time"
        await asyncio.sleep(0.01)


class ReplyDroppingProxy:
    """A loopback TCP proxy in front of Redis that, when armed, forwards the next request containing
    `marker` and then cuts the connection before the reply: the write happened, the client never hears."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.marker: bytes | None = None
        self.dropped = 0
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: set[asyncio.StreamWriter] = set()

    async def dropping_one_reply(self, coro_fn: Callable[[], Awaitable[Any]]) -> Any:
        """Run one store call whose script reply (EVALSHA) this proxy drops: the client must retry."""
        self.marker = b"EVALSHA"
        before = self.dropped
        result = await coro_fn()
        assert self.dropped == before + 1, "the reply was not dropped"
        return result

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return int(self._server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for writer in self._writers:
            writer.close()  # both relay directions see EOF and the handlers return
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=10)

    async def _handle(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self._writers.add(client_w)
        try:
            server_r, server_w = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            client_w.close()
            return
        self._writers.add(server_w)
        muted = False
        swallowed = asyncio.Event()  # the server answered the muted request: it ran

        async def downstream() -> None:
            with contextlib.suppress(ConnectionError):
                while data := await server_r.read(65536):
                    if muted:
                        swallowed.set()
                        continue
                    client_w.write(data)
                    await client_w.drain()

        relay = asyncio.create_task(downstream())
        try:
            while data := await client_r.read(65536):
                if self.marker is not None and self.marker in data:
                    self.marker = None
                    muted = True
                    server_w.write(data)
                    await server_w.drain()
                    await asyncio.wait_for(swallowed.wait(), 10)  # the server ran it; its reply is swallowed
                    self.dropped += 1
                    break
                server_w.write(data)
                await server_w.drain()
        except ConnectionError:
            pass
        finally:
            for writer in (client_w, server_w):
                writer.close()
            await relay
            self._tasks.discard(task)
            self._writers.difference_update((client_w, server_w))


@contextlib.asynccontextmanager
async def store_losing_replies(server: RedisServer) -> AsyncIterator[tuple[SessionStore, ReplyDroppingProxy]]:
    """A Redis store reached through a `ReplyDroppingProxy` (its `dropping_one_reply` loses one reply)."""
    proxy = ReplyDroppingProxy(server.port)
    port = await proxy.start()
    store = await open_store(f"redis://127.0.0.1:{port}/0")
    try:
        yield store, proxy
    finally:
        await store.close()
        await proxy.close()


async def test_retried_writes_after_a_lost_reply_apply_once(redis_server: RedisServer) -> None:
    async with store_losing_replies(redis_server) as (store, proxy):
        with_lost_reply = proxy.dropping_one_reply
        s = await with_lost_reply(
            lambda: store.create_session(
                Session(session_id="s1", env_key="e", token_hash="t1", status=SessionStatus.ACTIVE)
            )
        )
        assert s.version == 1
        s2 = await with_lost_reply(lambda: store.update_session(replace(s, turn=1)))
        assert s2.version == 2
        stored = await store.get_session("s1")
        assert stored is not None and stored.version == 2 and stored.turn == 1

        record, created = await with_lost_reply(lambda: store.claim_request("call:s1", "r1", "me"))
        assert created and record.owner == "me"
        assert await with_lost_reply(lambda: store.append_tool_call(ToolCallEntry("s1", 1, "r1", "t"))) == 1
        assert await store.count_tool_calls("s1", 1) == 1
        # A composite commit: the retry recognises its own update and applies nothing twice, not even
        # the append of an entry without a request_id (which append_tool_call alone could not dedupe).
        s3 = await with_lost_reply(
            lambda: store.commit(
                session=stored.copy(turn=2),
                request=("step:s1", "r2", "done-2"),
                tool_call=ToolCallEntry("s1", 1, "", "t2"),
            )
        )
        assert s3 is not None and s3.version == 3 and s3.turn == 2
        assert await store.count_tool_calls("s1", 1) == 2
        done = await store.get_request("step:s1", "r2")
        assert done is not None and done.state == RequestState.DONE and done.result == "done-2"
        await with_lost_reply(
            lambda: store.commit(request=("call:s1", "r3", "done-3"), tool_call=ToolCallEntry("s1", 1, "r3", "t3"))
        )
        assert await store.count_tool_calls("s1", 1) == 3
        assert await with_lost_reply(lambda: store.acquire_lease("l", "me", 30))
        assert not await store.acquire_lease("l", "other", 30)
        assert await store.check_invariants() == []
