"""The `fleet` provider's create plumbing that needs no server: a create's idempotency key set as X-Request-ID
on its POST only, Retry-After read (seconds or an HTTP date, bounded), and a 409 on a failed instance made a
stale key."""

from __future__ import annotations

import email.utils
import time

import httpx
from fleet._async.exceptions import FleetAPIError, FleetConflictError, FleetRateLimitError

from rlgate.orchestrator.providers.base import RateLimited, StaleRequest
from rlgate.orchestrator.providers.fleet import (
    MAX_RETRY_AFTER_S,
    _create_call,
    _create_error,
    _key_create,
    _note_retry_after,
    retry_after,
)


def test_retry_after_reads_seconds_and_dates_bounded() -> None:
    assert retry_after("3") == 3.0
    assert retry_after("0.5") == 0.5
    assert retry_after("-4") == 0.0
    assert retry_after("100000") == MAX_RETRY_AFTER_S
    in_ten = email.utils.formatdate(time.time() + 10, usegmt=True)
    seconds = retry_after(in_ten)
    assert seconds is not None and 8.0 <= seconds <= 10.0
    assert retry_after("soon") is None and retry_after("") is None and retry_after(None) is None


async def test_the_create_key_rides_on_the_create_post_only() -> None:
    create = httpx.Request("POST", "http://127.0.0.1:1/v1/env/instances", headers={"X-Request-ID": "sdk-made"})
    other = httpx.Request("POST", "http://127.0.0.1:1/v1/env/instances/i-1/heartbeat")
    with _create_call("intent-1"):
        await _key_create(create)
        await _key_create(other)
    assert create.headers["X-Request-ID"] == "intent-1"
    assert "X-Request-ID" not in other.headers
    outside = httpx.Request("POST", "http://127.0.0.1:1/v1/env/instances", headers={"X-Request-ID": "sdk-made"})
    await _key_create(outside)  # no create running in this context: the SDK's own id stays
    assert outside.headers["X-Request-ID"] == "sdk-made"


async def test_a_429s_retry_after_rides_on_rate_limited() -> None:
    with _create_call("intent-1") as call:
        await _note_retry_after(httpx.Response(429, headers={"Retry-After": "2"}))
        err = _create_error(FleetRateLimitError("slow down"), "create x", call)
    assert isinstance(err, RateLimited) and err.retry_after_s == 2.0


def test_a_409_on_a_failed_instance_makes_the_key_stale() -> None:
    with _create_call("intent-1") as call:
        conflict = FleetConflictError("points at instance 'i-1' in state 'error'", instance_id="i-1")
        assert isinstance(_create_error(conflict, "create x", call), StaleRequest)
        gone = FleetAPIError("Instance 'i-1' not found", status_code=404)  # vanished while being adopted
        assert isinstance(_create_error(gone, "create x", call), StaleRequest)
