"""Redis backend: several orchestrator/gateway replicas share one Redis server (standalone or behind a
proxy; Redis Cluster is not supported, because the scripts touch index keys they discover at run time).

Every write is one Lua script (lua/*.lua, loaded by rlgate.store.redis.scripts), so each record and its
secondary indexes change atomically. The package holds one module per concern (sessions, toolcalls, requests,
intents, admission, owners, upkeep: each a mixin of `RedisStore` over `connection.RedisBase`) and the mapping of records
onto keys and fields (codec). Keys live under a prefix (default `rlgate:`):

    s:<id>                   hash: data (Session JSON), version, token, run, labels, created, retain, last_active
    tok:<token_hash>         -> session id (only the current token; rotated/revoked tokens are deleted)
    idx:all / idx:open       sorted sets of session ids by created_at (all / open statuses)
    idx:closed               finished sessions by retention time (prune)
    idx:run:<run_id>         sessions of one caller run, by created_at
    idx:label:<len>:<k>:<v>  sessions carrying label k=v, by created_at
    tc:<id> / tcn:<id> / tcr:<id>   tool-call log (list), per-episode counts (hash), logged request ids (set)
    req:<len>:<scope>:<id>   request record (hash);  idx:reqdone  DONE records by finished_at
    hb:<owner> / lease:<name>       heartbeats and leases, expiring by Redis key TTL
    intent:<id>              hash: data, run;  idx:intents / idx:intents:run:<run_id> by created_at
    admit:<account>          create admission of one provider account (AdmissionState JSON)

Connection failures (a Redis restart, a dropped socket, AOF loading) are retried with backoff for up to
`retry_s` seconds, then surface as StoreError. A retry may re-send a script that already ran (the reply
was lost), so every script is idempotent for its own retry: creates and updates recognise their own
payload, a claim (and a commit's new request record) carries a per-call nonce, tool-call appends are keyed
by (episode, request_id), an admission recognises its own slot id, and timestamps are fixed before the first attempt.
"""

from __future__ import annotations

from rlgate.store.base import SessionStore
from rlgate.store.redis.admission import RedisAdmission
from rlgate.store.redis.connection import RedisBase
from rlgate.store.redis.intents import RedisIntents
from rlgate.store.redis.owners import RedisLeases, RedisOwners
from rlgate.store.redis.requests import RedisRequests
from rlgate.store.redis.sessions import RedisSessions
from rlgate.store.redis.toolcalls import RedisToolCalls
from rlgate.store.redis.upkeep import RedisUpkeep


class RedisStore(
    RedisSessions,
    RedisToolCalls,
    RedisRequests,
    RedisIntents,
    RedisAdmission,
    RedisOwners,
    RedisLeases,
    RedisUpkeep,
    RedisBase,
    SessionStore,
):
    """The Redis `SessionStore`. Open with `await RedisStore.open(url)`; `await close()` when done."""


__all__ = ["RedisStore"]
