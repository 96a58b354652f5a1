"""screenshot_vs_direct: a `computer` screenshot through the gateway vs the same call straight to localfleet.

One computer-use session (a `computer_use` task, so an `image_type="mcp"` instance with a screen) is opened
through the orchestrator; the direct baseline connects one long-lived `mcp.Client` to the very aggregator
endpoint (`{root}api/v1/mcp`) the gateway uses for that session. Both ask the same instance's page (same
viewport) for `computer {"action": "screenshot"}`, sequentially, alternating in rounds; the first calls (the
browser's start and the page's load) are warm-up. Every reply must carry the image, whole: an error result or
an OUTPUT_TRUNCATED one fails the benchmark. Headline: p50 gateway / p50 direct (goal <= 1.3).
"""

from __future__ import annotations

import base64

from mcp.types import CallToolResult, ImageContent

from bench.fixtures import BenchContext, BenchError, Rlgate, persistent_mcp
from bench.harness import Entry, Goal, Stats, alternate, closed_loop, stats_table
from rlgate import AsyncClient

NAME = "screenshot_vs_direct"
TASK = "mailbox-cu-flag-offsite"  # its first screen is the mailbox Inbox, the busiest page of the bundled apps
SCREENSHOT = {"action": "screenshot"}
BASELINE = "persistent mcp 2.x client calling localfleet's aggregator `computer` tool directly"
GOALS = (Goal("ratio", "<=", 1.3),)


def image_bytes(result: CallToolResult) -> int:
    """The screenshot's size in bytes, or BenchError when the direct reply carries none."""
    if result.is_error:
        raise BenchError(f"direct computer screenshot returned an error: {result.content!r}")
    for block in result.content:
        if isinstance(block, ImageContent):
            return len(base64.b64decode(block.data))
    raise BenchError("direct computer screenshot carried no image")


async def run(ctx: BenchContext) -> list[Entry]:
    stack = await ctx.stack()
    rounds = ctx.size(3, 6)
    budget = ctx.size(4, 10)
    sizes: dict[str, int] = {}
    async with (
        Rlgate(stack) as rl,
        AsyncClient(stack.orchestrator_address, gateway_addresses=stack.gateway_address) as trainer,
    ):
        session = await rl.reset(task_key=TASK)
        try:
            url = await rl.mcp_url(session, aggregator=True)
            async with persistent_mcp(url) as client:

                async def gateway_op(_slot: int) -> None:
                    reply = await trainer.call_tool(session.token, "computer", SCREENSHOT)
                    result = reply.result
                    if result.is_error or result.error_message:
                        raise BenchError(f"gateway computer screenshot: {result.error_message!r}")
                    images = [b.image.data for b in result.content if b.HasField("image")]
                    if not images:
                        raise BenchError("gateway computer screenshot carried no image")
                    sizes["gateway"] = len(images[0])

                async def direct_op(_slot: int) -> None:
                    sizes["direct"] = image_bytes(await client.call_tool("computer", SCREENSHOT))

                stats: dict[str, Stats] = await alternate(
                    rounds,
                    {
                        "gateway": lambda: closed_loop(gateway_op, 100_000, 1, warmup=3, duration_s=budget),
                        "direct": lambda: closed_loop(direct_op, 100_000, 1, warmup=3, duration_s=budget),
                    },
                )
        finally:
            await rl.close_session(session)
    print(stats_table(stats, "shots/s"))
    gw, direct = stats["gateway"], stats["direct"]
    return [
        Entry(
            name=NAME,
            value=gw.p50_ms,
            baseline=direct.p50_ms,
            unit="ms (p50, screenshot, sequential)",
            baseline_name=BASELINE,
            goals=GOALS,
            extra=gw.figures("gateway_")
            | direct.figures("direct_")
            | {
                "p99_ratio": round(gw.p99_ms / direct.p99_ms, 3),
                "task": TASK,
                "image_bytes": sizes.get("gateway"),
                "rounds": rounds,
            },
        )
    ]
