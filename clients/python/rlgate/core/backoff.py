"""The one backoff schedule: exponential growth, a ceiling, and symmetric jitter.

Every retry loop in rlgate (the client's `RetryPolicy`, the store's reconnects, provisioning, verifier runs,
the catalog load, the ledger's rewrites) draws its delays from a `Backoff`, so they all behave alike and a
change of policy has one place to go. A loop keeps its own decision of *whether* to retry and its own
deadline; `Backoff` only says *how long* to wait before retry number n.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class Backoff:
    """Delays of `initial * multiplier**n`, capped at `maximum`, each jittered by up to ±`jitter` of itself.

    Args:
        initial: the delay before the first retry, in seconds (before jitter).
        maximum: the ceiling any delay grows to, in seconds (before jitter).
        multiplier: growth per retry; 1 keeps the delay constant.
        jitter: the fraction each delay is spread by: drawn uniformly from
            `[d * (1 - jitter), d * (1 + jitter)]`; 0 makes the schedule deterministic.
    """

    initial: float
    maximum: float
    multiplier: float = 2.0
    jitter: float = 0.5

    def __post_init__(self) -> None:
        problems = [
            f"{name} must be {rule}, not {value!r}"
            for name, value, ok, rule in (
                ("initial", self.initial, self.initial >= 0, ">= 0 seconds"),
                ("maximum", self.maximum, self.maximum >= self.initial, ">= initial"),
                ("multiplier", self.multiplier, self.multiplier >= 1, ">= 1"),
                ("jitter", self.jitter, 0 <= self.jitter <= 1, "between 0 and 1"),
            )
            if not ok
        ]
        if problems:
            raise ValueError(f"Backoff: {'; '.join(problems)}")

    def delay(self, retry_index: int, rng: Callable[[], float] = random.random) -> float:
        """The delay before one retry.

        Args:
            retry_index: which retry (0 for the first); a negative one counts as 0.
            rng: draws the jitter, uniformly in [0, 1).

        Returns:
            The delay in seconds: `initial` times `multiplier` per retry, capped at `maximum`, then jittered.
        """
        # Growth is capped before it is computed in full, so a large index cannot overflow a float.
        base = self.initial
        for _ in range(max(0, retry_index)):
            if base >= self.maximum:
                break
            base *= self.multiplier
        base = min(self.maximum, base)
        return max(0.0, base * (1.0 - self.jitter + 2.0 * self.jitter * rng()))

    def delays(self, rng: Callable[[], float] = random.random) -> Iterator[float]:
        """The delays before each retry in turn, without end: the caller's loop bounds it.

        Args:
            rng: draws the jitter, uniformly in [0, 1).
        """
        index = 0
        while True:
            yield self.delay(index, rng)
            index += 1
