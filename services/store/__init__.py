"""The session store: the one piece of state the orchestration and agent planes share.

`open_store(url)` picks the backend: `sqlite:///path/to/file.db` (default; WAL, one machine) or
`redis://host:port/db` (several replicas); `memory://` keeps everything in this process (logic tests, no
file or server). All implement `SessionStore` and pass the same test suite.
Each concern has a protocol of its own (rlgate.store.protocols: `SessionRecords`, `ToolCallLog`,
`RequestRecords`, `IntentRecords`, `CreateAdmission`, `Owners`, `Leases`, `Upkeep`); `SessionStore` is all of them.
`StoreCorrupt` and `StoreFull` (both `StoreError`s) say why a store cannot serve; `SessionStore.health()`
probes for them.
"""

from rlgate.store.admission import CreateGrant, CreateLimits
from rlgate.store.base import SessionStore, open_store
from rlgate.store.memory import MemoryStore
from rlgate.store.models import (
    INFRA_FAULT_KINDS,
    OPEN_STATUSES,
    ConflictError,
    DoneReason,
    Intent,
    IntentState,
    RequestExists,
    RequestRecord,
    RequestState,
    Session,
    SessionStatus,
    StoreCorrupt,
    StoreError,
    StoreFull,
    ToolCallEntry,
    Verification,
    VerificationStatus,
    Writes,
    add_infra_fault,
    call_scope,
)
from rlgate.store.protocols import (
    CreateAdmission,
    IntentRecords,
    Leases,
    Owners,
    RequestRecords,
    SessionRecords,
    ToolCallLog,
    Upkeep,
)

__all__ = [
    "INFRA_FAULT_KINDS",
    "OPEN_STATUSES",
    "ConflictError",
    "CreateAdmission",
    "CreateGrant",
    "CreateLimits",
    "DoneReason",
    "Intent",
    "IntentRecords",
    "IntentState",
    "Leases",
    "MemoryStore",
    "Owners",
    "RequestExists",
    "RequestRecord",
    "RequestRecords",
    "RequestState",
    "Session",
    "SessionRecords",
    "SessionStatus",
    "SessionStore",
    "StoreCorrupt",
    "StoreError",
    "StoreFull",
    "ToolCallEntry",
    "ToolCallLog",
    "Upkeep",
    "Verification",
    "VerificationStatus",
    "Writes",
    "add_infra_fault",
    "call_scope",
    "open_store",
]
