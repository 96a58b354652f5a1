"""A second process for the store tests: `python worker.py URL write PREFIX N` or
`python worker.py URL lease NAME HOLDER TTL`. Prints one JSON line with what it did.
The test process runs the same `write` function, so both sides do identical work."""

from __future__ import annotations

import asyncio
import json
import sys
from dataclasses import replace
from typing import Any

from rlgate.store import ConflictError, Session, SessionStore, ToolCallEntry, open_store

SHARED_COUNTER = "shared-counter"


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


async def main(argv: list[str]) -> dict[str, Any]:
    url, mode, *args = argv
    store = await open_store(url)
    try:
        if mode == "write":
            return await write(store, args[0], int(args[1]))
        if mode == "lease":
            return {"acquired": await store.acquire_lease(args[0], args[1], float(args[2]))}
        raise SystemExit(f"unknown mode {mode!r}")
    finally:
        await store.close()


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(sys.argv[1:]))), flush=True)
