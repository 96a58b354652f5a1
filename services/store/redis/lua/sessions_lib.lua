-- Shared by the session scripts: index maintenance, given the fields stored in the session hash.
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

-- create(...): a new session's hash and indexes. 1 ok (or our own retried create: the same data stored),
-- 0 the id exists, -1 the token is another session's.
local function create(p, id, data, token, run, labels, created, retain, last_active)
  local sk = p .. 's:' .. id
  if redis.call('exists', sk) == 1 then
    if redis.call('hget', sk, 'data') == data then return 1 end  -- our own retried create
    return 0
  end
  if token_taken(p, id, token) then return -1 end
  redis.call('hset', sk, 'data', data, 'version', '1', 'token', token, 'run', run, 'labels', labels,
    'created', created, 'retain', retain, 'last_active', last_active)
  index(p, id, created, token, run, labels, retain)
  return 1
end
