"""Redis backend: several orchestrator/gateway replicas share one Redis server (standalone or behind a
proxy; Redis Cluster is not supported, because the scripts touch index keys they discover at run time).

Every write is one Lua script, so each record and its secondary indexes change atomically. Keys live
under a prefix (default `rlgate:`):

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

Connection failures (a Redis restart, a dropped socket, AOF loading) are retried with backoff for up to
`retry_s` seconds, then surface as StoreError. A retry may re-send a script that already ran (the reply
was lost), so every script is idempotent for its own retry: creates and updates recognise their own
payload, a claim (and a commit's new request record) carries a per-call nonce, tool-call appends are keyed
by (episode, request_id), and timestamps are fixed before the first attempt.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import OutOfMemoryError as RedisOutOfMemoryError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from rlgate.store import _common
from rlgate.store.base import SessionStore
from rlgate.store.claims import BackgroundWrites, claim_or_release
from rlgate.store.models import (
    CALL_SCOPE_PREFIX,
    OPEN_STATUSES,
    ConflictError,
    Intent,
    RequestExists,
    RequestRecord,
    RequestState,
    Session,
    SessionStatus,
    StoreError,
    StoreFull,
    ToolCallEntry,
    Writes,
    call_scope,
)

T = TypeVar("T")

# Shared by the session scripts: index maintenance, given the fields stored in the session hash.
_PRELUDE = """
local function label_key(p, k, v) return p .. 'idx:label:' .. string.len(k) .. ':' .. k .. ':' .. v end

local function unindex(p, id, token, run, labels)
  redis.call('zrem', p .. 'idx:all', id)
  redis.call('zrem', p .. 'idx:open', id)
  redis.call('zrem', p .. 'idx:closed', id)
  if token and token ~= '' and redis.call('get', p .. 'tok:' .. token) == id then
    redis.call('del', p .. 'tok:' .. token)
  end
  if run and run ~= '' then redis.call('zrem', p .. 'idx:run:' .. run, id) end
  if labels and labels ~= '' then
    local l = cjson.decode(labels)
    for i = 1, #l, 2 do redis.call('zrem', label_key(p, l[i], l[i + 1]), id) end
  end
end

local function index(p, id, created, token, run, labels, retain)
  redis.call('zadd', p .. 'idx:all', created, id)
  if retain == '' then
    redis.call('zadd', p .. 'idx:open', created, id)
  else
    redis.call('zadd', p .. 'idx:closed', retain, id)
  end
  if token ~= '' then redis.call('set', p .. 'tok:' .. token, id) end
  if run ~= '' then redis.call('zadd', p .. 'idx:run:' .. run, created, id) end
  local l = cjson.decode(labels)
  for i = 1, #l, 2 do redis.call('zadd', label_key(p, l[i], l[i + 1]), created, id) end
end

local function token_taken(p, id, token)
  if token == '' then return false end
  local holder = redis.call('get', p .. 'tok:' .. token)
  return holder and holder ~= id
end

local function drop(p, id)
  local sk = p .. 's:' .. id
  local cur = redis.call('hmget', sk, 'token', 'run', 'labels')
  unindex(p, id, cur[1], cur[2], cur[3])
  local n = redis.call('del', sk)
  redis.call('del', p .. 'tc:' .. id, p .. 'tcn:' .. id, p .. 'tcr:' .. id)
  return n
end
"""

# ARGV: prefix, id, data, token, run, labels, created, retain, last_active. 1 ok, 0 exists, -1 token taken.
_CREATE = (
    _PRELUDE
    + """
local p, id = ARGV[1], ARGV[2]
local sk = p .. 's:' .. id
if redis.call('exists', sk) == 1 then
  if redis.call('hget', sk, 'data') == ARGV[3] then return 1 end  -- our own retried create
  return 0
end
if token_taken(p, id, ARGV[4]) then return -1 end
redis.call('hset', sk, 'data', ARGV[3], 'version', '1', 'token', ARGV[4], 'run', ARGV[5], 'labels', ARGV[6],
  'created', ARGV[7], 'retain', ARGV[8], 'last_active', ARGV[9])
index(p, id, ARGV[7], ARGV[4], ARGV[5], ARGV[6], ARGV[8])
return 1
"""
)

# update(p, a, i): compare-and-set a session from a[i .. i+9] = id, expected, new_version, data, token, run,
# labels, created, retain, last_active. Returns code, last_active (or the stored version when code is 0),
# retried: code 1 ok, 0 version moved on, -1 token taken, -2 no such session; retried is true when the
# stored record already is this very update (a retry after a lost reply).
_UPDATE_LIB = """
local function update(p, a, i)
  local id, expected, new_version, data = a[i], a[i + 1], a[i + 2], a[i + 3]
  local token, run, labels, created, retain = a[i + 4], a[i + 5], a[i + 6], a[i + 7], a[i + 8]
  local sk = p .. 's:' .. id
  local cur = redis.call('hmget', sk, 'version', 'data', 'token', 'run', 'labels', 'last_active')
  if not cur[1] then return -2, '', false end
  if cur[1] ~= expected then
    if cur[1] == new_version and cur[2] == data then return 1, cur[6], true end
    return 0, cur[1], false
  end
  if token_taken(p, id, token) then return -1, '', false end
  unindex(p, id, cur[3], cur[4], cur[5])
  local last = a[i + 9]
  if cur[6] and tonumber(cur[6]) > tonumber(last) then last = cur[6] end
  redis.call('hset', sk, 'data', data, 'version', new_version, 'token', token, 'run', run, 'labels', labels,
    'created', created, 'retain', retain, 'last_active', last)
  index(p, id, created, token, run, labels, retain)
  return 1, last, false
