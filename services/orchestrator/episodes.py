"""The episode logic, wired: Reset, Step, State, Close, CloseSessions, ListSessions and ListTasks as plain
async methods of parts with one job each. gRPC stays in the servicer; the parts raise `RlgateError`s and
return wire messages.

- `sessions`: session records — read one, the compare-and-set loop every change goes through, open sessions;
- `admission`: whether a new session may start (drain, max_sessions);
- `resets`: Reset, every path (new session, next episode, repeat, retry after a dead attempt);
- `forks`: Fork, a running episode branched into new sessions on copies of its instance;
- `steps`: Step, the turn counted and the episode ended;
- `endings`: an ended episode scored and its answer recorded, in tasks that outlive their callers;
- `closing`: Close, CloseSessions, expiry and failure;
- `queries`: State, ListSessions, ListTasks;
- `instances`: where an episode's instance comes from and goes back to (for resets and closing);
- `ledger`: the request records of Reset and Step (`rlgate.ledger`).
"""

from __future__ import annotations

from dataclasses import dataclass

from rlgate.ledger import RequestLedger
from rlgate.orchestrator.admission import Admission
from rlgate.orchestrator.closing import Closing
from rlgate.orchestrator.config import OrchestratorConfig
from rlgate.orchestrator.endings import Endings
from rlgate.orchestrator.forks import Forks
from rlgate.orchestrator.instances import Instances
from rlgate.orchestrator.pool import WarmPool
from rlgate.orchestrator.providers.base import Provider
from rlgate.orchestrator.provisioning import Provisioner
from rlgate.orchestrator.queries import Queries
from rlgate.orchestrator.resets import Resets
from rlgate.orchestrator.sessions import Sessions
from rlgate.orchestrator.steps import Steps
from rlgate.orchestrator.tasks import TaskCatalog
from rlgate.orchestrator.tools import ToolCache
from rlgate.orchestrator.verifier import Verifier
from rlgate.store import SessionStore


@dataclass(frozen=True)
class Episodes:
    sessions: Sessions
    admission: Admission
    instances: Instances
    resets: Resets
    forks: Forks
    steps: Steps
    endings: Endings
    closing: Closing
    queries: Queries
    ledger: RequestLedger  # Reset's, Fork's and Step's request records

    @classmethod
    def create(
        cls,
        config: OrchestratorConfig,
        store: SessionStore,
        provider: Provider,
        catalog: TaskCatalog,
        tools: ToolCache,
        verifier: Verifier,
        provisioner: Provisioner,
        pool: WarmPool,
        owner: str,
    ) -> Episodes:
        """The parts for one process (`owner` names it in the request ledger)."""
        ledger = RequestLedger(store, owner)
        sessions = Sessions(store, catalog)
        admission = Admission(config, store)
        instances = Instances(config, provider, provisioner, pool)
        closing = Closing(sessions, instances)
        endings = Endings(sessions, provider, verifier, closing)
        resets = Resets(config, sessions, admission, instances, closing, provider, catalog, tools, ledger)
        return cls(
            sessions=sessions,
            admission=admission,
            instances=instances,
            resets=resets,
            forks=Forks(config, sessions, admission, instances, closing, provider, tools, ledger, resets),
            steps=Steps(sessions, endings, closing, ledger),
            endings=endings,
            closing=closing,
            queries=Queries(config, sessions, catalog),
            ledger=ledger,
        )

    async def abandon(self) -> None:
        """Shutdown, after the drain: the endings still being scored and the answers the store has not taken
        yet are given up; their request records stay PENDING, so once this process is declared dead a retry
        on another replica takes them over."""
        await self.endings.abandon()
        await self.ledger.drain(0)
