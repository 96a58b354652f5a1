"""A second process for the store tests: `python worker.py URL write PREFIX N`,
`python worker.py URL lease NAME HOLDER TTL` or `python worker.py URL stress PREFIX ROUNDS`. Prints one JSON
line with what it did. The test process runs the same `write` function, so both sides do identical work;
`stress` is one writer of test_wal_stress.py."""

from __future__ import annotations

import asyncio
import json
import sys
from dataclasses import replace
from typing import Any

from rlgate.store import (
    ConflictError,
    Session,
    SessionStatus,
    SessionStore,
    ToolCallEntry,
    call_scope,
    open_store,
)

SHARED_COUNTER = "shared-counter"
CLOSE_EVERY = 5  # stress: every 5th session is closed, then pruned (deletes, so pages are freed and reused)


async def write(store: SessionStore, prefix: str, n: int) -> dict[str, Any]:
    """Create n sessions (run_id=prefix) with two logged calls each, bump the shared counter n times by
    compare-and-set, and race for n shared request ids. Returns the request ids this side won."""
    won: list[str] = []
    conflicts = 0
    for i in range(n):
        await store.create_session(Session(session_id=f"{prefix}-{i}", env_key="mail:v1", run_id=prefix))
        for j in range(2):
            await store.append_tool_call(ToolCallEntry(f"{prefix}-{i}", 1, f"r{j}", "search"))
        while True:
            counter = await store.get_session(SHARED_COUNTER)
            assert counter is not None
            try:
                await store.update_session(replace(counter, turn=counter.turn + 1))
                break
            except ConflictError:
                conflicts += 1
        _, created = await store.claim_request("shared", f"req-{i}", prefix)
        if created:
            won.append(f"req-{i}")
    return {"won": won, "conflicts": conflicts}


async def stress(store: SessionStore, prefix: str, rounds: int) -> dict[str, Any]:
    """What an orchestrator and a gateway write per episode turn, `rounds` times over: a session created, a
    CallTool's claim then its DONE record and log entry, a Step's turn with its request record (one commit
    each), the shared counter bumped by compare-and-set, and every CLOSE_EVERY-th session closed and pruned.
    About five commits a round."""
    commits = conflicts = 0
    for i in range(rounds):
        sid, token = f"{prefix}-{i}", f"tok-{prefix}-{i}"
        session = await store.create_session(
            Session(
                session_id=sid,
                env_key="mail:v1",
                run_id=prefix,
                status=SessionStatus.ACTIVE,
                token_hash=token,
                labels={"worker": prefix, "round": str(i % 7)},
            )
        )
        found, record, created = await store.authorize_call(token, f"c{i}", prefix)
        assert found is not None and record is not None and created
        entry = ToolCallEntry(sid, 1, f"c{i}", "search", arguments={"q": i}, result_summary="r" * (100 + i % 900))
        await store.commit(request=(call_scope(sid), f"c{i}", "x" * (200 + i % 1500)), tool_call=entry)
        stepped = await store.commit(
            session=replace(session, turn=1), request=(f"step:{sid}", f"s{i}", "{}"), new_request=True
        )
        assert stepped is not None
        commits += 4
        if i % CLOSE_EVERY == CLOSE_EVERY - 1:
            await store.update_session(replace(stepped, status=SessionStatus.CLOSED, token_hash="", closed_at=1.0))
            await store.prune(closed_before=2.0, requests_before=0.0)
            commits += 2
        while True:
            counter = await store.get_session(SHARED_COUNTER)
            assert counter is not None
            try:
                await store.update_session(replace(counter, turn=counter.turn + 1))
                commits += 1
                break
            except ConflictError:
                conflicts += 1
    return {"commits": commits, "conflicts": conflicts}


async def main(argv: list[str]) -> dict[str, Any]:
    url, mode, *args = argv
    store = await open_store(url)
    try:
        if mode == "write":
            return await write(store, args[0], int(args[1]))
        if mode == "stress":
            return await stress(store, args[0], int(args[1]))
        if mode == "lease":
            return {"acquired": await store.acquire_lease(args[0], args[1], float(args[2]))}
        raise SystemExit(f"unknown mode {mode!r}")
    finally:
        await store.close()


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(sys.argv[1:]))), flush=True)
