-- ARGV: prefix, id, data, run, created
local p, id = ARGV[1], ARGV[2]
local k = p .. 'intent:' .. id
local old = redis.call('hget', k, 'run')
if old and old ~= '' then redis.call('zrem', p .. 'idx:intents:run:' .. old, id) end
redis.call('hset', k, 'data', ARGV[3], 'run', ARGV[4])
redis.call('zadd', p .. 'idx:intents', ARGV[5], id)
if ARGV[4] ~= '' then redis.call('zadd', p .. 'idx:intents:run:' .. ARGV[4], ARGV[5], id) end
return 0
