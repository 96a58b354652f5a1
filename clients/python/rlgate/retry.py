"""Retry policy shared by the sync and async clients: which status codes each RPC may retry, exponential
backoff with jitter, and a deadline that bounds the whole call (every attempt and every sleep).

The clients drive a `RetryState` in a small loop (sync: time.sleep, async: asyncio.sleep); everything that
decides lives here so both clients behave identically.

Why each RPC retries what it does:
- Reset/Step carry a request_id, so the orchestrator answers a retry with the recorded result: UNAVAILABLE,
  CANCELLED (the server cancelled the call: a caller's own cancellation never arrives as a status) and a
  per-attempt DEADLINE_EXCEEDED (when the caller's deadline still has time) are safe to retry.
- State/ListTasks/ListSessions/ListTools are reads; Close/CloseSessions are idempotent.
- CallTool is retried on UNAVAILABLE only, always with the same request_id: the gateway records the id
  before running the tool, so a retry gets the recorded result, or OUTCOME_UNKNOWN when the first attempt's
  owner died mid-call; the tool never runs twice. A DEADLINE_EXCEEDED CallTool is not retried (the tool may
  still be running and the caller's time is spent).

Every RPC also retries RESOURCE_EXHAUSTED with reason REPLY_BUDGET: the server refused it before any work
because this connection left too many replies unread (a burst of large replies still leaving), so a retry
once they are read is safe, CallTool's included.

A RetryInfo in the status details (the orchestrator and the toolgateway both attach one to UNAVAILABLE and
to REPLY_BUDGET) sets the minimum delay before the retry."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from rlgate.core.backoff import Backoff
from rlgate.core.errors import (
    MAX_MESSAGE,
    DeadlineExceeded,
    RlgateError,
    clip,
    error_from_rpc,
    error_reason,
    retry_delay,
    status_code,
)

_UNAVAILABLE = frozenset({grpc.StatusCode.UNAVAILABLE})
_UNAVAILABLE_OR_DEADLINE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})
# A server that stops while a call is still running cancels it (CANCELLED reaches the caller as a status; a
# caller's own cancellation never does): safe to repeat for reads and for Close, which is idempotent.
_IDEMPOTENT = _UNAVAILABLE_OR_DEADLINE | {grpc.StatusCode.CANCELLED}

# Per RPC: the codes a retry is safe for (see the module docstring).
RETRYABLE: dict[str, frozenset[grpc.StatusCode]] = {
    "Reset": _IDEMPOTENT,  # not idempotent by nature: made so by the request_id every attempt reuses
    "Step": _IDEMPOTENT,
    "State": _IDEMPOTENT,
    "Close": _IDEMPOTENT,
    "CloseSessions": _IDEMPOTENT,
    "ListTasks": _IDEMPOTENT,
    "ListSessions": _IDEMPOTENT,
    "ListTools": _IDEMPOTENT,
    "CallTool": _UNAVAILABLE,
}


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff with jitter. Every sleep and attempt is bounded by the call's deadline.

    With the defaults, ~35 s of retrying: enough to ride out a service restart.

    Args:
        max_attempts: attempts in all, the first included (1: no retries).
        initial_backoff: seconds before the first retry.
        max_backoff: the longest delay between two attempts, in seconds.
        multiplier: how much each delay grows over the one before.
        jitter: each delay is drawn uniformly from [delay * (1 - jitter), delay * (1 + jitter)].
        attempt_timeout: upper bound of one attempt in seconds; None lets an attempt use all the time left.
            A smaller value turns a hung server into a retried DEADLINE_EXCEEDED instead of one long wait
            (Reset/Step only; see RETRYABLE).

    Raises:
        ValueError: a field out of its range, each one named.
    """

    max_attempts: int = 20
    initial_backoff: float = 0.1
    max_backoff: float = 2.0
    multiplier: float = 2.0
    jitter: float = 0.5
    attempt_timeout: float | None = None
    # The delays themselves: the one backoff schedule (rlgate.core.backoff), built from the fields above.
    _schedule: Backoff = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        problems = [
            f"{name} must be {rule}, not {value!r}"
            for name, value, ok, rule in (
                ("max_attempts", self.max_attempts, self.max_attempts >= 1, "at least 1 (1: no retries)"),
                ("initial_backoff", self.initial_backoff, self.initial_backoff >= 0, ">= 0 seconds"),
                ("max_backoff", self.max_backoff, self.max_backoff >= self.initial_backoff, ">= initial_backoff"),
                ("multiplier", self.multiplier, self.multiplier >= 1, ">= 1"),
                ("jitter", self.jitter, 0 <= self.jitter <= 1, "between 0 and 1"),
                (
                    "attempt_timeout",
                    self.attempt_timeout,
                    self.attempt_timeout is None or self.attempt_timeout > 0,
                    "None or > 0 seconds",
                ),
            )
            if not ok
        ]
        if problems:
            raise ValueError(f"RetryPolicy: {'; '.join(problems)}")
        schedule = Backoff(self.initial_backoff, self.max_backoff, self.multiplier, self.jitter)
        object.__setattr__(self, "_schedule", schedule)  # frozen: set once, here

    def backoff(self, retry_index: int, rng: Callable[[], float] = random.random) -> float:
        """The delay before one retry, jittered.

        Args:
            retry_index: which retry (0 for the first).
            rng: draws the jitter, uniformly in [0, 1).
        """
        return self._schedule.delay(retry_index, rng)


