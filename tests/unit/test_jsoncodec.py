"""The store's JSON codec keeps every JSON value exactly, integers past 64 bits included."""

from __future__ import annotations

import pytest

from rlgate.runtime import jsoncodec


@pytest.mark.parametrize("value", [2**60, 2**64 - 1, 2**64, -(2**63) - 1, 10**30, 2.5, 3, "12345678901234567890"])
def test_round_trip_is_exact(value: object) -> None:
    record = {"arguments": {"n": value, "list": [value]}}
    for text in (jsoncodec.dumps(record), jsoncodec.dumps_bytes(record)):
        back = jsoncodec.loads(text)
        assert back == record
        assert type(back["arguments"]["n"]) is type(value)
