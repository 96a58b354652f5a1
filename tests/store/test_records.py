"""The records' JSON form (what both backends store) and their copies."""

from __future__ import annotations

import dataclasses
import json

import pytest

from rlgate.store import (
    DoneReason,
    Intent,
    RequestRecord,
    Session,
    SessionStatus,
    StoreError,
    ToolCallEntry,
    Verification,
    VerificationStatus,
)
from rlgate.store._common import decode

RECORDS: list[Session | ToolCallEntry | RequestRecord | Intent] = [
    Session(
        session_id="s1",
        env_key="mail:v1",
        status=SessionStatus.ACTIVE,
        labels={"a": "b"},
        reward=0.5,
        instance={"root_url": "http://127.0.0.1:1/", "nested": {"k": [1, 2.5, None, True]}},
        endpoints=["http://127.0.0.1:1/mcp"],
        tool_filter={"allow": ["x"]},
        verification=Verification(VerificationStatus.OK, stdout="fine", attempts=1, elapsed_ms=2.5),
        done_reason=DoneReason.FINAL_ANSWER,
    ),
    ToolCallEntry("s1", 2, "r1", "search", arguments={"q": ["a", {"b": 1}]}, is_error=True, error_kind="X"),
    RequestRecord("call:s1", "r1", owner="me", result="payload"),
    Intent("i1", "run", "mail:v1", instance_id="inst"),
]


@pytest.mark.parametrize("record", RECORDS, ids=lambda r: type(r).__name__)
def test_json_is_the_dataclass_fields(record: Session | ToolCallEntry | RequestRecord | Intent) -> None:
    raw = record.to_json()
    assert json.loads(raw) == dataclasses.asdict(record)  # the same document the asdict encoding wrote
    assert list(json.loads(raw)) == [f.name for f in dataclasses.fields(record)]
    assert " " not in raw.replace('"search"', "")  # compact separators
    back = type(record).from_json(raw)
    assert back == record and back is not record
    assert type(record).from_json(raw.encode()) == record  # backends may hand bytes back


def test_enums_are_stored_as_their_values() -> None:
    raw = Session(session_id="s", env_key="e", status=SessionStatus.DONE, done_reason=DoneReason.MAX_TURNS).to_json()
    assert (json.loads(raw)["status"], json.loads(raw)["done_reason"]) == ("done", "max_turns")
    back = Session.from_json(raw)
    assert back.status is SessionStatus.DONE and back.done_reason is DoneReason.MAX_TURNS
    assert json.loads(Session(session_id="s", env_key="e").to_json())["verification"] == {}  # not scored yet


# A session as the stringly typed models wrote it (status, done_reason and verification as plain JSON values,
# no verification written as {}): stored records, and records other replicas still write during an upgrade.
OLD_FORM = {
    "session_id": "s-old",
    "env_key": "mail:v1",
    "task_key": "mail/t1",
    "status": "done",
    "run_id": "",
    "orchestrator_run": "rlgate-x",
    "modality": "tool_use",
    "episode": 2,
    "turn": 3,
    "max_turns": 3,
    "done_reason": "max_turns",
    "reward": None,
    "verification": {"status": "timeout", "message": "slow", "stdout": "", "attempts": 1, "elapsed_ms": 30000.0},
    "labels": {},
    "provider": "fleet",
    "instance_id": "i",
    "intent_id": "",
    "instance": {},
    "endpoints": [],
    "tool_filter": {},
    "token_hash": "",
    "revoked_tokens": {},
    "call_budget": 0,
    "created_at": 1.0,
    "updated_at": 2.0,
    "last_active_at": 2.0,
    "expires_at": 0.0,
    "closed_at": 0.0,
    "version": 4,
}


def test_a_record_in_the_old_form_loads() -> None:
    session = Session.from_json(json.dumps(OLD_FORM))
    assert session.status is SessionStatus.DONE and session.done_reason is DoneReason.MAX_TURNS
    assert session.verification == Verification(VerificationStatus.TIMEOUT, "slow", "", 1, 30000.0)
    # Written back with the later fields at their defaults (old readers drop keys they do not know).
    assert json.loads(session.to_json()) == {
        **OLD_FORM,
        "parent_session_id": "",
        "branch_index": 0,
        "infra_faults": {},
    }

    running = Session.from_json(json.dumps({**OLD_FORM, "status": "active", "done_reason": "", "verification": {}}))
    assert running.done_reason is DoneReason.NONE and running.verification is None
    assert json.loads(running.to_json())["verification"] == {}

    older = {k: v for k, v in OLD_FORM.items() if k not in ("done_reason", "verification")}  # before those fields
    assert Session.from_json(json.dumps(older)).verification is None


@pytest.mark.parametrize(
    "change",
    [{"status": "paused"}, {"done_reason": "bored"}, {"verification": {"status": "maybe"}}, {"verification": [1]}],
)
def test_a_value_this_version_cannot_read_is_a_corrupt_record(change: dict[str, object]) -> None:
    with pytest.raises(StoreError, match="corrupt Session record"):
        decode(Session, json.dumps({**OLD_FORM, **change}))


def test_decoded_containers_are_fresh() -> None:
    session = RECORDS[0]
    assert isinstance(session, Session)
    a, b = Session.from_json(session.to_json()), Session.from_json(session.to_json())
    a.labels["new"] = "x"
    a.instance["nested"]["k"].append(3)
    assert "new" not in b.labels and b.instance["nested"]["k"] == [1, 2.5, None, True]
    assert "new" not in session.labels


def test_other_versions_records_decode() -> None:
    """Unknown keys (a newer writer) are dropped; missing ones (an older writer) take their defaults."""
    data = dataclasses.asdict(RECORDS[0])
    data["added_later"] = {"x": 1}
    del data["labels"], data["reward"]
    session = Session.from_json(json.dumps(data))
    assert session.labels == {} and session.reward is None and session.session_id == "s1"
    assert not hasattr(session, "added_later")


@pytest.mark.parametrize("raw", ["{not json", "[1, 2]", '"text"', '{"env_key": "e"}', "null"])
def test_corrupt_records_are_store_errors(raw: str) -> None:
    with pytest.raises(StoreError, match="corrupt Session record"):
        decode(Session, raw)


def test_copy_is_shallow_with_changes() -> None:
    session = RECORDS[0]
    assert isinstance(session, Session)
    clone = session.copy(version=7, turn=3)
    assert (clone.version, clone.turn) == (7, 3) and (session.version, session.turn) == (0, 0)
    assert clone == dataclasses.replace(session, version=7, turn=3)
    assert clone.labels is session.labels  # shared, as with dataclasses.replace
    with pytest.raises(TypeError):
        session.copy(no_such_field=1)
