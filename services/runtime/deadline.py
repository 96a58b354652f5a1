"""A monotonic deadline passed down from a gRPC call (or a configured default)."""

from __future__ import annotations

import time


class Deadline:
    def __init__(self, seconds: float) -> None:
        self.at = time.monotonic() + max(0.0, seconds)

    @classmethod
    def from_grpc(cls, time_remaining: float | None, default_s: float, margin_s: float = 0.25) -> Deadline:
        """The caller's deadline minus a margin to answer in time, or `default_s` when it set none."""
        if time_remaining is None:
            return cls(default_s)
        return cls(max(0.0, time_remaining - margin_s))

    def remaining(self) -> float:
        return max(0.0, self.at - time.monotonic())

    def expired(self) -> bool:
        return self.remaining() <= 0

    def cap(self, seconds: float) -> float:
        """min(seconds, remaining): a sub-operation's timeout inside this deadline."""
        return min(seconds, self.remaining())
