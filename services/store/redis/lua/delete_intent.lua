-- ARGV: prefix, id
local p, id = ARGV[1], ARGV[2]
local k = p .. 'intent:' .. id
local old = redis.call('hget', k, 'run')
if old and old ~= '' then redis.call('zrem', p .. 'idx:intents:run:' .. old, id) end
redis.call('zrem', p .. 'idx:intents', id)
return redis.call('del', k)
