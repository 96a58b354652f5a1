"""`sessions_open`: which of many sessions are open with a current agent token, in one call (the gateway's
janitor). Runs against every backend (see conftest.py)."""

from __future__ import annotations

from dataclasses import replace

from rlgate.store import Session, SessionStatus, SessionStore


async def test_sessions_open_names_the_open_sessions_holding_a_token(store: SessionStore) -> None:
    statuses = {
        "provisioning": SessionStatus.PROVISIONING,
        "active": SessionStatus.ACTIVE,
        "done": SessionStatus.DONE,
        "closed": SessionStatus.CLOSED,
        "expired": SessionStatus.EXPIRED,
        "failed": SessionStatus.FAILED,
    }
    for name, status in statuses.items():
        is_open = status in (SessionStatus.PROVISIONING, SessionStatus.ACTIVE, SessionStatus.DONE)
        token = f"h-{name}" if is_open else ""
        await store.create_session(Session(session_id=name, env_key="e:v1", status=status, token_hash=token))
    await store.create_session(Session(session_id="no-token", env_key="e:v1", status=SessionStatus.ACTIVE))
    asked = [*statuses, "no-token", "unknown", "active"]  # an unknown id and a repeated one
    assert await store.sessions_open(asked) == {"provisioning", "active", "done"}
    assert await store.sessions_open([]) == set()
    active = await store.get_session("active")
    assert active is not None
    await store.update_session(replace(active, status=SessionStatus.CLOSED, token_hash=""))
    assert await store.sessions_open(asked) == {"provisioning", "done"}


async def test_sessions_open_takes_more_ids_than_one_query_holds(store: SessionStore) -> None:
    for i in range(0, 1200, 2):
        await store.create_session(
            Session(session_id=f"s{i}", env_key="e:v1", status=SessionStatus.ACTIVE, token_hash=f"h{i}")
        )
    assert await store.sessions_open([f"s{i}" for i in range(1200)]) == {f"s{i}" for i in range(0, 1200, 2)}
