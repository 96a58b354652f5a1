"""The in-memory store's upkeep: retention (prune), its invariants, and the health probe."""

from __future__ import annotations

import time

from rlgate.store import _common
from rlgate.store.memory.data import MemoryBase, current_token, session_of
from rlgate.store.memory.sessions import drop_session
from rlgate.store.models import RequestState, Session


class MemoryUpkeep(MemoryBase):
    """The `Upkeep` of the in-memory store (`close` is `MemoryBase`'s)."""

    async def prune(self, closed_before: float, requests_before: float) -> int:
        def prune() -> int:
            data, now = self.data, time.time()
            doomed = []
            for sid, raw in data.sessions.items():
                retain = _common.retention_time(session_of(raw))
                if retain is not None and retain < closed_before:
                    doomed.append(sid)
            removed = sum(drop_session(self.data, sid) for sid in doomed)
            done = [
                key
                for key, r in data.requests.items()
                if r.state == RequestState.DONE and r.finished_at < requests_before
            ]
            for key in done:
                del data.requests[key]
            # Expired heartbeats and leases are dead weight; they are not counted as records.
            for owner in [o for o, expiry in data.owners.items() if expiry < now]:
                del data.owners[owner]
            for name in [n for n, (_, expiry) in data.leases.items() if expiry < now]:
                del data.leases[name]
            return removed + len(done)

        return await self._call("prune", prune)

    async def check_invariants(self) -> list[str]:
        def check() -> list[str]:
            data, problems = self.data, []
            for sid, raw in data.sessions.items():
                try:
                    session = Session.from_json(raw)
                except (ValueError, TypeError) as exc:
                    problems.append(f"session {sid}: undecodable record ({exc})")
                    continue
                problems.extend(_common.session_problems(session))
                if session.session_id != sid:
                    problems.append(f"session {sid}: stored under another id than its record's")
                if session.token_hash and data.tokens.get(session.token_hash) != sid:
                    problems.append(f"session {sid}: token index does not point at it")
            for token, holder in data.tokens.items():
                held = data.sessions.get(holder)
                if held is None:
                    problems.append(f"token index points at missing session {holder}")
                elif token != current_token(held):
                    problems.append(f"session {holder}: token index holds a token that is not its current one")
            for state in {r.state for r in data.requests.values()}:
                if state not in {s.value for s in RequestState}:
                    problems.append(f"request records in unknown state {state!r}")
            return problems

        return await self._call("check_invariants", check)

    async def ping(self) -> None:
        await self._call("ping", lambda: None)

    async def health(self) -> None:
        """Nothing to probe but the object itself: StoreError once closed."""
        await self._call("health", lambda: None)