end
"""

# ARGV: prefix, id, expected, new_version, data, token, run, labels, created, retain, last_active.
# Returns {code, last_active} (see update).
_UPDATE = (
    _PRELUDE
    + _UPDATE_LIB
    + """
local code, last = update(ARGV[1], ARGV, 2)
return {code, last}
"""
)

# Request records and the tool-call log, shared by their own scripts and _COMMIT.
_LOG_LIB = """
local function touch(p, id, now)
  local sk = p .. 's:' .. id
  local cur = redis.call('hget', sk, 'last_active')
  if cur and tonumber(cur) < tonumber(now) then redis.call('hset', sk, 'last_active', now) end
end

-- The episode's entry count; a request_id already logged for the episode is not logged again.
local function append(p, id, ep, request_id, entry)
  if request_id ~= '' and redis.call('sadd', p .. 'tcr:' .. id, ep .. ':' .. request_id) == 0 then
    return tonumber(redis.call('hget', p .. 'tcn:' .. id, ep) or '0')
  end
  redis.call('rpush', p .. 'tc:' .. id, entry)
  return redis.call('hincrby', p .. 'tcn:' .. id, ep, 1)
end

-- An upsert: a result is never dropped, even if the PENDING record was lost or pruned. `nonce` (optional)
-- marks a record this call creates, so a retry of the same call recognises it.
local function complete(p, key, scope, request_id, result, now, nonce)
  local k = p .. 'req:' .. key
  if redis.call('exists', k) == 0 then
    redis.call('hset', k, 'scope', scope, 'request_id', request_id, 'owner', '', 'created_at', now,
      'nonce', nonce or '')
  end
  redis.call('hset', k, 'state', 'done', 'result', result, 'finished_at', now)
  redis.call('zadd', p .. 'idx:reqdone', now, key)
end
"""

# ARGV: prefix, id, now
_TOUCH = (
    _LOG_LIB
    + """
touch(ARGV[1], ARGV[2], ARGV[3])
return 0
"""
)

# ARGV: prefix, id
_DELETE = _PRELUDE + "\nreturn drop(ARGV[1], ARGV[2])\n"

# ARGV: prefix, closed_before, batch. Returns {examined, removed}.
_PRUNE_SESSIONS = (
    _PRELUDE
    + """
local p = ARGV[1]
local ids = redis.call('zrangebyscore', p .. 'idx:closed', '-inf', '(' .. ARGV[2], 'LIMIT', 0, tonumber(ARGV[3]))
local n = 0
for _, id in ipairs(ids) do
  n = n + drop(p, id)
  redis.call('zrem', p .. 'idx:closed', id)
end
return {#ids, n}
"""
)

# ARGV: prefix, before, batch. Returns {examined, removed}.
_PRUNE_REQUESTS = """
local p = ARGV[1]
local ks = redis.call('zrangebyscore', p .. 'idx:reqdone', '-inf', '(' .. ARGV[2], 'LIMIT', 0, tonumber(ARGV[3]))
local n = 0
for _, s in ipairs(ks) do
  if redis.call('hget', p .. 'req:' .. s, 'state') == 'done' then n = n + redis.call('del', p .. 'req:' .. s) end
  redis.call('zrem', p .. 'idx:reqdone', s)
end
return {#ks, n}
"""

# ARGV: prefix, session id, episode, request_id, entry JSON. Returns the episode's entry count.
_APPEND = (
    _LOG_LIB
    + """
return append(ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5])
"""
)

# Request-record reads and claims, shared by _CLAIM, _COMMIT and _AUTHORIZE.
_REQUEST_LIB = """
-- The stored record as {state, owner, result, created_at, finished_at, nonce}, or nil.
local function request_fields(p, key)
  local r = redis.call('hmget', p .. 'req:' .. key, 'state', 'owner', 'result', 'created_at', 'finished_at', 'nonce')
  if r[1] then return r end
  return nil
end

-- Returns {created, state, owner, result, created_at, finished_at}; created is 1 for our own retried claim.
local function claim(p, key, scope, request_id, owner, now, nonce)
  local r = request_fields(p, key)
  if r then
    local mine = 0
    if r[6] == nonce then mine = 1 end
    return {mine, r[1], r[2], r[3], r[4], r[5]}
  end
  redis.call('hset', p .. 'req:' .. key, 'scope', scope, 'request_id', request_id, 'state', 'pending',
    'owner', owner, 'result', '', 'created_at', now, 'finished_at', '0', 'nonce', nonce)
  return {1, 'pending', owner, '', now, '0'}
end

-- _request_key in Lua: the scope's length in code points, as Python's len() counts it (UTF-8
-- continuation bytes 0x80-0xBF do not start a character).
local function request_key(scope, request_id)
  local _, n = string.gsub(scope, '[^\\128-\\191]', '')
  return n .. ':' .. scope .. ':' .. request_id
end
"""

# ARGV: prefix, key, scope, request_id, owner, now, nonce.
# Returns {created, state, owner, result, created_at, finished_at}.
_CLAIM = (
    _REQUEST_LIB
    + """
return claim(ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6], ARGV[7])
"""
)

# ARGV: prefix, token_hash, request_id, owner, now, nonce, call scope prefix, active status.
# Returns {} for an unknown token; {data, version, last_active} when nothing is claimed; else
# {data, version, last_active, created, state, owner, result, created_at, finished_at}.
_AUTHORIZE = (
    _REQUEST_LIB
    + """
