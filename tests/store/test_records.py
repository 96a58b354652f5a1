"""The records' JSON form (what both backends store) and their copies."""

from __future__ import annotations

import dataclasses
import json

import pytest

from rlgate.store import Intent, RequestRecord, Session, SessionStatus, StoreError, ToolCallEntry
from rlgate.store._common import decode

RECORDS = [
    Session(session_id="s1", env_key="mail:v1", status=SessionStatus.ACTIVE, labels={"a": "b"}, reward=0.5,
            instance={"root_url": "http://127.0.0.1:1/", "nested": {"k": [1, 2.5, None, True]}},
            endpoints=["http://127.0.0.1:1/mcp"], tool_filter={"allow": ["x"]}, verification={"status": "ok"}),
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
    raw = Session(session_id="s", env_key="e", status=SessionStatus.DONE).to_json()
    assert json.loads(raw)["status"] == "done"
    assert Session.from_json(raw).status == SessionStatus.DONE


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
