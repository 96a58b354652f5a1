"""step_vs_grpc_echo: orchestrator Step vs a bare grpc.aio unary echo server (the limit), same run.

Both are driven from this process over one grpc.aio channel each, sequentially and 16-way (one session
per worker, so Steps of a session never overlap). The echo server answers with the request's bytes: no
interceptors, no store, no (de)serialization. The Step carries one tool-call summary, like a real turn,
and its session's turn limit is never reached. Headline: Steps/s / echo calls/s, sequential. Goal >= 0.5.
"""

from __future__ import annotations

import sys
import uuid

import grpc

from bench.echo_server import METHOD
from bench.fixtures import BENCH_TOOLS, ERA_ENV, RPC_TIMEOUT_S, BenchContext, Rlgate, child_process
from bench.harness import Entry, Goal, alternate, closed_loop, stats_table, throughput_ratios
from rlgate.core.convert import json_text
from rlgate.v1 import orchestrator_pb2

NAME = "step_vs_grpc_echo"
CONCURRENT = 16


async def run(ctx: BenchContext) -> list[Entry]:
    total, rounds, budget = 100_000, ctx.rounds, ctx.duration_s
    env_key = ERA_ENV["modern"]
    call = BENCH_TOOLS[env_key]
    stack = await ctx.stack()
    echo_payload = orchestrator_pb2.StepRequest(
        request_id=uuid.uuid4().hex,
        session_id=uuid.uuid4().hex,
        assistant_text="thinking... calling a tool",
        tool_calls=[
            orchestrator_pb2.ToolCallSummary(
                name=call.name, arguments_json=json_text(call.arguments), request_id=uuid.uuid4().hex
            )
        ],
    ).SerializeToString()

    async with (
        child_process([sys.executable, "-m", "bench.echo_server"], ctx.out_dir / "logs" / "echo.log") as (_proc, port),
        Rlgate(stack) as rl,
        grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel,
    ):
        echo: grpc.aio.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary(METHOD)  # bytes both ways
        sessions = [await rl.reset(env_key) for _ in range(CONCURRENT)]

        async def echo_op(_slot: int) -> None:
            reply = await echo(echo_payload, timeout=RPC_TIMEOUT_S)
            if reply != echo_payload:
                raise RuntimeError("echo server returned different bytes")

        async def step_op(slot: int) -> None:
            await rl.step(sessions[slot], call)

        stats = await alternate(
            rounds,
            {
                "echo seq": lambda: closed_loop(echo_op, total, 1, warmup=50, duration_s=budget),
                "step seq": lambda: closed_loop(step_op, total, 1, warmup=50, duration_s=budget),
                "echo c16": lambda: closed_loop(echo_op, total, CONCURRENT, warmup=50, duration_s=budget),
                "step c16": lambda: closed_loop(step_op, total, CONCURRENT, warmup=50, duration_s=budget),
            },
        )
        for session in sessions:
            await rl.close_session(session)

    print(stats_table(stats, "calls/s"))
    seq_step, seq_echo, c_step, c_echo = stats["step seq"], stats["echo seq"], stats["step c16"], stats["echo c16"]
    return [
        Entry(
            name=NAME,
            value=seq_step.per_s,
            baseline=seq_echo.per_s,
            unit="calls/s",
            baseline_name="bare grpc.aio unary echo server (same run)",
            goals=(Goal("ratio", ">=", 0.5),),
            extra={
                **seq_step.figures("step_seq_"),
                **seq_echo.figures("echo_seq_"),
                **c_step.figures("step_c16_"),
                **c_echo.figures("echo_c16_"),
                **throughput_ratios(seq_step, seq_echo, c_step, c_echo),
            },
        )
    ]