local p, token, request_id = ARGV[1], ARGV[2], ARGV[3]
local id = redis.call('get', p .. 'tok:' .. token)
if not id then return {} end
local s = redis.call('hmget', p .. 's:' .. id, 'data', 'version', 'last_active', 'token')
-- The index and the record change in one script; checking again costs nothing and guards reads.
if not s[1] or s[4] ~= token then return {} end
local session = {s[1], s[2], s[3] or ''}
if request_id == '' or cjson.decode(s[1]).status ~= ARGV[8] then return session end
local scope = ARGV[7] .. id
local r = claim(p, request_key(scope, request_id), scope, request_id, ARGV[4], ARGV[5], ARGV[6])
for i = 1, 6 do session[3 + i] = r[i] end
return session
"""
)

# ARGV: prefix, key, scope, request_id, result, now
_COMPLETE = (
    _LOG_LIB
    + """
complete(ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6])
return 1
"""
)

# ARGV: prefix, then three parts, each a flag ('1' or '') and its arguments (empty strings when absent):
#   [2] session?  [3..12] the update's 10 arguments (see update)
#   [13] request? [14..18] key, scope, request_id, result, now
#   [19] call?    [20..24] session id, episode, request_id, entry JSON, finished_at (the touch)
#   [25] new request? [26] nonce of this call ('' unless new)
#   [27] held_by ('' for none)
# Returns {code, last_active} of the update ({1, ''} without a session), or {-3, state, owner, result,
# created_at, finished_at} when a new request's record exists already or another owner's record is not
# ours to complete (held_by; DONE with this result is our own retried commit). Nothing is written unless the
# request check and the update succeed; a retry of a commit that already ran returns at once (the rest
# ran with it): for a new request, the record carrying this call's nonce says so.
_COMMIT = (
    _PRELUDE
    + _UPDATE_LIB
    + _LOG_LIB
    + _REQUEST_LIB
    + """
local p = ARGV[1]
local code, last = 1, ''
if ARGV[25] == '1' then
  local r = request_fields(p, ARGV[14])
  if r and r[6] ~= ARGV[26] then return {-3, r[1], r[2], r[3], r[4], r[5]} end
  if r then  -- our own retried commit
    if ARGV[2] == '1' then return {1, redis.call('hget', p .. 's:' .. ARGV[3], 'last_active') or ARGV[12]} end
    return {1, ''}
  end
end
if ARGV[27] ~= '' then  -- held_by: completed only while missing, PENDING under it, or DONE with this result
  local r = request_fields(p, ARGV[14])
  if r and not ((r[1] == 'pending' and r[2] == ARGV[27]) or (r[1] ~= 'pending' and r[3] == ARGV[17])) then
    return {-3, r[1], r[2], r[3], r[4], r[5]}
  end
end
if ARGV[2] == '1' then
  local retried
  code, last, retried = update(p, ARGV, 3)
  if code ~= 1 or retried then return {code, last} end
end
if ARGV[13] == '1' then complete(p, ARGV[14], ARGV[15], ARGV[16], ARGV[17], ARGV[18], ARGV[26]) end
if ARGV[19] == '1' then
  append(p, ARGV[20], ARGV[21], ARGV[22], ARGV[23])
  touch(p, ARGV[20], ARGV[24])
end
return {code, last}
"""
)

# ARGV: prefix, key
_RELEASE = """
local k = ARGV[1] .. 'req:' .. ARGV[2]
if redis.call('hget', k, 'state') == 'pending' then redis.call('del', k) end
return 0
"""

# ARGV: prefix, key, dead owner, owner, now, nonce. Returns {} for no record, else {taken, state, owner,
# result, created_at, finished_at}; taken is 1 for our own retried takeover too (its nonce).
_TAKE_OVER = (
    _REQUEST_LIB
    + """
local p, key = ARGV[1], ARGV[2]
local r = request_fields(p, key)
if not r then return {} end
if r[1] == 'pending' and r[2] == ARGV[3] then
  redis.call('hset', p .. 'req:' .. key, 'owner', ARGV[4], 'created_at', ARGV[5], 'nonce', ARGV[6])
  return {1, 'pending', ARGV[4], '', ARGV[5], '0'}
