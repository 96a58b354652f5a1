"""Admission control for instance creation, as one record per provider account that every replica shares.

The record is JSON (`AdmissionState`); the memory and SQLite backends apply `admit`, `release` and `throttle`
below to it inside one atomic store call, and the Redis backend runs the same steps in Lua
(lua/admit_create.lua, release_create.lua, throttle_creates.lua), so every backend keeps it alike. What it
holds:

- slots: the creates in flight (slot id -> run, expiry). A slot lapses at its expiry, so one held by a
  process that died is given back without it.
- a token bucket refilled at `rate` creates/s, at most `burst` tokens.
- AIMD: a provider's rate-limit or burst-cap answer (`throttle`) cuts `rate` by a factor (once per
  `cut_window_s`, however many creates saw it) and pauses every admission until its Retry-After; the rate
  then climbs back by `recover_per_s` each second up to `max_rate`.
- fairness between runs: a refused urgent request leaves its run waiting since then; a run is admitted only
  when no other run has waited longer. Admitted, it goes to the back, so runs with waiters take turns.
- priority: while an urgent request (a Reset) waits, background ones (warm-pool refills) are refused.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from rlgate.store.models import StoreError


@dataclass(frozen=True)
class CreateLimits:
    """What the account allows; passed by the caller (the orchestrator's config) with every call."""

    max_in_flight: int  # creates in flight at once
    max_rate: float  # creates per second, at most
    min_rate: float  # the floor a throttle never cuts below
    burst: float  # tokens the bucket holds at most
    recover_per_s: float  # additive increase of the rate, per second
    slot_ttl_s: float  # a slot lapses this long after it was taken (its holder died)
    wait_ttl_s: float  # a waiting run is forgotten this long after its last refusal
    cut_factor: float = 0.5  # multiplicative decrease on a throttle
    cut_window_s: float = 1.0  # throttles closer together than this cut once


@dataclass(frozen=True)
class CreateGrant:
    """The answer to `admit`: admitted, or how long to wait before asking again; and the account's state."""

    admitted: bool
    wait_s: float
    in_flight: int
    rate: float
    reason: str = ""  # why not: "paused", "in_flight", "priority", "turn", "rate"


URGENT = "urgent"
BACKGROUND = "background"
# A refusal for a reason without a known end (a slot must free, another run must take its turn) is asked
# again after this long at most.
POLL_S = 0.05


@dataclass
class AdmissionState:
    """One account's record (see the module docstring)."""

    tokens: float = -1.0  # < 0: a new record, filled to `burst` on first use
    at: float = 0.0  # when tokens and rate were last brought up to date
    rate: float = 0.0
    paused_until: float = 0.0
    urgent_until: float = 0.0  # an urgent request was refused until then: background ones wait
    cut_at: float = 0.0
    slots: dict[str, list[float | str]] = field(default_factory=dict)  # slot id -> [run, expires_at]
    waiting: dict[str, list[float]] = field(default_factory=dict)  # run -> [since, expires_at]

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, raw: str | bytes | None) -> AdmissionState:
        if not raw:
            return cls()
        try:
            return cls(**json.loads(raw))
        except (ValueError, TypeError) as exc:
            raise StoreError(f"corrupt admission record in the store: {exc}") from exc


def _refresh(state: AdmissionState, limits: CreateLimits, now: float) -> None:
    """Expire lapsed slots and waiters; refill tokens and climb the rate back for the time since `at`."""
    state.slots = {k: v for k, v in state.slots.items() if float(v[1]) > now}
    state.waiting = {k: v for k, v in state.waiting.items() if v[1] > now}
    if state.tokens < 0:
        state.tokens, state.rate, state.at = limits.burst, limits.max_rate, now
        return
    # Nothing refills or recovers while paused: the provider said to wait.
    elapsed = max(0.0, now - max(state.at, state.paused_until))
    state.rate = max(limits.min_rate, min(limits.max_rate, state.rate + limits.recover_per_s * elapsed))
    state.tokens = min(limits.burst, state.tokens + state.rate * elapsed)
    state.at = max(state.at, now)


def admit(
    state: AdmissionState, slot_id: str, run: str, priority: str, limits: CreateLimits, now: float
) -> CreateGrant:
    """Take a slot and a token for `run` if the account allows it now (edits `state`)."""
    _refresh(state, limits, now)
    if slot_id in state.slots:  # this very admission, asked again (a reply lost): granted already
        return CreateGrant(True, 0.0, len(state.slots), state.rate)
    wait, reason = 0.0, ""
    mine = state.waiting.get(run)
    since = mine[0] if mine else now
    if state.paused_until > now:
        wait, reason = state.paused_until - now, "paused"
    elif len(state.slots) >= limits.max_in_flight:
        wait, reason = POLL_S, "in_flight"
    elif priority != URGENT and state.urgent_until > now:
        wait, reason = min(POLL_S, state.urgent_until - now), "priority"
    elif priority == URGENT and any(v[0] < since for r, v in state.waiting.items() if r != run):
        wait, reason = min(POLL_S, 1.0 / state.rate), "turn"
    elif state.tokens < 1.0:
        wait, reason = (1.0 - state.tokens) / state.rate, "rate"
    if reason:
        if priority == URGENT:
            state.waiting[run] = [since, now + limits.wait_ttl_s]
            state.urgent_until = max(state.urgent_until, now + limits.wait_ttl_s)
        return CreateGrant(False, wait, len(state.slots), state.rate, reason)
    state.tokens -= 1.0
    state.slots[slot_id] = [run, now + limits.slot_ttl_s]
    state.waiting.pop(run, None)
    return CreateGrant(True, 0.0, len(state.slots), state.rate)


def release(state: AdmissionState, slot_id: str) -> None:
    """Give a slot back (a no-op for one that lapsed)."""
    state.slots.pop(slot_id, None)


def throttle(state: AdmissionState, retry_after_s: float, limits: CreateLimits, now: float) -> float:
    """The provider refused a create for its rate or burst cap: pause until its Retry-After and cut the rate
    (once per cut window). Returns the new rate."""
    _refresh(state, limits, now)
    if now - state.cut_at >= limits.cut_window_s:
        state.rate = max(limits.min_rate, state.rate * limits.cut_factor)
        state.cut_at = now
    state.paused_until = max(state.paused_until, now + max(0.0, retry_after_s))
    state.tokens = min(state.tokens, 0.0)
    return state.rate


__all__ = [
    "BACKGROUND",
    "POLL_S",
    "URGENT",
    "AdmissionState",
    "CreateGrant",
    "CreateLimits",
    "admit",
    "release",
    "throttle",
]
