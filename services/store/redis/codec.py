"""How records map onto Redis: key names, hash fields, scores, and records read back from scripts' replies."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from rlgate.store import _common
from rlgate.store.models import RequestRecord, Session

SESSION_FIELDS = ("data", "version", "last_active")


def score(value: float) -> str:
    """A float as Redis reads it back exactly (repr is the shortest round-trip form)."""
    return repr(float(value))


def ttl_ms(ttl_s: float) -> str:
    return str(max(1, round(ttl_s * 1000)))


def labels_field(labels: Mapping[str, str]) -> str:
    """Labels as a flat JSON list [k1, v1, k2, v2, ...] (cjson cannot tell {} from [])."""
    return json.dumps([item for pair in sorted(labels.items()) for item in pair])


def label_index(key: str, value: str) -> str:
    # The scripts' label_key: Lua's string.len counts the key's UTF-8 bytes, not its characters.
    return f"idx:label:{len(key.encode())}:{key}:{value}"


def request_key(scope: str, request_id: str) -> str:
    # The scope's length keeps ("a:b", "c") and ("a", "b:c") apart.
    return f"{len(scope)}:{scope}:{request_id}"


def session_from_fields(fields: list[str | None]) -> Session | None:
    data, version, last_active = fields
    if data is None:
        return None
    session = _common.decode(Session, data)
    session.version = int(version or session.version)
    if last_active:  # None (hmget) or "" (a script's stand-in for a missing field)
        session.last_active_at = float(last_active)
    return session


def request_from_reply(scope: str, request_id: str, fields: list[Any]) -> RequestRecord:
    """A record from a script's {state, owner, result, created_at, finished_at} reply."""
    return _common.request_record(scope, request_id, *fields)


def session_args(session: Session) -> list[str]:
    """token, run, labels, created, retain, last_active: the hash fields the scripts index."""
    retain = _common.retention_time(session)
    return [
        session.token_hash,
        session.run_id,
        labels_field(session.labels),
        score(session.created_at),
        "" if retain is None else score(retain),
        score(session.last_active_at),
    ]