end
local mine = 0
if r[1] == 'pending' and r[6] == ARGV[6] then mine = 1 end
return {mine, r[1], r[2], r[3], r[4], r[5]}
"""
)

# ARGV: prefix, id, data, run, created
_PUT_INTENT = """
local p, id = ARGV[1], ARGV[2]
local k = p .. 'intent:' .. id
local old = redis.call('hget', k, 'run')
if old and old ~= '' then redis.call('zrem', p .. 'idx:intents:run:' .. old, id) end
redis.call('hset', k, 'data', ARGV[3], 'run', ARGV[4])
redis.call('zadd', p .. 'idx:intents', ARGV[5], id)
if ARGV[4] ~= '' then redis.call('zadd', p .. 'idx:intents:run:' .. ARGV[4], ARGV[5], id) end
return 0
"""

# ARGV: prefix, id
_DELETE_INTENT = """
local p, id = ARGV[1], ARGV[2]
local k = p .. 'intent:' .. id
local old = redis.call('hget', k, 'run')
if old and old ~= '' then redis.call('zrem', p .. 'idx:intents:run:' .. old, id) end
redis.call('zrem', p .. 'idx:intents', id)
return redis.call('del', k)
"""

# ARGV: prefix, name, holder, ttl_ms. 1 if holder now holds the lease (taken or renewed).
_ACQUIRE = """
local k = ARGV[1] .. 'lease:' .. ARGV[2]
local cur = redis.call('get', k)
if (not cur) or cur == ARGV[3] then
  redis.call('set', k, ARGV[3], 'PX', ARGV[4])
  return 1
end
return 0
"""

# ARGV: prefix, name, holder
_RELEASE_LEASE = """
local k = ARGV[1] .. 'lease:' .. ARGV[2]
if redis.call('get', k) == ARGV[3] then redis.call('del', k) end
return 0
"""

_SESSION_FIELDS = ("data", "version", "last_active")
_PRUNE_BATCH = 500
_WALK_BATCH = 200


def _score(value: float) -> str:
    """A float as Redis reads it back exactly (repr is the shortest round-trip form)."""
    return repr(float(value))


def _ttl_ms(ttl_s: float) -> str:
    return str(max(1, round(ttl_s * 1000)))


def _labels_field(labels: Mapping[str, str]) -> str:
    """Labels as a flat JSON list [k1, v1, k2, v2, ...] (cjson cannot tell {} from [])."""
    return json.dumps([item for pair in sorted(labels.items()) for item in pair])


def _label_index(key: str, value: str) -> str:
    # The scripts' label_key: Lua's string.len counts the key's UTF-8 bytes, not its characters.
    return f"idx:label:{len(key.encode())}:{key}:{value}"


def _request_key(scope: str, request_id: str) -> str:
    # The scope's length keeps ("a:b", "c") and ("a", "b:c") apart.
    return f"{len(scope)}:{scope}:{request_id}"


def _session_from_fields(fields: list[str | None]) -> Session | None:
    data, version, last_active = fields
    if data is None:
        return None
    session = _common.decode(Session, data)
    session.version = int(version or session.version)
    if last_active:  # None (hmget) or "" (a script's stand-in for a missing field)
        session.last_active_at = float(last_active)
    return session


def _request_from_reply(scope: str, request_id: str, fields: list[Any]) -> RequestRecord:
    """A record from a script's {state, owner, result, created_at, finished_at} reply."""
    return _common.request_record(scope, request_id, *fields)


