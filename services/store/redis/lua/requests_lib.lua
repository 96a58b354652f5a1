-- Request-record reads and claims, shared by _CLAIM, _COMMIT and _AUTHORIZE.
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
  redis.call('sadd', p .. 'pend:' .. scope, request_id)  -- the scope's PENDING index (pending_requests)
  return {1, 'pending', owner, '', now, '0'}
end

-- codec.request_key in Lua: the scope's length in code points, as Python's len() counts it (UTF-8
-- continuation bytes 0x80-0xBF do not start a character).
local function request_key(scope, request_id)
  local _, n = string.gsub(scope, '[^\128-\191]', '')
  return n .. ':' .. scope .. ':' .. request_id
end
