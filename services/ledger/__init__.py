"""The request ledger: what a `request_id` means, for every RPC that takes one (Reset, Step, CallTool).

A request_id names one request of one caller, and the ledger makes that true across retries, replicas and
crashes, through the session store's request records (so every replica sees the same ledger):

- **Scoped to the caller.** Records are keyed by (scope, request_id), and the scope names the caller
  (`scope(kind, caller)`): the orchestrator's caller is the API key (its hash) that authenticated the call,
  "" when no keys are configured (one anonymous caller); the gateway's is the session its agent token
  selects (`rlgate.store.call_scope`). The same request_id from another caller is another request.
- **Bound to its parameters.** The record keeps a fingerprint of the request's parameters: one short
  digest per field (`fingerprint`), so a reuse with other parameters raises `InvalidArgument` naming the
  first field that differs, and never answers with (or acts on) what the first request produced.
- **PENDING -> DONE.** The first attempt owns the record (PENDING, owner = this process, alive while the
  process heartbeats the store: `SessionStore.heartbeat_owner`) while it works; its response is recorded
  DONE. A repeat gets the recorded response (`replay`); a repeat that arrives while the first attempt runs
  waits for it: in-process on its future, across replicas by polling the record. A failed attempt releases
  its record (unless its work says the outcome may have happened and it records that itself: `Claim.keep`),
  so a retry runs again instead of replaying an error; a concurrent in-process repeat of a claimed attempt
  gets the same error.
- **Answers are never lost.** When the store does not take a response's DONE write (disk full, store down),
  the attempt fails with the store's error, but the response is kept: repeats in this process get it from
  memory, and the ledger writes it again in the background (with its log entry, if the work's write carried
  one) with backoff until it lands or the ledger is drained at shutdown. Meanwhile the record stays PENDING
  under this live process; once the process is gone, a repeat elsewhere takes it over.
- **Owners die.** A PENDING record whose owner's heartbeat lapsed is taken over: handed to the repeat in one
  atomic store step (`SessionStore.take_over_request`: of repeats racing for it exactly one gets it and the
  others wait for its answer, and the record never goes missing in between, so no retry claims it afresh)
  and run again by the repeat, whose work is told which record it took over (`Claim.prior`) so it converges
  instead of repeating (a dead attempt never recorded its parameters' fingerprint in the store, so the work
  checks what it finds against its own parameters). `orphan=` is run instead of the work then (the gateway:
  a tool never runs twice, so it records OUTCOME_UNKNOWN; a tool annotated read-only or idempotent it runs
  again, once, marking the log entry). A held record is completed only while this
  attempt still holds it (`commit(held_by=)`): if another process took it over meanwhile (this one was
  deemed dead), that answer stands, and this attempt answers with it as a repeat would.
- **Waits are bounded.** Every wait on an earlier attempt, its store reads included, ends by the caller's
  deadline: `DeadlineExceeded` with RetryInfo ("still being processed; retry later").

API (`RequestLedger(store, owner)`; one per process and plane):

    response = await ledger.run(scope, request_id, params, deadline, ResponseMessage, work, ...)

- `params`: the request's parameters as {field: JSON value} (protobuf Structs through
  `rlgate.core.convert.arguments_of` or `json_from_struct`); compared field by field, in the given order.
- `work(claim)`: does the request. `claim.prior` is the dead owner's record this attempt took over, else
  None. To record the response with the work's own last store write (one round trip instead of two), the
  work calls `await claim.commit(response=..., session=..., tool_call=...)` (`SessionStore.commit` with the
  request record); otherwise the ledger records the returned response after the work.
- `lazy=True`: no claim before the work. The work's `claim.commit` creates the record DONE together with
  its write, only if the request_id is new (`commit(new_request=True)`), so a request that needs nothing
  after its write costs no claim. Work with more to do after its write first calls `await claim.hold()`
  (the PENDING claim, so repeats wait for the outcome). If another attempt got there first, `hold` or
  `commit` raises `RequestExists`; work must let it propagate (it subclasses `ConflictError`: a
  compare-and-set loop re-raises it) and the ledger answers from that record. Work that fails before it
  claimed anything makes the ledger look for an earlier record (a repeat whose first attempt changed what
  the work checks, e.g. a Step repeated after its turn ended the episode) and answer from that instead.
- `claim=`: how the record is claimed, when the caller claims it together with other work in one store
  call (the gateway's `authorize_call`); returns `(record, created)` like `SessionStore.claim_request`.
- `redact(response)`: what is recorded (default: the response; Reset drops the agent token, stored only as
  a hash). `replay(recorded)`: the answer to a repeat, from the recorded (redacted) response (default: as
  recorded; Reset mints a fresh token). Every repeat goes through `replay`, whether it read the record or
  waited in-process on the first attempt.
- `orphan(claim)`: the work run instead of `work` by a repeat that took over the record of a first attempt
  whose owner died mid-flight (`claim.prior`; default: `work` itself).
- Without a request_id, `run` just runs `work` (with a claim that records nothing).
- `await ledger.drain(timeout_s)` at shutdown: background DONE writes get `timeout_s` to land, the rest are
  cancelled.

What a DONE record holds (`RequestRecord.result`): JSON text {"params": {field: digest}, "response":
base64 of the serialised (redacted) response}. A record written before the ledger (bare base64) replays
without a parameter check.
"""

from rlgate.ledger.attempts import RequestLedger
from rlgate.ledger.binding import ANONYMOUS, check_binding, decode_result, encode_result, fingerprint, scope
from rlgate.ledger.claim import Claim, LedgerStore

__all__ = [
    "ANONYMOUS",
    "Claim",
    "LedgerStore",
    "RequestLedger",
    "check_binding",
    "decode_result",
    "encode_result",
    "fingerprint",
    "scope",
]