class RedisStore(SessionStore):
    """The Redis `SessionStore`. Open with `await RedisStore.open(url)`; `await close()` when done."""

    def __init__(self, client: aioredis.Redis, url: str, prefix: str, retry_s: float) -> None:
        self.url = url
        self.prefix = prefix
        self.retry_s = retry_s
        # redis-py types replies as bytes | str; with decode_responses=True they are str, so use Any.
        self._client: Any = client
        self._closed = False
        self._background = BackgroundWrites()
        script = self._register
        self._scripts: list[Any] = []
        self._create, self._update, self._touch = script(_CREATE), script(_UPDATE), script(_TOUCH)
        self._delete, self._append = script(_DELETE), script(_APPEND)
        self._prune_sessions, self._prune_requests = script(_PRUNE_SESSIONS), script(_PRUNE_REQUESTS)
        self._claim, self._complete, self._release = script(_CLAIM), script(_COMPLETE), script(_RELEASE)
        self._commit, self._authorize, self._take = script(_COMMIT), script(_AUTHORIZE), script(_TAKE_OVER)
        self._put_intent, self._delete_intent = script(_PUT_INTENT), script(_DELETE_INTENT)
        self._acquire, self._release_lease = script(_ACQUIRE), script(_RELEASE_LEASE)

    async def _load_scripts(self) -> None:
        for script in self._scripts:
            script.sha = await self._client.script_load(script.script)

    def _register(self, source: str) -> Any:
        script = self._client.register_script(source)
        self._scripts.append(script)
        return script

    @classmethod
    async def open(
        cls,
        url: str,
        *,
        prefix: str = "rlgate:",
        retry_s: float = 20.0,
        connect_timeout_s: float = 2.0,
        command_timeout_s: float = 5.0,
    ) -> RedisStore:
        """Connect to `url` (redis://host:port/db) and check it answers. StoreError if it does not within
        `retry_s`. `retry_s` also bounds how long any later operation rides out an outage."""
        client = aioredis.Redis.from_url(
            url,
            decode_responses=True,
            socket_connect_timeout=connect_timeout_s,
            socket_timeout=command_timeout_s,
            # The store's own loop (_call) is the one retry policy; the client must not retry underneath it.
            retry=Retry(NoBackoff(), 0),
        )
        store = cls(client, url, prefix, retry_s)
        try:
            await store.ping()
            # Load the scripts up front (EVALSHA falls back to loading after a server restart anyway).
            await store._call("script load", store._load_scripts)
        except BaseException:
            await client.aclose()
            raise
        return store

    def __repr__(self) -> str:
        return f"RedisStore({self.url!r}, prefix={self.prefix!r})"

    # -- plumbing ---------------------------------------------------------------------------------------
    async def _call(self, what: str, op: Callable[[], Awaitable[T]]) -> T:
        """Run `op`, retrying connection failures with backoff for up to `retry_s`; StoreError after."""
        deadline = time.monotonic() + self.retry_s
        delay = 0.05
        while True:
            if self._closed:
                raise StoreError("store is closed")
            try:
                return await op()
            except (RedisConnectionError, RedisTimeoutError) as exc:  # includes BusyLoadingError
                if self._closed:
                    raise StoreError("store is closed") from exc
                if time.monotonic() + delay > deadline:
                    raise StoreError(f"redis store {self.url}: {what} failed: {exc}") from exc
                await asyncio.sleep(delay)
                delay = min(delay * 2, 0.5)
            except RedisError as exc:
                raise StoreError(f"redis store {self.url}: {what} failed: {exc}") from exc

    def _script(self, what: str, script: Any, *args: Any) -> Awaitable[Any]:
        return self._call(what, lambda: script(args=[self.prefix, *args]))

    def _key(self, suffix: str) -> str:
        return self.prefix + suffix

    @staticmethod
    def _session_args(session: Session) -> list[str]:
        """token, run, labels, created, retain, last_active: the hash fields the scripts index."""
        retain = _common.retention_time(session)
        return [
            session.token_hash,
            session.run_id,
            _labels_field(session.labels),
            _score(session.created_at),
            "" if retain is None else _score(retain),
            _score(session.last_active_at),
        ]

    async def _load_sessions(self, ids: list[str]) -> list[Session | None]:
        async def load() -> list[Any]:
            pipe = self._client.pipeline(transaction=False)
            for sid in ids:
                pipe.hmget(self._key(f"s:{sid}"), list(_SESSION_FIELDS))
            rows: list[Any] = await pipe.execute()
            return rows

        if not ids:
            return []
        rows = await self._call("load sessions", load)
        return [_session_from_fields(row) for row in rows]

    # -- sessions ---------------------------------------------------------------------------------------
    async def create_session(self, session: Session) -> Session:
        stored = session.copy(version=1)
        code = await self._script(
            "create_session", self._create, stored.session_id, stored.to_json(), *self._session_args(stored)
        )
        if code == 0:
            raise ConflictError(f"session {stored.session_id} already exists")
        if code == -1:
            raise ConflictError(f"agent token of session {stored.session_id} is already in use")
        return stored

    async def get_session(self, session_id: str) -> Session | None:
        return (await self._load_sessions([session_id]))[0]

    def _update_args(self, session: Session) -> tuple[Session, list[str]]:
        """The record update_session writes (version + 1, updated_at now) and the update's script args."""
        stored = session.copy(version=session.version + 1, updated_at=time.time())
        args = [stored.session_id, str(session.version), str(stored.version), stored.to_json()]
        return stored, args + self._session_args(stored)

    @staticmethod
    def _updated(stored: Session, code: int, last_active: str) -> Session:
        """`stored` with the stored last_active_at, or the ConflictError the update's code means."""
        sid, expected = stored.session_id, stored.version - 1
        if code == -2:
            raise ConflictError(f"session {sid} does not exist")
        if code == 0:
            raise ConflictError(f"session {sid} changed (version {last_active}, expected {expected})")
        if code == -1:
            raise ConflictError(f"agent token of session {sid} is already in use")
        stored.last_active_at = float(last_active)
        return stored

    async def update_session(self, session: Session) -> Session:
        stored, args = self._update_args(session)
        code, last_active = await self._script("update_session", self._update, *args)
        return self._updated(stored, code, last_active)

    async def _commit_writes(self, session: Session | None, writes: Writes) -> Session | None:
        request, tool_call, new_request, held_by = writes.request, writes.tool_call, writes.new_request, writes.held_by
        stored, args = self._update_args(session) if session is not None else (None, [""] * 10)
        args = ["1" if stored is not None else "", *args]
        if request is not None:
            scope, request_id, result = request
            args += ["1", _request_key(scope, request_id), scope, request_id, result, _score(time.time())]
        else:
            args += [""] * 6
        if tool_call is not None:
            args += [
                "1",
                tool_call.session_id,
                str(tool_call.episode),
                tool_call.request_id,
                tool_call.to_json(),
                _score(tool_call.finished_at),
            ]
        else:
            args += [""] * 6
        args += ["1", uuid.uuid4().hex] if new_request else ["", ""]
        args.append(held_by)
        reply = await self._script("commit", self._commit, *args)
        if reply[0] == -3 and request is not None:
            raise RequestExists(_request_from_reply(request[0], request[1], reply[1:]))
        code, last_active = reply
        return self._updated(stored, code, last_active) if stored is not None else None

    async def session_by_token(self, token_hash: str) -> Session | None:
        if not token_hash:  # "" is what a revoked session holds; it must never match
            return None
        key = self._key(f"tok:{token_hash}")
        session_id = await self._call("session_by_token", lambda: self._client.get(key))
        if session_id is None:
            return None
        session = await self.get_session(session_id)
        # The index and the record change in one script; checking again costs nothing and guards reads.
        return session if session is not None and session.token_hash == token_hash else None

    async def touch_session(self, session_id: str, now: float) -> None:
        await self._script("touch_session", self._touch, session_id, _score(now))

    async def sessions_open(self, session_ids: Sequence[str]) -> set[str]:
        ids = list(dict.fromkeys(session_ids))
        found: set[str] = set()
        for start in range(0, len(ids), _WALK_BATCH):
            chunk = ids[start : start + _WALK_BATCH]
            sessions = await self._load_sessions(chunk)
            for sid, session in zip(chunk, sessions, strict=True):
                if session is not None and session.is_open and session.token_hash:
                    found.add(sid)
        return found

    async def count_open_sessions(self) -> int:
        return int(await self._call("count_open_sessions", lambda: self._client.zcard(self._key("idx:open"))))

    def _walk_key(self, statuses: frozenset[str] | None, labels: Mapping[str, str] | None, run_id: str) -> str:
        """The most selective index for a listing; remaining filters are applied to the loaded records."""
        if run_id:
            return self._key(f"idx:run:{run_id}")
        if labels:
            key, value = next(iter(labels.items()))
            return self._key(_label_index(key, value))
        if statuses is not None and statuses <= OPEN_STATUSES:
            return self._key("idx:open")
        return self._key("idx:all")

    async def list_sessions(
        self,
        *,
        statuses: frozenset[str] | None = None,
        labels: Mapping[str, str] | None = None,
        run_id: str = "",
        limit: int = 100,
        cursor: str = "",
    ) -> tuple[list[Session], str]:
        limit = _common.page_limit(limit)
        position = _common.decode_cursor(cursor)
        if statuses is not None and not statuses:
            return [], ""
        key = self._walk_key(statuses, labels, run_id)
        # Walk the index newest first from the cursor, by score position rather than by offset, so
        # sessions created or deleted meanwhile do not shift the walk. `skip` counts the entries at
        # score `high` already examined.
        high = "+inf" if position is None else _score(position[0])
        skip = 0
        found: dict[str, Session] = {}
        while len(found) <= limit:
            batch = await self._index_batch(key, high, skip)
            for session in await self._load_sessions([sid for sid, _ in batch]):
                if (
                    session is not None
                    and _common.after_cursor(session, position)
                    and _common.matches(session, statuses, labels, run_id)
                ):
                    found[session.session_id] = session
            if len(batch) < _WALK_BATCH:
                break
            last = _score(batch[-1][1])
            if last == high:
                skip += len(batch)
            else:
                high, skip = last, sum(1 for _, score in batch if _score(score) == last)
        # Records loaded one by one may tie-break differently from the index; order them exactly.
        page = sorted(found.values(), key=lambda s: (s.created_at, s.session_id), reverse=True)
        if len(page) > limit:
            page = page[:limit]
            return page, _common.encode_cursor(page[-1])
        return page, ""

    async def _index_batch(self, key: str, high: str, skip: int) -> list[tuple[str, float]]:
        """Up to _WALK_BATCH (id, created_at) pairs of a sorted-set index, from score `high` down."""
        batch: list[tuple[str, float]] = await self._call(
            "list_sessions",
            lambda: self._client.zrevrangebyscore(key, high, "-inf", start=skip, num=_WALK_BATCH, withscores=True),
        )
        return batch

    async def delete_session(self, session_id: str) -> None:
        await self._script("delete_session", self._delete, session_id)

    # -- tool-call log ----------------------------------------------------------------------------------
    async def append_tool_call(self, entry: ToolCallEntry) -> int:
        count = await self._script(
            "append_tool_call",
            self._append,
            entry.session_id,
            str(entry.episode),
            entry.request_id,
            entry.to_json(),
        )
        return int(count)

    async def list_tool_calls(self, session_id: str, episode: int | None = None) -> list[ToolCallEntry]:
        raw: list[str] = await self._call(
            "list_tool_calls", lambda: self._client.lrange(self._key(f"tc:{session_id}"), 0, -1)
        )
        entries = [_common.decode(ToolCallEntry, item) for item in raw]
        return entries if episode is None else [e for e in entries if e.episode == episode]

    async def count_tool_calls(self, session_id: str, episode: int) -> int:
        count = await self._call(
            "count_tool_calls", lambda: self._client.hget(self._key(f"tcn:{session_id}"), str(episode))
        )
        return int(count or 0)

    # -- request records --------------------------------------------------------------------------------
    async def claim_request(self, scope: str, request_id: str, owner: str) -> tuple[RequestRecord, bool]:
        return await claim_or_release(
            self._claim_request(scope, request_id, owner),
            lambda claim: (scope, request_id) if claim[1] else None,
            self.release_request,
            self._background,
        )

    async def _claim_request(self, scope: str, request_id: str, owner: str) -> tuple[RequestRecord, bool]:
        reply = await self._script(
            "claim_request",
            self._claim,
            _request_key(scope, request_id),
            scope,
            request_id,
            owner,
            _score(time.time()),
            uuid.uuid4().hex,
        )
        return _request_from_reply(scope, request_id, reply[1:]), reply[0] == 1

    async def authorize_call(
        self, token_hash: str, request_id: str, owner: str
    ) -> tuple[Session | None, RequestRecord | None, bool]:
        if not token_hash:  # a revoked session holds ""; it must never match
            return None, None, False

        def claimed(result: tuple[Session | None, RequestRecord | None, bool]) -> tuple[str, str] | None:
            session, _, created = result
            return (call_scope(session.session_id), request_id) if created and session is not None else None

        return await claim_or_release(
            self._authorize_call(token_hash, request_id, owner), claimed, self.release_request, self._background
        )

    async def _authorize_call(
        self, token_hash: str, request_id: str, owner: str
    ) -> tuple[Session | None, RequestRecord | None, bool]:
        reply = await self._script(
            "authorize_call",
            self._authorize,
            token_hash,
            request_id,
            owner,
            _score(time.time()),
            uuid.uuid4().hex,
            CALL_SCOPE_PREFIX,
            SessionStatus.ACTIVE.value,
        )
        session = _session_from_fields(reply[:3]) if reply else None
        if session is None or len(reply) == 3:
            return session, None, False
        record = _request_from_reply(call_scope(session.session_id), request_id, reply[4:])
        return session, record, reply[3] == 1

    async def complete_request(self, scope: str, request_id: str, result: str) -> None:
        await self._script(
            "complete_request",
            self._complete,
            _request_key(scope, request_id),
            scope,
            request_id,
            result,
            _score(time.time()),
        )

    async def release_request(self, scope: str, request_id: str) -> None:
        await self._script("release_request", self._release, _request_key(scope, request_id))

    async def take_over_request(
        self, scope: str, request_id: str, dead_owner: str, owner: str
    ) -> tuple[RequestRecord | None, bool]:
        async def give_back(scope: str, request_id: str) -> None:
            await self._take_over(scope, request_id, owner, dead_owner)

        return await claim_or_release(
            self._take_over(scope, request_id, dead_owner, owner),
            lambda taken: (scope, request_id) if taken[1] else None,
            give_back,
            self._background,
        )

    async def _take_over(
        self, scope: str, request_id: str, dead_owner: str, owner: str
    ) -> tuple[RequestRecord | None, bool]:
        reply = await self._script(
            "take_over_request",
            self._take,
            _request_key(scope, request_id),
            dead_owner,
            owner,
            _score(time.time()),
            uuid.uuid4().hex,
        )
        if not reply:
            return None, False
        return _request_from_reply(scope, request_id, reply[1:]), reply[0] == 1

    async def get_request(self, scope: str, request_id: str) -> RequestRecord | None:
        key = self._key("req:" + _request_key(scope, request_id))
        fields: dict[str, str] = await self._call("get_request", lambda: self._client.hgetall(key))
        if not fields:
            return None
        return RequestRecord(
            scope=scope,
            request_id=request_id,
            state=fields.get("state", RequestState.PENDING),
            owner=fields.get("owner", ""),
            result=fields.get("result", ""),
            created_at=float(fields.get("created_at", 0)),
            finished_at=float(fields.get("finished_at", 0)),
        )

    async def heartbeat_owner(self, owner: str, ttl_s: float) -> None:
        key, value, ttl = self._key(f"hb:{owner}"), _score(time.time()), int(_ttl_ms(ttl_s))
        await self._call("heartbeat_owner", lambda: self._client.set(key, value, px=ttl))

    async def owner_alive(self, owner: str) -> bool:
        key = self._key(f"hb:{owner}")
        return bool(await self._call("owner_alive", lambda: self._client.exists(key)))

    # -- intents ----------------------------------------------------------------------------------------
    async def put_intent(self, intent: Intent) -> None:
        await self._script(
            "put_intent",
            self._put_intent,
            intent.intent_id,
            intent.to_json(),
            intent.run_id,
            _score(intent.created_at),
        )

    async def get_intent(self, intent_id: str) -> Intent | None:
        key = self._key(f"intent:{intent_id}")
        data = await self._call("get_intent", lambda: self._client.hget(key, "data"))
        return _common.decode(Intent, data) if data is not None else None

    async def list_intents(self, run_id: str = "") -> list[Intent]:
        index = self._key(f"idx:intents:run:{run_id}" if run_id else "idx:intents")

        async def load() -> list[Any]:
            ids = await self._client.zrange(index, 0, -1)
            pipe = self._client.pipeline(transaction=False)
            for intent_id in ids:
                pipe.hget(self._key(f"intent:{intent_id}"), "data")
            return await pipe.execute() if ids else []

        # zrange orders equal created_at by id, as SQLite does.
        return [_common.decode(Intent, data) for data in await self._call("list_intents", load) if data is not None]

    async def delete_intent(self, intent_id: str) -> None:
        await self._script("delete_intent", self._delete_intent, intent_id)

    # -- leases -----------------------------------------------------------------------------------------
    async def acquire_lease(self, name: str, holder: str, ttl_s: float) -> bool:
        return bool(await self._script("acquire_lease", self._acquire, name, holder, _ttl_ms(ttl_s)))

    async def release_lease(self, name: str, holder: str) -> None:
        await self._script("release_lease", self._release_lease, name, holder)

    # -- maintenance ------------------------------------------------------------------------------------
    async def prune(self, closed_before: float, requests_before: float) -> int:
        removed = 0
        for script, before in (
            (self._prune_sessions, closed_before),
            (self._prune_requests, requests_before),
        ):
            while True:  # batches keep each script short, so Redis never stalls on a big prune
                examined, deleted = await self._script("prune", script, _score(before), str(_PRUNE_BATCH))
                removed += int(deleted)
                if int(examined) < _PRUNE_BATCH:
                    break
        return removed

    async def check_invariants(self) -> list[str]:
        return await self._call("check_invariants", self._check)

    async def _scan(self, pattern: str) -> list[str]:
        return [key async for key in self._client.scan_iter(match=self._key(pattern), count=500)]

    async def _check(self) -> list[str]:
        problems: list[str] = []
        client, key = self._client, self._key
        all_ids = dict(await client.zrange(key("idx:all"), 0, -1, withscores=True))
        open_ids = dict(await client.zrange(key("idx:open"), 0, -1, withscores=True))
        closed_ids = dict(await client.zrange(key("idx:closed"), 0, -1, withscores=True))
        pipe = client.pipeline(transaction=False)
        for sid in all_ids:
            pipe.hgetall(key(f"s:{sid}"))
        hashes: list[dict[str, str]] = await pipe.execute() if all_ids else []
        loaded: dict[str, Session] = {}
        for sid, fields in zip(all_ids, hashes, strict=True):
            if not fields:
                problems.append(f"idx:all lists missing session {sid}")
                continue
            try:
                session = Session.from_json(fields["data"])
            except (KeyError, ValueError, TypeError) as exc:
                problems.append(f"session {sid}: undecodable record ({exc})")
                continue
            loaded[sid] = session
            problems.extend(_common.session_problems(session))
            expected = self._session_args(session)[:5]
            actual = [fields.get(f, "") for f in ("token", "run", "labels", "created", "retain")]
            if (
                session.session_id != sid
                or str(session.version) != fields.get("version")
                or any(a != e for a, e in zip(actual[:3], expected[:3], strict=True))
            ):
                problems.append(f"session {sid}: indexed fields disagree with the record")
            if all_ids[sid] != session.created_at:
                problems.append(f"session {sid}: idx:all score disagrees with created_at")
            retain = _common.retention_time(session)
            if retain is None and (sid not in open_ids or sid in closed_ids):
                problems.append(f"session {sid}: open but not indexed as open")
            if retain is not None and (sid in open_ids or closed_ids.get(sid) != retain):
                problems.append(f"session {sid}: finished but not indexed for retention")
        checks = client.pipeline(transaction=False)
        for sid, session in loaded.items():
            checks.get(key(f"tok:{session.token_hash}") if session.token_hash else key("tok:"))
            checks.zscore(key(f"idx:run:{session.run_id}"), sid)
            for k, v in session.labels.items():
                checks.zscore(key(_label_index(k, v)), sid)
        results = iter(await checks.execute() if loaded else [])
        for sid, session in loaded.items():
            if session.token_hash and next(results) != sid:
                problems.append(f"session {sid}: token index does not point at it")
            elif not session.token_hash:
                next(results)
            if (next(results) is not None) != bool(session.run_id):
                problems.append(f"session {sid}: run index out of step")
            for k in session.labels:
                if next(results) is None:
                    problems.append(f"session {sid}: label {k} not indexed")
        for sid in set(open_ids) | set(closed_ids):
            if sid not in all_ids:
                problems.append(f"status index lists unknown session {sid}")
        for token_key in await self._scan("tok:*"):
            sid = await client.get(token_key)
            token = token_key[len(key("tok:")) :]
            if sid not in loaded or loaded[sid].token_hash != token:
                problems.append(f"token index entry {token[:12]}... points at {sid}, which does not hold it")
        for session_key in await self._scan("s:*"):
            if session_key[len(key("s:")) :] not in all_ids:
                problems.append(f"session record {session_key} missing from idx:all")
        return problems

    async def ping(self) -> None:
        await self._call("ping", self._client.ping)

    async def health(self) -> None:
        """PING, then SET, GET and DEL a key of this probe's in one MULTI (a write and a read, nothing left
        behind). One attempt, no retry loop: a health check answers now. A write refused for memory
        (maxmemory with noeviction: OOM) or disk (persistence failing: MISCONF ... no space) is StoreFull."""
        if self._closed:
            raise StoreError("store is closed")
        key, token = self._key(f"health:{uuid.uuid4().hex}"), str(time.time())
        try:
            await self._client.ping()
            pipe = self._client.pipeline(transaction=True)
            pipe.set(key, token, px=60_000)  # expires even if the DEL never ran
            pipe.get(key)
            pipe.delete(key)
            _, echoed, _ = await pipe.execute()
        except RedisError as exc:
            full = isinstance(exc, RedisOutOfMemoryError) or "No space left" in str(exc)
            raise (StoreFull if full else StoreError)(f"redis store {self.url}: health probe failed: {exc}") from exc
        if echoed != token:
            raise StoreError(f"redis store {self.url}: health probe read back {echoed!r}, not what it wrote")

    async def close(self) -> None:
        if self._closed:
            return
        await self._background.drain()  # releases of abandoned claims, before the connection goes
        self._closed = True
        await self._client.aclose()
