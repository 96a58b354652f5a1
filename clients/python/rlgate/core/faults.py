"""The infrastructure faults an episode counts, as the proto names them (`InfraFaults`), for the services
that count them and the client that reads them."""

from __future__ import annotations

from rlgate.v1 import common_pb2

# InfraFaults' counts by field name (every field but `total`, their sum), in the proto's order.
INFRA_FAULT_KINDS: tuple[str, ...] = tuple(
    f.name for f in common_pb2.InfraFaults.DESCRIPTOR.fields if f.name != "total"
)

MAX_CLIENT_RETRIES = 1000  # StepRequest.client_retries' bound (the proto's)
