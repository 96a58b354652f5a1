"""TCP connection tracking for the uvicorn server: counts new connections and can drop one on purpose.

uvicorn accepts a protocol *class* as `Config(http=...)`; the subclass built here reports every accepted
connection (`connection_made`) to a `ConnectionTracker`, keyed by the peer address, which is also what
the ASGI scope carries as `scope["client"]`. That is how the "crash mid-call" fault finds the socket of
the request it is serving and aborts it (RST, no HTTP response), as a crashing server would.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

from rlgate.localfleet.counters import Counters


class ConnectionTracker:
    def __init__(self, counters: Counters) -> None:
        self.counters = counters
        self._open: dict[tuple[str, int], asyncio.Transport] = {}

    def opened(self, transport: asyncio.Transport) -> None:
        self.counters.inc("tcp_connections")
        peer = transport.get_extra_info("peername")
        if peer:
            self._open[(str(peer[0]), int(peer[1]))] = transport

    def closed(self, transport: asyncio.Transport) -> None:
        peer = transport.get_extra_info("peername")
        if peer:
            key = (str(peer[0]), int(peer[1]))
            if self._open.get(key) is transport:
                del self._open[key]

    @property
    def open_count(self) -> int:
        return len(self._open)

    def abort(self, client: Any) -> bool:
        """Drop the connection of an ASGI `scope["client"]` without a response. False if unknown."""
        if not client:
            return False
        transport = self._open.get((str(client[0]), int(client[1])))
        if transport is None:
            return False
        transport.abort()
        return True

    def protocol_class(self) -> type[H11Protocol]:
        tracker = self

        class TrackedH11Protocol(H11Protocol):
            def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
                tracker.opened(transport)
                super().connection_made(transport)

            def connection_lost(self, exc: Exception | None) -> None:
                if self.transport is not None:
                    tracker.closed(self.transport)
                super().connection_lost(exc)

        return TrackedH11Protocol
