"""Driving a CallToolStream / StepStream with the raw generated stub: write requests, read answers by call_id.
Every wait is bounded by `wait_s` so a server bug fails a test instead of hanging it."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc


async def send(stream: Any, *requests: Any, wait_s: float) -> None:
    for req in requests:
        await asyncio.wait_for(stream.write(req), wait_s)


async def receive(stream: Any, count: int, wait_s: float) -> dict[int, Any]:
    """The next `count` answers, by call_id (they come in any order)."""
    answers: dict[int, Any] = {}
    for _ in range(count):
        answer = await asyncio.wait_for(stream.read(), wait_s)
        assert answer is not grpc.aio.EOF, f"stream ended after {len(answers)} of {count} answers"
        assert answer.call_id not in answers, f"call_id {answer.call_id} answered twice"
        answers[answer.call_id] = answer
    return answers


async def ask(stream: Any, req: Any, wait_s: float) -> Any:
    """One call on the stream: write it, read its answer."""
    await send(stream, req, wait_s=wait_s)
    answer = (await receive(stream, 1, wait_s)).get(req.call_id)
    assert answer is not None, "answered under another call_id"
    return answer


def reply_of(answer: Any) -> Any:
    assert answer.WhichOneof("outcome") == "reply", f"error instead of a reply: {answer.error}"
    return answer.reply
