"""Who a service process is to the others sharing its store: the one owner id it heartbeats under
(`SessionStore.heartbeat_owner`), holds PENDING request records and provisioning intents by, and logs.

`role:host:pid:nonce`: the host and pid find the process, the nonce tells a restarted process with a reused
pid from its predecessor (whose records a retry must take over, not wait on). It never holds the intent ids'
separator `~` (a host name cannot), so `owner~...` parses back.
"""

from __future__ import annotations

import os
import socket
import uuid


def process_identity(role: str) -> str:
    """A new owner id for this process in `role` ("orchestrator", "toolgateway"): one per running service."""
    return f"{role}:{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
