-- ARGV: prefix, key
local k = ARGV[1] .. 'req:' .. ARGV[2]
local r = redis.call('hmget', k, 'state', 'scope', 'request_id')
if r[1] == 'pending' then
  redis.call('del', k)
  redis.call('srem', ARGV[1] .. 'pend:' .. r[2], r[3])
end
return 0
