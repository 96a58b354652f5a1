"""`Episode.fork` / `AsyncEpisode.fork` against the real local stack: branch episodes that carry the prefix's
messages, continue from the source's state, score on their own and close."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path

import rlgate
from rlgate.devtools.stack import LocalStack
from rlgate.v1 import common_pb2

TASK = "mailbox-clients-folder"
MOVED = [35, 46, 56, 89, 145, 165, 216, 238, 241, 302, 332, 333, 361, 411, 429]


def _open(address: str, run_id: str) -> list[str]:
    with rlgate.Client(address) as client:
        sessions = client.list_sessions(run_id=run_id)
    return [s.session_id for s in sessions if s.status != common_pb2.SESSION_STATUS_CLOSED]


def test_episode_fork_branches_carry_the_prefix(stack: LocalStack) -> None:
    run_id = f"fork-{uuid.uuid4().hex[:8]}"
    with rlgate.Client(stack.orchestrator_address) as client, client.episode(task_key=TASK, run_id=run_id) as ep:
        assert not ep.call_tool("create_folder", {"name": "Clients"}).result.is_error
        ep.step(assistant_text="made the folder")
        prefix = [*ep.initial_messages(), rlgate.Message("assistant", "made the folder")]
        branches = ep.fork(2, messages=prefix)
        try:
            assert [b.branch_index for b in branches] == [0, 1]
            assert {b.parent_session_id for b in branches} == {ep.session_id}
            assert len({b.session_id for b in {*branches, ep}}) == 3
            for b in branches:
                assert b.prefix_messages == prefix and b.prefix_messages is not prefix
                assert b.task_key == TASK and b.max_turns == ep.max_turns and b.tools
            branches[0].prefix_messages.append(rlgate.Message("user", "more"))  # each branch has its own list
            assert branches[1].prefix_messages == prefix
            # The branch sees the source's folder; its own move stays its own.
            good = branches[0]
            assert not good.call_tool("move_message", {"message_ids": MOVED, "folder": "Clients"}).result.is_error
            assert good.step(done=True).reward == 1.0
            assert branches[1].step(done=True).reward == 0.0
        finally:
            for b in branches:
                b.close()
    assert _open(stack.orchestrator_address, run_id) == []


async def test_async_episode_fork(stack: LocalStack) -> None:
    run_id = f"afork-{uuid.uuid4().hex[:8]}"
    async with (
        rlgate.AsyncClient(stack.orchestrator_address) as client,
        client.episode(task_key=TASK, run_id=run_id) as ep,
    ):
        await ep.step(assistant_text="thinking")
        branches = await ep.fork(3)
        try:
            assert [b.branch_index for b in branches] == [0, 1, 2]
            for b in branches:
                assert b.prefix_messages == ep.initial_messages()
                state = await b.state()
                assert state.session.turn == 1 and state.session.parent_session_id == ep.session_id
        finally:
            for b in branches:
                await b.close()
    assert _open(stack.orchestrator_address, run_id) == []


def test_rollout_fork_at_k_plays_every_branch_to_its_end(stack: LocalStack, tmp_path: Path) -> None:
    """`rlgate rollout --fork-at 1 --branches 3`: each episode forked after its first turn, every branch a
    trajectory of its own (the prefix's messages in each), scored by the reference policy's remaining turns."""
    summary_path, out_path = tmp_path / "summary.json", tmp_path / "traj.jsonl"
    cmd = [sys.executable, "-m", "rlgate.cli", "rollout", "--orchestrator", stack.orchestrator_address,
           "--no-progress", "--summary-json", str(summary_path), "--out", str(out_path), "--tasks", TASK,
           "--episodes", "2", "--fork-at", "1", "--branches", "3"]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=280)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    summary = json.loads(summary_path.read_text())
    lines = [json.loads(line) for line in out_path.read_text().splitlines()]
    assert summary["episodes"] == len(lines) == 6 and summary["reward_mean"] == 1.0
    assert summary["sessions_left_open"] == 0
    parents = {line["parent_session_id"] for line in lines}
    assert len(parents) == 2 and "" not in parents
    for parent in parents:
        group = [line for line in lines if line["parent_session_id"] == parent]
        assert sorted(line["branch_index"] for line in group) == [0, 1, 2]
        assert len({line["session_id"] for line in group}) == 3
        first_turn = next(m for m in group[0]["messages"] if m["role"] == "assistant")
        assert all(next(m for m in line["messages"] if m["role"] == "assistant") == first_turn for line in group)
