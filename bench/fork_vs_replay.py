"""fork_vs_replay: 8 branches of an episode at turn 10 by Fork vs 8 fresh episodes replaying the same 10 turns.

One stack. A source episode of mailbox:v1 plays 10 turns, each one state-changing call (`set_flag` on one
message) and its Step. Then, alternating, `rounds` times each:

- **Fork** (snapshot): `Fork(count=8)` of the source; the figure is the time until it answers, when all 8
  branches are ready for turn 11 (registered, tokens minted, tools listed).
- **client replay** (the baseline, what a trainer does without Fork): 8 fresh episodes, concurrently, each a
  Reset and the same 10 calls and Steps; the figure is the time until all 8 have finished turn 10.
- **Fork by replay** (`mechanism=REPLAY`, beside it): the orchestrator resets 8 fresh instances and re-runs
  the 10 logged calls on each through its MCP client.

Every session a round made is closed outside the timing. Headline: p50 client replay / p50 Fork (value =
client replay p50, baseline = Fork p50, so the ratio is the speedup); goal ratio >= 5.
"""

from __future__ import annotations

import asyncio
import statistics
import time

from bench.fixtures import RPC_TIMEOUT_S, BenchContext, Rlgate, Session, ToolCall
from bench.harness import Entry, Goal
from rlgate.v1 import orchestrator_pb2

NAME = "fork_vs_replay"
ENV_KEY = "mailbox:v1"
TURNS = 10
BRANCHES = 8


def turn_call(i: int) -> ToolCall:
    return ToolCall("set_flag", {"message_ids": [i + 1], "flagged": True})


async def play(rl: Rlgate, session: Session) -> None:
    for i in range(TURNS):
        await rl.call_tool(session, turn_call(i))
        await rl.step(session, turn_call(i))


async def fork(rl: Rlgate, source: Session, mechanism: int) -> tuple[float, list[str]]:
    t0 = time.perf_counter()
    reply: orchestrator_pb2.ForkResponse = await rl.orchestrator.Fork(
        orchestrator_pb2.ForkRequest(session_id=source.session_id, count=BRANCHES, mechanism=mechanism),  # type: ignore[arg-type]
        timeout=RPC_TIMEOUT_S * 3,
    )
    elapsed = time.perf_counter() - t0
    if len(reply.branches) != BRANCHES or reply.mechanism != mechanism:
        raise RuntimeError(f"Fork answered {len(reply.branches)} branches by {reply.mechanism}")
    return elapsed, [b.session_id for b in reply.branches]


async def replay_by_client(rl: Rlgate) -> tuple[float, list[Session]]:
    t0 = time.perf_counter()

    async def one() -> Session:
        session = await rl.reset(ENV_KEY)
        await play(rl, session)
        return session

    sessions = await asyncio.gather(*(one() for _ in range(BRANCHES)))
    return time.perf_counter() - t0, list(sessions)


async def close_all(rl: Rlgate, session_ids: list[str]) -> None:
    await asyncio.gather(
        *(
            rl.orchestrator.Close(orchestrator_pb2.CloseRequest(session_id=sid), timeout=RPC_TIMEOUT_S)
            for sid in session_ids
        )
    )


async def run(ctx: BenchContext) -> list[Entry]:
    stack = await ctx.stack(NAME)
    forks: list[float] = []
    replays: list[float] = []
    server_replays: list[float] = []
    async with Rlgate(stack) as rl:
        source = await rl.reset(ENV_KEY)
        await play(rl, source)
        # One unmeasured round of each pays first-use costs (connections, tool lists).
        _, warm = await fork(rl, source, orchestrator_pb2.FORK_MECHANISM_SNAPSHOT)
        await close_all(rl, warm)
        for _ in range(ctx.rounds + 1):
            elapsed, made = await fork(rl, source, orchestrator_pb2.FORK_MECHANISM_SNAPSHOT)
            forks.append(elapsed)
            await close_all(rl, made)
            elapsed, sessions = await replay_by_client(rl)
            replays.append(elapsed)
            await close_all(rl, [s.session_id for s in sessions])
            elapsed, made = await fork(rl, source, orchestrator_pb2.FORK_MECHANISM_REPLAY)
            server_replays.append(elapsed)
            await close_all(rl, made)
        await rl.close_session(source)
    fork_ms = statistics.median(forks) * 1e3
    replay_ms = statistics.median(replays) * 1e3
    server_ms = statistics.median(server_replays) * 1e3
    print(
        f"{NAME}: {BRANCHES} branches at turn {TURNS}, p50 of {len(forks)} rounds: Fork (snapshot) {fork_ms:.0f} ms, "
        f"Fork (replay) {server_ms:.0f} ms, 8 client replays {replay_ms:.0f} ms (ratio {replay_ms / fork_ms:.1f})"
    )
    return [
        Entry(
            name=NAME,
            value=replay_ms,
            baseline=fork_ms,
            unit=f"ms until {BRANCHES} episodes are ready for turn {TURNS + 1} (client replay / Fork)",
            baseline_name=f"Fork(count={BRANCHES}) by snapshot at turn {TURNS}",
            goals=(Goal("ratio", ">=", 5.0),),
            extra={
                "fork_snapshot_ms": round(fork_ms, 1),
                "fork_replay_ms": round(server_ms, 1),
                "client_replay_ms": round(replay_ms, 1),
                "fork_snapshot_all_ms": [round(x * 1e3, 1) for x in forks],
                "fork_replay_all_ms": [round(x * 1e3, 1) for x in server_replays],
                "client_replay_all_ms": [round(x * 1e3, 1) for x in replays],
                "branches": BRANCHES,
                "turns": TURNS,
            },
        )
    ]
