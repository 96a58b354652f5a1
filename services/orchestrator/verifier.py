"""Scoring an episode honestly: a verifier failure is reported as a failure, never as reward 0.

One `Verifier.run` = up to 1 + `retries` executions through the provider (the SDK's remote path for Fleet)
inside ONE overall `asyncio.wait_for(timeout)` (the SDK's own fixed 30 s is not the bound). Only
infrastructure failures (`Retryable`: timeouts of a single HTTP call, 5xx, connection errors) are retried;
a verifier that raised is an ERROR at once. Outcomes: OK (+ score), ERROR, TIMEOUT, SKIPPED (no scoring).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rlgate.core.backoff import Backoff
from rlgate.orchestrator import metrics
from rlgate.orchestrator.providers.base import InstanceHandle, Provider, Retryable, TaskDef
from rlgate.runtime import tracing
from rlgate.store import Verification, VerificationStatus

log = logging.getLogger(__name__)

STDOUT_LIMIT = 4096


@dataclass
class Outcome:
    status: VerificationStatus
    score: float | None = None
    message: str = ""
    stdout: str = ""
    attempts: int = 0
    elapsed_ms: float = 0.0

    def verification(self) -> Verification:
        """What the session keeps (the score becomes its reward when OK)."""
        return Verification(
            status=self.status,
            message=self.message,
            stdout=self.stdout[-STDOUT_LIMIT:],
            attempts=self.attempts,
            elapsed_ms=round(self.elapsed_ms, 1),
        )


class Verifier:
    def __init__(self, provider: Provider, *, timeout_s: float, retries: int, backoff_s: float = 0.5) -> None:
        self._provider = provider
        self._timeout = timeout_s
        self._retries = max(0, retries)
        # `backoff_s` doubling before each retry, unjittered; the ceiling is the last delay a run can reach.
        self.backoff = Backoff(backoff_s, backoff_s * 2.0 ** min(self._retries, 32), jitter=0.0)

    def runs_for(self, task: TaskDef | None) -> bool:
        """Whether `run` executes anything for `task`: without a verifier the outcome is SKIPPED, known
        before the episode ends (so the ending turn can record it with its own write)."""
        return task is not None and self._provider.can_verify(task)

    @staticmethod
    def skipped() -> Outcome:
        return Outcome(VerificationStatus.SKIPPED, message="the task defines no verifier")

    @tracing.traced("rlgate.verify")
    async def run(
        self,
        task: TaskDef | None,
        handle: InstanceHandle,
        final_answer: str | None,
        tool_calls: Sequence[Any] | None = None,
    ) -> Outcome:
        """`tool_calls`: the episode's tool-call log, for providers that score with it."""
        start = time.perf_counter()
        if task is None or not self.runs_for(task):
            outcome = self.skipped()
        else:
            attempts = [0]
            try:
                outcome = await asyncio.wait_for(
                    self._attempts(task, handle, final_answer, attempts, tool_calls), self._timeout
                )
            except TimeoutError:
                outcome = Outcome(
                    VerificationStatus.TIMEOUT, message=f"verifier did not finish within {self._timeout:g}s"
                )
            outcome.attempts = attempts[0]
        outcome.elapsed_ms = (time.perf_counter() - start) * 1000
        if outcome.status == VerificationStatus.OK:
            outcome.message = ""
        self.observe(outcome)
        return outcome

    @staticmethod
    def observe(outcome: Outcome) -> None:
        """Count, log and trace an outcome (every episode's, whether `run` produced it or the ending turn
        recorded SKIPPED itself)."""
        metrics.VERIFY_OUTCOMES.labels(outcome.status).inc()
        metrics.VERIFY_SECONDS.labels(outcome.status).observe(outcome.elapsed_ms / 1000)
        log.info(
            "verification %s score=%s attempts=%d %.0fms %s",
            outcome.status,
            outcome.score,
            outcome.attempts,
            outcome.elapsed_ms,
            outcome.message,
        )
        _annotate(tracing.current_span(), outcome)

    async def _attempts(
        self,
        task: TaskDef,
        handle: InstanceHandle,
        final_answer: str | None,
        attempts: list[int],
        tool_calls: Sequence[Any] | None,
    ) -> Outcome:
        extra = {} if tool_calls is None else {"tool_calls": tool_calls}
        last = ""
        for attempt in range(1, self._retries + 2):
            attempts[0] = attempt
            try:
                result = await self._provider.verify(task, handle, final_answer, timeout_s=self._timeout, **extra)
            except Retryable as exc:
                last = str(exc)
                log.warning("verifier attempt %d: infrastructure failure: %s", attempt, exc)
                if attempt <= self._retries:
                    await asyncio.sleep(self.backoff.delay(attempt - 1))
                continue
            except Exception as exc:  # a provider bug must not become a silent score
                return Outcome(VerificationStatus.ERROR, message=f"{type(exc).__name__}: {exc}")
            if not result.success:
                return Outcome(
                    VerificationStatus.ERROR, message=result.message or "verifier failed", stdout=result.stdout
                )
            if result.score is None:
                return Outcome(
                    VerificationStatus.ERROR, message="verifier returned no numeric score", stdout=result.stdout
                )
            return Outcome(VerificationStatus.OK, score=result.score, stdout=result.stdout)
        return Outcome(
            VerificationStatus.ERROR,
            message=f"verifier infrastructure failed after {self._retries + 1} attempts: {last}",
        )


def _annotate(span: tracing.Span, outcome: Outcome) -> None:
    """The outcome on the verifier's span (a no-op span when tracing is off)."""
    span.set_attribute("rlgate.verification.status", outcome.status)
    span.set_attribute("rlgate.verification.attempts", outcome.attempts)
    if outcome.score is not None:
        span.set_attribute("rlgate.verification.score", outcome.score)
    if outcome.status in (VerificationStatus.ERROR, VerificationStatus.TIMEOUT):
        span.set_status(tracing.StatusCode.ERROR, outcome.status)
