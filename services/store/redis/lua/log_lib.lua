-- Request records and the tool-call log, shared by their own scripts and _COMMIT.
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
  redis.call('srem', p .. 'pend:' .. scope, request_id)
end
