"""One process identity: both services own their request records and intents under `process_identity`."""

from __future__ import annotations

import os
import socket

from rlgate.orchestrator.provisioning import intent_owner, new_intent_id
from rlgate.runtime.identity import process_identity


def test_an_owner_id_names_the_role_host_and_process_and_differs_per_start() -> None:
    first, second = process_identity("orchestrator"), process_identity("orchestrator")
    role, host, pid, nonce = first.split(":")
    assert (role, host, pid) == ("orchestrator", socket.gethostname(), str(os.getpid())) and len(nonce) == 8
    assert first != second  # a restart with a reused pid is another owner


def test_an_intent_names_its_owner_back() -> None:
    owner = process_identity("orchestrator")
    assert (
        intent_owner(new_intent_id(owner, "0123456789ab")) == owner and intent_owner(new_intent_id(owner, "")) == owner
    )
