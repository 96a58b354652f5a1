"""`IntentRecords` (provisioning intents), against every backend (see conftest.py)."""

from __future__ import annotations

from rlgate.store import Intent, IntentState, SessionStore


async def test_intents(store: SessionStore) -> None:
    t = 1_700_000_000.0
    await store.put_intent(Intent("i2", "run-1", "mail:v1", created_at=t + 1))
    await store.put_intent(Intent("i1", "run-1", "mail:v1", created_at=t))
    await store.put_intent(Intent("i3", "run-2", "gh:v2", created_at=t + 2))
    assert [i.intent_id for i in await store.list_intents()] == ["i1", "i2", "i3"]
    assert [i.intent_id for i in await store.list_intents("run-1")] == ["i1", "i2"]
    assert await store.list_intents("run-none") == []

    await store.put_intent(
        Intent(
            "i1",
            "run-1",
            "mail:v1",
            state=IntentState.BOUND,
            instance_id="inst-9",
            session_id="s1",
            created_at=t,
            updated_at=t + 5,
        )
    )
    got = await store.get_intent("i1")
    assert got is not None and got.state == IntentState.BOUND and got.instance_id == "inst-9"
    assert got.updated_at == t + 5
    await store.delete_intent("i1")
    await store.delete_intent("i1")
    assert await store.get_intent("i1") is None
    assert [i.intent_id for i in await store.list_intents("run-1")] == ["i2"]
