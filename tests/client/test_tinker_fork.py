"""`RlgateForkGroupBuilder` against the real local stack: a group whose episodes share a played prefix (the
source forked at turn k), each continuing alone and scored alone; cleanup closes the source and every branch."""

from __future__ import annotations

import json
import pickle
import uuid

from tinker_cookbook.renderers.base import Message

import rlgate
from rlgate.adapters.tinker import RlgateForkGroupBuilder, RlgateMessageEnv
from rlgate.devtools.stack import LocalStack
from rlgate.v1 import common_pb2
from tests.client.tinker_support import renderer

TASK = "mailbox-clients-folder"
MOVED = [35, 46, 56, 89, 145, 165, 216, 238, 241, 302, 332, 333, 361, 411, 429]


def call(name: str, arguments: dict[str, object]) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def _open(address: str, run_id: str) -> list[str]:
    with rlgate.Client(address) as client:
        sessions = client.list_sessions(run_id=run_id)
    return [s.session_id for s in sessions if s.status != common_pb2.SESSION_STATUS_CLOSED]


async def test_a_group_shares_a_forked_prefix(stack: LocalStack) -> None:
    run_id = f"tfork-{uuid.uuid4().hex[:8]}"
    r = renderer()
    builder = RlgateForkGroupBuilder(
        task_key=TASK,
        renderer=r,
        group_size=3,
        orchestrator=stack.orchestrator_address,
        run_id=run_id,
        prefix=(call("create_folder", {"name": "Clients"}),),
    )
    assert pickle.loads(pickle.dumps(builder)).prefix == builder.prefix
    envs = [RlgateMessageEnv(builder, r) for _ in range(3)]
    try:
        chats = [await env.initial_observation() for env in envs]
        assert chats[0] == chats[1] == chats[2] and chats[0][-1]["role"] in ("tool", "user")
        assert any("Clients" in str(m.get("content")) for m in chats[0])  # the prefix's turn and its result
        episodes = [env.episode for env in envs]
        assert all(e is not None for e in episodes)
        sessions = {e.session_id for e in episodes if e is not None}
        assert len(sessions) == 3
        parents = {e.parent_session_id for e in episodes if e is not None}
        assert len(parents) == 1 and not parents & sessions
        for e in episodes:
            assert e is not None and (await e.state()).session.turn == 1

        moved = await envs[0].step(
            Message(role="assistant", content=call("move_message", {"message_ids": MOVED, "folder": "Clients"}))
        )
        assert not moved.episode_done
        good = await envs[0].step(Message(role="assistant", content="<done/>"))
        bad = await envs[1].step(Message(role="assistant", content="<done/>"))
        assert (good.episode_done, good.reward) == (True, 1.0)
        assert (bad.episode_done, bad.reward) == (True, 0.0)
    finally:
        await builder.cleanup()
    assert _open(stack.orchestrator_address, run_id) == []