NO_RETRY = RetryPolicy(max_attempts=1)
REFUSED_BEFORE_WORK = "REPLY_BUDGET"  # the ErrorInfo reason of a refusal any RPC may retry


def _refused_before_work(code: grpc.StatusCode | None, mapped: RlgateError) -> bool:
    return code is grpc.StatusCode.RESOURCE_EXHAUSTED and error_reason(mapped.rich_status) == REFUSED_BEFORE_WORK


@dataclass
class RetryState:
    """One logical call: counts attempts, computes attempt timeouts and decides after each failure.

    Args:
        method: the RPC's name (its retryable codes are `RETRYABLE[method]`).
        policy: the retry policy.
        timeout: the whole call's deadline in seconds from now; None for none.
        trace_id: the call's trace id, carried on the errors it raises.
        clock: the monotonic clock the deadline is kept on.
        attempts: attempts made so far.
        errors: each failed attempt's error, as text.
    """

    method: str
    policy: RetryPolicy
    timeout: float | None
    trace_id: str | None = None
    clock: Callable[[], float] = time.monotonic
    attempts: int = 0
    errors: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._deadline = None if self.timeout is None else self.clock() + self.timeout

    def remaining(self) -> float | None:
        """Seconds left before the call's deadline (negative once past it), or None without a deadline."""
        return None if self._deadline is None else self._deadline - self.clock()

    def attempt_timeout(self) -> float | None:
        """Timeout for the next attempt; raises DeadlineExceeded when no time is left."""
        self.attempts += 1
        remaining = self.remaining()
        if remaining is not None and remaining <= 0:
            raise DeadlineExceeded(
                f"{self.method}: the call's deadline of {self.timeout:.3g} s ran out after "
                f"{self.attempts - 1} attempt(s)"
                # The last error clipped, so the advice after it survives the message's own limit.
                + (f"; last error: {clip(self.errors[-1], MAX_MESSAGE // 2)}" if self.errors else "")
                + "; to wait longer, pass a larger timeout= or set ClientSettings.timeouts",
                trace_id=self.trace_id,
            )
        limit = self.policy.attempt_timeout
        if remaining is None:
            return limit
        return remaining if limit is None else min(limit, remaining)

    def on_error(self, err: BaseException) -> float:
        """After a failed attempt: the delay before the next one, or raise the mapped error.

        Args:
            err: what the attempt raised; anything but a `grpc.RpcError` is raised again as it is.

        Raises:
            RlgateError: the mapped error, when the code is not retryable for the method, the attempts are
                spent or the delay would pass the deadline.
        """
        if not isinstance(err, grpc.RpcError):
            raise err
        code = status_code(err)
        mapped = error_from_rpc(err, trace_id=self.trace_id, context=self.method)
        self.errors.append(str(mapped))
        retryable = code in RETRYABLE.get(self.method, frozenset()) or _refused_before_work(code, mapped)
        if not retryable or self.attempts >= self.policy.max_attempts:
            raise self._final(mapped)
        if code is grpc.StatusCode.DEADLINE_EXCEEDED and self.policy.attempt_timeout is None:
            # The attempt already used all the time there was.
            raise self._final(mapped)
        delay = max(self.policy.backoff(self.attempts - 1), retry_delay(mapped.rich_status))
        remaining = self.remaining()
        if remaining is not None and delay >= remaining:
            raise self._final(mapped)
        return delay

    def _final(self, mapped: RlgateError) -> RlgateError:
        if self.attempts > 1:
            mapped.message = f"{mapped.message} (after {self.attempts} attempts)"
            mapped.args = (mapped.message,)
        return mapped
