"""Fakes of what the services' logic talks to, for unit tests without a server, a Fleet or an MCP upstream:

- `FakeProvider` (provider.py): the orchestrator's `Provider`, instances in a dict, scriptable creates,
  resets and verifier runs, every delete recorded.
- `make_episodes` (episodes.py): the `Episodes` parts wired as the orchestrator wires it, on a fake provider.
- `FakeUpstreamPool` (upstream.py): what `ToolGateway` calls on `rlgate.mcpclient`'s pool and a session's
  upstreams, with a scriptable outcome per tool call (answer, not sent, lost, timed out, rejected, reply too
  large, hang until cancelled).

Pair them with the in-memory store (`rlgate.store.MemoryStore`), or `FaultyMemoryStore` (store.py): that store
with calls that fail or wait on demand."""

from tests.fakes.episodes import make_episodes
from tests.fakes.provider import HANG, FakeProvider, FakeToolCache
from tests.fakes.store import FaultyMemoryStore
from tests.fakes.upstream import (
    FakeUpstreamPool,
    Outcome,
    answer,
    hang,
    lost,
    not_sent,
    rejected,
    timed_out,
    too_large,
)

__all__ = [
    "HANG",
    "FakeProvider",
    "FakeToolCache",
    "FakeUpstreamPool",
    "FaultyMemoryStore",
    "Outcome",
    "answer",
    "hang",
    "lost",
    "make_episodes",
    "not_sent",
    "rejected",
    "timed_out",
    "too_large",
]
